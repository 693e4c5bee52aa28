"""Finding runs: the one place that says which runs a path or URL holds, and which files make each one.

Every reader starts here: ``Run.load`` and the dashboard's reader
(:func:`locate`: the one run a path names), ``list_runs``, the run browser,
``logitscope inspect`` and ``open_dataset`` (:func:`find_runs`: every run at or
under a path). A location is any of:

- a run file (``.parquet``/``.pq``, or Arrow IPC ``.arrow``/``.feather``/``.ipc``);
- a table (a folder holding ``_delta_log/``, :mod:`tracker.format.table`): its
  runs are what its commits name, never a file no commit names; a table's run
  folder (``<table>/run_id=<id>``) is that run;
- a folder of completion markers (the layout before tables,
  :mod:`tracker.format.marker`): a ``run_id=<id>`` folder is a run once its
  ``_complete.json`` is there, made of the parts the marker lists;
- a spill folder (``_run.json``, local only);
- any other folder: the runs at any of the above under it, up to
  :data:`MAX_DEPTH` folders down.

What a listing never shows, local or remote alike: a file no commit names, a
``run_id=`` folder without its marker (a run still being written, or a killed
writer's), hidden entries and temporary files, symlinks that lead out of the
folder listed (and run folders holding one). Opening a marker folder's run by
its folder's name reads the parts written so far, with a warning; naming it
from the dataset's root (``run_id=``) does not: a root shows complete runs only.
Needs pyarrow (and ``deltalake`` for tables).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow.fs as pafs

from tracker.format.checks import RunFileError
from tracker.format.fs import is_url, path_arg, resolve
from tracker.format.marker import COMPLETE, PARQUET_SUFFIXES, complete_runs, read_marker
from tracker.format.marker_index import markers
from tracker.format.spill import RUN_JSON
from tracker.format.table import RunTable, is_table
from tracker.format.table_index import PartFacts, part_facts, run_summary_of

__all__ = ["MAX_DEPTH", "RUN_SUFFIXES", "FoundRun", "NoRunError", "find_runs", "locate", "table_of"]

MAX_DEPTH = 4
IPC_SUFFIXES = (".arrow", ".feather", ".ipc")
RUN_SUFFIXES = PARQUET_SUFFIXES + IPC_SUFFIXES

Kind = Literal["file", "parts", "table", "spill"]


class NoRunError(FileNotFoundError):
    """Nothing to read at a path (no file, or a folder holding no run); ``reason`` says which."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"path: no run at '{path}' ({reason})")


@dataclass(frozen=True)
class FoundRun:
    """A run found at a location: where its bytes are, and what is known of it without reading a value.

    Attributes:
        path: how the run is named: its file, its run folder, or its spill folder (a URL string for a
            remote run, a Path for a local one).
        kind: ``"file"``, ``"parts"`` (a folder of parts: a marker folder, or a folder of files),
            ``"table"`` (a table's committed parts) or ``"spill"``.
        fs, files: the filesystem and the run's files inside it, in row order (a spill folder: its chunks).
        run_id: the run's id where the location tells it (a table's or a marker's), else None.
        complete: False for a marker folder without its marker (opened by name only).
        described: what the run browser shows (a marker's summary, or how to make it from a table's parts'
            facts); None: open the run. Read it as :attr:`summary`.
        table: the table holding the run (where its vocabulary is), if any.
        facts: what the footers of a table run's parts say (in ``files`` order).
    """

    path: str | Path
    kind: Kind
    fs: pafs.FileSystem = field(repr=False, compare=False)
    files: tuple[str, ...]
    run_id: str | None = None
    complete: bool = True
    described: dict[str, Any] | Callable[[], dict[str, Any]] | None = field(default=None, repr=False, compare=False)
    table: RunTable | None = field(default=None, repr=False, compare=False)
    facts: tuple[PartFacts, ...] = field(default=(), repr=False, compare=False)

    @property
    def summary(self) -> dict[str, Any] | None:
        """What the run browser shows (made on first use for a table's run: its prompt needs the vocabulary)."""
        if callable(self.described):
            object.__setattr__(self, "described", self.described())
        return self.described  # type: ignore[return-value]


# ---------------------------------------------------------------- names and places


