"""Every on-disk layout of a run, opened one way: what :meth:`tracker.Run.load` and the dashboard read.

Layouts (as :mod:`tracker.reading.run` and :mod:`tracker.format.spill` write them):

- a Parquet file (``.parquet``, ``.pq``) or an Arrow IPC file (``.arrow``, ``.feather``, ``.ipc``);
- a folder of Parquet parts (a ``run_id=...`` dataset partition);
- a dataset root holding complete ``run_id=...`` folders (with their :data:`COMPLETE`, :mod:`tracker.format.dataset`);
- any of these at a URL (``s3://...``, :mod:`tracker.format.fs`), but a spill folder (local by nature);
- a spill folder: ``_run.json``, ``_vocab.arrow`` and ``chunk-*.arrow`` files.

:func:`open_layout` reads the metadata (the generations a Parquet file keeps
in its ``generation_meta`` column put back), checks every part's columns
against it and returns a :class:`RunLayout`: its parts, read whole
(:meth:`RunLayout.batches`) or block by block (a Parquet row group, a record
batch of a memory-mapped IPC file: :meth:`Part.read_block`). A damaged file
raises :class:`RunFileError` naming the file and what is wrong with it;
Parquet pages are checked against their checksums on every read. Needs
pyarrow and numpy only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from processors.vocab import Vocabulary
from tracker.format.checks import (
    ID_COLUMNS,
    RunFileError,
    arrow_reason,
    check_batch,
    check_ids,
    check_row_groups,
    check_schemas,
    metadata_from,
    vocabulary_from,
)
from tracker.format.fs import is_url, resolve
from tracker.format.marker import COMPLETE, PARQUET_SUFFIXES, complete_runs, is_partition, read_marker
from tracker.format.schema import (
    GENERATIONS_COLUMN,
    META_RUN,
    META_VOCAB,
    RunMetadata,
    check_generations,
    generations_from_column,
)
from tracker.format.spill import CHUNK_GLOB, RUN_JSON, VOCAB_FILE

__all__ = [
    "PartialRunWarning",
    "path_arg",
    "folder_arg",
    "IPC_SUFFIXES",
    "PARQUET_SUFFIXES",
    "ID_COLUMNS",
    "RunFileError",
    "NoRunError",
    "Part",
    "RunLayout",
    "open_layout",
    "open_part",
    "is_partition",
    "arrow_reason",
    "metadata_from",
    "vocabulary_from",
    "COMPLETE",
    "complete_runs",
    "read_marker",
]

IPC_SUFFIXES = (".arrow", ".feather", ".ipc")


class PartialRunWarning(UserWarning):
    """A run read from a spill folder: only the rows that had spilled to disk (see :attr:`RunLayout.note`)."""


class NoRunError(FileNotFoundError):
    """Nothing to read at a path (no file, or a folder holding no run); ``reason`` says which."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"path: no run at '{path}' ({reason})")


# ---------------------------------------------------------------- parts: the files of a run


class Part(Protocol):
    """One file of a run, read whole or in blocks (row groups or record batches)."""

    path: Path | str  # a str: the URL of a part on a remote filesystem
    nbytes: int

    @property
    def schema(self) -> pa.Schema: ...
    def block_sizes(self) -> list[int]: ...
    def read_ids(self) -> pa.Table: ...
    def read_block(self, block: int, columns: tuple[str, ...]) -> tuple[pa.Table, int]: ...
    def read(self, columns: list[str]) -> pa.Table: ...
    def read_all(self) -> pa.Table: ...
    def steps(self) -> int: ...
    def generations(self) -> list[dict]: ...


