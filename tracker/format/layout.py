"""Every on-disk layout of a run, opened one way: what :meth:`tracker.Run.load` and the dashboard read.

Which files make the run a path names is :func:`tracker.format.discovery.locate`'s
answer (a run file, a table's run, a marker folder, a spill folder, on a local
disk or at a URL); this module opens them (:mod:`tracker.format.parts`): it
reads the metadata (the generations a Parquet file keeps in its
``generation_meta`` column put back), finds the vocabulary (in the file, or in
the table by its hash), checks every part's columns against the metadata and
returns a :class:`RunLayout`: its parts, read whole (:meth:`RunLayout.batches`)
or block by block (a Parquet row group, a record batch of a memory-mapped IPC
file: :meth:`Part.read_block`). A damaged file raises :class:`RunFileError`
naming the file and what is wrong with it; Parquet pages are checked against
their checksums on every read. Needs pyarrow and numpy only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.fs as pafs

from processors.vocab import Vocabulary
from tracker.format.checks import (
    RunFileError,
    arrow_reason,
    check_ids,
    check_schemas,
    metadata_from,
    vocabulary_from,
)
from tracker.format.discovery import FoundRun, NoRunError, locate, table_of
from tracker.format.fs import folder_arg, path_arg
from tracker.format.marker import COMPLETE, PARQUET_SUFFIXES, complete_runs, is_partition, read_marker
from tracker.format.parts import ID_COLUMNS, IPC_SUFFIXES, Part, open_part
from tracker.format.schema import (
    META_VOCAB,
    RunMetadata,
    check_generations,
)
from tracker.format.spill import CHUNK_GLOB, RUN_JSON, VOCAB_FILE
from tracker.format.table import RunTable

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
    "layout_of",
    "open_part",
    "is_partition",
    "arrow_reason",
    "metadata_from",
    "vocabulary_from",
    "COMPLETE",
    "complete_runs",
    "read_marker",
]


class PartialRunWarning(UserWarning):
    """A run read from a spill folder: only the rows that had spilled to disk (see :attr:`RunLayout.note`)."""


@dataclass(frozen=True)
class RunLayout:
    """An opened run on disk.

    Attributes:
        path: the run's file or folder (a table's run: ``<table>/run_id=<id>``).
        kind: ``"file"``, ``"parts"`` (a folder of Parquet parts), ``"table"`` (a table's committed
            parts) or ``"spill"``.
        parts: its files, in row order (a spill folder may have none yet).
        metadata: the run metadata, generations included.
        vocab_raw: the serialised vocabulary the run's file carries (None when it carries none).
        vocab_path: where the vocabulary comes from, for errors.
        vocab_ref: ``(table, hash)`` of a vocabulary a table keeps for its runs.
    """

    path: Path | str
    kind: Literal["file", "parts", "table", "spill"]
    parts: list[Part]
    metadata: RunMetadata
    vocab_raw: bytes | None
    vocab_path: Path | str
    incomplete: bool = False  # a ``run_id=...`` folder without its completion marker
    vocab_ref: tuple[RunTable, str] | None = None

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
        """The run's vocabulary (None when it carries none); RunFileError when it is damaged or missing."""
        try:
            if self.vocab_ref is not None:
                from tracker.format.vocab_store import load_vocab

                table, key = self.vocab_ref
                vocab: Vocabulary | None = load_vocab(table.fs, table.where, key, table.location)
            else:
                vocab = vocabulary_from(self.vocab_raw, self.metadata.vocab_size)
        except (ValueError, OSError) as exc:
            raise RunFileError(self.vocab_path, str(exc)) from exc
        if vocab is not None and vocab.size < self.metadata.vocab_size:
            raise RunFileError(
                self.vocab_path,
                f"its vocabulary holds {vocab.size} tokens, fewer than the {self.metadata.vocab_size} its rows have",
            )
        return vocab

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


def _metadata(path: Path | str, raw: bytes | None) -> RunMetadata:
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
    if len(entries) == len(metadata.generations):
        return metadata
    # a generation written in pieces (a server past its memory bound, a request preempted and resumed) has an
    # entry in each: one generation, the facts of the piece that ended last (its length) over the others'
    merged: dict[int, dict] = {}
    for entry in sorted(entries, key=lambda e: str(e.get("ended_at", ""))):
        merged[entry["generation"]] = {**merged.get(entry["generation"], {}), **entry}
    return replace(metadata, generations=sorted(merged.values(), key=lambda e: e["generation"]))


def _check(layout: RunLayout) -> None:
    check_schemas([(p.path, p.schema) for p in layout.parts], layout.metadata, spill=layout.kind == "spill")


