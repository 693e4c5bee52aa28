"""logitscope dashboard / demo: the server command (localhost, port, path) and the recorded runs."""

from __future__ import annotations

import subprocess

import pytest

import tracker
from dashboard import serve
from dashboard.paths import ENV_PATH, REPO_ROOT, default_runs_path
from logitscope.cli import main


@pytest.fixture
def started(monkeypatch):
    """Calls to the Streamlit server, recorded instead of started."""
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda command, env: calls.append((command, env)) or 0)
    return calls


def test_dashboard_serves_the_path_on_localhost_at_the_port(tmp_path, started, capsys):
    assert main(["dashboard", str(tmp_path), "--port", "8765", "--no-browser"]) == 0
    (command, env), = started
    assert command[1:4] == ["-m", "streamlit", "run"] and command[4].endswith("dashboard/app.py")
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert command[command.index("--server.port") + 1] == "8765"
    assert command[command.index("--server.headless") + 1] == "true"
    assert env[ENV_PATH] == str(tmp_path.resolve()) and env["PYTHONPATH"].split(":")[0] == str(REPO_ROOT)
    assert "http://127.0.0.1:8765" in capsys.readouterr().out


def test_dashboard_defaults_to_the_shipped_sample_runs(started):
    assert main(["dashboard"]) == 0
    (command, env), = started
    assert env[ENV_PATH] == str(default_runs_path().resolve())
    assert command[command.index("--server.port") + 1] == "8501"
    assert command[command.index("--server.headless") + 1] == "false"


@pytest.mark.parametrize(
    "args, message",
    [
        (["dashboard", "no/such/runs"], "argument PATH: no run or folder at 'no/such/runs'"),
        (["dashboard", "--port", "70000"], "must be a port in [1, 65535], got 70000"),
        (["demo", "--port", "0"], "must be a port in [1, 65535], got 0"),
    ],
)
def test_bad_dashboard_arguments_exit_with_a_clear_message(args, message, started, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not started


def test_streamlit_command_checks_the_port():
    with pytest.raises(ValueError, match="port must be an int in \\[1, 65535\\], got 0"):
        serve.streamlit_command(0)


def test_demo_records_the_sample_runs_then_opens_the_dashboard_on_them(tmp_path, started, capsys):
    assert main(["demo", "--out", str(tmp_path), "--port", "8600"]) == 0
    (command, env), = started
    assert env[ENV_PATH] == str(tmp_path.resolve()) and command[command.index("--server.port") + 1] == "8600"
    out = capsys.readouterr().out
    assert "--- Phone number (regex)" in out and "(" in out.split("--- Phone number (regex)")[1].splitlines()[1]
    run = tracker.Run.load(tmp_path / "regex_phone.parquet")
    assert run.stages == ["natural", "constrained", "sampled"] and run.metadata.extra["title"] == "Phone number (regex)"
    assert run.sequence().startswith("(") and run.metadata.model == "logitscope demo model"
