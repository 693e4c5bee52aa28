"""logitscope dashboard / demo: the server command (localhost, port, path), the recorded runs, and the real server."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import tracker
from dashboard import serve
from dashboard.paths import ENV_PATH, REPO_ROOT, default_runs_path
from logitscope.cli import main


@pytest.fixture
def started(monkeypatch):
    """Servers asked for: their command and environment are recorded, and a process that exits at once runs instead."""
    calls = []
    real_popen = subprocess.Popen

    def popen(command, env, **kwargs):
        calls.append((command, env))
        return real_popen([sys.executable, "-c", "pass"], env=env, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    return calls


def test_dashboard_serves_the_path_on_localhost_at_the_port(tmp_path, started, capsys):
    assert main(["dashboard", str(tmp_path), "--port", "8765", "--no-browser"]) == 0
    ((command, env),) = started
    assert command[1:4] == ["-m", "dashboard.launch", "run"] and command[4].endswith("dashboard/app.py")
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert command[command.index("--server.port") + 1] == "8765"
    assert command[command.index("--server.headless") + 1] == "true"
    assert env[ENV_PATH] == str(tmp_path.resolve()) and env["PYTHONPATH"].split(":")[0] == str(REPO_ROOT)
    assert "http://127.0.0.1:8765" in capsys.readouterr().out


def test_dashboard_defaults_to_the_shipped_sample_runs(started, capsys):
    assert main(["dashboard"]) == 0
    ((command, env),) = started
    assert env[ENV_PATH] == str(default_runs_path().resolve())
    port = command[command.index("--server.port") + 1]
    # 8501, or the next free port when something else holds it (and then it says so)
    assert port == "8501" or f"port 8501 is taken: serving on port {port}" in capsys.readouterr().out
    # always headless: logitscope opens the browser itself, where one can be opened
    assert command[command.index("--server.headless") + 1] == "true"


def test_the_server_never_prompts_nor_collects_usage_statistics(tmp_path, started):
    assert main(["dashboard", str(tmp_path)]) == 0
    ((command, env),) = started
    assert command[command.index("--browser.gatherUsageStats") + 1] == "false"
    assert command[command.index("--server.showEmailPrompt") + 1] == "false"
    assert command[command.index("--logger.hideWelcomeMessage") + 1] == "true"  # no advertising, no skills pop-up
    assert (
        env["STREAMLIT_SERVER_SHOW_EMAIL_PROMPT"] == "false" and env["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] == "false"
    )


def test_the_server_skips_the_garbage_collection_after_each_script_run(tmp_path, started):
    """It cost more than the rest of a Step replay click; the name of each option's variable is Streamlit's own."""
    import streamlit.config

    assert main(["dashboard", str(tmp_path)]) == 0
    ((command, env),) = started
    assert command[command.index("--runner.postScriptGC") + 1] == "false"
    assert env["STREAMLIT_RUNNER_POST_SCRIPT_GC"] == "false"
    options = streamlit.config.get_config_options()
    for option in {**serve.QUIET_OPTIONS, **serve.FAST_OPTIONS}:
        assert env[options[option].env_var] == ({**serve.QUIET_OPTIONS, **serve.FAST_OPTIONS})[option], option


def test_the_default_path_finds_sample_runs_in_a_checkout_and_in_an_installed_package(tmp_path):
    runs = sorted(p.name for p in default_runs_path().glob("*.parquet"))
    assert "regex_phone.parquet" in runs and len(runs) >= 8
    # an installed wheel: site-packages holds dashboard/ and logitscope/sample_runs/ (setup.py copies them there)
    site = tmp_path / "site-packages"
    (site / "dashboard").mkdir(parents=True)
    (site / "logitscope" / "sample_runs").mkdir(parents=True)
    (site / "dashboard" / "paths.py").write_bytes(Path(serve.__file__).with_name("paths.py").read_bytes())
    spec = importlib.util.spec_from_file_location("installed_paths", site / "dashboard" / "paths.py")
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.default_runs_path() == site / "logitscope" / "sample_runs"


@pytest.mark.parametrize(
    "args, message",
    [
        (["dashboard", "no/such/runs"], "argument PATH: no run or folder at 'no/such/runs'"),
        (["dashboard", "--port", "70000"], "must be a port in [1, 65535], got 70000"),
        (["demo", "--port", "0"], "must be a port in [1, 65535], got 0"),
        (["dashboard", "--port", "abc"], "argument --port: must be a port number in [1, 65535], got 'abc'"),
        (["demo", "--device", "tpu"], "argument --device: 'tpu' is not a device; use cpu, cuda, cuda:N or mps"),
        (["demo", "--no-serve"], "argument --no-serve: give --out FOLDER"),
    ],
)
def test_bad_dashboard_arguments_exit_with_a_clear_message(args, message, started, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err
    assert err.startswith(f"logitscope {args[0]}: error: ") and err.count("\n") == 1, err
    assert not started


def test_demo_refuses_a_file_as_its_folder(tmp_path, started, capsys):
    existing = tmp_path / "runs.parquet"
    existing.write_bytes(b"mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(existing)])
    assert exit_info.value.code == 2
    assert f"argument --out: '{existing}' is a file; give a folder" in capsys.readouterr().err
    assert existing.read_bytes() == b"mine" and not started


def test_demo_refuses_to_replace_its_runs_without_force(tmp_path, started, capsys, monkeypatch):
    import logitscope.cli_serve as cli_serve

    (tmp_path / "greedy.parquet").write_bytes(b"my earlier run")
    (tmp_path / "mine.parquet").write_bytes(b"not the demo's")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(tmp_path), "--no-serve"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == (
        f"logitscope demo: error: argument --out: '{tmp_path}' holds runs the demo would replace (greedy.parquet); "
        "give --force to replace them, or another folder\n"
    )
    assert (tmp_path / "greedy.parquet").read_bytes() == b"my earlier run" and not started
    recorded = []
    monkeypatch.setattr(
        cli_serve, "_record_demo", lambda args, out: recorded.append(out)
    )  # the runs are another test's
    assert main(["demo", "--out", str(tmp_path), "--no-serve", "--force"]) == 0 and recorded == [tmp_path]


@pytest.fixture
def listener():
    """A program listening on 127.0.0.1 at a port: the port is taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


