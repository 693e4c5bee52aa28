"""The same columns of many local run files at once, read by DuckDB's Parquet reader.

The views across runs (``steps``, ``sequences``) read the id and statistics
columns of every part of every run: a thousand small files. pyarrow opens
them one at a time, about a millisecond each here; DuckDB reads them all in
one scan in well under half that (``benchmarks/bench_query.py``). So local
files are read here, through a DuckDB connection that may read exactly those
files and nothing else (its ``allowed_paths`` are the files, its own file and
network access is otherwise switched off, no extension is loaded or fetched,
and the settings are locked before the scan). Rows come back in no order
(the scan runs in parallel), each with the index of its file, and each
file's count of rows is checked against what the table's log says it holds. DuckDB does not check Parquet page checksums; every
value read is checked as a run's are (:mod:`tracker.format.checks`) before
it is used. Whatever DuckDB cannot read (a file on an object store, a name
DuckDB would take for a pattern, a damaged file), the caller reads part by
part through :mod:`tracker.format.parts`, which names the file at fault.
Needs pyarrow, and duckdb for the scan.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

__all__ = ["scan_columns", "ScanUnavailable"]

#: File paths DuckDB reads as they are (no glob characters, no quotes).
_PLAIN = re.compile(r"^[A-Za-z0-9/._=:-]+$")


class ScanUnavailable(Exception):
    """DuckDB cannot read these files as one scan (the reason says why): read them part by part instead."""


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def scan_columns(files: list[str], columns: list[str], rows: list[int]) -> tuple[pa.Table, np.ndarray]:
    """``columns`` of the local ``files`` (each holding ``rows`` rows, as the table's log says) as one table,
    and for each row the index of its file in ``files`` (rows come in no particular order: DuckDB reads
    the files in parallel). ScanUnavailable when DuckDB cannot read them so."""
    if not files:
        return pa.table({c: pa.array([], pa.null()) for c in columns}), np.zeros(0, np.int64)
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
        con.execute("SET allowed_paths = $files", {"files": files})
        con.execute("SET enable_external_access = false")
        con.execute("SET preserve_insertion_order = false")
        con.execute("SET lock_configuration = true")
        query = f"SELECT {', '.join(map(_quote, columns))}, file_index FROM read_parquet($files)"
        result = con.sql(query, params={"files": files})
        reader = getattr(result, "to_arrow_reader", None) or result.fetch_record_batch
        table = reader(1 << 20).read_all()
        con.close()
    except duckdb.Error as exc:
        raise ScanUnavailable(" ".join(str(exc).split())[:300]) from exc
    index = table.column("file_index").to_numpy().astype(np.int64)
    counts = np.bincount(index, minlength=len(files)) if index.size else np.zeros(len(files), np.int64)
    if counts.size != len(files) or not np.array_equal(counts, np.asarray(rows)):
        raise ScanUnavailable("the files hold other row counts than the table's log says")
    return table.drop_columns(["file_index"]), index
