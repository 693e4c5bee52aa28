"""The group maxima a CPU tracker keeps beside its float32 rows (computed off the decode thread with the row
statistics) must leave every answer as it is: the same as a run of the same rows read without them, and as a
float64 reference. Rows holding NaN or +inf, fully masked rows, rows the processor never produced, memory reused
after ``clear()`` and a run exported and read back are the cases where a stale or partial index would show."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from processors.vocab import Vocabulary
from tracker import LogitTrackingProcessor, Run

VOCAB = 8192  # large enough for the grouped searches (and so for the index)


class MaskedUntilItRaises:
    """Masks every third token; masks a whole row at its fifth call; raises at its ``fail_at``-th call."""

    def __init__(self, fail_at: int) -> None:
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the grammar broke")
        out = scores.clone()
        out[:, ::3] = float("-inf")
        if self.calls == 5:
            out[0] = float("-inf")
        return out


def rows_like_a_models(gen: torch.Generator, scale: float) -> torch.Tensor:
    """Two rows sharing most of their shape (a common background with 20 likely tokens), each with three
    best tokens of its own: where an index read at the wrong row would find likely tokens but not the best."""
    background = torch.randn(VOCAB, generator=gen) * 0.3
    background[torch.randperm(VOCAB, generator=gen)[:20]] += 2.5
    x = background + torch.randn(2, VOCAB, generator=gen) * 0.05
    for row in range(2):
        x[row, torch.randperm(VOCAB, generator=gen)[:3]] += 4.0
    return x * scale


def record(
    seed: int, scale: float = 3.0, tracker: LogitTrackingProcessor | None = None, statistics: str = "auto"
) -> LogitTrackingProcessor:
    """Two generations into small chunks: NaN and +inf entries, a fully masked row, and the processor raising
    once (that step keeps only the model's row); rows alternate between random ones and model-like ones."""
    gen = torch.Generator().manual_seed(seed)
    if tracker is None:
        tracker = LogitTrackingProcessor(MaskedUntilItRaises(fail_at=12), memory_limit=None, statistics=statistics)
        tracker.recorder.chunk_bytes = 1 << 20  # a few steps a chunk: several sealed while recording
    ids = torch.ones(2, 3, dtype=torch.long)
    for t in range(30):
        x = torch.randn(2, VOCAB, generator=gen) * scale if t % 2 else rows_like_a_models(gen, scale / 3)
        if t == 4:
            x[0, 17] = float("nan")
        if t == 7:
            x[1, 99] = float("inf")
        try:
            out = tracker(ids, x)
        except RuntimeError:
            ids = torch.ones(2, 3, dtype=torch.long)  # the generation ends there; a new one begins
            continue
        weights = torch.softmax(torch.nan_to_num(out, nan=-1e9, posinf=50.0, neginf=-1e9), 1)
        ids = torch.cat([ids, torch.multinomial(weights, 1, generator=gen)], 1)
    tracker.finish(ids)
    return tracker


def without_index(run: Run) -> Run:
    """The same rows and metadata, read without the index."""
    return Run(run._record_batches(), run.metadata, run.vocab)


def answers(run: Run) -> dict[str, object]:
    out: dict[str, object] = {}
    for g in run.generations():
        for s in (0, 1):
            for k in (1, 7, 40):
                out[f"top{k}/{g}/{s}"] = run.get_top_tokens(k=k, generation=g, sequence=s)
            out[f"frame/{g}/{s}"] = run.to_dataframe(min_value=1e-3, generation=g, sequence=s)
            out[f"stats/{g}/{s}"] = run.stats(generation=g, sequence=s)
    return out


def assert_same(ours: dict[str, object], theirs: dict[str, object]) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(ours[key], value, obj=key)
        else:
            assert ours[key] == value, key


@pytest.mark.parametrize("statistics", ["auto", "record"])  # kept off the decode thread, or as each row is written
def test_the_trackers_answers_equal_those_of_its_rows_read_without_the_index(statistics):
    tracker = record(seed=11, statistics=statistics)
    run = tracker.run
    assert any(run._maxima), "precondition: the tracker kept group maxima for some chunk"
    assert len(run.generations()) == 2
    assert_same(answers(run), answers(without_index(run)))


@pytest.mark.parametrize("statistics", ["auto", "record"])
def test_top_tokens_with_the_index_match_a_float64_reference(statistics):
    tracker = record(seed=12, statistics=statistics)
    run = tracker.run
    table = run.to_arrow()
    natural = table.column("natural_logits").combine_chunks()
    constrained = table.column("constrained_logits").combine_chunks()
    generation = table.column("generation").to_numpy()
    step = table.column("step").to_numpy()
    sequence = table.column("sequence").to_numpy()
    checked = 0
    for g, s in [(g, s) for g in run.generations() for s in (0, 1)]:
        listed = run.get_top_tokens(k=5, generation=g, sequence=s)
        for entry in listed:
            (row,) = np.flatnonzero((generation == g) & (sequence == s) & (step == entry["position"]))
            if not constrained[row].is_valid:
                continue
            n = np.asarray(natural[row].values, dtype=np.float64)
            c = np.asarray(constrained[row].values, dtype=np.float64)
            if not (np.isfinite(n) | np.isneginf(n)).all() or not (np.isfinite(c) | np.isneginf(c)).all():
                continue  # NaN and +inf rows: read as the record reads them, compared above against the plain read
            if np.isneginf(c).all():
                assert entry["tokens"] == []  # nothing allowed: no token to list
                continue
            p_n = np.exp(n - np.logaddexp.reduce(n))
            p_c = np.exp(c - np.logaddexp.reduce(c))
            score = np.where(np.isneginf(c), -1.0, np.maximum(p_n, p_c))
            expected = np.argsort(-score, kind="stable")[:5]
            shown = [t["structured_prob"] for t in entry["tokens"]]
            np.testing.assert_allclose(shown, p_c[expected], rtol=1e-5, atol=1e-12)
            np.testing.assert_allclose(
                [t["unstructured_prob"] for t in entry["tokens"]], p_n[expected], rtol=1e-5, atol=1e-12
            )
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("statistics", ["auto", "record"])
def test_memory_reused_after_clear_leaves_no_stale_index(statistics):
    tracker = record(seed=13, scale=40.0, statistics=statistics)  # stale maxima would be far above the next run's
    first = answers(tracker.run)
    tracker.clear()
    record(seed=14, scale=0.5, tracker=tracker)
    run = tracker.run
    assert_same(answers(run), answers(without_index(run)))
    assert answers(run).keys() != first.keys() or answers(run)["top7/0/0"] != first["top7/0/0"]


def test_an_exported_run_answers_as_the_tracker_did(tmp_path):
    tracker = record(seed=15)
    path = tracker.to_parquet(tmp_path / "run.parquet")
    assert_same(answers(Run.load(path)), answers(tracker.run))


def test_maxima_must_match_the_batches():
    tracker = record(seed=16)
    run = tracker.run
    with pytest.raises(ValueError, match="maxima must hold one entry per batch"):
        Run(run._record_batches(), run.metadata, Vocabulary.placeholder(VOCAB), maxima=[{}])


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_group_maxima_on_the_device_equal_the_read_sides_fold(device, dtype):
    from tracker.reading.rows import group_max
    from tracker.recording.record_stats import group_maxima

    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(5, VOCAB + 9, generator=gen) * 4).to(
        dtype
    )  # a tail past the last group, as some vocabularies have
    x[1, 300] = float("nan")
    x[2, 7] = float("inf")
    x[3] = float("-inf")
    x[4, ::5] = float("-inf")
    found = group_maxima(x.to(device)).float().cpu().numpy()
    expected = group_max(x.float().numpy())
    np.testing.assert_array_equal(found, expected)