def _name(location: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str, str | Path]:
    """The filesystem of ``location``, the path inside it, and how to show it (a URL, or the local Path)."""
    if not is_url(location):
        location = path_arg("path", location)
    fs, where = resolve(location, "path")
    if is_url(location) and not isinstance(fs, pafs.LocalFileSystem):
        return fs, where.rstrip("/"), str(location).rstrip("/")
    return fs, where, Path(location) if not is_url(location) else Path(where)


def _join(shown: str | Path, name: str) -> str | Path:
    return shown / name if isinstance(shown, Path) else f"{shown}/{name}"


def _visible(name: str) -> bool:
    return not name.startswith((".", "_")) and not name.endswith(".tmp")


def _leads_out(entry: Path, inside: Path) -> bool:
    """A symlink whose target is not under ``inside`` (or cannot be resolved)."""
    if not entry.is_symlink():
        return False
    try:
        return not entry.resolve().is_relative_to(inside)
    except (OSError, RuntimeError):
        return True


def _holds_outside_links(fs: pafs.FileSystem, folder: str, inside: Path | None) -> bool:
    """A local run folder one of whose files is a symlink leading out of ``inside``."""
    if inside is None or not isinstance(fs, pafs.LocalFileSystem):
        return False
    try:
        return any(_leads_out(entry, inside) for entry in Path(folder).iterdir())
    except OSError:
        return True


def _kind_of(fs: pafs.FileSystem, where: str) -> pafs.FileType:
    return fs.get_file_info(where).type


def table_of(fs: pafs.FileSystem, where: str, shown: str | Path) -> tuple[RunTable, str, str | Path] | None:
    """The table whose run folder ``where`` is (``<table>/run_id=<id>``): the table, the run id and how to
    show the table (``shown``'s parent); None when ``where`` is no table's run folder."""
    parent, _, name = where.rstrip("/").rpartition("/")
    if not name.startswith("run_id=") or not parent or not is_table(fs, parent):
        return None
    if isinstance(shown, Path):
        return RunTable.at(parent), name.split("=", 1)[1], shown.parent
    table_shown = shown.rstrip("/").rpartition("/")[0]
    return RunTable.at(table_shown), name.split("=", 1)[1], table_shown


# ---------------------------------------------------------------- runs of a table


def _table_runs(
    table: RunTable, shown: str | Path, only: str | None = None, cache: bool = True, inside: Path | None = None
) -> list[FoundRun]:
    """The committed runs of ``table`` (``only``: that run), each with its parts' facts and summary; a local
    run one of whose parts is a symlink leading out of ``inside`` is left out."""
    committed = [c for c in table.committed() if only is None or c.run_id == only]
    facts = part_facts(table, committed, cache=cache)
    runs: dict[str, list[PartFacts]] = {}
    for fact in facts:
        runs.setdefault(fact.run_id, []).append(fact)
    found = []
    for run_id, parts in sorted(runs.items()):
        files = tuple(f"{table.where}/{p.path}" for p in parts)
        if inside is not None and any(_leads_out(Path(f), inside) for f in files):
            continue
        found.append(
            FoundRun(
                _join(shown, f"run_id={run_id}"),
                "table",
                table.fs,
                files,
                run_id=run_id,
                described=lambda parts=parts: run_summary_of(table, parts),
                table=table,
                facts=tuple(parts),
            )
        )
    return found


# ---------------------------------------------------------------- runs of a folder of markers


def _marker_folder(fs: pafs.FileSystem, where: str, shown: str | Path, named: bool) -> FoundRun | None:
    """A ``run_id=`` folder of a marker dataset: the parts its marker lists; without a marker, only when
    ``named`` (opened by its name): every part there, incomplete."""
    raw = None
    if _kind_of(fs, f"{where}/{COMPLETE}") == pafs.FileType.File:
        with fs.open_input_stream(f"{where}/{COMPLETE}") as f:
            raw = f.read()
    run_id = where.rstrip("/").rsplit("/", 1)[-1].split("=", 1)[1]
    if raw is None:
        if not named:
            return None
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(where)) if i.type == pafs.FileType.File]
        parts = sorted(n for n in names if n.endswith(PARQUET_SUFFIXES) and not n.startswith("."))
        return FoundRun(shown, "parts", fs, tuple(f"{where}/{n}" for n in parts), run_id=run_id, complete=False)
    try:
        marker = read_marker(raw)
    except ValueError as exc:
        raise RunFileError(_join(shown, COMPLETE), f"a damaged completion marker: {exc}") from exc
    summary = marker.get("summary") if isinstance(marker.get("summary"), dict) else None
    if summary is not None:
        summary = {**summary, "bytes": marker.get("bytes", 0), "growing": marker.get("growing") is True}
    files = tuple(f"{where}/{n}" for n in marker["parts"])
    return FoundRun(shown, "parts", fs, files, run_id=run_id, described=summary)


