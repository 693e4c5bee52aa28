"""The same columns of many small local parts of a table at once, read by DuckDB's Parquet reader.

The views across runs (``steps``, ``sequences``) read the id and statistics
columns of every part of every run: often a thousand small files. pyarrow
opens them one at a time, about 1.5 ms each here with the checks, three times
DuckDB's cost for a file (``benchmarks/bench_query.py``: a first question over
1,000 one-part runs took 5x DuckDB's own time). DuckDB checks no Parquet page
checksum (a flipped byte of a value was answered as another value), so a part
is read here only when its bytes are the ones its writer wrote: a table's part
names the first digits of its SHA-256 (:func:`~tracker.format.run_file.part_digest`),
and each file is hashed whole before the scan (:func:`verified`; about 1 ms per
megabyte, so only parts up to :data:`MAX_SCAN_BYTES` come here). The scan runs
through a DuckDB connection that may read exactly those files and nothing else
(``allowed_paths``; its own file and network access otherwise off, no
extension loaded or fetched, settings locked before the scan). The columns
must come back with the run schema's types and each file's row count must be
what the table's log says; every value is then checked as a run's are
(:mod:`tracker.format.checks`) before it is used. A part without a digest in
its name (written before digests), one whose bytes differ, a file on an
object store, or a scan that fails for any reason is read part by part through
:mod:`tracker.format.parts` instead, which checks page checksums and names the
file at fault. Needs pyarrow and numpy, and duckdb for the scan.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from tracker.format.run_file import file_digest, named_digest

__all__ = ["scan_columns", "verified", "ScanUnavailable", "MAX_SCAN_BYTES"]

#: Parts larger than this are read through pyarrow: hashing a whole file costs about 1 ms a megabyte, more
#: than pyarrow's cost of opening one (about 1.5 ms), and a large part's statistics are a small share of it.
MAX_SCAN_BYTES = 1 << 20
#: File paths DuckDB reads as they are (no glob characters, no quotes).
_PLAIN = re.compile(r"^[A-Za-z0-9/._=:-]+$")


class ScanUnavailable(Exception):
    """DuckDB cannot read these files as one scan (the reason says why): read them part by part instead."""


def _matches(path: str) -> bool:
    named = named_digest(path)
    if named is None:
        return False
    try:
        return file_digest(path) == named
    except OSError:
        return False


def verified(paths: list[str], threads: int = 2) -> list[bool]:
    """For each local file, whether its name ends with the digest of its bytes (:func:`part_digest`):
    hashed whole, ``threads`` files at a time (hashing and reading release the interpreter)."""
    if len(paths) < 2 or threads < 2:
        return [_matches(p) for p in paths]
    share = -(-len(paths) // threads)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="logitscope-hash") as pool:
        found = pool.map(lambda at: [_matches(p) for p in paths[at : at + share]], range(0, len(paths), share))
        return [ok for some in found for ok in some]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def scan_columns(files: list[str], columns: dict[str, pa.DataType], rows: list[int]) -> tuple[pa.Table, np.ndarray]:
    """``columns`` (name: the type it must have) of the local ``files`` (each holding ``rows`` rows, as the
    table's log says) as one table, and for each row the index of its file in ``files`` (rows come in no
    particular order: DuckDB reads the files in parallel). ScanUnavailable when DuckDB cannot read them so,
    or they hold other types or row counts."""
    if not files:
        raise ScanUnavailable("no files")
    bad = next((f for f in files if not _PLAIN.match(f)), None)
    if bad is not None:
        raise ScanUnavailable(f"the path {bad!r} holds characters DuckDB would read as a pattern")
    try:
        import duckdb
    except ImportError as exc:
        raise ScanUnavailable(f"duckdb is not installed ({exc})") from exc
    try:
        con = duckdb.connect(
            ":memory:", config={"autoinstall_known_extensions": False, "autoload_known_extensions": False}
        )
        try:
            con.execute("SET allowed_paths = $files", {"files": files})
            con.execute("SET enable_external_access = false")
            con.execute("SET preserve_insertion_order = false")
            con.execute("SET lock_configuration = true")
            query = f"SELECT {', '.join(map(_quote, columns))}, file_index FROM read_parquet($files)"
            table = con.sql(query, params={"files": files}).to_arrow_reader(1 << 20).read_all()
        finally:
            con.close()
    except duckdb.Error as exc:
        raise ScanUnavailable(" ".join(str(exc).split())[:300]) from exc
    for name, kind in columns.items():
        if table.schema.field(name).type != kind:
            raise ScanUnavailable(f"column {name!r} came back as {table.schema.field(name).type}, not {kind}")
    index = table.column("file_index").to_numpy().astype(np.int64)
    counts = np.bincount(index, minlength=len(files))
    if counts.size != len(files) or not np.array_equal(counts, np.asarray(rows)):
        raise ScanUnavailable("the files hold other row counts than the table's log says")
    return table.drop_columns(["file_index"]), index
