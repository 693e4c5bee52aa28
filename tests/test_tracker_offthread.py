"""Work moved off the decode thread: the next chunk's pages touched ahead of time, and a CPU run's row
statistics computed on a background thread as chunks are sealed. Values must be what recording them on the
decode thread gives (and what a float64 reference gives); the decode thread must not fault fresh pages in."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_tracker_support import MaskThird

from tracker import LogitTrackingProcessor
from tracker.recording.buffers import BufferPool
from tracker.recording.recorder import Recorder, Storage

CPU = torch.device("cpu")


def record(statistics: str, seed: int, steps: int = 60, batch: int = 2, vocab: int = 3000) -> LogitTrackingProcessor:
    """A run in small chunks (several sealed while recording), with NaN and +inf rows and EOS ids."""
    gen = torch.Generator().manual_seed(seed)
    tracker = LogitTrackingProcessor(MaskThird(), statistics=statistics, memory_limit=None)
    tracker.recorder.chunk_bytes = 1 << 19
    tracker.recorder.eos_token_ids = [4, 8]
    ids = torch.ones(batch, 3, dtype=torch.long)
    for t in range(steps):
        x = torch.randn(batch, vocab, generator=gen) * 3
        if t == 5:
            x[0, 10] = float("nan")
        if t == 9:
            x[batch - 1, 13] = float("inf")
        out = tracker(ids, x)
        weights = torch.softmax(torch.nan_to_num(out, nan=-1e9, posinf=50.0), 1)
        ids = torch.cat([ids, torch.multinomial(weights, 1, generator=gen)], 1)
    tracker.finish(ids)
    return tracker


def columns(tracker: LogitTrackingProcessor) -> dict[str, np.ndarray]:
    table = pa.Table.from_batches(tracker.recorder.batches())
    return {
        name: table.column(name).to_numpy(zero_copy_only=False)
        for name in table.schema.names
        if not pa.types.is_fixed_size_list(table.schema.field(name).type)
    }


def matrix(table: pa.Table, name: str, vocab: int) -> np.ndarray:
    return table.column(name).combine_chunks().flatten().to_numpy().reshape(-1, vocab)


def test_cpu_statistics_computed_off_the_decode_thread_equal_those_recorded_with_the_rows():
    background, recorded = record("auto", seed=3), record("record", seed=3)
    assert background.recorder.background_stats and not background.recorder.record_stats
    ours, theirs = columns(background), columns(recorded)
    assert ours.keys() == theirs.keys()
    assert "constrained_lse" in ours and "natural_rank_chosen" in ours
    for name, values in theirs.items():
        if values.dtype.kind == "f":
            np.testing.assert_array_equal(ours[name], values, err_msg=name)
        else:
            assert ours[name].tolist() == values.tolist(), name
    assert background.run.get_top_tokens(k=5) == recorded.run.get_top_tokens(k=5)
    assert background.run.stats().equals(recorded.run.stats())


def test_background_log_sum_exp_matches_a_float64_reference():
    tracker = record("auto", seed=5, steps=40, batch=1)
    table = pa.Table.from_batches(tracker.recorder.batches())
    vocab = tracker.recorder.vocab_size
    for stage in ("natural", "constrained"):
        rows = matrix(table, f"{stage}_logits", vocab).astype(np.float64)
        lse = table.column(f"{stage}_lse").to_numpy(zero_copy_only=False)
        for row, value in zip(rows, lse):
            if np.isposinf(row).any():
                assert value == np.inf
                continue
            finite = row[~np.isnan(row)]
            top = finite.max()
            expected = top + np.log(np.exp(finite - top).sum())
            assert value == pytest.approx(expected, rel=1e-5, abs=1e-4)


def test_sealed_chunks_get_their_statistics_without_a_read():
    recorder = Recorder(Storage.parse("float32"), ["natural"], chunk_bytes=1 << 16, pool=BufferPool())
    gen = torch.Generator().manual_seed(0)
    for t in range(40):
        rows = recorder.begin_step(0, t, 1, 2048, CPU)
        recorder.write(rows, "natural", torch.randn(1, 2048, generator=gen))
        recorder.set_chosen(rows, [t])
    recorder.flush()  # waits for the background work submitted so far; reads nothing
    sealed = [c for c in recorder._chunks if c is not recorder._active]
    assert len(sealed) >= 3
    assert all(c.stats_known["natural"][: c.n].all() for c in sealed)


def test_clear_while_statistics_are_computed_leaves_the_next_run_right():
    """clear() may come while the background thread works on a chunk; the next run (another vocabulary,
    reusing the buffers) must hold exactly what was fed, with its own statistics."""
    pool = BufferPool()
    recorder = Recorder(Storage.parse("float32"), ["natural"], chunk_bytes=1 << 17, pool=pool)
    gen = torch.Generator().manual_seed(1)
    for run, vocab in enumerate((4096, 1024, 4096)):
        fed = torch.randn(30, 1, vocab, generator=gen) * (run + 1)
        for t in range(30):
            rows = recorder.begin_step(0, t, 1, vocab, CPU)
            recorder.write(rows, "natural", fed[t])
            recorder.set_chosen(rows, [t])
        table = pa.Table.from_batches(recorder.batches())
        got = matrix(table, "natural_logits", vocab)
        np.testing.assert_array_equal(got, fed[:, 0].numpy())
        expected = torch.logsumexp(fed[:, 0].double(), dim=1).numpy()
        np.testing.assert_allclose(table.column("natural_lse").to_numpy(), expected, rtol=1e-5)
        recorder.clear()


def test_threads_sharing_a_tracker_get_statistics_for_every_row():
    tracker = LogitTrackingProcessor(MaskThird(), memory_limit=None)
    tracker.recorder.chunk_bytes = 1 << 17

    def generate(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.full((1, 3), seed, dtype=torch.long)
        for _ in range(25):
            out = tracker(ids, torch.randn(1, 1024, generator=gen))
            ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
        tracker.finish(ids)

    threads = [threading.Thread(target=generate, args=(s,)) for s in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    table = pa.Table.from_batches(tracker.recorder.batches())
    assert table.num_rows == 75
    rows = matrix(table, "constrained_logits", 1024).astype(np.float64)
    finite = np.where(np.isinf(rows), -np.inf, rows)
    expected = np.log(np.exp(finite - finite.max(1, keepdims=True)).sum(1)) + finite.max(1)
    np.testing.assert_allclose(table.column("constrained_lse").to_numpy(), expected, rtol=1e-5)
    assert table.column("constrained_p_chosen").null_count == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the thread's page faults (getrusage)")
def test_the_decode_thread_does_not_fault_in_the_pages_of_later_chunks():
    """Chunks after the first come from buffers touched on a background thread: the recording thread takes
    far fewer page faults than the pages it fills (before, one per 4 KiB page written). Each step leaves the
    background thread a millisecond, as a model's step would: a loop that outruns it does not wait for it but
    faults in itself the pages it reaches first."""
    import resource
    import time

    from tracker.recording.buffers import _preparer

    _preparer().submit(lambda: None).result()  # what earlier tests queued on the shared thread is done

    vocab, steps = 1 << 15, 96  # 128 KiB per row, 1 MiB chunks: 12 chunks, 3072 pages
    recorder = Recorder(
        Storage.parse("float32"), ["natural"], chunk_bytes=1 << 20, pool=BufferPool(), statistics="read"
    )
    rows_fed = [torch.randn(1, vocab) for _ in range(4)]
    first = recorder.begin_step(0, 0, 1, vocab, CPU)
    recorder.write(first, "natural", rows_fed[0])
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for t in range(1, steps):
        rows = recorder.begin_step(0, t, 1, vocab, CPU)
        recorder.write(rows, "natural", rows_fed[t % 4])
        time.sleep(0.001)  # the model's step
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    pages = (steps - 1) * vocab * 4 // 4096
    assert faults < pages // 4, f"{faults} page faults on the recording thread for {pages} pages written"
    table = pa.Table.from_batches(recorder.batches())
    got = matrix(table, "natural_logits", vocab)
    np.testing.assert_array_equal(got[1:], torch.cat([rows_fed[t % 4] for t in range(1, steps)]).numpy())


@pytest.mark.parametrize("kernel_populates", [True, False])
def test_fresh_buffers_written_while_their_pages_are_populated_keep_every_value(monkeypatch, kernel_populates):
    """A new buffer is handed out while the background thread still faults its pages in (where the kernel
    can do that without changing them): what the recording thread writes meanwhile must all stay. Where it
    cannot, buffers are touched before they are given out, with the same result."""
    from tracker.recording import buffers

    if kernel_populates and not buffers.populates():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    monkeypatch.setattr(buffers, "_POPULATES", [kernel_populates])
    pool = BufferPool()
    rng = np.random.default_rng()
    sizes = [8 << 20, 4 << 20, 1 << 20, 3 << 18]  # mapped ones, and one from the heap
    pool.prepare(sizes).result()
    for size in sizes + [16 << 20]:  # the prepared ones, then a fresh one made on the spot
        buf = pool.take(size)
        values = rng.standard_normal(size // 4).astype(np.float32)
        view = buf.tensor((size // 4,), torch.float32)
        view.copy_(torch.from_numpy(values))  # at once: the background thread may still be populating
        buffers._preparer().submit(lambda: None).result()  # the population queued so far is done
        np.testing.assert_array_equal(view.numpy(), values)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority is a Linux notion")
def test_background_work_yields_the_cores_to_the_decode_thread_and_the_model():
    """The statistics and staging threads run at the lowest priority: on a busy machine they take no core
    from the model's intra-op threads (whose parallel kernels would wait for the one that lost its core),
    while the decoding thread keeps its priority."""
    import os

    tracker = record("auto", seed=3)
    deferred = LogitTrackingProcessor(MaskThird(), storage="float16", memory_limit=None)
    ids = torch.ones(1, 3, dtype=torch.long)
    for _ in range(4):  # a step goes to the staging thread when the next one begins
        deferred(ids, torch.randn(1, 3000))
        ids = torch.cat([ids, ids[:, -1:]], 1)
    deferred.finish()
    tracker.run.stats()
    names = {"logitscope-stats", "logitscope-deferred"}
    workers = [t for t in threading.enumerate() if any(t.name.startswith(n) for n in names)]
    assert {n for n in names if any(t.name.startswith(n) for t in workers)} == names
    for thread in workers:
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == 19, thread.name
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == os.getpriority(os.PRIO_PROCESS, 0)