def _marker_runs(
    fs: pafs.FileSystem, where: str, shown: str | Path, inside: Path | None, cache: bool = True
) -> list[FoundRun]:
    """The complete runs of a folder of marker folders, described from their markers (cached)."""
    names = complete_runs(fs, where)
    found = []
    for name, marker in markers(fs, where, str(shown), names, cache=cache).items():
        folder = f"{where}/{name}"
        if _holds_outside_links(fs, folder, inside):
            continue
        files = tuple(f"{folder}/{n}" for n in marker["parts"])
        summary = {**marker["summary"], "growing": marker.get("growing", False)}
        found.append(FoundRun(_join(shown, name), "parts", fs, files, run_id=name.split("=", 1)[1], described=summary))
    return found


# ---------------------------------------------------------------- a walk over folders


def _entries(fs: pafs.FileSystem, where: str) -> list[pafs.FileInfo]:
    return sorted(fs.get_file_info(pafs.FileSelector(where, allow_not_found=True)), key=lambda i: i.base_name)


def _folder_runs(
    fs: pafs.FileSystem, where: str, shown: str | Path, depth: int, inside: Path | None, top: bool, cache: bool
) -> list[FoundRun]:
    """The runs in the folder ``where`` and under it (``depth`` more folders down)."""
    local = isinstance(fs, pafs.LocalFileSystem)
    if is_table(fs, where):
        return _table_runs(RunTable.at(shown if isinstance(shown, str) else where), shown, cache=cache, inside=inside)
    if local and (Path(where) / RUN_JSON).is_file():
        return [FoundRun(shown, "spill", fs, ())]
    name = where.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith("run_id="):
        if not top and table_of(fs, where, shown) is not None:
            return []  # a table's run folder: the table lists it
        if _holds_outside_links(fs, where, inside):
            return []
        run = _marker_folder(fs, where, shown, named=False)
        return [] if run is None else [run]
    try:
        entries = _entries(fs, where)
    except OSError:
        if top:
            raise
        return []  # a subfolder this reader may not list
    if any(e.base_name.startswith("run_id=") and e.type == pafs.FileType.Directory for e in entries):
        runs = _marker_runs(fs, where, shown, inside, cache)
        others = [e for e in entries if not e.base_name.startswith("run_id=")]
    else:
        runs, others = [], entries
    for entry in others:
        if not _visible(entry.base_name):
            continue
        child = f"{where}/{entry.base_name}"
        if local and _leads_out(Path(child), inside):  # type: ignore[arg-type]
            continue
        if entry.type == pafs.FileType.File and entry.base_name.endswith(RUN_SUFFIXES):
            runs.append(FoundRun(_join(shown, entry.base_name), "file", fs, (child,)))
        elif entry.type == pafs.FileType.Directory and depth > 0:
            runs += _folder_runs(fs, child, _join(shown, entry.base_name), depth - 1, inside, False, cache)
    return runs


def find_runs(location: str | os.PathLike[str], *, depth: int = MAX_DEPTH, cache: bool = True) -> list[FoundRun]:
    """Every run at or under ``location`` (see the module docstring), sorted by path.

    What was read of a table's parts and of markers is kept on this machine (``cache``: use and keep it;
    :mod:`tracker.format.table_index`, :mod:`tracker.format.marker_index`). NoRunError (a
    FileNotFoundError) when nothing is at ``location``; PermissionError when it cannot be listed
    (subfolders that cannot be are skipped); RunFileError for a damaged marker or table part.
    """
    fs, where, shown = _name(location)
    kind = _kind_of(fs, where)
    if kind == pafs.FileType.NotFound:
        raise NoRunError(shown, "there is no file or folder at this path")
    inside = Path(where).resolve() if isinstance(fs, pafs.LocalFileSystem) else None
    if kind == pafs.FileType.File:
        return [FoundRun(shown, "file", fs, (where,))]
    owner = table_of(fs, where, shown)
    if owner is not None:
        return _table_runs(owner[0], owner[2], owner[1], cache, inside)
    runs = _folder_runs(fs, where, shown, depth - 1, inside, True, cache)
    return sorted(runs, key=lambda r: str(r.path))


