"""The memory bound holds while a run spills: in the recorder's count (rows kept, chunks on their way to
disk and the spare buffers waiting for the next chunk), in the process's resident memory, and every row
fed comes back."""

from __future__ import annotations

import os
import platform
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tracker_support import MaskThird, json_from_a_fresh_process

from tracker import LogitTrackingProcessor
from tracker.recording.memory import HostPool
from tracker.recording.recorder import Recorder, SpillWarning, Storage

CPU = torch.device("cpu")


@pytest.mark.parametrize("batch", [1, 4])
def test_a_bound_smaller_than_a_chunk_holds_with_chunks_on_their_way_and_every_row_comes_back(
    tmp_path, slow_disk, batch
):
    """With the default chunk size (32 MiB) and a 6 MiB bound, memory held for rows (kept, queued for
    the disk, being written, and idle buffers kept for the next chunk) stays within the bound."""
    slow_disk(0.005)
    bound, vocab, steps = 6 << 20, 2048, 800 // batch
    pool = HostPool()  # this recorder's alone: its idle buffers are the spare ones
    recorder = Recorder(
        Storage.parse("float32"), ["natural"], memory_limit=bound, spill_dir=tmp_path, run_id="r", pool=pool
    )
    gen = torch.Generator().manual_seed(1)
    fed = torch.randn(steps, batch, vocab, generator=gen)
    held = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for t in range(steps):
            rows = recorder.begin_step(0, t, batch, vocab, CPU)
            recorder.write(rows, "natural", fed[t].clone())
            recorder.set_chosen(rows, fed[t].argmax(1))
            held.append(recorder.host_bytes + pool.free_bytes)
        recorder.end_generation(0)
        recorder.flush()
    assert max(held) <= bound, f"rows held {max(held):,} bytes in memory, over the bound of {bound:,}"
    assert recorder.chunks_spilled > 5, "the run should have spilled"
    batches = recorder.batches()
    steps_read = np.concatenate([b.column("step").to_numpy() for b in batches])
    logits = np.concatenate([b.column("natural_logits").flatten().to_numpy() for b in batches])
    np.testing.assert_array_equal(steps_read, np.repeat(np.arange(steps), batch))
    np.testing.assert_array_equal(logits.reshape(steps, batch, vocab), fed.numpy())


def anon_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def record_spilling_run(folder: str) -> dict[str, int]:
    """Record 300 MB of float32 rows (32k tokens, batch 4, natural and constrained) under a 16 MiB bound;
    return the bound, the peak anonymous memory over the baseline, and the rows read back."""
    import threading

    bound, vocab, batch, steps = 16 << 20, 32000, 4, 300
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, vocab, generator=gen) * 3 for _ in range(8)]
    ids = torch.ones(batch, 4, dtype=torch.long)
    for t in range(20):  # warm-up: the same tensor work without the tracker
        MaskThird()(ids, logits[t % 8].clone()).argmax(1)
    tracker = LogitTrackingProcessor(MaskThird(), storage="float32", memory_limit=bound, spill_dir=folder)
    base = peak = anon_bytes()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, anon_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for t in range(steps):
            out = tracker(ids, logits[t % 8].clone())
            ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
        tracker.finish(ids)
        tracker.recorder.flush()
    stop.set()
    sampler.join()
    return {"bound": bound, "grew": peak - base, "rows": sum(b.num_rows for b in tracker.recorder.batches())}


@pytest.mark.skipif(
    not Path("/proc/self/status").exists() or platform.libc_ver()[0] != "glibc",
    reason="reads RssAnon from /proc; the heap is trimmed with glibc's malloc_trim",
)
def test_a_spilling_run_stays_near_its_bound_in_resident_memory(tmp_path):
    """In a fresh process with glibc's default allocator settings: a run writing 300 MB to disk under a
    16 MiB bound grows anonymous memory by well under twice the bound (before the chunks were sized to
    the bound and the heap trimmed as chunks spill, it grew by 85-145 MiB)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = json_from_a_fresh_process("test_tracker_memory_bound", "record_spilling_run", str(tmp_path), env)
    assert result["rows"] == 300 * 4
    assert result["grew"] <= 2 * result["bound"], f"grew by {result['grew'] / 2**20:.0f} MiB"