class _ParquetPart:
    """A Parquet file: blocks are row groups; only the requested column chunks are read."""

    def __init__(self, path: Path | str, source: pa.NativeFile | None = None) -> None:
        self.path = path
        self.file = pq.ParquetFile(
            path if source is None else source, memory_map=source is None, page_checksum_verification=True
        )
        check_row_groups(path, self.file.metadata)
        self.nbytes = int(os.path.getsize(path) if source is None else source.size())

    @property
    def schema(self) -> pa.Schema:
        return self.file.schema_arrow

    def block_sizes(self) -> list[int]:
        meta = self.file.metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

    def read_ids(self) -> pa.Table:
        return self.file.read(columns=list(ID_COLUMNS), use_threads=True)

    def read_block(self, block: int, columns: tuple[str, ...]) -> tuple[pa.Table, int]:
        table = self.file.read_row_group(block, columns=list(columns), use_threads=True)
        group = self.file.metadata.row_group(block)
        wanted = set(columns)
        nbytes = sum(
            group.column(j).total_compressed_size
            for j in range(group.num_columns)
            if group.column(j).path_in_schema.split(".")[0] in wanted
        )
        return table, int(nbytes)

    def read(self, columns: list[str]) -> pa.Table:
        """Every row of ``columns`` (those the file has)."""
        return self.file.read(columns=[n for n in columns if n in self.schema.names], use_threads=True)

    def read_all(self) -> pa.Table:
        """Every row and column but the generations' metadata."""
        return self.read([n for n in self.schema.names if n != GENERATIONS_COLUMN])

    def steps(self) -> int:
        """The highest step + 1, from the row groups' statistics (no value read; 0 without them)."""
        if "step" not in self.schema.names:
            return 0
        meta, index, high = self.file.metadata, self.schema.get_field_index("step"), -1
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(index).statistics
            if stats is not None and stats.has_min_max:
                high = max(high, int(stats.max))
        return high + 1

    def generations(self) -> list[dict]:
        if GENERATIONS_COLUMN not in self.schema.names:
            return []
        return generations_from_column(self.file.read(columns=[GENERATIONS_COLUMN]).column(0))


class _IpcPart:
    """An Arrow IPC file through a memory map: blocks are record batches, read without a copy, each checked
    against its buffers before a value is touched (:func:`~tracker.format.checks.check_batch`, once per batch)."""

    def __init__(self, path: Path | str, source: pa.NativeFile | None = None) -> None:
        self.path = path
        self.reader = pa.ipc.open_file(pa.memory_map(str(path), "r") if source is None else source)
        self.nbytes = int(os.path.getsize(path) if source is None else source.size())
        self._checked: set[int] = set()

    @property
    def schema(self) -> pa.Schema:
        return self.reader.schema

    def _batch(self, i: int) -> pa.RecordBatch:
        batch = self.reader.get_batch(i)
        if i not in self._checked:
            check_batch(self.path, batch, f"record batch {i}")
            self._checked.add(i)
        return batch

    def block_sizes(self) -> list[int]:
        return [self._batch(i).num_rows for i in range(self.reader.num_record_batches)]

    def read_ids(self) -> pa.Table:
        return self.read(list(ID_COLUMNS))

    def read_block(self, block: int, columns: tuple[str, ...]) -> tuple[pa.Table, int]:
        batch = self._batch(block).select(list(columns))
        return pa.Table.from_batches([batch]), int(batch.nbytes)

    def read(self, columns: list[str]) -> pa.Table:
        """Every row of ``columns`` (those the file has), each batch checked first."""
        wanted = [n for n in columns if n in self.schema.names]
        batches = [self._batch(i).select(wanted) for i in range(self.reader.num_record_batches)]
        return pa.Table.from_batches(batches, schema=pa.schema([self.schema.field(n) for n in wanted]))

    def read_all(self) -> pa.Table:
        return self.read([n for n in self.schema.names if n != GENERATIONS_COLUMN])

    def steps(self) -> int:
        """The highest step + 1 (read from the ``step`` column: an IPC file keeps no statistics)."""
        if "step" not in self.schema.names:
            return 0
        high = pc.max(self.read(["step"]).column(0)).as_py()
        return 0 if high is None else int(high) + 1

    def generations(self) -> list[dict]:
        if GENERATIONS_COLUMN not in self.schema.names:
            return []
        return generations_from_column(self.read([GENERATIONS_COLUMN]).column(0))


