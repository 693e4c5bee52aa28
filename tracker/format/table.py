"""A dataset of runs as a Delta Lake table: many writers append, every reader sees only what is committed.

A table is a folder (or an object-store prefix) holding ``_delta_log/`` (the
commits, JSON, with Parquet checkpoints), the runs' Parquet parts under
``run_id=<id>/`` (the partition column ``run_id``) and ``_vocab/`` (each
distinct vocabulary once, :mod:`tracker.format.vocab_store`). Why Delta Lake
(``deltalake``, delta-rs): appends from any number of processes and machines
commit atomically, on a local disk and on object stores (S3 with conditional
writes, GCS, Azure); DuckDB and pyarrow read it through
``DeltaTable(root).to_pyarrow_dataset()``, Polars, Spark, Ray and Daft
natively; its ``vacuum`` removes what no commit names; a column a new storage
mode or stage brings is added to the table's schema (older parts read it as
null). ``docs/guide.md`` ("At scale") has the figures against the folder of
completion markers it replaces.

Writing a part is two steps: :meth:`RunTable.stage` writes the file (no
reader sees it: nothing names it), :meth:`RunTable.commit` names any number of
staged parts in one commit. A writer killed between the two leaves a file that
no reader ever sees; ``vacuum`` removes it. Committed parts never change: a
run written again is a new commit that removes its old parts and adds the new
ones (:meth:`RunTable.commit` with ``replace``). A part's name ends with the digest of its bytes
(:func:`~tracker.format.run_file.part_digest`), so that a reader that checks no page checksum reads it only
once its bytes are known to be the writer's (:mod:`tracker.format.scan`). Needs ``deltalake`` and pyarrow.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from tracker.format.columns import RUN_META, part_json
from tracker.format.fs import is_url, resolve
from tracker.format.run_file import is_statistic, write_part
from tracker.format.schema import GENERATIONS_COLUMN, META_VOCAB, RunMetadata

__all__ = ["LOG_DIR", "RunTable", "Staged", "Committed", "is_table", "check_run_id", "check_part_path", "TableError"]

LOG_DIR = "_delta_log"
#: Schemes ``deltalake`` serves (a table elsewhere cannot be written; its parts can still be read).
TABLE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure", "file")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_COMMIT_TRIES = 20
#: The longest run metadata a commit repeats as its part's statistics (longer: readers read the part).
LOGGED_META_BYTES = 16 << 10
#: What a committed part's path may hold: its run folder and file name, nothing that leads elsewhere.
_PART_PATH = re.compile(r"^run_id=[A-Za-z0-9][A-Za-z0-9._-]{0,199}/[A-Za-z0-9][A-Za-z0-9._=-]{0,250}\.parquet$")


_last_stamp = 0
_stamp_lock = threading.Lock()


def _stamp() -> str:
    """A UTC time to the microsecond, later than any this process gave before: a run's parts sort in the
    order they were written."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(_last_stamp + 1, time.time_ns() // 1000)
        micros = _last_stamp
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(micros // 1_000_000)) + f"{micros % 1_000_000:06d}"


_shared: dict[tuple[str, tuple[tuple[str, str], ...]], RunTable] = {}
_shared_lock = threading.Lock()


class TableError(ValueError):
    """A table that cannot be written or read as one (its location, its schema, a commit that failed)."""


def check_run_id(run_id: object) -> str:
    """``run_id`` if a table may hold it (its folder name is ``run_id=<id>``); ValueError naming it otherwise."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(
            f"run_id must be 1-200 letters, digits, '.', '_' or '-' (not first) to be written into a table, "
            f"got {run_id!r:.80}; write such a run as one file (to_parquet) instead"
        )
    return run_id


def check_part_path(path: str, table: str) -> None:
    """TableError naming the table when a commit names a file that is not a part of one of its run folders
    (an absolute path, a URL, ``..``: a log written by anyone names only its own parts)."""
    if not _PART_PATH.match(path) or ".." in path:
        raise TableError(
            f"the table at '{table}' names a part {path[:120]!r} that is not in one of its run_id= folders"
        )


def is_table(fs: pafs.FileSystem, where: str) -> bool:
    """Whether the folder ``where`` (inside ``fs``) is a Delta table (holds ``_delta_log/``)."""
    return fs.get_file_info(f"{where.rstrip('/')}/{LOG_DIR}").type == pafs.FileType.Directory


@dataclass(frozen=True)
class Staged:
    """A part written into a table, not yet committed: its path relative to the table, run, size and rows."""

    path: str
    run_id: str
    size: int
    rows: int
    schema: pa.Schema
    stats: str


@dataclass(frozen=True)
class Committed:
    """A committed part: its path relative to the table, its run, size in bytes and rows, and what the log's
    statistics of it say: its largest step + 1 (-1: not told) and its :data:`~tracker.format.columns.RUN_META`
    ('' where not told: read the part)."""

    path: str
    run_id: str
    size: int
    rows: int
    steps: int = -1
    run_json: str = ""


def _options(location: str, given: dict[str, str] | None) -> dict[str, str]:
    """``deltalake``'s storage options for ``location``: S3 with conditional writes (safe concurrent commits
    without a lock service) and plain HTTP to an ``http://`` endpoint, unless ``given`` says otherwise."""
    options: dict[str, str] = {}
    if location.startswith(("s3://", "s3a://")):
        options["conditional_put"] = "etag"
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            options["allow_http"] = "true"
    return {**options, **(given or {})}


