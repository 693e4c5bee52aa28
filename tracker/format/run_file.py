"""Writing a run as Parquet: one self-contained file, or a part of a table, on any filesystem.

Both hold the run's columns as :mod:`tracker.format.columns` lays them out
(no copy of the Arrow schema in the footer) and the generations' metadata in
their column. A single file carries the rest of the run metadata and its
vocabulary once, in the footer; a table's part carries the run metadata in a
column (:data:`~tracker.format.columns.RUN_META`, what the table's log repeats)
and names its vocabulary by hash, stored once per table
(:mod:`tracker.format.vocab_store`), so a footer is a few kilobytes.

Value columns take the given codec (zstd by default); the id and statistics
columns, read by every question across runs, take LZ4 (decoding zstd's small
pages costs more than reading them) and Parquet statistics (min/max), so that
engines skip row groups and files by them. Every page carries a checksum.

Locally a file is written atomically (a temporary file flushed to disk, then
renamed). An object store shows an object only when its upload completes, so
a file is written in place there; a table's part becomes a part of a run only
when a commit names it (:mod:`tracker.format.table`). Needs pyarrow and numpy only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tracker.format.columns import RUN_META, to_file
from tracker.format.fs import is_url, path_arg, resolve
from tracker.format.schema import (
    GENERATIONS_COLUMN,
    MAX_METADATA_BYTES,
    META_RUN,
    META_VOCAB,
    RunMetadata,
    generations_column,
)
from tracker.format.spill import atomic_path, fsync_path, remove_orphans

__all__ = [
    "ROW_GROUP_BYTES",
    "write_parquet",
    "write_part",
    "part_digest",
    "file_digest",
    "named_digest",
    "PART_DIGEST_LEN",
    "parquet_table",
    "check_compression",
    "is_statistic",
    "SCALAR_CODEC",
]

#: Hex digits of a part's SHA-256 its name ends with (:func:`part_digest`).
PART_DIGEST_LEN = 16
#: Bytes of values per Parquet row group: reading one step back reads about this much.
ROW_GROUP_BYTES = 8 << 20
#: The codec of the id and statistics columns (when the values are compressed at all).
SCALAR_CODEC = "lz4"
#: Columns given Parquet statistics (min/max), so that engines skip row groups and files by them: the ids
#: a row is found by and the statistics questions filter on (each costs its footer about 35 bytes).
_ID_STATS = ("generation", "sequence", "step")
_STAT_SUFFIXES = tuple(
    f"_{n}" for n in ("entropy", "allowed", "p_eos", "removed_mass", "margin", "p_chosen", "rank_chosen")
)


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


def check_compression(compression: object) -> None:
    """ValueError naming ``compression`` unless it is None or a codec this pyarrow has."""
    codecs = [c for c in ("zstd", "snappy", "gzip", "brotli", "lz4") if pa.Codec.is_available(c)]
    if compression is not None and (not isinstance(compression, str) or compression.lower() not in {*codecs, "none"}):
        raise ValueError(f"compression must be None or one of {[*codecs, 'none']}, got {compression!r}")


def parquet_table(table: pa.Table, metadata: RunMetadata, *, part: str | None = None) -> pa.Table:
    """``table`` as a run file holds it: its columns laid out for a file (:mod:`tracker.format.columns`), the
    generations in their column, and the run metadata: in the footer with the vocabulary ``table``
    carries, for a single file; in the :data:`~tracker.format.columns.RUN_META` column, for a table's part
    (``part``: that column's JSON, :func:`~tracker.format.columns.part_json`)."""
    carried = table.schema.metadata or {}
    footer = {}
    if part is None:
        footer[META_RUN] = _footer(metadata, table.num_rows > 0)
        if META_VOCAB in carried:
            footer[META_VOCAB] = carried[META_VOCAB]
    table = to_file(table).replace_schema_metadata(footer or None)
    if table.num_rows:
        generation = table.column("generation").to_numpy()
        table = table.append_column(GENERATIONS_COLUMN, generations_column(generation, metadata.generations))
    if part is not None:
        if len(part) > MAX_METADATA_BYTES:
            _footer(metadata, True)  # names the largest fields
        one = pa.DictionaryArray.from_arrays(pa.array(np.zeros(table.num_rows, np.int32)), pa.array([part]))
        table = table.append_column(RUN_META, one)  # one value for every row, written once (a dictionary)
    return table


def is_statistic(name: str) -> bool:
    """Whether a run file's column gets Parquet statistics (and a table's log its minimum and maximum)."""
    return name in _ID_STATS or name.endswith(_STAT_SUFFIXES)


def _write(
    table: pa.Table,
    where: str | pa.NativeFile,
    metadata: RunMetadata,
    compression: str | None,
    fs: pafs.FileSystem | None,
) -> None:
    width = metadata.top_k if metadata.storage == "topk" else metadata.vocab_size
    row_bytes = max(1, width * 4 * max(1, len(metadata.stages)))
    values = compression if compression and compression.lower() != "none" else "none"
    codecs: dict[str, str] = {}
    split: dict[str, str] = {}
    scalars = []
    for field in table.schema:
        if pa.types.is_list(field.type) or pa.types.is_fixed_size_list(field.type):
            codecs[f"{field.name}.list.element"] = values
            if pa.types.is_float32(field.type.value_type):  # every Parquet reader decodes it for FLOAT
                split[f"{field.name}.list.element"] = "BYTE_STREAM_SPLIT"
            elif pa.types.is_int16(field.type.value_type):  # half-precision bit patterns: 28% faster under zstd
                split[f"{field.name}.list.element"] = "DELTA_BINARY_PACKED"  # and 18% smaller than plain INT32
        else:
            codecs[field.name] = SCALAR_CODEC if values != "none" else "none"
            scalars.append(field.name)
    stats = [n for n in scalars if is_statistic(n)]
    options = dict(
        filesystem=fs,
        compression=codecs,
        use_dictionary=["generation", "sequence", RUN_META],
        write_statistics=stats,
        write_page_checksum=True,
        column_encoding=split or None,  # smaller under zstd, and written faster
        store_schema=False,  # pyarrow's copy of the schema would repeat the metadata (the vocabulary) in the footer
    )
    with pq.ParquetWriter(where, table.schema, **options) as writer:
        writer.write_table(table, row_group_size=max(1, ROW_GROUP_BYTES // row_bytes))
        writer.add_key_value_metadata(table.schema.metadata or {})


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
    ``metadata`` and the vocabulary in the footer, once; row groups hold about
    :data:`ROW_GROUP_BYTES`; every page carries a checksum. A local file is
    written atomically (a temporary file flushed to disk, then renamed), after
    removing temporary files a killed writer left beside ``path``; with
    ``scratch``, the temporary file is made there, and so are those removed
    (:func:`~tracker.format.spill.atomic_path`). A URL (``s3://...``) is written
    in place through its filesystem (see the module docstring). Returns the
    path (the URL as given for a URL).
    """
    check_compression(compression)
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
    _write_local(parquet_table(table, metadata), target, metadata, compression, scratch)
    return target


def _write_local(
    table: pa.Table, target: Path, metadata: RunMetadata, compression: str | None, scratch: Path | None
) -> None:
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
        fsync_path(folder)  # the file's entry (and, with scratch, its new folder's)


def part_digest(data: bytes | pa.Buffer) -> str:
    """What a table's part name ends with: the first 16 hex digits of its bytes' SHA-256."""
    return hashlib.sha256(data).hexdigest()[:PART_DIGEST_LEN]


def file_digest(path: str | os.PathLike[str]) -> str:
    """:func:`part_digest` of a local file's bytes: a small file read whole, a larger one a megabyte at a time
    into one buffer (a fresh megabyte per read cost its page faults again)."""
    with open(path, "rb", buffering=0) as file:
        if os.fstat(file.fileno()).st_size <= 1 << 20:
            return part_digest(file.read())
        digest, buffer = hashlib.sha256(), bytearray(1 << 20)
        view = memoryview(buffer)
        while count := file.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()[:PART_DIGEST_LEN]


_NAMED_DIGEST = re.compile(rf"-sha([0-9a-f]{{{PART_DIGEST_LEN}}})\.parquet$")


def named_digest(path: str) -> str | None:
    """The digest a part's name ends with (:func:`write_part`), None for a name without one (a part written
    before names carried it)."""
    found = _NAMED_DIGEST.search(path)
    return None if found is None else found.group(1)


def write_part(
    table: pa.Table,
    metadata: RunMetadata,
    fs: pafs.FileSystem,
    prefix: str,
    part: str,
    compression: str | None = "zstd",
) -> tuple[str, int, pa.Schema]:
    """Write one part of a table's run at ``<prefix>-sha<digest>.parquet`` (inside ``fs``; ``digest``:
    :func:`part_digest` of the file's bytes, so that a reader checks the whole part against the name its
    commit gives before a reader that checks no page checksum reads it): the rows of ``table`` (the run
    schema), ``metadata`` holding the part's generations, ``part`` its
    :data:`~tracker.format.columns.RUN_META` value. Returns the path, the bytes written and the file's
    schema. On a local disk the file is written atomically under a provisional name, hashed as it lies in
    the operating system's cache, then renamed (made in memory first, a 30 MB part took 0.19-0.41 s to stage
    against 0.17-0.21 s); on an object store it is made in memory and uploaded once."""
    check_compression(compression)
    data = parquet_table(table, metadata, part=part)
    if isinstance(fs, pafs.LocalFileSystem):
        provisional = Path(f"{prefix}.parquet")
        _write_local(data, provisional, metadata, compression, None)
        where = f"{prefix}-sha{file_digest(provisional)}.parquet"
        os.replace(provisional, where)  # a writer killed before leaves a file no commit names: vacuum's
        fsync_path(provisional.parent)
        return where, os.path.getsize(where), data.schema.remove_metadata()
    sink = pa.BufferOutputStream()
    _write(data, sink, metadata, compression, None)
    written = sink.getvalue()
    where = f"{prefix}-sha{part_digest(written)}.parquet"
    with fs.open_output_stream(where) as out:
        out.write(written)
    return where, written.size, data.schema.remove_metadata()