@pytest.mark.parametrize("command", [["dashboard"], ["demo"]])
def test_a_port_asked_for_and_taken_is_refused_in_one_line_before_anything_runs(
    command, listener, started, tmp_path, capsys, monkeypatch
):
    import logitscope.cli_serve as cli_serve

    monkeypatch.setattr(cli_serve, "_record_demo", lambda *a: pytest.fail("the demo recorded runs on a taken port"))
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--port", str(listener), "--no-browser"])
    printed = capsys.readouterr()
    assert exit_info.value.code == 2 and printed.out == "" and not started
    assert printed.err == (
        f"logitscope {command[0]}: error: argument --port: port {listener} on 127.0.0.1 is taken "
        "(another program listens there); choose another with --port N\n"
    )


@pytest.mark.parametrize("command", [["dashboard"], ["demo"]])
def test_without_a_port_a_taken_8501_gives_the_next_free_one_and_says_which(
    command, started, tmp_path, capsys, monkeypatch
):
    import logitscope.cli_serve as cli_serve

    monkeypatch.setattr(cli_serve, "_record_demo", lambda *a: None)  # the runs are not what this test is about
    with socket.socket() as taken:
        # as the server binds: a connection of an earlier test still in TIME_WAIT on 8501 leaves it free
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            taken.bind(("127.0.0.1", serve.DEFAULT_PORT))
        except OSError:
            pass  # already taken by something else: the same situation
        else:
            taken.listen()
        assert main([*command, "--no-browser"]) == 0
    ((server, _),) = started
    port = int(server[server.index("--server.port") + 1])
    out = capsys.readouterr().out
    assert port > serve.DEFAULT_PORT
    assert f"port 8501 is taken: serving on port {port} (choose one with --port N)" in out
    assert f"http://127.0.0.1:{port}" in out and "http://127.0.0.1:8501" not in out


def test_streamlit_command_checks_the_port():
    with pytest.raises(ValueError, match="port must be an int in \\[1, 65535\\], got 0"):
        serve.streamlit_command(0)


def test_demo_records_the_sample_runs_then_opens_the_dashboard_on_them(tmp_path, started, capsys):
    assert main(["demo", "--out", str(tmp_path), "--port", "8600"]) == 0
    ((command, env),) = started
    assert env[ENV_PATH] == str(tmp_path.resolve()) and command[command.index("--server.port") + 1] == "8600"
    out = capsys.readouterr().out
    assert "--- Phone number (regex)" in out and "(" in out.split("--- Phone number (regex)")[1].splitlines()[1]
    run = tracker.Run.load(tmp_path / "regex_phone.parquet")
    assert run.stages == ["natural", "constrained", "sampled"] and run.metadata.extra["title"] == "Phone number (regex)"
    assert run.sequence().startswith("(") and run.metadata.model == "logitscope demo model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(AssertionError):
    """The free port picked for the server was taken before the server could bind it."""


def _started(
    command: list[str], env: dict[str, str], log: Path, seconds: float, **popen: object
) -> tuple[subprocess.Popen, int]:
    """``command + ["--port", PORT]`` started and answering its health check, on a port found free
    (tried again on another port when something else took it in between)."""
    for _ in range(3):
        port = _free_port()
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [*command, "--port", str(port)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                **popen,
            )
        try:
            _wait_healthy(port, process, seconds, log)
            return process, port
        except PortTaken:
            continue
        except BaseException:
            if process.poll() is None:
                process.kill()
            raise
    raise AssertionError("three free ports were taken before the server could bind them")


