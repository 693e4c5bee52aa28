"""Queries about a few positions read only their rows: the same answers as the whole query, and on a spilled
run, resident memory that grows by about the rows read, not by the spill.

The queries: ``get_top_tokens``, ``to_dataframe`` and ``stats`` with ``positions=``, ``compare`` with
``positions=``, ``why``, a step's display, ``continuation_probability`` at one position, and the dashboard's
:class:`~dashboard.reader.RunReader` reading one step."""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_tracker_support import json_from_a_fresh_process

from tracker import Run, compare

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_query_memory import peak_growth  # noqa: E402
from bench_query_memory import record_spilled_run as record  # noqa: E402


@pytest.mark.parametrize("spill", [False, True])
def test_a_query_about_a_few_positions_answers_as_the_whole_query_does(tmp_path, spill):
    tracker = record(str(tmp_path), steps=150, vocab=4096, bound=(1 << 20) if spill else None)
    if spill:
        assert tracker.recorder.chunks_spilled >= 2
    whole = tracker.run.get_top_tokens(k=7)
    for positions in (0, 17, 149, [3, 140], [149, 0, 31]):
        fresh = tracker.run.__class__(tracker.run._record_batches(), tracker.run.metadata, tracker.run.vocab)
        wanted = [positions] if isinstance(positions, int) else positions
        assert fresh.get_top_tokens(k=7, positions=positions) == [whole[p] for p in wanted]
        assert tracker.run.get_top_tokens(k=7, positions=positions) == [whole[p] for p in wanted]  # cached run


def fresh(run: Run) -> Run:
    """The same rows, nothing read or cached yet."""
    return Run(run._record_batches(), run.metadata, run.vocab)


def whole(run: Run) -> Run:
    """The same rows with the whole sequence's arrays read and cached first (the fully loaded run: a query about
    one position then takes its values from there)."""
    run = fresh(run)
    run.get_logits(), run.get_probabilities(), run.get_top_tokens(k=7), run.stats()
    return run


def softmax64(row: np.ndarray) -> np.ndarray:
    """The straightforward float64 softmax of one stored row (-inf masked)."""
    x = row.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize(
    "storage, statistics", [("float32", "auto"), ("float32", "read"), ("float16", "auto"), ("topk", "auto")]
)
@pytest.mark.parametrize("spill", [False, True])
def test_every_query_about_one_position_answers_as_on_the_whole_run(tmp_path, spill, storage, statistics):
    """to_dataframe, stats, compare (with positions=), why, a step's display and continuation_probability at a
    position give what the same query gives on the fully loaded run, and (float32) what a float64 softmax of the
    stored row gives."""
    bound = (1 << 20) if spill else None
    tracker = record(str(tmp_path), 150, 4096, bound, seed=3, statistics=statistics, storage=storage)
    if spill and storage != "topk":  # top-k rows of 150 steps fit one chunk
        assert tracker.recorder.chunks_spilled >= 2
    run = tracker.run
    loaded, logits = whole(run), run.get_logits()
    frame, stats = loaded.to_dataframe(min_value=0.01), loaded.stats()
    everything = compare(loaded, loaded, top=3)
    for positions in (0, 77, 149, [140, 3]):
        at = [positions] if isinstance(positions, int) else sorted(positions)
        picked = frame[frame["position"].isin(at)].reset_index(drop=True)
        pd.testing.assert_frame_equal(fresh(run).to_dataframe(min_value=0.01, positions=positions), picked)
        picked = stats[stats["position"].isin(at)].reset_index(drop=True)
        pd.testing.assert_frame_equal(fresh(run).stats(positions=positions), picked)
        one = compare(fresh(run), fresh(run), top=3, positions=positions)
        assert one.divergence == everything.divergence and one.length_a == everything.length_a
        pd.testing.assert_frame_equal(
            one.steps, everything.steps[everything.steps["step"].isin(at)].reset_index(drop=True)
        )
        tokens = everything.tokens[everything.tokens["step"].isin(at)]
        pd.testing.assert_frame_equal(one.tokens.sort_values(["step", "stage", "token_id"]).reset_index(drop=True),
                                      tokens.sort_values(["step", "stage", "token_id"]).reset_index(drop=True))  # fmt: skip
    for position in (0, 77, 149):
        pd.testing.assert_frame_equal(fresh(run).why(position), loaded.why(position))
        assert fresh(run).step(position, k=5)._repr_html_() == loaded.step(position, k=5)._repr_html_()
        chosen = int(run.stats(positions=position)["chosen_id"][0])
        token = int(np.argsort(logits["unstructured"][position])[-2])  # another token than the chosen one, mostly
        for t in (chosen, token):
            answer = fresh(run).continuation_probability(run.vocab.display[t], position)
            assert answer == loaded.continuation_probability(run.vocab.display[t], position)
            for stage, key in (("natural", "unstructured"), ("constrained", "structured")):
                if storage == "float32":  # elsewhere the recorded log-sum-exp is of the row before rounding
                    want = softmax64(logits[key][position])[t]
                    assert math.isclose(answer.probabilities[stage], want, rel_tol=1e-5, abs_tol=1e-12)
    for nothing in ([], 999):  # no position recorded: no rows, the same columns
        assert list(fresh(run).stats(positions=nothing).columns) == list(stats.columns)
        assert fresh(run).to_dataframe(min_value=0.01, positions=nothing).empty
        assert compare(fresh(run), fresh(run), positions=nothing).steps.empty
    with pytest.raises(ValueError, match="positions"):
        run.stats(positions=-1)
    with pytest.raises(TypeError, match="positions"):
        run.to_dataframe(positions="3")


