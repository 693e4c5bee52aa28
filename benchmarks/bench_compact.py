"""A server's run of many small parts, read before and after ``logitscope compact``: what a reader pays per part.

    python benchmarks/bench_compact.py                     # 1,000 parts of 4 requests x 32 steps, top-20 of 32,000
    python benchmarks/bench_compact.py --parts 200 --repeats 1

The table: one run (``server-1``) whose parts are what a vLLM server's part writer commits, a file per commit
(here each part holds ``--requests`` generations recorded by the real tracker through
:func:`dashboard.synthetic.hand_made_run`: random logits, a constraint, top-k storage with statistics), all
named by one commit. Each timing runs in a new process, the files in the operating system's cache, a fresh
logitscope cache (nothing kept from an earlier process):

- *load*: ``Run.load(root, run_id="server-1")`` and its rows;
- *question*: ``open_dataset(root)`` and "mean entropy per generation" over ``steps``.

Then :func:`tracker.reading.compact.compact` (its time), and the same timings again. The answers are checked
equal before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TIMING = """
import json, sys, time
import deltalake, duckdb  # imported before the clock starts
from tracker import Run, open_dataset
root = sys.argv[1]
start = time.perf_counter()
rows = Run.load(root, run_id="server-1").num_rows
load = time.perf_counter() - start
start = time.perf_counter()
answer = open_dataset(root).sql(
    "SELECT generation, avg(entropy_natural) AS e FROM steps GROUP BY generation ORDER BY generation"
).to_pylist()
question = time.perf_counter() - start
print(json.dumps({"load": load, "question": question, "rows": rows, "answer": [[a["generation"], a["e"]] for a in answer]}))
"""


def make_table(root: Path, parts: int, requests: int, steps: int, vocab: int, k: int) -> int:
    """One run of ``parts`` parts, each ``requests`` generations, named by one commit; the bytes written."""
    from dashboard.synthetic import hand_made_run
    from tracker.format.table import RunTable

    rng = np.random.default_rng(0)
    tokens = [f"t{i}" for i in range(vocab)]
    table = RunTable(root)
    staged = []
    for p in range(parts):  # each part its own values, as a server's requests are
        natural = (rng.standard_normal((requests, 1, steps, vocab), dtype=np.float32) * 3).astype(np.float32)
        keep = rng.random(natural.shape, dtype=np.float32) < 0.5
        keep[..., 0] = True
        constrained = np.where(keep, natural, -np.inf).astype(np.float32)
        run = hand_made_run(natural, constrained.argmax(-1), tokens, constrained=constrained, storage="topk", top_k=k)
        rows = run.to_arrow()
        generation = rows.column("generation").to_numpy() + p * requests
        part = rows.set_column(0, "generation", pa.array(generation.astype(np.int32)))
        entries = [dict(e, generation=int(e["generation"]) + p * requests) for e in run.metadata.generations]
        staged.append(table.stage(part, replace(run.metadata, run_id="server-1", generations=entries)))
    table.commit(staged)
    return sum(s.size for s in staged)


def timed(root: Path) -> dict:
    cache = tempfile.mkdtemp(prefix="bench-compact-cache-")
    try:
        done = subprocess.run(
            [sys.executable, "-c", TIMING, str(root)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "LOGITSCOPE_CACHE": cache},
            timeout=3600,
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if done.returncode:
        raise SystemExit(f"a timing process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rounds(root: Path, repeats: int) -> dict:
    found = [timed(root) for _ in range(repeats)]
    return {
        "load": statistics.median(f["load"] for f in found),
        "question": statistics.median(f["question"] for f in found),
        "rows": found[0]["rows"],
        "answer": found[0]["answer"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=4, help="generations per part")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="timing processes before and after (medians)")
    args = parser.parse_args(argv)

    from tracker.reading.compact import compact

    root = Path(tempfile.mkdtemp(prefix="bench-compact-"))
    try:
        nbytes = make_table(root, args.parts, args.requests, args.steps, args.vocab, args.k)
        print(
            f"one run of {args.parts:,} parts ({args.requests} requests x {args.steps} steps each), {nbytes / 1e6:.1f} MB"
        )
        before = rounds(root, args.repeats)
        start = time.perf_counter()
        done = compact(root, min_parts=2)
        took = time.perf_counter() - start
        print(
            f"compact: {done[0].parts_before:,} parts -> {done[0].parts_after} in {took:.1f} s "
            f"({done[0].bytes_before / 1e6:.1f} MB -> {done[0].bytes_after / 1e6:.1f} MB)"
        )
        after = rounds(root, args.repeats)
        if before["rows"] != after["rows"] or not np.allclose(
            np.array(before["answer"], float), np.array(after["answer"], float), rtol=1e-6
        ):
            raise SystemExit("the answers differ after compaction")
        print(f"medians of {args.repeats} processes each, seconds:")
        for key, what in (("load", "Run.load of the run"), ("question", "open_dataset + a first question")):
            print(f"  {what:32s} {before[key]:7.2f} before, {after[key]:6.2f} after ({before[key] / after[key]:.1f}x)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
