"""A recorded run as data: Arrow in memory, Parquet (or Arrow IPC) on disk, the same analysis API either way.

>>> run = tracker.run                      # or Run.load("runs/", run_id=...)
>>> run.to_parquet("run.parquet")          # one self-contained file, written atomically
>>> run.to_dataset("runs/")                # runs/run_id=<id>/part-00000.parquet
>>> Run.load("run.parquet").get_top_tokens(k=5)

Many runs saved with :meth:`Run.to_dataset` under one folder form a
Hive-partitioned dataset (``run_id=...``) that ``pyarrow.dataset`` and DuckDB
read as they are (``read_parquet('runs/**/*.parquet', hive_partitioning=true)``).
Runs with different vocabulary sizes or storage modes have different column
types: read those with DuckDB's ``union_by_name=true``.

A Parquet run keeps its generations' metadata (prompts, per-row sampling) in
the ``generation_meta`` column, not in the footer, and refuses run metadata
past :data:`~tracker.schema.MAX_METADATA_BYTES`. Pages carry CRC checksums,
checked on every read; the file is flushed to disk before it is renamed into
place, and temporary files that a killed export left in the folder are
removed by the next export there. A damaged file raises :class:`RunFileError`
naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracker.analysis import Analysis, stage_matrix
from tracker.rows import nonfinite_rows
from tracker.insight import Insight
from tracker.schema import (
    GENERATIONS_COLUMN,
    MAX_METADATA_BYTES,
    META_RUN,
    META_VOCAB,
    RunMetadata,
    flag_column,
    run_schema,
)
from tracker.spill import CHUNK_GLOB, RUN_JSON, VOCAB_FILE, atomic_path, read_ipc, remove_orphans
from processors.vocab import Vocabulary

__all__ = ["Run", "RunFileError", "check_columns", "generations_from_column"]


class RunFileError(ValueError):
    """A file or folder that cannot be read as a run; the message names it and what is wrong."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"'{path}' cannot be read as a logitscope run: {reason}")


def _arrow_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lowered = text.lower()
    if "checksum" in lowered or "crc" in lowered:
        return f"a data page fails its checksum: the file is damaged ({text})"
    if "magic" in lowered or "footer" in lowered or "not an arrow file" in lowered:
        return f"the file is truncated or is not a Parquet/Arrow file ({text})"
    return f"the file could not be read ({type(exc).__name__}: {text})"


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to the disk."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # a folder that cannot be opened (some platforms): nothing more to flush
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _generations_column(table: pa.Table, generations: list[dict[str, Any]]) -> pa.Array:
    """Each generation's metadata as a JSON list on its first row (null elsewhere); entries of
    generations without rows go on row 0."""
    values: list[list[dict[str, Any]] | None] = [None] * table.num_rows
    ids = table.column("generation").to_numpy()
    unique, first = np.unique(ids, return_index=True)
    where = dict(zip(unique.tolist(), first.tolist()))
    for entry in generations:
        row = where.get(int(entry.get("generation", -1)), 0)
        values[row] = (values[row] or []) + [entry]
    return pa.array([None if v is None else json.dumps(v, separators=(",", ":")) for v in values], pa.string())


def generations_from_column(column: pa.ChunkedArray | pa.Array) -> list[dict[str, Any]]:
    """The generations' metadata entries held in a ``generation_meta`` column, in generation order."""
    entries: list[dict[str, Any]] = []
    for raw in column.drop_null().to_pylist():
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"column {GENERATIONS_COLUMN!r} holds text that is not JSON ({exc})") from exc
        if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
            raise ValueError(f"column {GENERATIONS_COLUMN!r} must hold JSON lists of objects, got {raw[:80]!r}")
        entries.extend(value)
    return sorted(entries, key=lambda e: e.get("generation", -1) if isinstance(e.get("generation"), int) else -1)


