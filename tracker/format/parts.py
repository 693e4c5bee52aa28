"""The files of a run, opened one way: a Parquet file (blocks are row groups) or an Arrow IPC file (record batches).

:func:`open_part` tells the format by the first bytes, reads the footer (never
a value) and answers the same questions of either: the schema, the blocks'
sizes, the id columns, a block's requested columns, every row. Once the run's
metadata is known (:meth:`Part.bind`), a Parquet part gives its columns in the
run schema (:func:`tracker.format.columns.restore`: lists back to fixed-size
lists of the run's width, half-precision values back from their bit
patterns); pages are checked against their checksums on every read; an IPC
record batch is checked against its buffers before a value is touched. A file
that cannot be read raises :class:`~tracker.format.checks.RunFileError`
naming it. Needs pyarrow and numpy only.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tracker.format.checks import RunFileError, arrow_reason, check_batch, check_row_groups
from tracker.format.columns import ARROW_SCHEMA_KEY, NOT_ROWS, RUN_META, bits_name, restore, restored_schema
from tracker.format.schema import (
    GENERATIONS_COLUMN,
    ID_SCHEMA,
    META_RUN,
    META_VOCAB_REF,
    RunMetadata,
    generations_from_column,
)

__all__ = ["Part", "open_part", "IPC_SUFFIXES", "PARQUET_SUFFIXES", "ID_COLUMNS"]

IPC_SUFFIXES = (".arrow", ".feather", ".ipc")
PARQUET_SUFFIXES = (".parquet", ".pq")
ID_COLUMNS: tuple[str, ...] = tuple(ID_SCHEMA.names)


class Part(Protocol):
    """One file of a run, read whole or in blocks (row groups or record batches)."""

    path: Path | str  # a str: the URL of a part on a remote filesystem
    nbytes: int

    @property
    def schema(self) -> pa.Schema: ...
    @property
    def footer(self) -> dict[bytes, bytes]: ...
    def described(self) -> tuple[bytes | None, str | None]: ...
    def bind(self, metadata: RunMetadata) -> None: ...
    def block_sizes(self) -> list[int]: ...
    def read_ids(self) -> pa.Table: ...
    def read_block(self, block: int, columns: tuple[str, ...]) -> tuple[pa.Table, int]: ...
    def read_all(self) -> pa.Table: ...
    def generations(self) -> list[dict]: ...


class _ParquetPart:
    """A Parquet file: blocks are row groups; only the requested column chunks are read."""

    def __init__(
        self, path: Path | str, source: pa.NativeFile | None = None, metadata: pq.FileMetaData | None = None
    ) -> None:
        self.path = path
        self.file = pq.ParquetFile(
            path if source is None else source,
            memory_map=source is None,
            page_checksum_verification=True,
            metadata=metadata,
        )
        check_row_groups(path, self.file.metadata)  # row counts a damaged footer lowered lose no rows silently
        self.nbytes = int(os.path.getsize(path) if source is None else source.size())
        self._file_schema = self.file.schema_arrow  # pyarrow builds it anew on every access (20 µs)
        self._run: RunMetadata | None = None
        self._schema: pa.Schema | None = None  # the run schema, once bound
        self._names: dict[str, str] = {}  # run column -> file column, where they differ

    @property
    def footer(self) -> dict[bytes, bytes]:
        """The file's key-value metadata (where a run keeps its metadata and vocabulary)."""
        return dict(self.file.metadata.metadata or {})

    @property
    def _arrow(self) -> bool:
        return ARROW_SCHEMA_KEY in (self.file.metadata.metadata or {})

    def described(self) -> tuple[bytes | None, str | None]:
        """``(run metadata JSON, vocabulary hash)``: from the footer (a single file), or from the
        :data:`~tracker.format.columns.RUN_META` column (a table's part: its first row); None where absent."""
        footer = self.footer
        if META_RUN in footer or RUN_META not in self._file_schema.names:
            ref = footer.get(META_VOCAB_REF)
            return footer.get(META_RUN), None if ref is None else ref.decode("ascii", "replace")
        try:  # its first row only: one value for every row, which read whole took 0.23 s for 12,800 rows
            groups = self.file.metadata.num_row_groups
            first = next(self.file.iter_batches(1, row_groups=[0], columns=[RUN_META]), None) if groups else None
            column = None if first is None else first.column(0)
        except (pa.ArrowException, OSError) as exc:  # a damaged page (checksum), a truncated file
            raise RunFileError(self.path, arrow_reason(exc)) from exc
        raw = column[0].as_py() if column is not None and len(column) else None
        if not isinstance(raw, str):
            return None, None
        try:
            part = json.loads(raw).get("part")
        except (ValueError, AttributeError, RecursionError):
            part = None  # the metadata's own parse says what is wrong
        ref = part.get("vocab") if isinstance(part, dict) else None
        return raw.encode(), ref if isinstance(ref, str) else None

    @property
    def schema(self) -> pa.Schema:
        """The run schema once bound (the file's own before), with the footer's metadata."""
        if self._schema is not None:
            return self._schema
        raw = self._file_schema
        if not self._arrow:
            raw = raw.with_metadata(self.footer)
        if self._run is None:
            return raw
        self._schema = restored_schema(raw, self._run, self._arrow)
        return self._schema

    def bind(self, metadata: RunMetadata) -> None:
        """Read columns in the run schema that ``metadata`` describes from now on. RunFileError when a
        list column's rows cannot all be as wide as the metadata says (told by the footer's counts)."""
        self._run, self._schema = metadata, None
        names = self._file_schema.names
        if metadata.storage in ("float16", "bfloat16"):  # the values as their bit patterns (a table's layout)
            self._names = {
                f"{s}_logits": bits_name(s, metadata.storage)
                for s in metadata.stages
                if bits_name(s, metadata.storage) in names and f"{s}_logits" not in names
            }
        self._check_widths()

    def _check_widths(self) -> None:
        """Each row group of a list column holds ``k`` rows of the run's width and ``rows - k`` null rows (one
        entry each), so its count of entries is ``k * width + rows - k`` for some ``k`` in ``[0, rows]``."""
        meta, file_schema, schema = self.file.metadata, self._file_schema, self.schema
        if meta.num_columns == len(file_schema):  # a leaf per column (flat and list columns): in their order
            leaves = {name: j for j, name in enumerate(file_schema.names)}
        else:
            leaves = {meta.schema.column(j).path.split(".")[0]: j for j in range(meta.num_columns)}
        for field, have in zip(schema, file_schema):
            if not pa.types.is_fixed_size_list(field.type) or have.name not in leaves:
                continue
            width, j = field.type.list_size, leaves[have.name]
            for g in range(meta.num_row_groups):
                rows, entries = meta.row_group(g).num_rows, meta.row_group(g).column(j).num_values
                full, rest = divmod(entries - rows, width - 1) if width > 1 else (0, entries - rows)
                if rest or not 0 <= full <= rows:
                    raise RunFileError(
                        self.path,
                        f"column {field.name!r} holds {entries} values in {rows} rows of row group {g}: its rows "
                        f"are not {width} wide, as the metadata's {'top_k' if 'topk' in field.name else 'vocab_size'} says",
                    )

    def _restored(self, table: pa.Table) -> pa.Table:
        if self._run is None:
            return table
        try:
            return restore(table, self._run, self.path, self._arrow)
        except ValueError as exc:
            raise RunFileError(self.path, str(exc).split(": ", 1)[-1]) from exc

    def _file_columns(self, columns: list[str] | tuple[str, ...]) -> list[str]:
        return [self._names.get(c, c) for c in columns]

    def block_sizes(self) -> list[int]:
        meta = self.file.metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

    def read_ids(self) -> pa.Table:
        return self.file.read(columns=list(ID_COLUMNS), use_threads=True)

    def read_columns(self, columns: list[str]) -> pa.Table:
        """Every row of ``columns`` (run names; those the file lacks are left out)."""
        there = set(self._file_schema.names)
        wanted = [c for c in self._file_columns(columns) if c in there]
        return self._restored(self.file.read(columns=wanted, use_threads=False))

    def read_block(self, block: int, columns: tuple[str, ...]) -> tuple[pa.Table, int]:
        wanted = self._file_columns(columns)
        table = self._restored(self.file.read_row_group(block, columns=wanted, use_threads=True))
        group = self.file.metadata.row_group(block)
        chosen = set(wanted)
        nbytes = sum(
            group.column(j).total_compressed_size
            for j in range(group.num_columns)
            if group.column(j).path_in_schema.split(".")[0] in chosen
        )
        return table, int(nbytes)

    def read_all(self) -> pa.Table:
        """Every row and column but the generations' metadata."""
        names = [n for n in self._file_schema.names if n not in NOT_ROWS]
        return self._restored(self.file.read(columns=names, use_threads=True))

    def generations(self) -> list[dict]:
        if GENERATIONS_COLUMN not in self._file_schema.names:
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

    @property
    def footer(self) -> dict[bytes, bytes]:
        return dict(self.reader.schema.metadata or {})

    def described(self) -> tuple[bytes | None, str | None]:
        return self.footer.get(META_RUN), None

    def bind(self, metadata: RunMetadata) -> None:
        """Nothing to do: an IPC file keeps the run schema as it is."""

    def _batch(self, i: int) -> pa.RecordBatch:
        batch = self.reader.get_batch(i)
        if i not in self._checked:
            check_batch(self.path, batch, f"record batch {i}")
            self._checked.add(i)
        return batch

    def block_sizes(self) -> list[int]:
        return [self._batch(i).num_rows for i in range(self.reader.num_record_batches)]

    def read_ids(self) -> pa.Table:
        batches = [self._batch(i).select(list(ID_COLUMNS)) for i in range(self.reader.num_record_batches)]
        return pa.Table.from_batches(batches, schema=pa.schema([self.reader.schema.field(n) for n in ID_COLUMNS]))

    def read_columns(self, columns: list[str]) -> pa.Table:
        there = set(self.reader.schema.names)
        return self._table().select([c for c in columns if c in there])

    def read_block(self, block: int, columns: tuple[str, ...]) -> tuple[pa.Table, int]:
        batch = self._batch(block).select(list(columns))
        return pa.Table.from_batches([batch]), int(batch.nbytes)

    def _table(self) -> pa.Table:
        return pa.Table.from_batches(
            [self._batch(i) for i in range(self.reader.num_record_batches)], schema=self.reader.schema
        )

    def read_all(self) -> pa.Table:
        table = self._table()
        return table.drop_columns([n for n in NOT_ROWS if n in table.schema.names])

    def generations(self) -> list[dict]:
        if GENERATIONS_COLUMN not in self.schema.names:
            return []
        column = [self._batch(i).column(GENERATIONS_COLUMN) for i in range(self.reader.num_record_batches)]
        return generations_from_column(pa.chunked_array(column, self.schema.field(GENERATIONS_COLUMN).type))


def open_part(
    path: Path | str,
    fs: pafs.FileSystem | None = None,
    url: str | None = None,
    metadata: pq.FileMetaData | None = None,
) -> Part:
    """Open one run file (IPC or Parquet, told by its first bytes, else its suffix); RunFileError naming it
    when it cannot be read. With ``fs``, ``path`` is inside that filesystem and ``url`` names it in errors;
    ``metadata``: a Parquet footer already read (not read again)."""
    try:
        source = None if fs is None else fs.open_input_file(str(path))
        name: Path | str = path if url is None else url
        with open(path, "rb") if source is None else contextlib.nullcontext(source) as f:
            magic = f.read(6)
        source is None or source.seek(0)
        if magic.startswith(b"PAR1"):
            return _ParquetPart(name, source, metadata)
        if magic == b"ARROW1" or str(path).endswith(IPC_SUFFIXES):
            return _IpcPart(name, source)
        return _ParquetPart(name, source, metadata)
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise RunFileError(url or path, arrow_reason(exc)) from exc