def _wait_healthy(port: int, process: subprocess.Popen, seconds: float, log: Path | None = None) -> float:
    """Seconds until the server answers its health check (fails if the command exits or time runs out)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if process.poll() is not None:
            said = log.read_text(errors="replace")[-12000:] if log is not None and log.exists() else ""
            if f"Port {port} is not available" in said or f"port {port} on 127.0.0.1 is taken" in said:
                raise PortTaken(said)
            raise AssertionError(f"the command exited with {process.returncode}:\n{said}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"no dashboard on port {port} after {seconds} s")


def _port_is_free(port: int, seconds: float = 5.0) -> bool:
    """Whether nothing listens on the port any more (within a few seconds of being asked to stop)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def test_demo_without_a_terminal_serves_then_stops_its_server_and_removes_its_folder(tmp_path):
    """`logitscope demo </dev/null` as a service would run it: no prompt, a server, and nothing left after SIGTERM."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "HOME": str(tmp_path), "DISPLAY": ""}  # a fresh user, no display
    env["PYTHONFAULTHANDLER"] = "1"  # a process that does not stop says where it is (SIGABRT below)
    log = tmp_path / "log.txt"
    # the server answers while the runs are still being recorded: the signal may come at any point of that
    process, port = _started([sys.executable, "-m", "logitscope", "demo"], env, log, 240, cwd=tmp_path)
    try:
        assert [p.name for p in temp.iterdir()][0].startswith("logitscope-demo-")
        process.send_signal(signal.SIGTERM)
        try:
            status = process.wait(30)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to the log
            process.wait(30)
            said = log.read_text(errors="replace")[-8000:]
            raise AssertionError(f"`logitscope demo` did not stop on SIGTERM:\n{said}") from None
        assert status == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text(errors="replace")
    assert "Email" not in text and "gatherUsageStats" not in text and "streamlit skills" not in text, text
    assert "<|endoftext|>" not in text
    assert _port_is_free(port), "the Streamlit server still holds the port"
    assert list(temp.iterdir()) == [], "the demo left its temporary folder behind"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_dashboard_killed_outright_takes_its_server_with_it(tmp_path):
    """SIGKILL (the OOM killer, ``kill -9``, a test's cleanup) runs no ``finally``: the server must not live on
    holding the port."""
    env = {**os.environ, "HOME": str(tmp_path), "DISPLAY": ""}
    log = tmp_path / "log.txt"
    process, port = _started([sys.executable, "-m", "logitscope", "dashboard", str(default_runs_path())], env, log, 60)
    process.kill()
    process.wait(30)
    assert _port_is_free(port, 20), "the Streamlit server outlived a killed `logitscope dashboard`"


def test_a_stop_signal_that_lands_in_a_finalizer_still_stops_the_server(tmp_path):
    """A signal may come while a finalizer runs (``__del__``, a weakref callback), where the interpreter drops any
    exception raised: the server must stop all the same, and the block know it."""
    from dashboard.serve import _wait_until_up, start

    port = _free_port()
    with start(tmp_path, port) as server:
        assert _wait_until_up(server.child, port), "the server did not start"

        class Busy:
            def __del__(self) -> None:  # the signal comes while this runs
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and server.child.poll() is None:
                    time.sleep(0.05)

        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        busy = Busy()
        del busy
        assert server.stopping.is_set(), "the signal went unnoticed"
        assert server.child.wait(15) is not None
        assert server.wait() == 0
    assert _port_is_free(port)


def test_sigterm_to_the_dashboard_stops_the_server(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "DISPLAY": ""}
    log = tmp_path / "log.txt"
    process, port = _started([sys.executable, "-m", "logitscope", "dashboard", str(default_runs_path())], env, log, 60)
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert _port_is_free(port), "the Streamlit server outlived `logitscope dashboard`"


def test_ctrl_c_leaves_only_logitscopes_own_lines_in_the_terminal(tmp_path):
    """An empty folder is served with a note saying so; Streamlit's own lines (its server start, "Stopping..."
    once for the terminal's Ctrl-C and once for logitscope's SIGTERM) do not reach the terminal."""
    env = {**os.environ, "HOME": str(tmp_path), "DISPLAY": ""}
    log, empty = tmp_path / "log.txt", tmp_path / "runs"
    empty.mkdir()
    command = [sys.executable, "-m", "logitscope", "dashboard", str(empty)]
    process, port = _started(command, env, log, 60, start_new_session=True)
    try:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert log.read_text().splitlines() == [
        f"note: '{empty}' holds no runs yet (run files .parquet/.arrow, run folders); the Runs page lists them as "
        "they are written",
        f"logitscope dashboard: http://127.0.0.1:{port}  (runs from {empty.resolve()}; Ctrl-C to stop)",
    ]
    assert _port_is_free(port)


def test_dashboard_on_a_file_that_is_not_a_run_says_why_in_one_line(tmp_path, started, capsys):
    (tmp_path / "notes.parquet").write_text("my notes")
    with pytest.raises(SystemExit) as exit_info:
        main(["dashboard", str(tmp_path / "notes.parquet")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and not started
    assert err.startswith(
        f"logitscope dashboard: error: argument PATH: '{tmp_path / 'notes.parquet'}' is not a readable run: "
    )