def _json_value(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _add_stats(table: pa.Table, part: str) -> str:
    """Delta's per-file statistics as JSON: rows; min and max of the columns run files give Parquet statistics
    (:data:`~tracker.format.run_file.STATISTICS`), so that engines skip files by them; and, as its minimum,
    the part's :data:`~tracker.format.columns.RUN_META` (its one value), so that the log alone lists the
    runs (unless it is longer than :data:`LOGGED_META_BYTES`). Null counts are left out (optional, and as
    large as the rest)."""
    low, high = {}, {}
    if len(part) <= LOGGED_META_BYTES:
        low[RUN_META] = part
    for name in table.column_names:
        if not is_statistic(name) or not pa.types.is_primitive(table.schema.field(name).type):
            continue
        bounds = pc.min_max(table.column(name)).as_py()
        lo, hi = _json_value(bounds["min"]), _json_value(bounds["max"])
        if lo is not None and hi is not None:
            low[name], high[name] = lo, hi
    return json.dumps({"numRecords": table.num_rows, "minValues": low, "maxValues": high}, separators=(",", ":"))


def _loose(field: pa.Field) -> pa.Field:
    """``field`` as a table's schema holds it: nullable (a part of another run may lack it), plain lists."""
    kind = field.type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind):
        kind = pa.list_(pa.field("element", kind.value_type, nullable=True))
    return pa.field(field.name, kind, nullable=True)


