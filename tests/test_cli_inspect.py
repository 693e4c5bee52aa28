"""``logitscope inspect``: a run in the terminal, with the numbers the dashboard shows, checked against float64."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dashboard.synthetic import hand_made_run
from logitscope.cli import main

V = 40


def _softmax64(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


@pytest.fixture()
def recorded(tmp_path):
    """A two-sequence run from fresh random logits, a constraint masking about a third of each row."""
    rng = np.random.default_rng()
    natural = (rng.normal(size=(2, 6, V)) * 2).astype(np.float32)
    constrained = np.where(rng.random(natural.shape) < 0.35, -np.inf, natural).astype(np.float32)
    constrained[..., 0] = natural[..., 0]  # never an empty row
    chosen = np.argmax(np.where(np.isfinite(constrained), constrained, -np.inf), axis=-1)
    tokens = [f"w{i}" for i in range(V)]
    path = hand_made_run(natural, chosen, tokens, constrained=constrained, title="random").to_parquet(
        tmp_path / "run.parquet"
    )
    return path, natural, constrained, chosen


def _json(capsys, *argv: str):
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_steps_show_each_stages_probabilities_as_a_float64_softmax(recorded, capsys):
    path, natural, constrained, chosen = recorded
    doc = _json(capsys, str(path), "--sequence", "1", "--steps", "1:4", "--top", "6")
    assert doc["run"]["title"] == "random" and doc["run"]["vocab_size"] == V
    (seq,) = doc["sequences"]
    assert (seq["generation"], seq["sequence"], seq["steps"]) == (0, 1, 6)
    assert seq["text"] == "".join(f"w{i}" for i in chosen[1])
    assert [s["step"] for s in seq["step_details"]] == [1, 2, 3]
    for step in seq["step_details"]:
        t = step["step"]
        p_nat, p_con = _softmax64(natural[1, t]), _softmax64(constrained[1, t])
        assert step["chosen_id"] == chosen[1, t] and step["chosen_token"] == f"w{chosen[1, t]}"
        masked = ~np.isfinite(constrained[1, t])
        assert step["allowed"] == int((~masked).sum())
        assert step["removed_mass"] == pytest.approx(p_nat[masked].sum(), abs=1e-6)
        assert step["entropy"]["natural"] == pytest.approx(-(p_nat * np.log(p_nat)).sum(), abs=1e-5)
        assert step["p_chosen"]["constrained"] == pytest.approx(p_con[chosen[1, t]], abs=1e-6)
        listed = [tok["token_id"] for tok in step["tokens"]]
        assert int(np.argmax(p_nat)) in listed and chosen[1, t] in listed
        for tok in step["tokens"]:
            i = tok["token_id"]
            assert tok["token"] == f"w{i}" and tok["chosen"] == (i == chosen[1, t])
            assert tok["prob"]["natural"] == pytest.approx(p_nat[i], abs=1e-6)
            if masked[i]:
                assert tok["state"]["constrained"] == "masked" and tok["removed_by"] == "constrained"
            else:
                assert tok["prob"]["constrained"] == pytest.approx(p_con[i], abs=1e-6)
                assert tok["state"]["constrained"] == "kept" and tok["removed_by"] is None


def test_the_text_view_names_the_chosen_token_and_its_probabilities(recorded, capsys):
    path, natural, constrained, chosen = recorded
    assert main(["inspect", str(path), "--generation", "0", "--sequence", "0", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    c = int(chosen[0, 2])
    p = _softmax64(natural[0, 2])[c]
    assert "title       random" in out and "stages      natural, constrained" in out
    assert f"text:   {''.join(f'w{i}' for i in chosen[0])!r}" in out
    assert f"step 2: chose 'w{c}' (id {c})" in out
    assert f"p(chosen): natural {p:.3f}" in out
    chosen_line = next(line for line in out.splitlines() if line.strip().startswith(f"*  w{c} "))
    assert f"{p:.3f}" in chosen_line
    assert "step 1:" not in out and "step 3:" not in out
    assert "generation 0, sequence 1" not in out


def test_a_folder_lists_its_runs_and_names_the_one_it_cannot_read(recorded, tmp_path, capsys):
    path, *_ = recorded
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not a run")
    assert main(["inspect", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("broken.parquet: not a readable run")
    assert lines[1].startswith("run.parquet: 6 step(s), 1 generation(s) x 2 sequence(s), float32")
    assert main(["inspect", str(tmp_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(r["label"], r["error"] is None, r["steps"]) for r in doc] == [
        ("broken.parquet", False, 0),
        ("run.parquet", True, 6),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "two"], "argument --steps: must be a step number N, a range A:B"),
        (["--steps", "3:-1"], "argument --steps: must be a step number N, a range A:B"),
        (["--steps", "-1"], "with steps >= 0, got '-1'"),
        (["--steps", "4:2"], "argument --steps: must be a range A:B with A < B (B is excluded), got '4:2'"),
        (["--top", "0"], "argument --top: must be >= 1, got 0"),
        (["--generation", "4"], "argument --generation: 4 is not in this run; its generations are [0]"),
        (["--sequence", "7"], "argument --sequence: 7 is not in generation 0; its sequences are [0, 1]"),
    ],
)
def test_bad_arguments_name_the_argument_and_what_is_allowed(recorded, capsys, argv, message):
    path, *_ = recorded
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_path_and_a_folder_with_step_options_are_refused(recorded, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path / "nothing")])
    assert f"argument PATH: cannot read '{tmp_path / 'nothing'}'" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path / "empty")])
    assert "argument PATH: no runs under" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--steps", "0"])
    assert "is a folder of runs; --steps, --generation and --sequence need one run" in capsys.readouterr().err


def test_a_file_that_is_not_a_run_exits_1_saying_why(tmp_path, capsys):
    bad = tmp_path / "notes.parquet"
    bad.write_bytes(b"PAR1 not a run")
    assert main(["inspect", str(bad)]) == 1
    assert f"'{bad}' is not a readable run" in capsys.readouterr().err


def test_each_sequence_shows_the_sampling_of_its_own_generation(capsys):
    """A run's header would hold only the latest generation's settings: each generation says its own."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "sample_runs" / "two_seeds.parquet"  # seeds 0 and 1
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    first, second = out.split("generation 1, sequence 0")
    assert "seed=0" in first.split("generation 0, sequence 0")[1] and "seed=1" not in first
    assert "seed=1" in second and "seed=0" not in second
    doc = _json(capsys, str(path))
    assert ["seed=0" in s["sampling"] for s in doc["sequences"]] == [True, False]


