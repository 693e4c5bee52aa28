"""Queries about a few positions read only their rows: the same answers as the whole query, and on a spilled
run, resident memory that grows by about the rows read, not by the spill."""

from __future__ import annotations

import os
import platform
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_tracker_support import MaskThird, json_from_a_fresh_process

from tracker import LogitTrackingProcessor
from tracker.recording.recorder import SpillWarning


def record(folder: str | None, steps: int, vocab: int, bound: int | None, seed: int = 0) -> LogitTrackingProcessor:
    gen = torch.Generator().manual_seed(seed)
    tracker = LogitTrackingProcessor(MaskThird(), storage="float32", memory_limit=bound, spill_dir=folder)
    ids = torch.ones(1, 4, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for _ in range(steps):
            out = tracker(ids, torch.randn(1, vocab, generator=gen) * 3)
            ids = torch.cat([ids, torch.multinomial(torch.softmax(out, 1), 1, generator=gen)], 1)
        tracker.finish(ids)
        tracker.recorder.flush()
    return tracker


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


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def one_step_query_on_a_spill(folder: str) -> dict[str, int]:
    """Record 200 MB of float32 rows (32k tokens, natural and constrained) under a 16 MiB bound; return the
    bound and how much resident memory (heap and mapped file pages) a one-step query added at its peak."""
    import threading

    bound = 16 << 20
    tracker = record(folder, steps=800, vocab=32768, bound=bound)
    run = tracker.run
    # the query's code paths warmed up on another run (on this one it would read rows the query then finds)
    record(None, steps=20, vocab=32768, bound=None, seed=1).run.get_top_tokens(k=10, positions=0)
    base = peak = vm_rss()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, vm_rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    answer = run.get_top_tokens(k=10, positions=0)
    stop.set()
    sampler.join()
    return {"bound": bound, "grew": peak - base, "tokens": len(answer[0]["tokens"])}


@pytest.mark.skipif(
    not Path("/proc/self/status").exists() or platform.system() != "Linux", reason="reads VmRSS from /proc"
)
def test_a_one_step_query_on_a_spilled_run_stays_within_the_bound(tmp_path):
    """A one-step query on a 200 MB spill grows resident memory by well under the 16 MiB bound plus one
    8 MiB block per reading thread (before, it read every chunk: VmRSS grew by the whole spill)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = json_from_a_fresh_process("test_tracker_query_bound", "one_step_query_on_a_spill", str(tmp_path), env)
    assert result["tokens"] == 10
    limit = result["bound"] + 2 * (8 << 20)
    assert result["grew"] <= limit, f"grew by {result['grew'] / 2**20:.0f} MiB"