class RunTable:
    """The Delta table at ``location`` (a folder or a URL), made on its first commit.

    Args:
        location: the table's folder or URL.
        storage_options: ``deltalake``'s options for the store (credentials and endpoints come from the
            usual ``AWS_*``, ``GOOGLE_*``, ``AZURE_*`` variables; S3 gets conditional writes by default).
    """

    def __init__(self, location: str | os.PathLike[str], *, storage_options: dict[str, str] | None = None) -> None:
        self.location = str(location).rstrip("/") if is_url(location) else str(location)
        self.fs, where = resolve(location, "root")
        self.where = where.rstrip("/") or where
        scheme = self.location.split("://", 1)[0].lower() if is_url(self.location) else "file"
        if scheme not in TABLE_SCHEMES:
            raise TableError(
                f"root {self.location!r}: a table is written through deltalake, which serves local folders and "
                f"{', '.join(s + '://' for s in TABLE_SCHEMES if s != 'file')}; not {scheme}://"
            )
        self.uri = self.where if isinstance(self.fs, pafs.LocalFileSystem) else self.location
        self.options = _options(self.location, storage_options)
        self._lock = threading.Lock()
        self._committing = threading.Lock()
        self._delta: Any = None

    def __repr__(self) -> str:
        return f"RunTable({self.location!r})"

    @classmethod
    def at(cls, location: str | os.PathLike[str], *, storage_options: dict[str, str] | None = None) -> RunTable:
        """The table at ``location``, shared in this process (its log is read once, then brought up to date)."""
        probe = cls(location, storage_options=storage_options)
        key = (probe.location if is_url(location) else probe.where, tuple(sorted(probe.options.items())))
        with _shared_lock:
            return _shared.setdefault(key, probe)

    # ---------------------------------------------------------------- reading the log

    def _snapshot(self) -> Any:
        """The table's latest snapshot (a ``DeltaTable``), None while there is no table; kept and brought up to
        date on each call."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        with self._lock:
            if self._delta is None:
                if not is_table(self.fs, self.where):
                    return None
                try:
                    self._delta = DeltaTable(self.uri, storage_options=self.options)
                except TableNotFoundError:
                    return None
            else:
                self._delta.update_incremental()
            return self._delta

    def exists(self) -> bool:
        return self._snapshot() is not None

    def create(self) -> None:
        """Make the table (no run yet) unless it is there: from then on, its run folders hold only what its
        commits name, and a part written but not committed is never taken for a run."""
        from deltalake import Schema
        from deltalake.exceptions import CommitFailedError, DeltaError
        from deltalake.transaction import create_table_with_add_actions

        if is_table(self.fs, self.where):
            return
        schema = pa.schema([pa.field(GENERATIONS_COLUMN, pa.string()), pa.field("run_id", pa.string())])
        try:
            create_table_with_add_actions(
                self.uri,
                Schema.from_arrow(schema),
                [],
                mode="ignore",
                partition_by=["run_id"],
                name="logitscope runs",
                storage_options=self.options,
            )
        except (CommitFailedError, DeltaError, OSError) as exc:  # another writer made it first: fine
            if not is_table(self.fs, self.where):
                raise TableError(f"the table at '{self.location}' could not be made: {exc}") from exc

    def committed(self) -> list[Committed]:
        """Every committed part of the latest version, by run id then path (``[]`` before the first commit)."""
        delta = self._snapshot()
        if delta is None:
            return []
        actions = pa.table(delta.get_add_actions(flatten=True))
        names = actions.column_names
        run = actions.column("partition.run_id").to_pylist() if "partition.run_id" in names else [None] * len(actions)
        paths = actions.column("path").to_pylist()
        sizes = actions.column("size_bytes").to_pylist()
        nothing = [None] * len(actions)
        rows = actions.column("num_records").to_pylist() if "num_records" in names else nothing
        steps = actions.column("max.step").to_pylist() if "max.step" in names else nothing
        described = actions.column(f"min.{RUN_META}").to_pylist() if f"min.{RUN_META}" in names else nothing
        found = [
            Committed(p, r or "", int(s or 0), int(n or 0), -1 if t is None else int(t) + 1, m or "")
            for p, r, s, n, t, m in zip(paths, run, sizes, rows, steps, described)
        ]
        for part in found:
            check_part_path(part.path, self.location)
        return sorted(found, key=lambda c: (c.run_id, c.path))

    def version(self) -> int:
        delta = self._snapshot()
        return -1 if delta is None else int(delta.version())

    # ---------------------------------------------------------------- writing

    def stage(self, rows: pa.Table, metadata: RunMetadata, compression: str | None = "zstd") -> Staged:
        """Write ``rows`` (the run schema, as :meth:`tracker.Run.to_arrow` gives them, its vocabulary in the
        schema metadata) as a new part of run ``metadata.run_id`` (``metadata`` holding the part's
        generations); the vocabulary goes to the table's store once. Not committed: no reader sees it."""
        from tracker.format.vocab_store import store_vocab, vocab_key

        run_id = check_run_id(metadata.run_id)
        serialized = (rows.schema.metadata or {}).get(META_VOCAB)
        vocab_ref = None if serialized is None else vocab_key(serialized)[0]
        prefix = f"run_id={run_id}/part-{_stamp()}-{secrets.token_hex(8)}"
        part = part_json(metadata, "natural_entropy" in rows.schema.names, vocab_ref)
        where, size, schema = write_part(rows, metadata, self.fs, f"{self.where}/{prefix}", part, compression)
        name = where[len(self.where) + 1 :]
        if serialized is not None:  # after the part: a part that could not be written leaves nothing behind
            store_vocab(self.fs, self.where, serialized)
        return Staged(name, run_id, size, rows.num_rows, schema, _add_stats(rows, part))

    def commit(
        self,
        staged: list[Staged],
        *,
        replace: set[str] | frozenset[str] = frozenset(),
        remove: set[str] | frozenset[str] = frozenset(),
    ) -> int:
        """Name ``staged`` parts in one commit (the table is made by the first); with ``replace``, the same
        commit removes the parts those runs had; with ``remove``, exactly these parts (paths in the table:
        TableError, nothing committed, when one is no longer committed). Returns the new version. Concurrent
        commits from other writers are retried against; TableError naming the table when the commit cannot
        be made."""
        from deltalake.exceptions import CommitFailedError, DeltaError

        if not staged and not replace and not remove:
            return self.version()
        last: Exception | None = None
        others = 0
        for attempt in range(_COMMIT_TRIES):
            try:
                with self._committing:  # one commit at a time from this process (its snapshot is shared)
                    self._commit(staged, replace, remove)
                return self.version()
            except (CommitFailedError, DeltaError, OSError) as exc:
                # a concurrent writer committed first (or made the table, or changed its schema): read, retry;
                # anything else three times at most (a store that fails for good says so soon)
                last = exc
                others += not isinstance(exc, CommitFailedError)
                if others > 3:
                    break
                with self._lock:
                    self._delta = None
                time.sleep(min(0.5, 0.01 * 2**attempt) * (0.5 + secrets.randbelow(1000) / 1000))
        reason = " ".join(str(last).split("\n")[0].split())
        raise TableError(f"the table at '{self.location}' could not commit {len(staged)} part(s): {reason}") from last

    def _schema(self, staged: list[Staged]) -> pa.Schema:
        fields: dict[str, pa.Field] = {}
        for part in staged:
            for field in part.schema:
                loose = _loose(field)
                if fields.setdefault(loose.name, loose).type != loose.type:
                    raise TableError(
                        f"parts for '{self.location}' disagree on column {field.name!r}: {fields[field.name].type} "
                        f"and {loose.type}"
                    )
        fields.setdefault(GENERATIONS_COLUMN, pa.field(GENERATIONS_COLUMN, pa.string()))
        return pa.schema([*fields.values(), pa.field("run_id", pa.string())])

    def _commit(
        self, staged: list[Staged], replace: set[str] | frozenset[str], remove: set[str] | frozenset[str]
    ) -> None:
        from deltalake import Schema
        from deltalake.schema import Field
        from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions

        now = int(time.time() * 1000)
        adds = [AddAction(p.path, p.size, {"run_id": p.run_id}, now, True, p.stats) for p in staged]
        wanted = self._schema(staged)
        delta = self._snapshot()
        if delta is None:
            create_table_with_add_actions(
                self.uri,
                Schema.from_arrow(wanted),
                adds,
                mode="error",
                partition_by=["run_id"],
                name="logitscope runs",
                storage_options=self.options,
            )
            return
        current = pa.schema(delta.schema().to_arrow())
        new = [f for f in wanted if f.name not in current.names]
        clash = [f.name for f in wanted if f.name in current.names and current.field(f.name).type != f.type]
        if clash:
            raise TableError(
                f"the table at '{self.location}' holds column(s) {clash} with other types "
                f"({[str(current.field(n).type) for n in clash]}); write these runs into another table"
            )
        if new:  # a storage mode or a stage the table has not held yet: its columns join the schema
            delta.alter.add_columns([Field.from_arrow(f) for f in new])
            delta = self._snapshot()
        removes = []
        if replace or remove:
            committed = self.committed()
            gone = sorted(set(remove) - {p.path for p in committed})
            if gone:
                raise TableError(
                    f"the table at '{self.location}' no longer holds {len(gone)} of the parts this commit removes "
                    f"({gone[0]}...): another writer removed or replaced them; nothing was committed"
                )
            for part in committed:
                if part.run_id in replace or part.path in remove:
                    removes.append(RemoveAction(part.path, True, now, part.size, {"run_id": part.run_id}))
        delta.create_write_transaction(removes + adds, mode="append", schema=delta.schema(), partition_by=["run_id"])

    # ---------------------------------------------------------------- debris

    def vacuum(self, older_than_hours: float, dry_run: bool = False) -> list[str]:
        """Remove files of the table no commit names (a killed writer's parts, parts a rewrite replaced),
        older than ``older_than_hours`` (whole hours, rounded up); returns their paths, relative to the
        table. Delta's own vacuum; :func:`tracker.format.upkeep.vacuum` also removes vocabularies."""
        delta = self._snapshot()
        if delta is None:
            return []
        hours = max(0, math.ceil(older_than_hours))
        removed = delta.vacuum(retention_hours=hours, dry_run=dry_run, enforce_retention_duration=False, full=True)
        return sorted(str(p) for p in removed if str(p) and not str(p).endswith("/") and "/" in str(p))
