"""Runs at fleet scale, storage side: many writers into one dataset, and the run browser over 10,000 runs.

    python benchmarks/bench_fleet.py                       # 4 writers x 8 runs; a 10,000-run dataset
    python benchmarks/bench_fleet.py --runs 2000 --writer-runs 4 --keep /tmp/fleet
    python benchmarks/bench_fleet.py --part browser     # only the run browser (the dataset kept from before)

- *write throughput*: each writer records top-k runs (k=20, a 32,000-token
  vocabulary, 64 steps, random logits) with the real tracker and writes each
  into one local table (``to_dataset``: a commit each). The baseline, in the same run, is
  one process recording and writing all the runs; the figure is the ratio of
  runs per second, 4 processes against 1 (on a machine with fewer free cores
  than writers, expect less than 4).
- *the run browser*: a table of ``--runs`` small runs (built once by 4 writer
  processes, a commit each, kept under ``--keep``, reused when it is there),
  then, in this process: :func:`tracker.format.dataset.list_runs` reading the
  table's log (its checkpoint and the commits after it: no part is opened),
  and again with the log read, the Runs page's first render on a fresh Streamlit session and cache (``AppTest``,
  server side: script, widgets, table), and its baseline, ``AppTest`` running
  a one-line script (Streamlit's own start-up). For scale, opening runs the
  way the page did before it read markers (:class:`~dashboard.reader.RunReader`
  and :func:`~dashboard.discover.summary_of` per run) is timed on 200 runs and
  extrapolated. Goal: first render under 2 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

ROOT = Path(__file__).resolve().parents[1]

RECORD = """
import sys, time, torch
sys.path.insert(0, {root!r})
from tracker import LogitTrackingProcessor
root, first, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(first, first + runs):
    gen = torch.Generator().manual_seed(i)
    tracker = LogitTrackingProcessor(None, storage="topk", top_k=20)
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(64):
        out = tracker(ids, torch.randn(1, 32000, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    tracker.finish(ids)
    tracker.to_dataset(root)
"""

BUILD = """
import sys
sys.path.insert(0, {root!r})
from dashboard.synthetic import write_run_dataset
write_run_dataset(sys.argv[1], int(sys.argv[3]), steps=8, vocab=64, start=int(sys.argv[2]))
"""


def _processes(script: str, root: str, jobs: list[tuple[int, int]]) -> float:
    """Seconds for processes running ``script`` on ``(first, runs)`` each, all at once."""
    code = script.format(root=str(ROOT))
    start = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-c", code, root, str(a), str(n)]) for a, n in jobs]
    codes = [c.wait() for c in children]
    if any(codes):
        raise SystemExit(f"a writer failed: exit statuses {codes}")
    return time.perf_counter() - start


def write_throughput(writers: int, runs_each: int) -> None:
    total = writers * runs_each
    with tempfile.TemporaryDirectory() as tmp:
        one = _processes(RECORD, f"{tmp}/one", [(0, total)])
        many = _processes(RECORD, f"{tmp}/many", [(w * runs_each, runs_each) for w in range(writers)])
        from tracker.format.dataset import list_runs

        assert len(list_runs(f"{tmp}/one")) == total == len(list_runs(f"{tmp}/many"))
    print(f"write: {total} top-k runs (k=20, V=32,000, 64 steps) recorded and written to one table")
    print(f"  1 process:   {one:6.1f} s  ({total / one:5.2f} runs/s; process start-up included)")
    print(f"  {writers} processes: {many:6.1f} s  ({total / many:5.2f} runs/s)")
    print(f"  ratio (throughput {writers} : 1): {one / many:.2f}x on {os.cpu_count()} cores")


def _first_render(root: str, app: str) -> float:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(app, default_timeout=600)
    at.session_state["root"] = root
    start = time.perf_counter()
    at.run()
    took = time.perf_counter() - start
    if at.exception:
        raise SystemExit(f"the page failed: {at.exception[0].message}")
    return took


def run_browser(runs: int, keep: Path) -> None:
    from dashboard.discover import find_runs, summary_of
    from dashboard.paths import APP
    from dashboard.reader import RunReader
    from tracker.format.dataset import list_runs

    root = keep / f"fleet-{runs}"
    have = len(list_runs(root)) if root.is_dir() else 0
    if have != runs:
        share = -(-runs // 4)
        jobs = [(w * share, min(share, runs - w * share)) for w in range(4) if runs > w * share]
        took = _processes(BUILD, str(root), jobs)
        print(f"built {runs:,} runs into {root} in {took:.0f} s (4 processes; kept for the next run)")
    start = time.perf_counter()
    entries = list_runs(root, cache=False)
    cold = time.perf_counter() - start
    list_runs(root)  # fills the index cache, if this machine's was empty
    start = time.perf_counter()
    list_runs(root)
    listing = time.perf_counter() - start
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write("import streamlit as st\nst.write('hello')\n")
    baseline = min(_first_render(str(root), script.name) for _ in range(3))
    os.unlink(script.name)
    renders = sorted([_first_render(str(root), str(APP)) for _ in range(4)][1:])  # the first pays the imports
    sample = find_runs(root)[:200]
    start = time.perf_counter()
    for path in sample:
        summary_of(RunReader(path), path.name)
    per_run = (time.perf_counter() - start) / len(sample)
    print(f"run browser: {len(entries):,} runs in {root}")
    print(f"  list_runs, the table's log read:          {cold * 1000:7.0f} ms")
    print(f"  list_runs again (the log brought up to date): {listing * 1000:7.0f} ms")
    print(f"  Runs page, first render (median of 3):   {renders[1] * 1000:7.0f} ms  (min {renders[0] * 1000:.0f})")
    print(f"  baseline, a one-line Streamlit script:   {baseline * 1000:7.0f} ms")
    print(
        f"  opening every run instead (200 timed):   {per_run * len(entries):7.1f} s  ({per_run * 1000:.1f} ms a run)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--writer-runs", type=int, default=8, help="runs each writer records (default 8)")
    parser.add_argument("--runs", type=int, default=10_000, help="runs in the run browser's dataset")
    parser.add_argument("--keep", type=Path, default=ROOT / ".bench", help="where the dataset is kept")
    parser.add_argument("--part", choices=("all", "write", "browser"), default="all", help="which figures")
    args = parser.parse_args()
    if args.part in ("all", "write"):
        write_throughput(args.writers, args.writer_runs)
    if args.part in ("all", "browser"):
        run_browser(args.runs, args.keep)


if __name__ == "__main__":
    main()
