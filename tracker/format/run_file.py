"""Writing a run as one Parquet file, on a local disk or any filesystem :mod:`tracker.format.fs` resolves.

Locally the file is written atomically (a temporary file flushed to disk, then
renamed). An object store has no rename, but it makes an object visible only
when its upload completes, so a reader never sees half of one: the file is
written in place. Other remote filesystems (HDFS, SFTP, ...) may show a file
while it is written; a dataset run becomes visible only by its completion
marker, written last (:mod:`tracker.format.dataset`). Needs pyarrow and numpy only.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tracker.format.fs import is_url, resolve
from tracker.format.layout import path_arg
from tracker.format.schema import GENERATIONS_COLUMN, MAX_METADATA_BYTES, META_RUN, RunMetadata, generations_column
from tracker.format.spill import atomic_path, fsync_path, remove_orphans

__all__ = ["ROW_GROUP_BYTES", "write_parquet", "parquet_table"]

#: Bytes of values per Parquet row group: reading one step back reads about this much.
ROW_GROUP_BYTES = 8 << 20


def _footer(metadata: RunMetadata, with_rows: bool) -> bytes:
    """The run metadata a Parquet footer keeps (generations go in their column when there are rows to hold
    them); ValueError past :data:`MAX_METADATA_BYTES`, naming the largest fields."""
    footer = replace(metadata, generations=[]).to_json() if with_rows else metadata.to_json()
    if len(footer) > MAX_METADATA_BYTES:
        sizes = {k: len(json.dumps(v)) for k, v in json.loads(footer).items()}
        largest = sorted(sizes, key=sizes.get, reverse=True)[:3]  # type: ignore[arg-type]
        raise ValueError(
            f"run metadata is {len(footer):,} bytes, over the {MAX_METADATA_BYTES:,} a run file keeps in its "
            f"footer (largest fields: {', '.join(f'{k} {sizes[k]:,}' for k in largest)}); keep what "
            "annotate() adds small, and store large data beside the run"
        )
    return footer


def _check_compression(compression: object) -> None:
    codecs = [c for c in ("zstd", "snappy", "gzip", "brotli", "lz4") if pa.Codec.is_available(c)]
    if compression is not None and (not isinstance(compression, str) or compression.lower() not in {*codecs, "none"}):
        raise ValueError(f"compression must be None or one of {[*codecs, 'none']}, got {compression!r}")


def parquet_table(table: pa.Table, metadata: RunMetadata) -> pa.Table:
    """``table`` as a run file holds it: the footer metadata in the schema, the generations in their column."""
    footer = _footer(metadata, table.num_rows > 0)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_RUN: footer})
    if table.num_rows:
        generation = table.column("generation").to_numpy()
        table = table.append_column(GENERATIONS_COLUMN, generations_column(generation, metadata.generations))
    return table


def _write(table: pa.Table, where: str, metadata: RunMetadata, compression: str | None, fs: pafs.FileSystem) -> None:
    width = metadata.top_k if metadata.storage == "topk" else metadata.vocab_size
    row_bytes = max(1, width * 4 * max(1, len(metadata.stages)))
    pq.write_table(
        table,
        where,
        filesystem=fs,
        compression=compression,
        row_group_size=max(1, ROW_GROUP_BYTES // row_bytes),
        use_dictionary=["generation", "sequence"],
        write_statistics=["generation", "sequence", "step", "chosen"],
        write_page_checksum=True,
    )


def write_parquet(
    table: pa.Table,
    path: str | os.PathLike[str],
    metadata: RunMetadata,
    *,
    compression: str | None = "zstd",
    scratch: Path | None = None,
) -> str | Path:
    """Write a run's table (the run schema, with its vocabulary in the schema metadata) as one Parquet file.

    The generations' metadata goes in :data:`GENERATIONS_COLUMN`, the rest of
    ``metadata`` in the footer; row groups hold about :data:`ROW_GROUP_BYTES`;
    only the id columns get dictionaries and statistics; every page carries a
    checksum. A local file is written atomically (a temporary file flushed to
    disk, then renamed), after removing temporary files a killed writer left
    beside ``path``; with ``scratch`` (a dataset's root), the temporary file is
    made there, and so are those removed (:func:`~tracker.format.spill.atomic_path`).
    A URL (``s3://...``) is written in place through its filesystem (see the
    module docstring). Returns the path (the URL as given for a URL).
    """
    _check_compression(compression)
    if is_url(path):
        fs, where = resolve(path, "path")
        if not isinstance(fs, pafs.LocalFileSystem):
            info = fs.get_file_info(where)
            if info.type == pafs.FileType.Directory:
                raise IsADirectoryError(f"path: '{path}' is a folder; give a file name, e.g. '{path}/run.parquet'")
            fs.create_dir(where.rsplit("/", 1)[0], recursive=True)
            _write(parquet_table(table, metadata), where, metadata, compression, fs)
            return str(path)
        path = where
    target = path_arg("path", path)
    if target.is_dir():
        raise IsADirectoryError(f"path: '{target}' is a folder; give a file name, e.g. '{target / 'run.parquet'}'")
    table = parquet_table(table, metadata)
    remove_orphans(target.parent, target.name)
    if scratch is not None:
        remove_orphans(scratch, target.name)
    try:
        with atomic_path(target, scratch) as tmp:
            _write(table, str(tmp), metadata, compression, pafs.LocalFileSystem())
            fsync_path(tmp)
    except OSError as exc:  # disk full, file too large, I/O error: say which file (Arrow's message does not)
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, f"{os.strerror(exc.errno)}: the run could not be written to '{target}'") from exc
    for folder in (target.parent, scratch) if scratch is not None else (target.parent,):
        fsync_path(folder)  # the file's entry (and, in a dataset, its new partition's)
    return target