def open_part(path: Path, fs: pafs.FileSystem | None = None, url: str | None = None) -> Part:
    """Open one run file (IPC or Parquet, told by its first bytes, else its suffix); RunFileError naming it
    when it cannot be read. With ``fs``, ``path`` is inside that filesystem and ``url`` names it in errors."""
    try:
        source = None if fs is None else fs.open_input_file(str(path))
        name: Path | str = path if url is None else url
        with open(path, "rb") if source is None else contextlib.nullcontext(source) as f:
            magic = f.read(6)
        source is None or source.seek(0)
        if magic.startswith(b"PAR1"):
            return _ParquetPart(name, source)
        if magic == b"ARROW1" or str(path).endswith(IPC_SUFFIXES):
            return _IpcPart(name, source)
        return _ParquetPart(name, source)
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise RunFileError(url or path, arrow_reason(exc)) from exc


# ---------------------------------------------------------------- a run's layout


@dataclass(frozen=True)
class RunLayout:
    """An opened run on disk.

    Attributes:
        path: the run's file or folder.
        kind: ``"file"``, ``"parts"`` (a folder of Parquet parts) or ``"spill"``.
        parts: its files, in row order (a spill folder may have none yet).
        metadata: the run metadata, generations included.
        vocab_raw: the serialised vocabulary (None when the run carries none).
        vocab_path: the file it came from, for errors.
    """

    path: Path | str
    kind: Literal["file", "parts", "spill"]
    parts: list[Part]
    metadata: RunMetadata
    vocab_raw: bytes | None
    vocab_path: Path | str
    incomplete: bool = False  # a ``run_id=...`` folder without its completion marker

    @property
    def note(self) -> str | None:
        """What a reader should know about how much of the run this is (None: the whole run as exported)."""
        if self.incomplete:
            return (
                f"'{self.path}' has no {COMPLETE}: its run is still being written (or its writer died, or an "
                "older logitscope wrote it without the marker); these are the parts written so far"
            )
        if self.kind != "spill":
            return None
        return (
            f"'{self.path}' is a spill folder: it holds the rows that had spilled to disk when its tracker stopped "
            "(or its process died); rows the tracker still held in memory are not in it. The whole run is in "
            "the tracker's exports (to_parquet, to_dataset)."
        )

    def vocabulary(self) -> Vocabulary | None:
        """The run's vocabulary (None when it carries none); RunFileError when it is damaged."""
        try:
            return vocabulary_from(self.vocab_raw, self.metadata.vocab_size)
        except ValueError as exc:
            raise RunFileError(self.vocab_path, str(exc)) from exc

    def check_rows(self, ids: pa.Table) -> None:
        """RunFileError naming the run when its id columns ``ids`` (every row's) cannot be a run's
        (:func:`~tracker.format.checks.check_ids`: nulls, chosen ids outside the vocabulary, a row twice)."""
        check_ids(self.path, ids, self.metadata.vocab_size)

    def batches(self) -> list[pa.RecordBatch]:
        """Every row of the run (a spill chunk keeps the columns it was written with); RunFileError naming
        a damaged file."""
        batches: list[pa.RecordBatch] = []
        for part in self.parts:
            try:
                batches += part.read_all().to_batches()
            except (pa.ArrowException, OSError) as exc:
                if isinstance(exc, (FileNotFoundError, PermissionError)):
                    raise
                raise RunFileError(part.path, arrow_reason(exc)) from exc
        return batches


def _metadata(path: Path, raw: bytes | None) -> RunMetadata:
    try:
        return metadata_from(raw)
    except ValueError as exc:
        raise RunFileError(path, str(exc)) from exc


def _with_generations(metadata: RunMetadata, parts: list[Part]) -> RunMetadata:
    entries = list(metadata.generations)
    for part in parts:
        try:
            found = part.generations()
            check_generations(found, metadata.vocab_size)
            entries += found
        except (pa.ArrowException, OSError) as exc:
            raise RunFileError(part.path, arrow_reason(exc)) from exc
        except RunFileError:
            raise
        except ValueError as exc:
            raise RunFileError(part.path, str(exc)) from exc
    return metadata if len(entries) == len(metadata.generations) else replace(metadata, generations=entries)


def _check(layout: RunLayout) -> None:
    check_schemas([(p.path, p.schema) for p in layout.parts], layout.metadata, spill=layout.kind == "spill")