def check_columns(schema: pa.Schema, metadata: RunMetadata, *, complete: bool = True) -> None:
    """Every column the metadata implies is there with its type (``_nonfinite`` flags may be absent;
    with ``complete=False``, as in a spill chunk written before a stage was added, any may be)."""
    try:
        expected = run_schema(metadata.storage, metadata.stages, metadata.vocab_size, metadata.top_k)
    except (ValueError, TypeError, OverflowError, pa.ArrowException) as exc:
        raise ValueError(f"its metadata describes no valid run schema ({exc})") from exc
    names = set(schema.names)
    for field in expected:
        if field.name not in names:
            if field.name.endswith("_nonfinite") or not complete:
                continue
            raise ValueError(
                f"column {field.name!r} is missing (the metadata declares storage {metadata.storage!r}, "
                f"stages {metadata.stages}, vocabulary {metadata.vocab_size})"
            )
        actual = schema.field(field.name).type
        if actual != field.type:
            raise ValueError(f"column {field.name!r} has type {actual}, a run with this metadata has {field.type}")

_ROW_GROUP_BYTES = 8 << 20


class Run(Insight, Analysis):
    """Rows of a run, its metadata and vocabulary; answers the analysis API.

    Args:
        batches: the rows (record batches of the run schema).
        metadata: what the run says about itself.
        vocab: the vocabulary, or a function building it on first use.
    """

    def __init__(
        self,
        batches: list[pa.RecordBatch],
        metadata: RunMetadata,
        vocab: Vocabulary | Callable[[], Vocabulary] | None = None,
    ) -> None:
        self._batches = list(batches)
        self.metadata = metadata
        self._vocab_source = vocab
        self._exported: list[pa.RecordBatch] | None = None

    # ---------------------------------------------------------------- data

    def _record_batches(self) -> list[pa.RecordBatch]:
        return self._batches

    @property
    def vocab(self) -> Vocabulary:
        source = self._vocab_source
        if isinstance(source, Vocabulary):
            return source
        vocab = source() if callable(source) else Vocabulary.placeholder(self.metadata.vocab_size)
        self._vocab_source = vocab
        return vocab

    @property
    def run_id(self) -> str:
        return self.metadata.run_id

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self._batches)

    def schema(self, run_json: bytes | None = None) -> pa.Schema:
        """The run's Arrow schema with its metadata (run JSON, by default the whole metadata, and vocabulary)."""
        m = self.metadata
        stats = bool(self._batches) and "natural_entropy" in self._batches[0].schema.names
        base = run_schema(m.storage, m.stages, m.vocab_size, m.top_k, stats=stats)
        return base.with_metadata({META_RUN: m.to_json() if run_json is None else run_json, META_VOCAB: self.vocab.serialize()})

    def to_arrow(self) -> pa.Table:
        """The run as one Arrow table with metadata and ``_nonfinite`` flags.

        The recorded values are not copied (the table shares the recorder's
        buffers); the flags are computed on the first export, in one summing
        pass per stage, and kept.
        """
        return self._table(self.schema())

    def _table(self, schema: pa.Schema) -> pa.Table:
        if not self._batches:
            return schema.empty_table()
        if self._exported is None:
            self._exported = [self._with_flags(b, schema) for b in self._batches]
        return pa.Table.from_batches(self._exported).replace_schema_metadata(schema.metadata)

    def _with_flags(self, batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
        """``batch`` in the export schema, computing the ``_nonfinite`` flags it lacks."""
        names = batch.schema.names
        if all(flag_column(stage) in names for stage in self.metadata.stages):
            return batch
        columns = []
        for field in schema:
            if field.name in names:
                columns.append(batch.column(field.name))
                continue
            stage = field.name[: -len("_nonfinite")]
            if f"{stage}_nan" in names:  # from the statistics recorded with the rows
                nan = batch.column(f"{stage}_nan").fill_null(0).to_numpy(zero_copy_only=False)
                lse = batch.column(f"{stage}_lse").fill_null(0.0).to_numpy(zero_copy_only=False)
                flags = (nan > 0) | (lse == np.inf)
            elif self.metadata.storage == "topk":
                lse = batch.column(f"{stage}_lse").fill_null(0.0).to_numpy(zero_copy_only=False)
                flags = np.isnan(lse) | (lse == np.inf)
            else:
                valid = batch.column(f"{stage}_logits").is_valid().to_numpy(zero_copy_only=False)
                matrix = stage_matrix(batch, stage, self.metadata.vocab_size)
                flags = nonfinite_rows(matrix) & valid
            columns.append(pa.array(flags))
        return pa.RecordBatch.from_arrays(columns, schema=schema.remove_metadata())

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"Run(run_id={m.run_id!r}, rows={self.num_rows}, generations={len(self.generations()) if self._batches else 0}, "
            f"stages={m.stages}, storage={m.storage!r}, vocab_size={m.vocab_size})"
        )

    # ---------------------------------------------------------------- writing

    def _row_group_rows(self) -> int:
        m = self.metadata
        width = m.top_k if m.storage == "topk" else m.vocab_size
        per_row = max(1, width * 4 * max(1, len(m.stages)))
        return max(1, _ROW_GROUP_BYTES // per_row)

    def to_parquet(self, path: str | os.PathLike[str], *, compression: str | None = "zstd") -> Path:
        """Write the run as one Parquet file, atomically (temporary file, flushed to disk, then renamed).

        Row groups are kept small (about 8 MiB) so that reading one step back
        is cheap; value columns skip dictionary encoding; every page carries a
        checksum. The generations' metadata goes in the ``generation_meta``
        column; the rest of the run metadata must fit
        :data:`~tracker.schema.MAX_METADATA_BYTES` (ValueError otherwise).
        Temporary files a killed export left beside ``path`` are removed
        first. Returns the path.
        """
        target = Path(path)
        if self.num_rows:
            footer = replace(self.metadata, generations=[]).to_json()
            table = self._table(self.schema(footer))
            table = table.append_column(GENERATIONS_COLUMN, _generations_column(table, self.metadata.generations))
        else:
            footer = self.metadata.to_json()
            table = self._table(self.schema(footer))
        if len(footer) > MAX_METADATA_BYTES:
            sizes = {k: len(json.dumps(v)) for k, v in json.loads(footer).items()}
            largest = sorted(sizes, key=sizes.get, reverse=True)[:3]
            raise ValueError(
                f"run metadata is {len(footer):,} bytes, over the {MAX_METADATA_BYTES:,} a run file keeps in its "
                f"footer (largest fields: {', '.join(f'{k} {sizes[k]:,}' for k in largest)}); keep what "
                "annotate() adds small, and store large data beside the run"
            )
        remove_orphans(target.parent, target.name)
        with atomic_path(target) as tmp:
            pq.write_table(
                table,
                tmp,
                compression=compression,
                row_group_size=self._row_group_rows(),
                use_dictionary=["generation", "sequence"],
                write_statistics=["generation", "sequence", "step", "chosen"],
                write_page_checksum=True,
            )
            _fsync(tmp)
        _fsync(target.parent)
        return target

    def to_dataset(self, root: str | os.PathLike[str], *, compression: str | None = "zstd") -> Path:
        """Write the run into a Hive-partitioned folder: ``root/run_id=<id>/part-00000.parquet``.

        The partition column is the folder name, not a file column, so
        ``pyarrow.dataset.dataset(root, partitioning="hive")`` and DuckDB's
        ``hive_partitioning`` add ``run_id`` to every row. Returns the file.
        """
        folder = Path(root) / f"run_id={self.run_id}"
        return self.to_parquet(folder / "part-00000.parquet", compression=compression)

    # ---------------------------------------------------------------- reading

    @classmethod
    def from_arrow(cls, table: pa.Table) -> "Run":
        """A run from a table written by :meth:`to_arrow` or read from :meth:`to_parquet`'s file.

        ValueError saying what is wrong when the metadata, the vocabulary or
        a column's type is damaged.
        """
        meta = table.schema.metadata or {}
        if META_RUN not in meta:
            raise ValueError(
                "table: no logitscope run metadata in its schema (key 'logitscope.run'); "
                "was it written by Run.to_arrow / to_parquet?"
            )
        metadata = RunMetadata.from_json(meta[META_RUN])
        if GENERATIONS_COLUMN in table.schema.names:
            column = table.column(GENERATIONS_COLUMN)
            if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
                raise ValueError(f"column {GENERATIONS_COLUMN!r} has type {column.type}, expected string (JSON)")
            metadata = replace(metadata, generations=metadata.generations + generations_from_column(column))
            table = table.drop_columns([GENERATIONS_COLUMN])
        check_columns(table.schema, metadata)
        vocab = None
        if META_VOCAB in meta:
            try:
                vocab = Vocabulary.deserialize(meta[META_VOCAB])
            except Exception as exc:  # base64, Arrow or layout errors: all mean a damaged vocabulary
                raise ValueError(f"its vocabulary (schema key 'logitscope.vocab') is damaged ({type(exc).__name__}: {exc})") from exc
        return cls(table.to_batches(), metadata, vocab)

    @classmethod
    def load(cls, path: str | os.PathLike[str], run_id: str | None = None) -> "Run":
        """Load a run: a Parquet or Arrow IPC file, a run folder, a dataset root, or a spill folder.

        A dataset root holding several ``run_id=...`` folders needs ``run_id``.
        No model and no tokenizer are needed: the vocabulary is in the file.
        """
        source = Path(path)
        if not source.exists():
            raise FileNotFoundError(f"path: no run at '{source}'")
        if source.is_file():
            table = _read_file(source)
            try:
                return cls.from_arrow(table)
            except ValueError as exc:
                raise RunFileError(source, str(exc)) from exc
        runs = sorted(p for p in source.iterdir() if p.is_dir() and p.name.startswith("run_id="))
        if runs:
            if run_id is None:
                if len(runs) > 1:
                    names = [p.name.split("=", 1)[1] for p in runs]
                    raise ValueError(f"'{source}' holds {len(runs)} runs; pass run_id= one of {names}")
                return cls.load(runs[0])
            folder = source / f"run_id={run_id}"
            if not folder.is_dir():
                raise ValueError(f"run_id={run_id!r} is not in '{source}'")
            return cls.load(folder)
        if (source / RUN_JSON).exists():
            return cls._load_spill(source)
        parts = sorted(source.glob("*.parquet"))
        if not parts:
            raise FileNotFoundError(f"path: '{source}' holds no run (no .parquet parts, no spill files)")
        tables = [_read_file(p) for p in parts]
        try:
            return cls.from_arrow(pa.concat_tables(tables))
        except (ValueError, pa.ArrowException) as exc:
            raise RunFileError(source, str(exc)) from exc

    @classmethod
    def _load_spill(cls, folder: Path) -> "Run":
        """A run from a spill folder (what a crashed or still running generation left on disk)."""
        try:
            metadata = RunMetadata.from_json((folder / RUN_JSON).read_bytes())
        except ValueError as exc:
            raise RunFileError(folder / RUN_JSON, str(exc)) from exc
        vocab = None
        if (folder / VOCAB_FILE).exists():
            meta = _read_file(folder / VOCAB_FILE).schema.metadata or {}
            try:
                vocab = Vocabulary.deserialize(meta[META_VOCAB]) if META_VOCAB in meta else None
            except Exception as exc:  # base64, Arrow or layout errors: all mean a damaged vocabulary
                raise RunFileError(folder / VOCAB_FILE, f"its vocabulary is damaged ({type(exc).__name__}: {exc})") from exc
        batches = []
        for p in sorted(folder.glob(CHUNK_GLOB)):
            table = _read_file(p)
            try:
                check_columns(table.schema, metadata, complete=False)
            except ValueError as exc:
                raise RunFileError(p, str(exc)) from exc
            batches += table.to_batches()
        return cls(batches, metadata, vocab)


def _read_file(path: Path) -> pa.Table:
    """A Parquet (pages checksummed) or Arrow IPC file as a table; RunFileError naming it when it is damaged."""
    try:
        if path.suffix in (".arrow", ".feather", ".ipc"):
            return read_ipc(path)
        return pq.read_table(path, memory_map=True, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise RunFileError(path, _arrow_reason(exc)) from exc
