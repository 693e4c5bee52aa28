"""Opening a 10,000-step run at a 128k vocabulary in the dashboard, and moving one step.

    python benchmarks/bench_dashboard.py                     # 10,000 x 128,000, Parquet and Arrow IPC
    python benchmarks/bench_dashboard.py --steps 2000 --vocab 32000 --keep /tmp/runs
    python benchmarks/bench_dashboard.py --new-session          # the first page of a new session, sample runs

The run is streamed to disk by :func:`dashboard.synthetic.write_large_run`
(natural logits and a constraint allowing 1,024 tokens per step, float32, in
the tracker's schema: about 10 GB of values per format, written to a
temporary folder that is removed at the end, or to ``--keep``; the benchmark
says how much it needs and stops first if the disk lacks the room). Then,
in this process:

- *first view*: what the step replay and the overview need on opening a run:
  :class:`~dashboard.reader.RunReader` (metadata and id columns), the first
  step's table and numbers, the text, and the overview's first window of
  steps (statistics, alternatives, heatmap);
- *a step drawn, new block*: what Step replay's fragment does for a step
  whose row group (or IPC batch) was not read yet: the row read, its table
  and numbers, the figure, and Streamlit's serialisation of figure and
  table; *same block*: the same for a neighbour in a block already read
  (the reader's cache). Streamlit's own cost of a fragment rerun, and the
  browser's, are what ``bench_dashboard_browser.py`` adds;
- *through Streamlit*: ``AppTest`` runs of the real pages on a fresh server
  and session (script, widgets, figure serialisation included): the run
  browser (which opens the run), the overview, the step replay, a slider move
  to a new block and the Next button (``AppTest`` reruns the whole script on
  a click: in a browser, Next reruns only the step's fragment).

With ``--new-session``, what a newcomer waits for instead: in a new Python
process (nothing imported, nothing cached), the first page of a new session
on the shipped sample runs, each other page's first visit, and the same first
page in a second session (the process warm); once cold, and once after the
early imports that ``dashboard.launch`` makes while the server starts. The baseline, in that process,
is ``AppTest`` running a one-line Streamlit script first (Streamlit's own
start-up, which any app pays).

The baseline, in the same run, is what any whole-file approach pays at
least: reading every byte of the file once (warm page cache), and, for IPC,
``tracker.Run.load`` (memory-mapped). Figures are medians; goals: first view
under 2 s, a step under 200 ms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tracker  # noqa: E402
from dashboard import charts  # noqa: E402
from dashboard.reader import RunReader  # noqa: E402
from dashboard.synthetic import write_large_run  # noqa: E402
from dashboard.views import step_summary, step_table, token_pieces, window_view  # noqa: E402

WINDOW = 32  # what dashboard.data.window_steps gives at 128k float32 with two stages


def _median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _read_all_bytes(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def first_view(path: Path, window: int) -> RunReader:
    reader = RunReader(path)
    track = reader.track(0, 0)
    row = reader.step(track, 0)
    step_table(row, reader.vocab, 10)
    step_summary(row, reader.vocab)
    token_pieces(reader.vocab, track.chosen)
    window_view(reader.window(track, 0, min(window, track.length)), 0, 0)
    return reader


def draw_step(reader: RunReader, track, position: int) -> int:
    """What Step replay's fragment computes and sends for one step: the row read, its table and numbers,
    the figure, and Streamlit's serialisation of both (figure JSON, table Arrow). Returns the bytes."""
    import plotly.io
    import plotly.tools
    from streamlit import dataframe_util

    row = reader.step(track, position)
    table = step_table(row, reader.vocab, 10)
    summary = step_summary(row, reader.vocab)
    stages = list(row.stages)
    figure = charts.step_bars(table, stages, title=f"Step {summary.step}: top 10 tokens by stage")
    spec = plotly.io.to_json(plotly.tools.return_figure_from_figure_or_data(figure, True), validate=False)
    shown = dataframe_util.convert_pandas_df_to_arrow_bytes(table.drop(columns=["token"]))
    return len(spec) + len(shown)