def _parts_of_one_run(
    folder: Path, parts: list[Part], metas: list[RunMetadata], run_id: str | None
) -> tuple[list[Part], list[RunMetadata]]:
    """The parts of a folder that belong to one run: the one ``run_id`` names, or the only one there is.

    A folder of separate run files (what ``logitscope demo --out`` writes) is not one run: its parts
    are never merged; ValueError names the runs and asks for ``run_id`` or one file.
    """
    ids = list(dict.fromkeys(m.run_id for m in metas))
    if run_id is not None:
        keep = [i for i, m in enumerate(metas) if m.run_id == run_id]
        if not keep:
            raise ValueError(f"run_id={run_id!r} is not in '{folder}'; its runs are {ids}")
        return [parts[i] for i in keep], [metas[i] for i in keep]
    if len(ids) > 1:
        files = [Path(p.path).name for p in parts]
        raise ValueError(
            f"'{folder}' holds {len(ids)} runs in {len(files)} files ({', '.join(files[:4])}"
            f"{', ...' if len(files) > 4 else ''}); open one file, or pass run_id= one of {ids}"
        )
    return parts, metas


def _dataset_member(root: Path | str, runs: list[str], run_id: str | None, exists: Callable[[str], bool]) -> str:
    """The ``run_id=...`` folder name of a dataset root that ``run_id`` names (the only one when it is None)."""
    if run_id is None:
        if len(runs) > 1:
            names = [p.split("=", 1)[1] for p in runs]
            raise ValueError(f"'{root}' holds {len(runs)} runs; pass run_id= one of {names}")
        return runs[0]
    if f"run_id={run_id}" not in runs and not exists(f"run_id={run_id}"):
        raise ValueError(f"run_id={run_id!r} is not in '{root}'")
    return f"run_id={run_id}"  # named: opened even before it is complete (then with a PartialRunWarning)


def _folder_parts(names: list[str], marker_raw: bytes | None, where: Path | str) -> tuple[list[str], bool]:
    """The part names of a run folder: those its marker lists, else every part there (then it is incomplete)."""
    if marker_raw is None:
        return sorted(n for n in names if n.endswith(PARQUET_SUFFIXES) and not n.startswith(".")), True
    try:
        return list(read_marker(marker_raw)["parts"]), False
    except ValueError as exc:
        raise RunFileError(where, str(exc)) from exc


