"""Resident memory a one-position query adds on a spilled run, query by query.

Records a run that spilled to disk (float32 rows of a 32k vocabulary, natural
and constrained, under a 16 MiB memory bound: about 200 MB of Arrow IPC
chunks at the default 800 steps), then runs each query about one position in
a fresh process that opens the spill folder, and prints how far the query
raised the process's peak resident memory (VmHWM, reset before the query).
A query that reads only the chunk holding its position adds about that
chunk's rows it reads and a block of scratch; one that reads the whole run
adds the whole spill.

    python benchmarks/bench_query_memory.py                # 800 steps, position 0
    python benchmarks/bench_query_memory.py --steps 400 --position 123 --statistics read

Linux only (it reads ``/proc/self/status`` and resets the peak through
``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from bench_tracker import HalfMask, _status_kib  # noqa: E402

BOUND = 16 << 20
VOCAB = 32768


def record_spilled_run(
    folder: str,
    steps: int = 800,
    vocab: int = VOCAB,
    bound: int | None = BOUND,
    seed: int = 0,
    statistics: str = "auto",
    storage: str = "float32",
) -> Any:
    """A tracker that recorded ``steps`` steps of random logits (half the vocabulary masked) in ``storage`` under
    a ``bound``-byte memory limit, its chunks spilled under ``folder``; returns the tracker (every chunk on disk).
    ``statistics``: as the tracker takes it (``"read"``: no statistics columns, queries sum the rows up)."""
    import torch

    from tracker import LogitTrackingProcessor
    from tracker.recording.recorder import SpillWarning

    gen = torch.Generator().manual_seed(seed)
    tracker = LogitTrackingProcessor(
        HalfMask(vocab), storage=storage, memory_limit=bound, spill_dir=folder, statistics=statistics
    )
    ids = torch.ones(1, 4, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for _ in range(steps):
            out = tracker(ids, torch.randn(1, vocab, generator=gen) * 3)
            ids = torch.cat([ids, torch.multinomial(torch.softmax(out, 1), 1, generator=gen)], 1)
        tracker.finish(ids)
        tracker.recorder.flush()
    return tracker


def peak_growth(query: Callable[[], Any]) -> tuple[int, Any]:
    """``(bytes, answer)``: how far ``query()`` raised this process's peak resident memory above what it held
    before (heap and mapped file pages alike)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the resident memory now
    base = _status_kib("VmRSS")
    answer = query()
    return (_status_kib("VmHWM") - base) << 10, answer


def queries(position: int) -> dict[str, Callable[[Any, Any], Any]]:
    """Each query about one position, as ``query(run, folder)``. A query the code does not offer about one
    position (an older release) falls back to the whole query, then picks the position: what a user had to do."""
    import numpy as np

    def with_positions(call: Callable[..., Any], whole: Callable[[Any], Any]) -> Any:
        try:
            return call(positions=position)
        except TypeError:
            return whole(call())

    def frame_at(frame: Any) -> Any:
        return frame[frame["position"] == position]

    def compare(run: Any, folder: Any) -> Any:
        from tracker import compare

        try:
            return compare(run, run, positions=position)
        except TypeError:
            return compare(run, run)

    def reader_step(run: Any, folder: Any) -> Any:
        from dashboard.reader import RunReader

        reader = RunReader(folder)
        return reader.step(reader.track(reader.generations()[-1], 0), position)

    return {
        "get_top_tokens": lambda run, folder: run.get_top_tokens(k=10, positions=position),
        "to_dataframe": lambda run, folder: with_positions(lambda **o: run.to_dataframe(min_value=0.01, **o), frame_at),
        "stats": lambda run, folder: with_positions(lambda **o: run.stats(**o), frame_at),
        "sequence": lambda run, folder: run.sequence(position),
        "why": lambda run, folder: run.why(position),
        "step display": lambda run, folder: run.step(position)._repr_html_(),
        "continuation_probability": lambda run, folder: run.continuation_probability("a", position),
        "compare": compare,
        "RunReader.step": reader_step,
        "(nothing)": lambda run, folder: np.zeros(0),
    }


def measure_one(folder: str, name: str, position: int) -> dict[str, Any]:
    """In this process: open the spill folder, warm the query's code on a small run, and measure ``name``."""
    from tracker import Run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = Run.load(folder)
        with tempfile.TemporaryDirectory() as scratch:  # the query's code paths warmed up on a small spilled run
            warm = record_spilled_run(scratch, steps=position + 100, vocab=4096, bound=0, seed=1)
            query = queries(position)[name]
            query(Run.load(warm.recorder.spill_path), warm.recorder.spill_path)
        grew, _ = peak_growth(lambda: query(run, folder))
    return {"query": name, "grew": grew}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--position", type=int, default=0)
    parser.add_argument(
        "--statistics", choices=("auto", "read"), default="auto", help="read: a run without statistics columns"
    )
    parser.add_argument("--only", nargs="*", help="the queries to measure (default: all)")
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "QUERY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_one(args.child[0], args.child[1], args.position)))
        return
    names = args.only or list(queries(args.position))
    with tempfile.TemporaryDirectory() as folder:
        tracker = record_spilled_run(folder, steps=args.steps, statistics=args.statistics)
        spill = tracker.recorder.spill_path
        size = sum(p.stat().st_size for p in Path(spill).rglob("*.arrow"))
        chunks = tracker.recorder.chunks_spilled
        print(
            f"spill: {size / 2**20:.0f} MiB in {chunks} chunks, bound {BOUND >> 20} MiB, statistics={args.statistics}"
        )
        print(f"{'query at one position':<28} {'peak RSS growth':>16}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        for name in names:
            done = subprocess.run(
                [sys.executable, __file__, "--position", str(args.position), "--child", str(spill), name],
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                print(f"{name:<28} failed: {done.stderr.strip().splitlines()[-1]}")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:<28} {result['grew'] / 2**20:>12.1f} MiB")


if __name__ == "__main__":
    main()