def _parts_of_one_run(
    folder: Path | str, parts: list[Part], metas: list[RunMetadata], run_id: str | None
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
        files = [str(p.path).replace("\\", "/").rsplit("/", 1)[-1] for p in parts]
        raise ValueError(
            f"'{folder}' holds {len(ids)} runs in {len(files)} files ({', '.join(files[:4])}"
            f"{', ...' if len(files) > 4 else ''}); open one file, or pass run_id= one of {ids}"
        )
    return parts, metas


def _spill(found: FoundRun) -> RunLayout:
    source = Path(found.path)
    metadata = _metadata(source / RUN_JSON, (source / RUN_JSON).read_bytes())
    vocab = source / VOCAB_FILE
    vocab_raw = open_part(vocab).footer.get(META_VOCAB) if vocab.is_file() else None
    parts = [open_part(p) for p in sorted(source.glob(CHUNK_GLOB))]
    return RunLayout(source, "spill", parts, metadata, vocab_raw, vocab)


def _open(found: FoundRun, file: str) -> Part:
    if isinstance(found.fs, pafs.LocalFileSystem):
        return open_part(Path(file))
    shown = found.path if found.kind == "file" else f"{found.path}/{file.rsplit('/', 1)[-1]}"
    return open_part(file, found.fs, str(shown))


def _vocab_ref(found: FoundRun, key: str | None) -> tuple[RunTable, str] | None:
    """Where a table keeps the vocabulary a part names by hash (a part opened alone: its folder's table)."""
    if key is None:
        return None
    table = found.table
    if table is None and found.files:
        parent = found.path.parent if isinstance(found.path, Path) else str(found.path).rsplit("/", 1)[0]
        owner = table_of(found.fs, found.files[0].rsplit("/", 1)[0], parent)
        table = owner[0] if owner is not None else None
    if table is None:
        raise RunFileError(
            found.path, "its vocabulary is kept by the table it was written into (_vocab/ there); open it there"
        )
    return table, key


def open_layout(path: str | os.PathLike[str], run_id: str | None = None) -> RunLayout:
    """Open the run at ``path`` (any layout :func:`~tracker.format.discovery.locate` finds, or a URL of one)
    by its metadata and schemas.

    Reads no values (only the small ``generation_meta`` column): :meth:`RunLayout.batches`
    or the parts' blocks do.
    Raises :class:`NoRunError` when nothing is there, :class:`RunFileError`
    for a file or folder that is not a readable run, and ValueError when a
    dataset root holds several runs and ``run_id`` names none of them.
    """
    return layout_of(locate(path, run_id), run_id)


def layout_of(found: FoundRun, run_id: str | None = None) -> RunLayout:
    """:func:`open_layout` of a run already found (a table run's ``files`` may be some of its parts)."""
    if found.kind == "spill":
        return _checked(_spill(found), run_id)
    if not found.files:
        raise NoRunError(found.path, "the folder holds no .parquet parts and no spill files (_run.json)")
    missing = [f for f in found.files if found.fs.get_file_info(f).type != pafs.FileType.File]
    if missing:
        what = "its commits name" if found.kind == "table" else f"its {COMPLETE} lists"
        names = [m.rsplit("/", 1)[-1] for m in missing[:4]]
        raise RunFileError(found.path, f"{what} parts that are not there: {names}")
    parts = [_open(found, f) for f in found.files]
    described = [p.described() for p in parts]
    metas = [_metadata(p.path, raw) for p, (raw, _) in zip(parts, described)]
    if found.kind == "table":
        strangers = [p.path for p, m in zip(parts, metas) if m.run_id != found.run_id]
        if strangers:
            raise RunFileError(strangers[0], f"its metadata names another run than its table's {found.run_id!r}")
        for part, (raw, _), fact in zip(parts, described, found.facts):
            if raw is not None and raw.decode("utf-8", "replace") != fact.run_json:
                raise RunFileError(part.path, "its run_meta is not what its commit says it holds (it was changed)")
    elif found.kind != "file":  # a file is one run (a run_id naming another is refused below)
        parts, metas = _parts_of_one_run(found.path, parts, metas, run_id)
    for part, meta in zip(parts, metas):
        part.bind(meta)
    ref = next((r for p, (_, r) in zip(found.files, described) if r), None)
    layout = RunLayout(
        found.path,
        "file" if found.kind == "file" else found.kind,
        parts,
        metas[0],
        parts[0].footer.get(META_VOCAB),
        parts[0].path,
        incomplete=not found.complete,
        vocab_ref=_vocab_ref(found, ref),
    )
    return _checked(layout, run_id)


def _checked(layout: RunLayout, run_id: str | None) -> RunLayout:
    if run_id is not None and layout.metadata.run_id != run_id:
        raise ValueError(f"run_id={run_id!r} is not in '{layout.path}': it holds run {layout.metadata.run_id!r}")
    _check(layout)  # the columns first: the generations are read from one of them
    return replace(layout, metadata=_with_generations(layout.metadata, layout.parts))