def path_arg(name: str, value: object) -> Path:
    """``value`` as a Path: a non-empty ``str`` or an ``os.PathLike``; else an error naming the argument and the value."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (a str or os.PathLike), got {value!r} ({type(value).__name__})")
    if str(value) == "":
        raise ValueError(f"{name} must be a path, got '' (an empty string)")
    return Path(value)


def folder_arg(name: str, value: object) -> Path:
    """``value`` as a Path (:func:`path_arg`) to a folder that exists or can be made (not at or under a file)."""
    folder = path_arg(name, value)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == folder else f"lies under '{existing}', which is a file"
        raise NotADirectoryError(f"{name} must be a folder (made if missing), got '{folder}', which {where}")
    return folder


def _parts_layout(where: Path | str, names: list[str], marker: bytes | None, opener, run_id: str | None) -> RunLayout:
    """The layout of a folder of Parquet parts (``names`` its entries, ``marker`` its :data:`COMPLETE`)."""
    files, incomplete = _folder_parts(names, marker, f"{where}/{COMPLETE}")
    if not files:
        pending = sum(n.startswith("run_id=") for n in names)
        raise NoRunError(
            where,
            f"it holds {pending} run_id=... folders but no complete run yet (a run is complete once its "
            f"{COMPLETE} is written)"
            if pending
            else "the folder holds no .parquet parts and no spill files (_run.json)",
        )
    missing = [n for n in files if n not in names]
    if missing:
        raise RunFileError(where, f"its {COMPLETE} lists parts that are not there: {missing[:4]}")
    parts = [opener(n) for n in files]
    metas = [_metadata(p.path, (p.schema.metadata or {}).get(META_RUN)) for p in parts]
    parts, metas = _parts_of_one_run(where, parts, metas, run_id)  # type: ignore[arg-type]
    meta = parts[0].schema.metadata or {}
    incomplete = incomplete and str(where).rstrip("/").rsplit("/", 1)[-1].startswith("run_id=")
    return RunLayout(where, "parts", parts, metas[0], meta.get(META_VOCAB), parts[0].path, incomplete)


def _open_remote(fs: pafs.FileSystem, where: str, url: str, run_id: str | None) -> RunLayout:
    """:func:`open_layout` of a file or folder on a remote filesystem (no spill folders there)."""
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.NotFound:
        raise NoRunError(url, "there is no object or folder at this URL")
    if info.type == pafs.FileType.File:
        part = open_part(where, fs, url)  # type: ignore[arg-type]
        meta = part.schema.metadata or {}
        return RunLayout(url, "file", [part], _metadata(url, meta.get(META_RUN)), meta.get(META_VOCAB), url)
    runs = complete_runs(fs, where)
    named = run_id is not None and fs.get_file_info(f"{where}/run_id={run_id}").type == pafs.FileType.Directory
    if runs or named:
        member = _dataset_member(url, runs, run_id, lambda n: named)
        where, url = f"{where}/{member}", f"{url}/{member}"
    listing = fs.get_file_info(pafs.FileSelector(where, allow_not_found=True))
    names = [i.base_name for i in listing if i.type == pafs.FileType.File] + [
        i.base_name for i in listing if i.type == pafs.FileType.Directory
    ]
    marker = None
    if COMPLETE in names:
        with fs.open_input_stream(f"{where}/{COMPLETE}") as f:
            marker = f.read()
    return _parts_layout(url, names, marker, lambda n: open_part(f"{where}/{n}", fs, f"{url}/{n}"), run_id)  # type: ignore[arg-type]


def open_layout(path: str | os.PathLike[str], run_id: str | None = None) -> RunLayout:
    """Open the run at ``path`` (any layout of the module docstring, or a URL of one) by its metadata and schemas.

    Reads no values (only the small ``generation_meta`` column): :meth:`RunLayout.batches`
    or the parts' blocks do.
    Raises :class:`NoRunError` when nothing is there, :class:`RunFileError`
    for a file or folder that is not a readable run, and ValueError when a
    dataset root holds several runs and ``run_id`` names none of them.
    """
    if is_url(path):
        fs, where = resolve(path, "path")
        if not isinstance(fs, pafs.LocalFileSystem):
            layout = _open_remote(fs, where.rstrip("/"), str(path).rstrip("/"), run_id)
            return _checked(layout, run_id)
        path = where
    source = path_arg("path", path)
    if not source.exists():
        raise NoRunError(source, "there is no file or folder at this path")
    if source.is_file():
        part = open_part(source)
        meta = part.schema.metadata or {}
        layout = RunLayout(source, "file", [part], _metadata(source, meta.get(META_RUN)), meta.get(META_VOCAB), source)
    elif (source / RUN_JSON).is_file():
        metadata = _metadata(source / RUN_JSON, (source / RUN_JSON).read_bytes())
        vocab = source / VOCAB_FILE
        vocab_raw = (open_part(vocab).schema.metadata or {}).get(META_VOCAB) if vocab.is_file() else None
        parts = [open_part(p) for p in sorted(source.glob(CHUNK_GLOB))]
        layout = RunLayout(source, "spill", parts, metadata, vocab_raw, vocab)
    else:
        runs = complete_runs(pafs.LocalFileSystem(), str(source))
        if runs or (run_id is not None and (source / f"run_id={run_id}").is_dir()):
            return open_layout(source / _dataset_member(source, runs, run_id, lambda n: (source / n).is_dir()))
        marker = source / COMPLETE
        names = [p.name for p in source.iterdir()]
        raw = marker.read_bytes() if marker.is_file() else None
        layout = _parts_layout(source, names, raw, lambda n: open_part(source / n), run_id)
    return _checked(layout, run_id)


def _checked(layout: RunLayout, run_id: str | None) -> RunLayout:
    if run_id is not None and layout.metadata.run_id != run_id:
        raise ValueError(f"run_id={run_id!r} is not in '{layout.path}': it holds run {layout.metadata.run_id!r}")
    _check(layout)  # the columns first: the generations are read from one of them
    return replace(layout, metadata=_with_generations(layout.metadata, layout.parts))
