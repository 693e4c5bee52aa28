"""Low-precision and top-k rows of a CPU run are stored off the decode thread (copied as float32 there, converted,
offset, selected and summed up on a background thread). What ends up recorded must be, bit for bit, what
``statistics="record"`` (all of it on the decode thread) gives: on fresh random rows with NaN, ``+inf`` and
all-masked rows, in half-precision logits too, with reads in the middle of a chunk and of a step, after
``clear()``, and under a memory bound that spills (where staging is small and the decode thread stores
the rows itself)."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_tracker_support import MaskThird

from tracker import LogitTrackingProcessor
from tracker.recording.buffers import BufferPool
from tracker.recording.recorder import Recorder, SpillWarning, Storage

CPU = torch.device("cpu")
KINDS = ["float16", "bfloat16", "topk"]


def fed_rows(gen: torch.Generator, batch: int, vocab: int, t: int) -> torch.Tensor:
    """Random logits, with a NaN, a +inf, an all-masked row and a row with nothing but one +inf now and then."""
    x = torch.randn(batch, vocab, generator=gen) * 3
    if t % 7 == 5:
        x[0, 10] = float("nan")
    if t % 11 == 9:
        x[batch - 1, 13] = float("inf")
    if t % 13 == 12:
        x[0] = float("-inf")
    if t % 17 == 3:
        x[batch - 1] = float("-inf")
        x[batch - 1, 2] = float("inf")
    return x


def table_bits(table: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per column: which rows are null, and the bytes of the values of the others (NaN compares by its bits)."""
    out = {}
    for name in table.schema.names:
        column = table.column(name).combine_chunks()
        null = column.is_null().to_numpy(zero_copy_only=False)
        if pa.types.is_fixed_size_list(column.type):
            values = column.values.to_numpy(zero_copy_only=False).reshape(len(column), -1)[~null]
        else:
            values = column.drop_null().to_numpy(zero_copy_only=False)
        out[name] = (null, np.ascontiguousarray(values).view(np.uint8).copy())
    return out


def assert_same_bits(got: pa.Table, want: pa.Table) -> None:
    assert got.schema == want.schema
    ours, theirs = table_bits(got), table_bits(want)
    for name, (null, values) in theirs.items():
        np.testing.assert_array_equal(ours[name][0], null, err_msg=f"{name}: nulls")
        assert np.array_equal(ours[name][1], values), f"{name}: values differ from statistics='record'"


def tracked_run(statistics: str, kind: str, seed: int, reads: set[int] = frozenset(), **options) -> pa.Table:
    """A transformers-style run through the tracker (chosen tokens from the next call's input), with reads."""
    gen = torch.Generator().manual_seed(seed)
    batch, vocab, steps = 2, 3001, 45
    tracker = LogitTrackingProcessor(MaskThird(), statistics=statistics, storage=kind, top_k=7, **options)
    tracker.recorder.chunk_bytes = 1 << 17  # several chunks
    tracker.recorder.eos_token_ids = [4, 8]
    ids = torch.ones(batch, 3, dtype=torch.long)
    dtype = torch.float16 if seed % 2 else torch.float32  # a half-precision model's logits too
    for t in range(steps):
        out = tracker(ids, fed_rows(gen, batch, vocab, t).to(dtype))
        if t in reads:
            tracker.recorder.batches()  # a query in the middle of a chunk
        weights = torch.softmax(torch.nan_to_num(out.float(), nan=-1e9, posinf=50.0, neginf=-1e9), 1)
        ids = torch.cat([ids, torch.multinomial(weights, 1, generator=gen)], 1)
    tracker.finish(ids)
    assert tracker.recorder.deferred == (statistics != "record")
    return pa.Table.from_batches(tracker.recorder.batches())


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_rows_stored_off_the_decode_thread_equal_those_recorded_on_it(kind, seed):
    want = tracked_run("record", kind, seed)
    assert want.column("constrained_p_chosen").null_count < want.num_rows  # the chosen statistics are there
    assert_same_bits(tracked_run("auto", kind, seed), want)
    assert_same_bits(tracked_run("auto", kind, seed, reads={0, 6, 7, 30}), want)
    assert_same_bits(tracked_run("read", kind, seed), want)


def direct_run(recorder: Recorder, fed: torch.Tensor, chosen: torch.Tensor, read_mid_step: set[int]) -> pa.Table:
    """Steps written through the recorder's own calls; some read between a step's stages and before its tokens."""
    for t in range(fed.shape[0]):
        rows = recorder.begin_step(0, t, fed.shape[2], fed.shape[3], CPU)
        recorder.write(rows, "natural", fed[t, 0])
        if t in read_mid_step:
            recorder.batches()  # natural stored, constrained not yet written
        recorder.write(rows, "constrained", fed[t, 1])  # its natural: this step's natural rows
        if t in read_mid_step:
            recorder.batches()  # the chosen tokens come after this read
        recorder.set_chosen(rows, chosen[t])
    recorder.end_generation(0)
    return pa.Table.from_batches(recorder.batches())


