"""Record-time row statistics on a CPU: the ``_rowstats`` extension against numpy, in one process.

    python benchmarks/bench_row_stats.py [--vocab 32768 131072] [--batch 1 8] [--repeats 20]

Per vocabulary size and batch, on model-like float32 rows (a natural row and a constrained row that masks
about half of it):

- ``row_stats`` of the natural rows, and of the constrained rows against the natural ones (log-sum-exp,
  entropy, maximum, allowed count, removed mass, margin), through the extension and through numpy;
- a step of a float16 run recorded and stored on this thread, as the background thread stores it (both
  stages: the statistics, the offset and conversion to float16, the stored log-sum-exp, the chosen
  token's statistics), through each: 16 steps after ``clear()``, per step.

Each figure is the median of ``--repeats`` timings; the ratio is numpy's time over the extension's (above
1: the extension is faster). Without the extension built (no C compiler at install time) only numpy runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import tracker.recording.record_stats as record_stats  # noqa: E402
from tracker import LogitTrackingProcessor  # noqa: E402
from tracker.recording.deferred import DeferredRows  # noqa: E402


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def rows(vocab: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    natural = (rng.standard_normal((batch, vocab)) * 3.0).astype(np.float32)
    constrained = np.where(rng.random((batch, vocab)) < 0.5, -np.inf, natural).astype(np.float32)
    return torch.from_numpy(natural), torch.from_numpy(constrained)


STEPS = 16  # steps recorded and stored per timing (the figure printed is per step)


def store_steps(batch: int, natural: torch.Tensor, constrained: torch.Tensor) -> Callable[[], None]:
    """A function that records :data:`STEPS` float16 steps (natural and constrained rows) and stores them
    on this thread, as the background thread would (the statistics, the offset and the conversion to
    float16, the stored log-sum-exp, the chosen token's statistics); the storing dominates its time."""
    ids = [torch.zeros((batch, 3 + t), dtype=torch.int64) for t in range(STEPS)]
    tracker = LogitTrackingProcessor(lambda i, scores: constrained.clone(), storage="float16", memory_limit=None)

    def run() -> None:
        tracker.clear()
        for t in range(STEPS):
            tracker(ids[t], natural.clone())
        tracker.recorder._deferred.complete()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    DeferredRows._drain = lambda self: setattr(self, "_running", False)  # staged steps wait for complete()
    extension = record_stats._rowstats
    print(f"_rowstats extension: {'built' if extension is not None else 'not built (numpy only)'}")
    print(f"{'vocab':>7} {'batch':>5} {'what':<34}{'extension ms':>14}{'numpy ms':>10}{'ratio':>8}")
    for vocab in args.vocab:
        for batch in args.batch:
            natural, constrained = rows(vocab, batch, seed=vocab + batch)
            cases = {
                "row_stats(natural)": lambda: record_stats.row_stats(natural, None, None),
                "row_stats(constrained, natural)": lambda: record_stats.row_stats(constrained, None, natural),
                "a float16 step recorded and stored": store_steps(batch, natural, constrained),
            }
            for name, fn in cases.items():
                per = STEPS if name.startswith("a float16 step") else 1
                fused = median_time(fn, args.repeats) / per if extension is not None else float("nan")
                record_stats._rowstats = None
                try:
                    plain = median_time(fn, args.repeats) / per
                finally:
                    record_stats._rowstats = extension
                print(f"{vocab:>7} {batch:>5} {name:<34}{fused * 1e3:>14.3f}{plain * 1e3:>10.3f}{plain / fused:>8.2f}")


if __name__ == "__main__":
    main()
