"""A dataset of runs on any storage, written by many processes at once, listed without reading the runs.

A dataset is a folder (or an object-store prefix) of ``run_id=<id>/`` folders,
each holding a run's Parquet parts (``part-00000.parquet``, ...) and, once the
run is complete, the small JSON object ``_complete.json`` (:data:`COMPLETE`),
written last. Rules that make any number of uncoordinated writers safe:

- run ids are unique across processes and machines (a timestamp and 64 random
  bits), so two writers never write the same folder;
- each file is written once, whole: renamed into place on a local disk, a
  single upload on an object store (which shows an object only once its upload
  completes); nothing shared is ever rewritten (there is no dataset-wide index);
- a run is visible only once its marker is there: :func:`list_runs`, the
  dashboard, :meth:`tracker.Run.load` on the dataset root and the query views
  skip a ``run_id=`` folder without one. Opening such a folder directly
  (``Run.load("runs/run_id=X")``) reads the parts written so far and warns
  (:class:`~tracker.format.layout.PartialRunWarning`).

The marker lists the run's parts and a summary (title, model, processors,
sampling, steps, ...), so listing 10,000 runs reads 10,000 small objects, not
10,000 runs. :class:`RunStream` writes a long run part by part while it
generates: a crash loses at most the rows since the last part. Needs pyarrow
and numpy only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from tracker.format.fs import is_url, resolve
from tracker.format.layout import folder_arg
from tracker.format.marker import COMPLETE, complete_runs, is_partition, read_marker
from tracker.format.spill import atomic_path, fsync_path

__all__ = ["COMPLETE", "RunEntry", "RunStream", "list_runs", "write_run", "write_marker", "run_summary"]

_PROMPT_CHARS = 300


class RunEntry(NamedTuple):
    """A complete run of a dataset: its id, where its folder is (a path or a URL), and its marker's summary."""

    run_id: str
    path: str
    summary: dict[str, Any]


def _root(root: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str, str]:
    """The filesystem, the path inside it and the name to show (the URL, or the local path) of a dataset root."""
    if is_url(root):
        fs, where = resolve(root, "root")
        if isinstance(fs, pafs.LocalFileSystem):
            return fs, where, where
        return fs, where.rstrip("/"), str(root).rstrip("/")
    folder = folder_arg("root", root)
    return pafs.LocalFileSystem(), str(folder.expanduser().absolute()), str(folder)


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