def feed(seed: int, steps: int, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    fed = torch.stack([torch.stack([fed_rows(gen, batch, vocab, t) for _ in range(2)]) for t in range(steps)])
    fed[:, 1, :, ::3] = float("-inf")
    return fed, torch.randint(0, vocab, (steps, batch), generator=gen)


@pytest.mark.parametrize("kind", KINDS)
def test_reads_in_the_middle_of_a_step_and_after_clear_leave_the_rows_as_recorded(kind):
    """A read between a step's stages, or before its chosen tokens, stores what was written so far; the rest
    is stored later. clear() in the middle of a run (staged rows waiting) and a next run of another vocabulary
    in the same buffers record exactly what was fed."""
    pool = BufferPool()
    ours = Recorder(Storage.parse(kind, 5), ["natural", "constrained"], chunk_bytes=1 << 16, pool=pool)
    ours.eos_token_ids = [1, 3]
    for run, (vocab, batch) in enumerate([(4099, 3), (1024, 1), (4099, 2)]):
        fed, chosen = feed(run, 30, batch, vocab)
        if run == 1:  # a run cleared while steps wait in staging (and on the background thread)
            for t in range(12):
                rows = ours.begin_step(0, t, batch, vocab, CPU)
                ours.write(rows, "natural", fed[t, 0] * 2)
            ours.clear()
        theirs = Recorder(Storage.parse(kind, 5), ["natural", "constrained"], chunk_bytes=1 << 16, statistics="record")
        theirs.eos_token_ids = [1, 3]
        got = direct_run(ours, fed, chosen, read_mid_step={0, 4, 5, 29})
        assert ours.deferred and not theirs.deferred
        assert_same_bits(got, direct_run(theirs, fed, chosen, read_mid_step=set()))
        assert got.column("constrained_rank_chosen").null_count == 0
        ours.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_under_a_memory_bound_that_spills_the_rows_are_those_recorded(tmp_path, kind):
    """A small bound: staging is a quarter of it, so the decode thread stores rows itself whenever the background
    thread falls behind, and chunks spill; every row reads back as statistics='record' gives it."""
    fed, chosen = feed(7, 60, 2, 8192)
    bound = 0 if kind == "topk" else 1 << 20  # top-k rows are small: with no room at all they spill
    tables = {}
    for statistics in ("auto", "record"):
        recorder = Recorder(
            Storage.parse(kind, 9),
            ["natural", "constrained"],
            memory_limit=bound,
            chunk_bytes=1 << 12,
            spill_dir=tmp_path / statistics,
            statistics=statistics,
            pool=BufferPool(),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SpillWarning)
            tables[statistics] = direct_run(recorder, fed, chosen, read_mid_step={20})
            recorder.flush()
            assert recorder.chunks_spilled > 2, "the run should have spilled"
            # a quarter of the bound, past it the step being written and the one the background thread stores
            assert recorder._deferred.nbytes <= bound // 4 + 2 * (2 * 2 * 8192 * 4)
    assert_same_bits(tables["auto"], tables["record"])


def test_half_precision_rows_read_back_within_their_rounding_of_the_float64_row():
    """What the background thread stores is the row: float16 minus its largest logit, read back within
    float16's rounding of the float64 value, and its log-sum-exp that of the float64 row."""
    fed, chosen = feed(11, 20, 2, 2048)
    recorder = Recorder(Storage.parse("float16"), ["natural", "constrained"], pool=BufferPool())
    table = direct_run(recorder, fed, chosen, read_mid_step=set())
    logits = table.column("constrained_logits").combine_chunks().values.to_numpy().astype(np.float64)
    offset = table.column("constrained_max").to_numpy(zero_copy_only=False)
    rows = fed[:, 1].reshape(-1, 2048).double().numpy()
    plain = np.isfinite(offset) & ~np.isnan(rows).any(1) & ~np.isposinf(rows).any(1)
    assert plain.sum() > 20
    back = logits.reshape(-1, 2048)[plain] + offset[plain, None]
    np.testing.assert_allclose(back, rows[plain], atol=2e-3 * 16, rtol=1e-3)
    want = np.log(np.exp(rows[plain] - rows[plain].max(1, keepdims=True)).sum(1)) + rows[plain].max(1)
    np.testing.assert_allclose(table.column("constrained_lse").to_numpy(zero_copy_only=False)[plain], want, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_that_cannot_wait_in_float32_are_stored_as_they_come_and_still_as_recorded(kind):
    """float64 logits (float32 staging would round them) and a natural row handed in that is not the one
    recorded as this step's natural stage are stored on the calling thread, mixed with staged ones."""
    fed, chosen = feed(13, 24, 2, 3001)
    tables = {}
    for statistics in ("auto", "record"):
        recorder = Recorder(
            Storage.parse(kind, 6), ["natural", "constrained"], chunk_bytes=1 << 16, statistics=statistics
        )
        for t in range(fed.shape[0]):
            rows = recorder.begin_step(0, t, 2, 3001, CPU)
            natural = fed[t, 0].double() if t % 3 == 0 else fed[t, 0]
            recorder.write(rows, "natural", natural)
            other = fed[t, 0] + 1 if t % 4 == 1 else None  # the rows before the processor, as the caller has them
            recorder.write(rows, "constrained", fed[t, 1], natural=other)
            recorder.set_chosen(rows, chosen[t])
        tables[statistics] = pa.Table.from_batches(recorder.batches())
        assert recorder.deferred == (statistics == "auto")
    assert_same_bits(tables["auto"], tables["record"])
