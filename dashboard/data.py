"""The data layer behind Streamlit's caches: open runs once, read steps and windows once.

- :func:`reader`: one :class:`~dashboard.reader.RunReader` per run file and
  version of it (``st.cache_resource``: a shared object holding a memory map
  and the blocks it read);
- :func:`runs`, :func:`step`, :func:`window`: small results computed from it
  (``st.cache_data``), keyed by the path and its modification stamp, so a
  file rewritten on disk is read again.

Every function raises :class:`~dashboard.reader.BadRunError` for a path that
is not a readable run; the pages turn it into a message.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pyarrow as pa
import streamlit as st

from dashboard.discover import (
    MAX_DEPTH,
    RunSummary,
    found_runs,
    label_of,
    summary_from_marker,
    summary_of,
    unexpected_reason,
)
from dashboard.reader import BadRunError, RunReader, Track
from dashboard.views import (
    StepSummary,
    WindowView,
    step_summary,
    step_table,
    token_pieces,
    window_view,
)
from tracker.format.checks import DamagedRowError
from tracker.format.dataset import RunEntry
from tracker.format.fs import is_url
from tracker.reading.compare import Comparison, compare
from tracker.reading.prompt import perplexity

__all__ = [
    "WINDOW_BYTES",
    "reader",
    "runs",
    "stamp",
    "step",
    "pieces",
    "prompt",
    "track",
    "window",
    "window_steps",
    "comparison",
    "prompt_perplexity",
]

#: Bytes of values the overview reads at once; a longer run is shown a window at a time
#: (32 steps at a 128k vocabulary with two stages, the whole of most runs at smaller ones).
WINDOW_BYTES = 32 << 20
_MIN_WINDOW, _MAX_WINDOW = 16, 512

Stamp = tuple[int, int, int]


def stamp(path: str | Path) -> Stamp:
    """``(entries, newest mtime in ns, total bytes)`` of a file or a folder's files and subfolders, as deep
    as runs are looked for: changes when they do. An entry that cannot be read (a dangling symlink, no
    permission) counts by its link, or not at all; it never hides the others."""
    target = Path(path)
    try:
        if target.is_file():
            info = target.stat()
            return (1, info.st_mtime_ns, info.st_size)
        entries, newest, total = 0, target.stat().st_mtime_ns, 0
    except OSError:
        return (0, 0, 0)
    top = len(target.parts)
    for folder, folders, files in os.walk(target):
        if len(Path(folder).parts) - top >= MAX_DEPTH:
            folders[:] = []
        for name in files + folders:
            where = os.path.join(folder, name)
            try:
                info = os.stat(where)
            except OSError:
                try:
                    info = os.lstat(where)
                except OSError:
                    continue
            entries, newest, total = entries + 1, max(newest, info.st_mtime_ns), total + info.st_size
    return (entries, newest, total)


@st.cache_resource(max_entries=16, show_spinner=False)
def _open(path: str, version: Stamp) -> RunReader:
    return RunReader(path)


def reader(path: str) -> RunReader:
    """The shared reader of the run at ``path`` (BadRunError when it is not one). A run at a URL is opened
    again every :data:`REMOTE_LISTING_S` seconds (a table's run written again is a new commit)."""
    return _open(path, (0, int(time.time() // REMOTE_LISTING_S), 0) if is_url(path) else stamp(path))


@st.cache_resource(max_entries=8, show_spinner=False)  # shared, not copied: 10,000 summaries unpickled per call cost
def _runs(root: str, version: Stamp) -> list[RunSummary]:  # 0.3 s (RunSummary is frozen; nobody changes the list)
    try:
        found = found_runs(root)
    except ValueError as exc:  # a damaged marker or committed part: say so rather than hide the dataset
        return [RunSummary(path=root, label=root, error=str(exc))]
    summaries = []
    for run in found:
        label = label_of(run.path, root)
        if run.summary is not None:  # a table's or a marker folder's run: described from its listing, not opened
            summaries.append(summary_from_marker(RunEntry(run.run_id or "", str(run.path), run.summary), label))
            continue
        path = str(run.path)
        try:
            summaries.append(summary_of(reader(path), label))
        except BadRunError as exc:
            summaries.append(RunSummary(path=path, label=label, error=exc.reason))
        except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError, pa.ArrowException) as exc:
            summaries.append(RunSummary(path=path, label=label, error=unexpected_reason(exc)))
        except OSError as exc:  # no permission to read it, or it vanished while listing
            summaries.append(RunSummary(path=path, label=label, error=f"it cannot be read ({exc.strerror or exc})"))
    return summaries


#: Seconds a dataset's listing is kept before it is read again (new runs appear by then).
REMOTE_LISTING_S = 30


def is_dataset(root: str) -> bool:
    """A URL of a store's folder, or a local folder holding ``run_id=...`` folders (a table, or a folder of
    completion markers): listed again by time, not by its files' stamps."""
    if is_url(root):
        return not root.rstrip("/").rsplit("/", 1)[-1].startswith("run_id=")
    try:
        with os.scandir(root) as entries:
            return any(e.name.startswith("run_id=") for e in entries)
    except OSError:
        return False


def runs(root: str) -> list[RunSummary]:
    """Summaries of the runs at or under ``root`` (FileNotFoundError when nothing is there). A dataset (a
    store's URL, or a folder of ``run_id=...`` folders) is listed again every :data:`REMOTE_LISTING_S`
    seconds, other folders whenever a file in them changes."""
    if is_dataset(root):
        return _runs(root, (0, int(time.time() // REMOTE_LISTING_S), 0))
    return _runs(root, stamp(root))


def track(path: str, generation: int, sequence: int) -> Track:
    """The steps of one sequence (memoised by the reader)."""
    return reader(path).track(generation, sequence)


@st.cache_data(max_entries=64, show_spinner=False)
def _pieces(path: str, version: Stamp, generation: int, sequence: int) -> list[str]:
    run = reader(path)
    return token_pieces(run.vocab, run.track(generation, sequence).chosen)


def pieces(path: str, generation: int, sequence: int) -> list[str]:
    """The text each chosen token adds, step by step."""
    return _pieces(path, stamp(path), generation, sequence)


def stages(path: str) -> list[str]:
    """The run's stages as it is read: the recorded ones and, for a run vLLM sampled, its sampler's
    (computed when read; a dataset's marker lists the recorded ones only)."""
    return list(reader(path).stages)


def stage_aliases(path: str) -> dict[str, str]:
    """The run's other names for its stages (``after:<last processor>`` -> ``constrained``)."""
    return dict(reader(path).metadata.stage_aliases)


def prompt(path: str, generation: int, sequence: int) -> str:
    """The prompt of one sequence ("" when the run did not keep it)."""
    return reader(path).prompt(generation, sequence)


def window_steps(path: str) -> int:
    """How many steps the overview reads at once for this run: about :data:`WINDOW_BYTES` of values."""
    m = reader(path).metadata
    width = (m.top_k * 3 + 2) if m.storage == "topk" else m.vocab_size
    per_row = max(1, width * 4 * len(m.stages))
    return int(min(_MAX_WINDOW, max(_MIN_WINDOW, WINDOW_BYTES // per_row)))


@st.cache_data(max_entries=512, show_spinner=False)
def _step(path: str, version: Stamp, generation: int, sequence: int, position: int, k: int):
    run = reader(path)
    row = run.step(run.track(generation, sequence), position)
    return step_table(row, run.vocab, k), step_summary(row, run.vocab)


def step(path: str, generation: int, sequence: int, position: int, k: int) -> tuple[pd.DataFrame, StepSummary]:
    """The table and headline numbers of one step (reads only the block holding it)."""
    return _step(path, stamp(path), generation, sequence, position, k)


@st.cache_data(max_entries=32, show_spinner=False)
def _window(path: str, version: Stamp, generation: int, sequence: int, start: int, stop: int) -> WindowView:
    run = reader(path)
    part = run.window(run.track(generation, sequence), start, stop)
    try:
        view = window_view(part, generation, sequence)
    except DamagedRowError as exc:
        raise BadRunError(path, str(exc)) from exc
    # the text as the whole sequence decodes it: a character split across the window's edge is not two "�"
    return replace(view, tokens=_pieces(path, version, generation, sequence)[start:stop])


def window(path: str, generation: int, sequence: int, start: int, stop: int) -> WindowView:
    """Statistics, alternatives and heat matrices of track positions ``[start, stop)``."""
    return _window(path, stamp(path), generation, sequence, start, stop)


@st.cache_data(max_entries=16, show_spinner=False)
def _comparison(
    path_a: str,
    version_a: Stamp,
    generation_a: int,
    sequence_a: int,
    path_b: str,
    version_b: Stamp,
    generation_b: int,
    sequence_b: int,
    start: int,
    stop: int,
) -> Comparison:
    parts = []
    for path, generation, sequence in ((path_a, generation_a, sequence_a), (path_b, generation_b, sequence_b)):
        run = reader(path)
        track_ = run.track(generation, sequence)
        parts.append(run.window(track_, min(start, track_.length), min(stop, track_.length)))
    try:
        result = _compare(parts, generation_a, sequence_a, generation_b, sequence_b)
    except DamagedRowError as exc:
        raise BadRunError(f"{path_a}' or '{path_b}", str(exc)) from exc
    result.steps["step"] += start
    result.tokens["step"] += start
    return result


def _compare(parts: list, generation_a: int, sequence_a: int, generation_b: int, sequence_b: int) -> Comparison:
    return compare(
        parts[0],
        parts[1],
        generation_a=generation_a,
        sequence_a=sequence_a,
        generation_b=generation_b,
        sequence_b=sequence_b,
        include_finished=True,
    )


def comparison(
    path_a: str,
    generation_a: int,
    sequence_a: int,
    path_b: str,
    generation_b: int,
    sequence_b: int,
    start: int,
    stop: int,
) -> Comparison:
    """:func:`tracker.compare` of two sequences over steps ``[start, stop)`` (steps numbered from the track's start)."""
    return _comparison(
        path_a, stamp(path_a), generation_a, sequence_a, path_b, stamp(path_b), generation_b, sequence_b, start, stop
    )


def prompt_perplexity(path: str, generation: int, sequence: int) -> float:
    """The perplexity of one row's prompt, NaN when the run did not record its log-probabilities."""
    for entry in reader(path).metadata.generations:
        if int(entry.get("generation", -1)) == generation:
            rows = entry.get("prompt_logprobs") or []
            if 0 <= sequence < len(rows):
                return perplexity(rows[sequence])
    return float("nan")


@st.cache_data(max_entries=4, show_spinner="Comparing every sequence of the two runs…")
def _run_statistics(path_a: str, version_a: Stamp, path_b: str, version_b: Stamp) -> tuple[pd.DataFrame, str]:
    from tracker.reading.divergence import compare_runs
    from tracker.reading.run import Run

    result = compare_runs(Run.load(path_a), Run.load(path_b))
    return result.table(), result.note


def run_statistics(path_a: str, path_b: str) -> tuple[pd.DataFrame, str]:
    """:func:`tracker.reading.divergence.compare_runs` of two whole runs: its table (KL quantiles, top-1 agreement,
    Δp, perplexities) and its note (top-k bounds)."""
    return _run_statistics(path_a, stamp(path_a), path_b, stamp(path_b))