# ---------------------------------------------------------------- the one run a path names


def _pick(location: str | Path, runs: list[FoundRun], run_id: str | None, what: str) -> FoundRun:
    ids = [r.run_id for r in runs]
    if run_id is None:
        if len(runs) > 1:
            raise ValueError(f"'{location}' holds {len(runs)} runs; pass run_id= one of {ids}")
        return runs[0]
    for run in runs:
        if run.run_id == run_id:
            return run
    raise ValueError(f"run_id={run_id!r} is not {what} '{location}'; its runs are {ids}")


def locate(location: str | os.PathLike[str], run_id: str | None = None) -> FoundRun:
    """The one run ``location`` names (with ``run_id``: that run of a table or dataset root).

    A table root or a marker dataset root gives complete runs only: ``run_id`` naming a run still being
    written (or never committed) is refused, locally and on an object store alike. A marker folder named
    directly gives the parts written so far (``complete`` False). A folder of separate run files gives
    them all (the caller tells runs apart by their metadata). NoRunError when nothing is there.
    """
    fs, where, shown = _name(location)
    kind = _kind_of(fs, where)
    if kind == pafs.FileType.NotFound:
        reason = (
            "there is no object or folder at this URL"
            if isinstance(shown, str)
            else "there is no file or folder at this path"
        )
        raise NoRunError(shown, reason)
    if kind == pafs.FileType.File:
        return FoundRun(shown, "file", fs, (where,), run_id=None)
    if isinstance(fs, pafs.LocalFileSystem) and (Path(where) / RUN_JSON).is_file():
        return FoundRun(shown, "spill", fs, ())
    owner = table_of(fs, where, shown)
    if owner is not None:
        table, named, table_shown = owner
        runs = _table_runs(table, table_shown, named)
        if not runs:
            raise NoRunError(
                shown,
                f"no commit of its table names a part of run {named!r} (a writer still at work, or one that died: `logitscope vacuum` removes what it left)",
            )
        return _pick(shown, runs, run_id, "in")
    if is_table(fs, where):
        table = RunTable.at(shown if isinstance(shown, str) else where)
        runs = _table_runs(table, shown, run_id)
        if not runs:
            known = [c.run_id for c in table.committed()]
            if run_id is None:
                raise NoRunError(shown, "its table holds no committed run yet")
            raise ValueError(
                f"run_id={run_id!r} is not in '{shown}' (no commit names it); its runs are {sorted(set(known))[:20]}"
            )
        return _pick(shown, runs, run_id, "in")
    name = where.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith("run_id="):
        run = _marker_folder(fs, where, shown, named=True)
        assert run is not None
        return run
    entries = _entries(fs, where)
    if any(e.base_name.startswith("run_id=") and e.type == pafs.FileType.Directory for e in entries):
        runs = _marker_runs(fs, where, shown, None)
        if not runs:
            pending = sum(e.base_name.startswith("run_id=") for e in entries)
            raise NoRunError(
                shown,
                f"it holds {pending} run_id=... folders but no complete run yet (a run is complete once its {COMPLETE} is written)",
            )
        if run_id is not None and run_id not in {r.run_id for r in runs}:
            if any(e.base_name == f"run_id={run_id}" for e in entries):
                raise NoRunError(
                    _join(shown, f"run_id={run_id}"),
                    f"its run is not complete (no {COMPLETE} yet): a dataset's root shows complete runs only; "
                    "open its folder by name to read the parts written so far",
                )
        return _pick(shown, runs, run_id, "in")
    files = [
        f"{where}/{e.base_name}"
        for e in entries
        if e.type == pafs.FileType.File and _visible(e.base_name) and e.base_name.endswith(PARQUET_SUFFIXES)
    ]
    if not files:
        raise NoRunError(shown, "the folder holds no .parquet parts and no spill files (_run.json)")
    return FoundRun(shown, "parts", fs, tuple(files))