def test_a_greedy_run_shows_no_seed(capsys):
    """Greedy decoding draws nothing: a seed beside it would read as a way to replay a random choice."""
    from pathlib import Path

    samples = Path(__file__).resolve().parent.parent / "sample_runs"
    assert main(["inspect", str(samples / "greedy.parquet")]) == 0
    sampling = [line for line in capsys.readouterr().out.splitlines() if "sampling:" in line]
    assert sampling and all("greedy=True" in line and "seed=" not in line for line in sampling)
    assert main(["inspect", str(samples / "two_seeds.parquet")]) == 0  # a sampled run keeps its seed
    assert "seed=0" in capsys.readouterr().out


def test_output_piped_into_a_reader_that_stops_early_ends_without_a_traceback(tmp_path):
    """`logitscope inspect run.parquet --steps all | head -1`: the reader closes the pipe, the command ends quietly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    rng = np.random.default_rng()
    natural = rng.normal(size=(1, 300, V)).astype(np.float32)
    path = hand_made_run(natural, natural.argmax(-1), [f"w{i}" for i in range(V)]).to_parquet(tmp_path / "long.parquet")
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a shell's default: block-buffered
    code = "import sys; from logitscope.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "inspect", str(path), "--steps", "all", "--top", str(V)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()  # what `head -1` reads; far more than a pipe holds follows
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert first.startswith(str(path).encode())
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


#: Text a crafted run may hold: OSC 0 retitles the window, OSC 8 plants a link, CSI 2J clears the screen (also
#: as the one-byte C1 CSI), a right-to-left override reorders what follows, a newline forges a line.
HOSTILE = [
    "\x1b]0;owned\x07",
    "\x1b]8;;http://example.invalid/\x1b\\link\x1b]8;;\x1b\\",
    "\x1b[2J",
    "\x9b2J",
    "\u202eab",
]
#: What a terminal acts on (the characters shown escaped); a newline only ends a line printed.
OBEYED = set(map(chr, [*range(0x20), *range(0x7F, 0xA0), 0x202E])) - {"\n"}


def hostile_run(folder):
    """A run whose title, tokens and chosen tokens hold terminal control sequences: (path, the texts)."""
    rng = np.random.default_rng()
    tokens = [*HOSTILE, *(f"w{i}" for i in range(len(HOSTILE), V))]
    natural = rng.normal(size=(3, V)).astype(np.float32)
    natural[:, : len(HOSTILE)] += 10  # the hostile tokens lead every step
    title = "title\x1b]0;owned\x07\nforged line"
    path = hand_made_run(natural, [0, 2, 3], tokens, title=title).to_parquet(folder / "hostile.parquet")
    return path, [title, *HOSTILE]


def test_text_from_a_run_file_is_shown_escaped_never_obeyed_by_the_terminal(tmp_path, capsys):
    path, texts = hostile_run(tmp_path)
    (tmp_path / "bad\x1b[2J.parquet").write_bytes(b"not a run")  # a file name that is not a run: named, escaped
    for argv in ([str(path), "--steps", "all"], [str(tmp_path)], [str(path), "--json"], [str(tmp_path), "--json"]):
        main(["inspect", *argv])
        captured = capsys.readouterr()
        shown = captured.out + captured.err
        assert not OBEYED & set(shown), (argv, sorted(OBEYED & set(shown)))
        if "--json" in argv:
            assert json.loads(captured.out)  # still JSON: the same text once parsed (below)
        else:
            assert "\\x1b]0;owned\\x07" in shown and "\\x1b[2J" in shown
    assert main(["inspect", str(path)]) == 0
    assert "title\\x1b]0;owned\\x07\\nforged line" in capsys.readouterr().out  # on its line
    doc = _json(capsys, str(path), "--steps", "0")
    assert doc["run"]["title"] == texts[0] and doc["sequences"][0]["step_details"][0]["chosen_token"] == HOSTILE[0]
