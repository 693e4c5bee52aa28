"""The command line: logitscope run and logitscope demo, offline, with clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from logitscope.cli import main
from logitscope.samples import RECIPES


def test_run_prints_generations(capsys):
    assert main(["run", "--prompt", "7 + 5 = ", "--prompt", "Call ", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "[0] 7 + 5 = " in out and "[1] Call " in out
    assert out.count("tokens, finished:") == 2


def test_run_reads_a_prompt_file_and_prints_json(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('{"name": "\n\n3 * 4 = \nThe weather in Lyon\n', encoding="utf-8")
    args = ["run", "--prompt-file", str(prompts), "--temperature", "0.8", "--top-k", "40", "--seed", "3"]
    assert main(args + ["--max-new-tokens", "10", "--json", "--batch-size", "2"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ['{"name": "', "3 * 4 = ", "The weather in Lyon"]
    assert all(0 < len(r["token_ids"]) <= 10 and len(r["logprobs"]) == len(r["token_ids"]) for r in records)
    # the same seed gives the same records again
    assert main(args + ["--max-new-tokens", "10", "--json"]) == 0
    again = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in records]


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--prompt", "a", "--top-p", "1.5"], r"argument --top-p: top_p must be in [0, 1], got 1.5"),
        (["run", "--prompt", "a", "--temperature", "-1"], "argument --temperature: temperature must be"),
        (["run", "--prompt", "a", "--model", "no/such/folder"], "argument --model: model: no model folder at 'no/such/folder'"),
        (["run"], "give at least one --prompt"),
        (["run", "--prompt-file", "missing.txt"], "argument --prompt-file: no file at 'missing.txt'"),
        (["run", "--prompt", "a", "--batch-size", "0"], "must be >= 1, got 0"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_prints_sensible_text(tmp_path, capsys):
    assert main(["demo", "--no-serve", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--- JSON record (schema)" in out and '"age"' in out
    assert f"logitscope dashboard {tmp_path}" in out
    assert len(list(tmp_path.glob("*.parquet"))) == len(RECIPES)


def test_console_script_runs_offline():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/nonexistent-hub-cache"}
    result = subprocess.run(
        [sys.executable, "-m", "logitscope", "run", "--prompt", "Call ", "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[0] Call ")
