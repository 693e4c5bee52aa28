"""Runs into a table: :func:`write_run` (what ``Run.to_dataset`` does), :class:`RunStream`, :func:`list_runs`.

A dataset of runs is a Delta Lake table (:mod:`tracker.format.table`): any
number of processes and machines append runs at once; a run is visible to
every reader (logitscope, DuckDB, pyarrow, Polars, Spark) once the commit
naming its parts is made, never before; a run written again is a new commit
replacing its parts. :class:`~tracker.format.table_writer.TableWriter` commits
the parts of a serving engine's requests in groups.

Folders written before tables (``run_id=<id>/`` folders made complete by a
``_complete.json`` marker, :mod:`tracker.format.marker`) keep reading; new runs
are not added to one (``logitscope convert`` copies its runs into a table).
:func:`write_marker` and :func:`run_summary` write that layout for the
engines that still do. Needs pyarrow and numpy (and ``deltalake`` for tables).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from tracker.format.discovery import NoRunError, find_runs
from tracker.format.fs import folder_arg, is_url
from tracker.format.marker import COMPLETE, complete_runs
from tracker.format.spill import atomic_path, fsync_path
from tracker.format.table import RunTable, Staged, TableError, is_table
from tracker.format.table_index import CACHE_ENV

__all__ = [
    "CACHE_ENV",
    "COMPLETE",
    "RunEntry",
    "RunStream",
    "list_runs",
    "write_run",
    "write_marker",
    "run_summary",
    "open_table",
]

_PROMPT_CHARS = 300


class RunEntry(NamedTuple):
    """A complete run of a dataset: its id, where its folder is (a path or a URL), and its summary."""

    run_id: str
    path: str
    summary: dict[str, Any]


def open_table(
    root: str | os.PathLike[str], *, storage_options: dict[str, str] | None = None, create: bool = True
) -> RunTable:
    """The table at ``root`` to write runs into, made if it is not there (``create``; else by its first
    commit). A folder of completion markers (written before tables) is refused: its runs would be hidden
    from readers of the table."""
    if not is_url(root):
        folder_arg("root", root)
    table = RunTable.at(root, storage_options=storage_options)
    there = table.fs.get_file_info(table.where).type == pafs.FileType.Directory
    if there and not is_table(table.fs, table.where) and complete_runs(table.fs, table.where):
        raise TableError(
            f"root '{table.location}' holds runs with completion markers (written before tables); write new "
            f"runs into a new table, or copy these into one first: logitscope convert '{table.location}' NEW_ROOT"
        )
    if create:
        table.create()
    return table


def _part_path(table: RunTable, staged: Staged) -> str | Path:
    if isinstance(table.fs, pafs.LocalFileSystem) and not is_url(table.location):
        return Path(table.location) / staged.path
    return f"{table.location}/{staged.path}"


def write_run(run: Any, root: str | os.PathLike[str], compression: str | None = "zstd") -> str | Path:
    """Write ``run`` (a :class:`tracker.Run`) into the table at ``root`` as one part, in one commit that also
    removes the parts an earlier write of the same run left (a run written again replaces itself).

    What :meth:`tracker.Run.to_dataset` does. Returns the part's path (its URL for a URL root).
    """
    if not run._record_batches() and not run.metadata.vocab_size:
        raise ValueError("nothing recorded yet: run a generation with the tracker first (an empty run is not written)")
    table = open_table(root, create=False)  # a failed write leaves no table behind; the commit makes it
    staged = table.stage(run.to_arrow(), run.metadata, compression)
    table.commit([staged], replace={run.run_id})
    return _part_path(table, staged)


def list_runs(root: str | os.PathLike[str], *, cache: bool = True) -> list[RunEntry]:
    """The complete runs of the dataset at ``root`` (a table, or a folder of completion markers; a folder or
    a URL), sorted by run id, with what the run browser shows of each (:mod:`tracker.format.discovery`).

    Reads the table's log and the footers of parts this machine has not seen (or the markers), never a run's
    values; a damaged marker or footer raises ValueError naming it. An empty or missing root gives ``[]``.
    ``cache``: keep (and use) what was read on this machine (see :mod:`tracker.format.discovery`).
    """
    try:
        found = find_runs(root, depth=1, cache=cache)
    except NoRunError:
        return []
    entries = [RunEntry(r.run_id, str(r.path), r.summary) for r in found if r.run_id and r.summary is not None]
    return sorted(entries, key=lambda e: e.run_id)


class RunStream:
    """Write a tracker's run into a table part by part while it generates; the run appears whole at close.

    >>> stream = RunStream(tracker, "runs/")      # or tracker.stream_to("s3://bucket/runs")
    >>> model.generate(..., logits_processor=[tracker]); stream.flush()   # a part, written, not committed
    >>> model.generate(..., logits_processor=[tracker]); stream.flush()   # another
    >>> stream.close()                                                    # one commit: the run is visible

    Each :meth:`flush` writes the rows recorded since the last one as a new part (call it after a generation
    returns: a step's chosen token is recorded with the step after it), so that closing writes little. No
    reader sees a part before :meth:`close` commits them all at once (replacing what an earlier write of
    the run left); a stream that is never closed (an exception in its ``with`` block, a killed process)
    leaves parts no reader ever sees, which ``logitscope vacuum`` removes.

    Args:
        source: the tracker (anything with a ``run`` attribute giving a :class:`tracker.Run`).
        root: the table's folder or URL.
        compression: the parts' Parquet codec (of the value columns).
    """

    def __init__(self, source: Any, root: str | os.PathLike[str], *, compression: str | None = "zstd") -> None:
        if not hasattr(source, "run"):
            raise TypeError(f"source must be a tracker (with a .run), got {type(source).__name__}")
        self.source = source
        self.root = root
        self.compression = compression
        self._table = open_table(root)
        self._staged: list[Staged] = []
        self._rows = 0
        self._written: set[int] = set()
        self._run_id = source.run.run_id
        self.closed = False

    @property
    def parts(self) -> list[str]:
        """The parts written so far (paths relative to the table)."""
        return [s.path for s in self._staged]

    @property
    def folder(self) -> str | Path:
        """The run's folder in the table (a path or a URL)."""
        base = self._table.location
        return Path(base) / f"run_id={self._run_id}" if not is_url(base) else f"{base}/run_id={self._run_id}"

    def flush(self) -> str | Path | None:
        """Write the rows recorded since the last flush as the next part (not committed); None when there
        are none."""
        if self.closed:
            raise ValueError("this stream is closed: start a new RunStream for a new run")
        run = self.source.run
        if run.run_id != self._run_id:
            raise ValueError(f"the tracker now records run {run.run_id!r}, not {self._run_id!r} (it was reset)")
        batches = run._record_batches()
        total = sum(b.num_rows for b in batches)
        if total <= self._rows:
            return None
        rows = pa.Table.from_batches(batches).slice(self._rows).to_batches()
        present = set(np.unique(np.concatenate([b.column("generation").to_numpy() for b in rows])).tolist())
        entries = [e for e in run.metadata.generations if e.get("generation") in present - self._written]
        piece = type(run)(rows, replace(run.metadata, generations=entries), run.vocab)
        staged = self._table.stage(piece.to_arrow(), piece.metadata, self.compression)
        self._staged.append(staged)
        self._rows = total
        self._written |= present
        return _part_path(self._table, staged)

    def close(self) -> str | Path:
        """Write what is left as a last part, then commit every part at once: the run becomes visible.
        Returns the run's folder in the table."""
        if self.closed:
            raise ValueError("this stream is already closed")
        self.flush()
        if not self._staged:
            raise ValueError("nothing recorded yet: an empty run is not written")
        self._table.commit(self._staged, replace={self._run_id})
        self.closed = True
        return self.folder

    def __enter__(self) -> RunStream:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if not self.closed and kind is None:
            self.close()  # on an exception nothing is committed: the parts stay invisible (vacuum removes them)


# ---------------------------------------------------------------- the layout before tables (engines still write it)


def run_summary(run: Any) -> dict[str, Any]:
    """What the dashboard's run browser shows of a run (:class:`tracker.Run`), kept in its marker."""
    m = run.metadata
    batches = run._record_batches()
    generation = np.concatenate([b.column("generation").to_numpy() for b in batches]) if batches else np.zeros(0)
    sequence = np.concatenate([b.column("sequence").to_numpy() for b in batches]) if batches else np.zeros(0)
    steps = sequences = 0
    if generation.size:
        pairs, counts = np.unique(np.stack([generation, sequence]), axis=1, return_counts=True)
        steps = int(counts.max())
        sequences = int(np.unique(pairs[0], return_counts=True)[1].max())
    prompt = ""
    if m.generations:
        rows = m.generations[-1].get("prompt_ids") or []
        prompt = run.vocab.decode_shown(rows[0])[:_PROMPT_CHARS] if rows else ""
    return {
        "title": str(m.extra.get("title", "")) if isinstance(m.extra, dict) else "",
        "model": m.model or "",
        "processors": m.processors or "none",
        "sampling": m.sampling,
        "created_at": m.created_at,
        "storage": m.storage,
        "top_k": m.top_k,
        "stages": list(m.stages),
        "vocab_size": m.vocab_size,
        "rows": int(generation.size),
        "steps": steps,
        "sequences": sequences,
        "generations": len(np.unique(generation)) if generation.size else 0,
        "prompt": prompt,
    }


def write_marker(
    fs: pafs.FileSystem,
    folder: str,
    run_id: str,
    parts: list[str],
    nbytes: int,
    summary: dict[str, Any],
    *,
    growing: bool = False,
) -> str:
    """Write (or replace) the :data:`COMPLETE` marker of the run in ``folder`` (the layout before tables);
    returns its path. ``growing`` marks a run that its one writer keeps extending: readers see each version
    whole (a rename on a local disk, one upload on an object store), and listings do not cache it.
    """
    body = {"run_id": run_id, "parts": parts, "bytes": nbytes, "summary": summary}
    if growing:
        body["growing"] = True
    raw = json.dumps(body, separators=(",", ":"), default=str).encode()
    target = f"{folder}/{COMPLETE}"
    if isinstance(fs, pafs.LocalFileSystem):
        with atomic_path(Path(target)) as tmp:
            tmp.write_bytes(raw)
            fsync_path(tmp)
        fsync_path(Path(folder))
    else:
        with fs.open_output_stream(target) as sink:
            sink.write(raw)
    return target