def _write_marker(fs: pafs.FileSystem, folder: str, run: Any, parts: list[str], nbytes: int) -> str:
    """Write the run's :data:`COMPLETE` (its last write: the run becomes visible); returns its path."""
    return write_marker(fs, folder, run.run_id, parts, nbytes, run_summary(run))


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
    """Write (or replace) the :data:`COMPLETE` marker of the run in ``folder``; returns its path.

    ``growing`` marks a run that its one writer keeps extending (a serving engine writes each ended request
    as a part, then replaces the marker with one listing every part so far): readers see each version whole
    (a rename on a local disk, one upload on an object store), and :func:`list_runs` does not cache it.
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


def _size(fs: pafs.FileSystem, path: str) -> int:
    return int(fs.get_file_info(path).size or 0)


def write_run(run: Any, root: str | os.PathLike[str], compression: str | None = "zstd") -> str | Path:
    """Write ``run`` (a :class:`tracker.Run`) as ``root/run_id=<id>/part-00000.parquet``, then its marker.

    What :meth:`tracker.Run.to_dataset` does. Returns the part's path (its URL for a URL root).
    """
    fs, where, shown = _root(root)
    name = "part-00000.parquet"
    folder = f"{where}/run_id={run.run_id}"
    if isinstance(fs, pafs.LocalFileSystem):
        part: str | Path = run._write(Path(folder) / name, compression, scratch=Path(where))
    else:
        part = run._write(f"{shown}/run_id={run.run_id}/{name}", compression)
    _write_marker(fs, folder, run, [name], _size(fs, f"{folder}/{name}"))
    return part


#: Where :func:`list_runs` keeps what it read of each dataset's markers (``$LOGITSCOPE_CACHE`` overrides).
CACHE_ENV = "LOGITSCOPE_CACHE"


def _cache_file(shown: str) -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "logitscope")
    return Path(base) / "run-index" / f"{hashlib.sha1(shown.encode()).hexdigest()[:20]}.json"


def _load_cache(path: Path) -> dict[str, dict]:
    try:
        cached = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def list_runs(root: str | os.PathLike[str], *, threads: int = 16, cache: bool = True) -> list[RunEntry]:
    """The complete runs of the dataset at ``root`` (a folder or a URL), sorted by run id, from their markers.

    Reads one listing and the markers, never a run's data; a damaged marker raises ValueError naming it. An
    empty or missing root gives ``[]``. A complete run is never rewritten, so with ``cache`` what was read of
    its marker is kept on this machine (``~/.cache/logitscope/run-index/``, or ``$LOGITSCOPE_CACHE``) and a
    later listing reads only the markers of runs it has not seen: one listing, however many runs.
    """
    fs, where, shown = _root(root)
    if fs.get_file_info(where).type != pafs.FileType.Directory:
        return []
    index_file = _cache_file(shown if is_url(root) else where)
    known = _load_cache(index_file) if cache else {}
    if isinstance(fs, pafs.LocalFileSystem):  # a run seen complete stays complete: only new folders are checked
        with os.scandir(where) as listing:
            folders = sorted(e.name for e in listing if e.name.startswith("run_id="))
        names = [n for n in folders if n in known or is_partition(Path(where) / n)]
    else:
        names = complete_runs(fs, where)

    def read(name: str) -> dict:
        if isinstance(known.get(name), dict):
            return known[name]
        path = f"{where}/{name}/{COMPLETE}"
        with fs.open_input_stream(path) as f:
            raw = f.read()
        try:
            marker = read_marker(raw)
        except ValueError as exc:
            raise ValueError(f"'{shown}/{name}/{COMPLETE}' is a damaged completion marker: {exc}") from exc
        summary = marker.get("summary") if isinstance(marker.get("summary"), dict) else {}
        return {**summary, "bytes": marker.get("bytes", 0), "growing": marker.get("growing") is True}

    known = {n: v for n, v in known.items() if isinstance(v, dict) and not v.get("growing")}  # growing: read again
    if isinstance(fs, pafs.LocalFileSystem) or threads <= 1 or len(names) - len(known) < 8:
        summaries = [read(n) for n in names]
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            summaries = list(pool.map(read, names))
    if cache and (len(names) != len(known) or any(n not in known for n in names)):
        with contextlib.suppress(OSError):  # a cache that cannot be written is only slower next time
            index_file.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(index_file) as tmp:
                done = {n: v for n, v in zip(names, summaries) if not v.get("growing")}
                tmp.write_text(json.dumps(done, separators=(",", ":"), default=str))
    return [RunEntry(n.split("=", 1)[1], f"{shown}/{n}", s) for n, s in zip(names, summaries)]


class RunStream:
    """Write a tracker's run into a dataset part by part while it generates, then mark it complete.

    >>> stream = RunStream(tracker, "runs/")      # or tracker.stream_to("s3://bucket/runs")
    >>> model.generate(..., logits_processor=[tracker]); stream.flush()   # part-00000.parquet
    >>> model.generate(..., logits_processor=[tracker]); stream.flush()   # part-00001.parquet
    >>> stream.close()                                                    # _complete.json: the run is visible

    Each :meth:`flush` writes the rows recorded since the last one as a new part (call it after a
    generation returns: a step's chosen token is recorded with the step after it). Until :meth:`close`,
    the run is invisible to dataset listings; opening its folder directly reads the parts so far, with a
    :class:`~tracker.format.layout.PartialRunWarning`. Used as a context manager, it closes on a normal exit
    and, on an exception, flushes what was recorded but leaves the run unmarked (incomplete).

    Args:
        source: the tracker (anything with a ``run`` attribute giving a :class:`tracker.Run`).
        root: the dataset's folder or URL.
        compression: the parts' Parquet codec.
    """

    def __init__(self, source: Any, root: str | os.PathLike[str], *, compression: str | None = "zstd") -> None:
        if not hasattr(source, "run"):
            raise TypeError(f"source must be a tracker (with a .run), got {type(source).__name__}")
        self.source = source
        self.root = root
        self.compression = compression
        self.parts: list[str] = []
        self._fs, self._where, self._shown = _root(root)
        self._rows = 0
        self._written: set[int] = set()
        self._bytes = 0
        self._run_id = source.run.run_id
        self.closed = False

    @property
    def folder(self) -> str:
        """The run's folder (a path or a URL)."""
        return f"{self._shown}/run_id={self._run_id}"

    def flush(self) -> str | Path | None:
        """Write the rows recorded since the last flush as the next part; None when there are none."""
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
        part = replace(run.metadata, generations=entries)
        name = f"part-{len(self.parts):05d}.parquet"
        piece = type(run)(rows, part, run.vocab)
        folder = f"{self._where}/run_id={self._run_id}"
        if isinstance(self._fs, pafs.LocalFileSystem):
            path: str | Path = piece._write(Path(folder) / name, self.compression, scratch=Path(self._where))
        else:
            path = piece._write(f"{self.folder}/{name}", self.compression)
        self._bytes += _size(self._fs, f"{folder}/{name}")
        self.parts.append(name)
        self._rows = total
        self._written |= present
        return path

    def close(self) -> str:
        """Write what is left as a last part, then the marker: the run becomes visible. Returns the marker's path."""
        if self.closed:
            raise ValueError("this stream is already closed")
        self.flush()
        if not self.parts:
            raise ValueError("nothing recorded yet: an empty run is not written")
        marker = _write_marker(
            self._fs, f"{self._where}/run_id={self._run_id}", self.source.run, self.parts, self._bytes
        )
        self.closed = True
        return marker

    def __enter__(self) -> RunStream:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if self.closed:
            return
        if kind is None:
            self.close()
        else:
            self.flush()  # keep what was recorded; the run stays unmarked