def one_position_queries_on_a_spill(folder: str) -> dict[str, object]:
    """Record 200 MB of float32 rows (32k tokens, natural and constrained) under a 16 MiB bound, then ask each
    query about one position of a spilled chunk (a chunk of its own, so no query finds pages another read);
    return the bound and, per query, how much the process's peak resident memory (heap and
    mapped file pages) rose above what it held before the query."""
    from dashboard.reader import RunReader

    bound = 16 << 20
    tracker = record(folder, steps=800, vocab=32768, bound=bound)
    run = tracker.run
    rows = [c.n for c in tracker.recorder._chunks if c.spilled is not None]
    # the queries' code paths warmed up on another run (on this one they would read rows the query then finds)
    small = record(None, steps=20, vocab=32768, bound=None, seed=1).run
    small.get_top_tokens(k=10, positions=0), small.why(0), small.step(0)._repr_html_(), small.to_dataframe(positions=0)
    compare(small, small, positions=0), small.stats(positions=0), small.continuation_probability("<1>", 0)
    reader = RunReader(tracker.recorder.spill_path)
    track = reader.track(reader.generations()[-1], 0)
    queries = {
        "get_top_tokens": lambda p: len(run.get_top_tokens(k=10, positions=p)[0]["tokens"]),
        "to_dataframe": lambda p: len(run.to_dataframe(min_value=0.001, positions=p)),
        "stats": lambda p: len(run.stats(positions=p)),
        "why": lambda p: len(run.why(p)),
        "step display": lambda p: len(run.step(p)._repr_html_()),
        "continuation_probability": lambda p: run.continuation_probability("<1>", p).position + 1,
        "compare": lambda p: len(compare(run, run, positions=p).steps),
        "RunReader.step": lambda p: len(reader.step(track, p).stages),
    }
    starts = np.cumsum([0, *rows]).tolist()
    grew, answers = {}, {}
    for j, (name, query) in enumerate(queries.items()):
        position = starts[j + 1] + rows[j + 1] // 2  # the middle of a chunk of its own (the first is left alone)
        grew[name], answers[name] = peak_growth(functools.partial(query, position))
    return {"bound": bound, "grew": grew, "answers": answers}


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists() or platform.system() != "Linux",
    reason="reads VmHWM from /proc and resets it through /proc/self/clear_refs",
)
def test_one_position_queries_on_a_spilled_run_stay_within_the_bound(tmp_path):
    """Each query about one position of a 200 MB spill grows resident memory by at most the 16 MiB bound plus one
    8 MiB block per reading thread (before, all but get_top_tokens read every chunk: VmRSS grew by the whole spill,
    up to three times over)."""
    from tracker.reading.rows import MAX_WORKERS

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = json_from_a_fresh_process(
        "test_tracker_query_bound", "one_position_queries_on_a_spill", str(tmp_path), env
    )
    threads = max(1, min(MAX_WORKERS, os.cpu_count() or 1))
    limit = result["bound"] + threads * (8 << 20)
    assert all(n > 0 for n in result["answers"].values()), result["answers"]
    over = {name: f"{grew / 2**20:.1f} MiB" for name, grew in result["grew"].items() if grew > limit}
    assert over == {}, f"grew past {limit / 2**20:.0f} MiB: {over}"
