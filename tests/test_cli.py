"""The command line: logitscope run and logitscope demo, offline, with clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from logitscope import __version__
from logitscope.cli import main
from logitscope.samples import RECIPES
from tracker import Run

TESTS = os.path.dirname(os.path.abspath(__file__))


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
        (
            ["run", "--prompt", "a", "--model", "no/such/folder"],
            "argument --model: model: no model folder at 'no/such/folder'",
        ),
        (["run"], "give at least one --prompt"),
        (["run", "--prompt-file", "missing.txt"], "argument --prompt-file: no file at 'missing.txt'"),
        (["run", "--prompt", "a", "--batch-size", "0"], "must be >= 1, got 0"),
        (
            ["run", "--prompt", "a", "--device", "tpu"],
            "argument --device: 'tpu' is not a device; use cpu, cuda, cuda:N or mps",
        ),
        (["run", "--prompt", "a", "--json-schema", "none.json"], "argument --json-schema: no file at 'none.json'"),
        (["run", "--prompt", "a", "--grammar", "none.lark"], "argument --grammar: no file at 'none.lark'"),
        (["run", "--prompt", "a", "--bad-words", ""], "argument --bad-words: words[0] must be a non-empty string"),
        (["run", "--prompt", "a", "--storage", "topk"], "argument --storage: is only used with --out RUN.parquet"),
        (
            ["run", "--prompt", "a", "--storage", "int8", "--out", "r.parquet"],
            "argument --storage: invalid choice: 'int8'",
        ),
        (
            ["run", "--prompt", "a", "--regex", "a", "--grammar", "g.lark"],
            "argument --grammar: not allowed with argument --regex",
        ),
        (["run", "--prompt", "a", "--out", "no/such/folder/r.parquet"], "argument --out: no folder 'no/such/folder'"),
        (["run", "--prompt", ""], "argument --prompt: prompts[0] is empty: it has no tokens"),
        (
            ["run", "--prompt", "Call " * 200, "--max-new-tokens", "100"],
            "argument --prompt: prompts[0] has 400 tokens and max_new_tokens=100",
        ),
        (["run", "--prompt", "a", "--grammar-syntax", "gbnf"], "argument --grammar-syntax: 'gbnf' is only used with"),
        (["run", "--prompt", "a", "--storage-top-k", "5"], "argument --storage-top-k: 5 is only used with --storage"),
        (
            ["run", "--prompt", "a", "--out", "r.parquet", "--storage", "float16", "--storage-top-k", "5"],
            "argument --storage-top-k: 5 is only used with --storage topk",
        ),
        (["run", "--prompt-file", TESTS], f"argument --prompt-file: '{TESTS}' is a folder"),
        (["run", "--prompt-file", "no/such/prompts.txt"], "argument --prompt-file: no file at 'no/such/prompts.txt'"),
        (["run", "--prompt", "a", "--model", "no/such/model"], "argument --model: model: no model folder at"),
        (["run", "--prompt", "a", "--json-schema", TESTS], f"argument --json-schema: '{TESTS}' is a folder"),
        (
            ["run", "--prompt", "Hi", "--regex", "abc", "--bad-words", "a"],
            "argument --bad-words: --regex with --bad-words leave no allowed token",
        ),
    ],
)
def test_bad_arguments_exit_with_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("logitscope run: error: argument ") and err.count("\n") == 1, err


def test_prompt_errors_name_the_prompt_file_for_its_prompts(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("fine\n" + "Call " * 200 + "\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["run", "--prompt", "a", "--prompt-file", str(prompts), "--max-new-tokens", "10"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("logitscope run: error: argument --prompt-file: prompts[2] has 400 tokens")
    assert "context of 256 tokens" in line


def test_prompt_files_that_are_not_text_are_one_line(tmp_path, capsys):
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SystemExit):
        main(["run", "--prompt-file", str(binary)])
    assert f"argument --prompt-file: '{binary}' is not UTF-8 text" in capsys.readouterr().err


def test_an_out_folder_that_refuses_files_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import logitscope.cli as cli

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    def no_model(*args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli.tempfile, "NamedTemporaryFile", refuse)
    monkeypatch.setattr(cli, "_generator", no_model)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--prompt", "Hi", "--out", str(tmp_path / "r.parquet")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --out: cannot write 'r.parquet' into the folder '{tmp_path}' (Permission denied)" in err
    assert list(tmp_path.iterdir()) == []


def test_run_out_refuses_to_replace_a_file_without_force(tmp_path, capsys, monkeypatch):
    import logitscope.cli as cli

    out = tmp_path / "r.parquet"
    out.write_bytes(b"my earlier run")
    monkeypatch.setattr(cli, "_generator", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--prompt", "Hi", "--out", str(out)])
    assert exit_info.value.code == 2 and out.read_bytes() == b"my earlier run"
    assert capsys.readouterr().err == (
        f"logitscope run: error: argument --out: '{out}' exists; give --force to replace it, or another file name\n"
    )
    monkeypatch.undo()
    assert main(["run", "--prompt", "Hi", "--max-new-tokens", "2", "--out", str(out), "--force"]) == 0
    assert Run.load(out).sequence() != "" and f"wrote {out}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, text, message",
    [
        (
            "--regex",
            "(",
            "argument --regex: pattern: the regex '(' cannot be compiled: unclosed group (at character 1)",
        ),
        (  # the pattern once, as typed; the engine's reason without its drawing
            "--regex",
            "\\d{3}-(\\d",
            "argument --regex: pattern: the regex '\\d{3}-(\\d' cannot be compiled: unclosed group (at character 7)\n",
        ),
        ("--json-schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}', "argument --json-schema: "),
        ("--grammar", "start: foo", "argument --grammar: grammar: the lark grammar cannot be compiled: "),
    ],
)
def test_a_bad_constraint_is_one_line_before_the_model_loads(flag, text, message, tmp_path, capsys, monkeypatch):
    import sampling.generator

    monkeypatch.setattr(sampling.generator, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    if flag != "--regex":
        (tmp_path / "constraint").write_text(text)
        text = str(tmp_path / "constraint")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--prompt", "Hi", flag, text])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage:" not in err and "Traceback" not in err
    assert err.startswith(f"logitscope run: error: {message}") and err.count("\n") == 1, err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc, a folder that takes no new files")
def test_out_in_proc_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--prompt", "Hi", "--max-new-tokens", "2", "--out", "/proc/x.parquet"])
    assert "argument --out: cannot write 'x.parquet' into the folder '/proc'" in capsys.readouterr().err


def test_run_out_says_how_many_steps_sequences_and_tokens(tmp_path, capsys):
    out = tmp_path / "r.parquet"
    args = ["run", "--prompt", "Hi", "--prompt", "7 + 5 = ", "--prompt", "Call ", "--max-new-tokens", "6"]
    assert main(args + ["--batch-size", "2", "--json", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    lengths = [len(json.loads(line)["token_ids"]) for line in printed.out.splitlines()]
    steps = max(lengths[:2]) + lengths[2]  # two batches: each takes as many steps as its longest sequence
    assert f"wrote {out} ({steps} steps, 3 sequences, {sum(lengths)} tokens)" in printed.err
    assert main(["run", "--prompt", "Hi", "--max-new-tokens", "3", "--out", str(out), "--force"]) == 0
    assert "steps, 1 sequence, " in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch build without CUDA")
def test_cuda_on_a_cpu_build_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--prompt", "a", "--device", "cuda"])
    assert "argument --device: 'cuda' is not available" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"logitscope {__version__}"


PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def test_run_out_records_a_regex_constrained_run(tmp_path, capsys):
    out = tmp_path / "r.parquet"
    assert main(["run", "--prompt", "Call ", "--regex", PHONE, "--out", str(out), "--title", "My phone"]) == 0
    printed = capsys.readouterr()
    text = printed.out.splitlines()[0].removeprefix("[0] Call ")
    assert re.fullmatch(PHONE, text), text
    run = Run.load(out)
    assert run.stages == ["natural", "constrained", "sampled"] and run.metadata.extra["title"] == "My phone"
    assert re.fullmatch(PHONE, run.sequence().removesuffix("<|endoftext|>"))
    assert run.metadata.model == "logitscope demo model" and run.metadata.storage == "float32"
    assert f"logitscope dashboard {out}" in printed.err


def test_run_out_with_a_json_schema_a_grammar_bad_words_and_top_k_storage(tmp_path, capsys):
    schema = tmp_path / "city.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"city": {"enum": ["Lyon", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            }
        )
    )
    out = tmp_path / "json.parquet"
    assert (
        main(
            [
                "run",
                "--prompt",
                "<|endoftext|>",
                "--json-schema",
                str(schema),
                "--out",
                str(out),
                "--storage",
                "topk",
                "--storage-top-k",
                "5",
                "--max-new-tokens",
                "20",
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out.splitlines()[0].removeprefix("[0] <|endoftext|>"))
    assert record["city"] in ("Lyon", "Oslo")
    run = Run.load(out)
    assert run.metadata.storage == "topk" and run.metadata.top_k == 5

    grammar = tmp_path / "sum.lark"
    grammar.write_text('start: NUMBER " + " NUMBER\nNUMBER: /[0-9]{1,2}/\n')
    out = tmp_path / "sum.parquet"
    assert (
        main(
            [
                "run",
                "--prompt",
                "<|endoftext|>",
                "--grammar",
                str(grammar),
                "--bad-words",
                "7",
                "--out",
                str(out),
                "--storage",
                "float16",
                "--max-new-tokens",
                "10",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.splitlines()[0].removeprefix("[0] <|endoftext|>")
    assert re.fullmatch(r"[0-9]{1,2} \+ [0-9]{1,2}", line) and "7" not in line, line
    assert Run.load(out).metadata.storage == "float16"


def test_demo_prints_sensible_text(tmp_path, capsys):
    assert main(["demo", "--no-serve", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--- JSON record (schema)" in out and '"age"' in out
    assert "<|endoftext|>" not in out  # some prompts start with the marker; the texts shown do not
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
    assert "Loading weights" not in result.stderr  # no progress bar printed line by line without a terminal


def test_run_help_says_every_option_s_default(capsys):
    """`logitscope run --help` answers "what happens if I leave this out?" for each generation option."""
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes
    for option, default in [
        ("--max-new-tokens N", "(default: 64)"),
        ("--temperature TEMPERATURE", "(default: greedy when no sampling option is given, else 1"),
        ("--top-k K", "(default: off)"),
        ("--top-p P", "(default: off)"),
        ("--min-p P", "(default: off)"),
        ("--seed SEED", "(default: a fresh one each run)"),
        ("--n N", "(default: 1)"),
        ("--batch-size BATCH_SIZE", "(default: 8)"),
        ("--device DEVICE", "cpu (default)"),
    ]:
        after = text.split(f"{option} ", 2)[-1]  # the option's line in the list, past the usage
        assert default in after.split(" --")[0], (option, after[:120])


def test_ctrl_c_during_run_out_keeps_the_steps_recorded_so_far(tmp_path, capsys, monkeypatch):
    """A long recorded run stopped with Ctrl-C: exit 130, and the run file holds every step taken until then."""
    import functools

    import sampling
    import sampling.generator

    args = ["run", "--prompt", "7 + 5 = ", "--prompt", "Call ", "--max-new-tokens", "6", "--batch-size", "1"]
    whole = tmp_path / "whole.parquet"
    assert main(args + ["--out", str(whole)]) == 0
    capsys.readouterr()

    calls = {"generate": 0, "forward": 0}
    original_generate, original_load = sampling.Generator.generate, sampling.generator.load_model

    def generate(self, *a, **k):
        calls["generate"] += 1
        return original_generate(self, *a, **k)

    def load_model(*a, **k):
        model, tokenizer = original_load(*a, **k)
        forward = model.forward

        @functools.wraps(forward)
        def interrupted_forward(*fa, **fk):
            if calls["generate"] == 2:  # the second prompt's batch: Ctrl-C on its third forward pass
                calls["forward"] += 1
                if calls["forward"] == 3:
                    raise KeyboardInterrupt
            return forward(*fa, **fk)

        model.forward = interrupted_forward
        return model, tokenizer

    monkeypatch.setattr(sampling.Generator, "generate", generate)
    monkeypatch.setattr(sampling.generator, "load_model", load_model)
    out = tmp_path / "cut.parquet"
    assert main(args + ["--out", str(out)]) == 130
    assert f"interrupted: wrote the steps recorded so far to {out}" in capsys.readouterr().err
    cut, full = Run.load(out), Run.load(whole)
    assert cut.metadata.extra.get("interrupted") is True
    assert cut.sequence(generation=0) == full.sequence(generation=0)  # the first prompt's generation, whole
    first = cut.get_logits(generation=0)["unstructured"]
    np.testing.assert_array_equal(first, full.get_logits(generation=0)["unstructured"])
    second = cut.get_logits(generation=1)["unstructured"]
    assert len(second) == 2  # the two steps taken before Ctrl-C
    np.testing.assert_array_equal(second, full.get_logits(generation=1)["unstructured"][:2])


def test_top_k_and_top_p_alone_sample_at_temperature_1_as_the_help_says(tmp_path, capsys):
    out = tmp_path / "r.parquet"
    argv = ["run", "--prompt", "Alice is", "--max-new-tokens", "3", "--top-k", "50", "--top-p", "0.9", "--seed", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    sampling = Run.load(out).metadata.sampling
    assert sampling["temperature"] is None and sampling["top_k"] == 50 and sampling["greedy"] is False
    from sampling import SamplingParams

    assert SamplingParams(top_k=50, top_p=0.9).effective[0] == 1.0  # what "else 1" means