def step_times(reader: RunReader, repeats: int) -> tuple[float, float, int]:
    """Median seconds to draw a step in a block not read yet, and its neighbour (same block); bytes a step."""
    track = reader.track(0, 0)
    stride = max(1, track.length // (repeats + 1))
    fresh, near, sent = [], [], []
    for i in range(1, repeats + 1):
        position = i * stride
        for bucket, where in ((fresh, position), (near, position + 1)):
            start = time.perf_counter()
            sent.append(draw_step(reader, track, min(where, track.length - 1)))
            bucket.append(time.perf_counter() - start)
    return statistics.median(fresh), statistics.median(near), int(statistics.median(sent))


def through_streamlit(path: Path, repeats: int) -> dict[str, float]:
    """Median seconds of each page's first run on a fresh server and session, and of moving a step."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    app = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
    times: dict[str, list[float]] = {}

    def timed(name: str, action: Callable[[], AppTest]) -> AppTest:
        start = time.perf_counter()
        at = action()
        times.setdefault(name, []).append(time.perf_counter() - start)
        if at.exception:
            raise RuntimeError(f"{name}: the page raised: {at.exception[0].message}")
        return at

    for i in range(repeats):
        st.cache_data.clear()
        st.cache_resource.clear()  # a fresh server: the run is opened again
        at = AppTest.from_file(app, default_timeout=120)
        at.session_state["root"] = str(path)
        timed("runs page (opens the run)", at.run)
        timed("overview page (first window)", lambda: at.switch_page("app_pages/overview.py").run())
        timed("replay page", lambda: at.switch_page("app_pages/replay.py").run())
        timed("replay: slider to a new block", lambda: at.slider(key="step_slider").set_value(1000 + 997 * i).run())
        timed("replay: Next (whole script)", lambda: at.button(key="next").click().run())
    return {name: statistics.median(values) for name, values in times.items()}


NEW_SESSION = """
import statistics, sys, tempfile, time
from pathlib import Path
start = time.perf_counter()
from streamlit.testing.v1 import AppTest
script = Path(tempfile.mkdtemp()) / "hello.py"
script.write_text("import streamlit as st\\nst.write('hello')\\n")
AppTest.from_file(str(script), default_timeout=120).run()
print(f"baseline: a one-line Streamlit script, first run (imports included)  {time.perf_counter() - start:6.2f} s")
app, root, warmed = sys.argv[1], sys.argv[2], sys.argv[3] == "warm"
if warmed:  # what `logitscope dashboard` does while its server starts, before anyone connects
    t = time.perf_counter()
    from dashboard.launch import warm
    warm()
    print(f"early imports of dashboard.launch (server start-up, before the first visitor)  {time.perf_counter() - t:6.2f} s")
def session(label):
    at = AppTest.from_file(app, default_timeout=120)
    at.session_state["root"] = root
    t = time.perf_counter(); at.run(); first = time.perf_counter() - t
    assert not at.exception, at.exception[0].message
    print(f"{label}: runs page  {first:6.2f} s")
    return at
at = session("new session in a new process")
for page in ("overview", "replay", "compare"):
    t = time.perf_counter(); at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, at.exception[0].message
    print(f"  then the {page} page  {time.perf_counter() - t:6.2f} s")
session("a second new session (process warm)")
"""


def new_session(root: Path) -> None:
    """Time the first page of a new session in a fresh interpreter (see the module docstring)."""
    import subprocess

    app = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for mode, what in (("cold", "as `streamlit run` alone"), ("warm", "as `logitscope dashboard` serves it")):
        print(f"\nthe dashboard on {root}, a new process, {what}; load {os.getloadavg()[0]:.1f}", flush=True)
        subprocess.run([sys.executable, "-c", NEW_SESSION, app, str(root), mode], check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--vocab", type=int, default=128_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--keep", default=None, help="folder to write the runs to and keep (default: a temporary folder, removed)"
    )
    parser.add_argument("--formats", default="parquet,arrow", help="comma-separated: parquet, arrow")
    parser.add_argument("--no-streamlit", action="store_true", help="skip the AppTest timings")
    parser.add_argument(
        "--new-session",
        action="store_true",
        help="only time the first page of a new session on the shipped sample runs, in a new process",
    )
    args = parser.parse_args(argv)
    if args.new_session:
        from dashboard.paths import default_runs_path

        new_session(default_runs_path())
        return 0
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    folder.mkdir(parents=True, exist_ok=True)
    formats = args.formats.split(",")
    # at most two float32 stages per step and format (Parquet compresses the constrained -inf well)
    need = sum(2 * 4 * args.steps * args.vocab for fmt in formats if not (folder / f"large.{fmt}").exists())
    free = shutil.disk_usage(folder).free
    print(f"writing to {folder}: up to {need / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free there)")
    if need > free:
        if not args.keep:
            folder.rmdir()
        parser.error(
            f"the runs need up to {need / 2**30:.1f} GiB and {folder} has {free / 2**30:.1f} GiB free; "
            "pass --keep FOLDER on a larger disk, or fewer --steps / --vocab / --formats"
        )
    print(
        f"run: {args.steps:,} steps x {args.vocab:,} tokens, natural + constrained, float32; load {os.getloadavg()[0]:.1f}"
    )
    try:
        for fmt in formats:
            path = folder / f"large.{fmt}"
            if not path.exists():
                start = time.perf_counter()
                write_large_run(path, args.steps, args.vocab)
                print(f"\n[{fmt}] wrote {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")
            else:
                print(f"\n[{fmt}] reusing {path} ({path.stat().st_size / 2**30:.2f} GiB)")
            _read_all_bytes(path)  # warm the page cache, as for the figures below
            whole = _median(lambda: _read_all_bytes(path), 3)
            print(f"  baseline: read every byte once       {whole * 1e3:9.1f} ms")
            if fmt == "arrow":
                load = _median(lambda: tracker.Run.load(path).num_rows, 3)
                print(f"  baseline: tracker.Run.load (mmap)     {load * 1e3:9.1f} ms")
            view = _median(lambda: first_view(path, WINDOW), args.repeats)
            reader = first_view(path, WINDOW)
            fresh, near, sent = step_times(reader, args.repeats)
            print(
                f"  first view (open, step 0, {WINDOW}-step overview) {view * 1e3:9.1f} ms   (whole-file read / first view: {whole / view:.1f})"
            )
            print(
                f"  a step drawn, new block               {fresh * 1e3:9.1f} ms   ({sent / 1024:.0f} KiB of figure and table)"
            )
            print(f"  a step drawn, same block (cached)     {near * 1e3:9.1f} ms")
            print(
                f"  bytes read for {reader.blocks_read} blocks: {reader.bytes_read / 2**20:.1f} MiB of {path.stat().st_size / 2**20:,.0f} MiB"
            )
            if not args.no_streamlit:
                for name, seconds in through_streamlit(path, max(1, args.repeats // 2)).items():
                    print(f"  Streamlit, {name:<30} {seconds * 1e3:9.1f} ms")
    finally:
        if not args.keep:
            for p in folder.iterdir():
                p.unlink()
            folder.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
