"""Parts of runs committed into a table in groups, from one background thread: what a serving engine writes with.

A server ends thousands of requests a minute, each a part of a run (one
generation). Committing each alone would make commits the server's limit
and leave a file per request; :class:`TableWriter` takes parts as they come
(:meth:`TableWriter.add` returns at once), and its thread, within
``commit_every_s`` of the first part waiting (or once ``max_parts`` wait),
writes the waiting parts of each run as one file and names every file in
one commit. A part is visible to readers once its commit is made; a process
killed before that leaves files no reader sees (``logitscope vacuum``
removes them). Parts of one run may come from several writers, in several
processes: they read back as one run, provided their generation numbers
differ. One generation may come in several parts (a server writes a request's
rows early past its memory bound, or when it goes idle): their rows read back
as one generation, its metadata that of the part that ended last. Needs
pyarrow and ``deltalake``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import replace

import pyarrow as pa

from tracker.format.dataset import open_table
from tracker.format.schema import ID_SCHEMA, META_VOCAB, RunMetadata
from tracker.format.table import Staged, check_run_id
from tracker.format.worker import name_os_thread

__all__ = ["TableWriter"]


class TableWriter:
    """Commit parts of runs into the table at ``root`` in groups, from one background thread.

    >>> writer = TableWriter("s3://bucket/runs", commit_every_s=1.0)
    >>> writer.add(run.to_arrow(), run.metadata)   # returns at once; committed within about a second
    >>> writer.flush()                              # every part added so far is committed (or raises)
    >>> writer.close()                              # flush, then stop the thread (also at interpreter exit)

    Args:
        root: the table's folder or URL.
        commit_every_s: the longest a part waits for its commit (from when it is added), in seconds > 0.
        max_parts: a commit is made as soon as this many parts wait; :meth:`add` waits while twice as many
            do (the queue's bound).
        max_pending_bytes: :meth:`add` also waits while the parts waiting hold more than this many bytes.
        compression: the parts' Parquet codec (of the value columns).
        storage_options: ``deltalake``'s options for the store (see :class:`~tracker.format.table.RunTable`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        commit_every_s: float = 1.0,
        max_parts: int = 256,
        max_pending_bytes: int = 256 << 20,
        compression: str | None = "zstd",
        storage_options: dict[str, str] | None = None,
    ) -> None:
        if isinstance(commit_every_s, bool) or not isinstance(commit_every_s, (int, float)) or not commit_every_s > 0:
            raise ValueError(f"commit_every_s must be a number of seconds > 0, got {commit_every_s!r}")
        for name, value in (("max_parts", max_parts), ("max_pending_bytes", max_pending_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.table = open_table(root, storage_options=storage_options)
        self.commit_every_s = float(commit_every_s)
        self.max_parts = max_parts
        self.max_pending_bytes = max_pending_bytes
        self.compression = compression
        self.commits = 0  # commits made, and parts they named: for benchmarks and tests
        self.parts_committed = 0
        self._cond = threading.Condition()
        self._queue: list[tuple[pa.Table, RunMetadata, int]] = []
        self._pending_bytes = 0
        self._added = self._done = self._flush_to = 0
        self._first_at = 0.0
        self._failure: BaseException | None = None
        self._closing = self._closed = False
        self._thread = threading.Thread(target=self._loop, name="logitscope-table-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def __repr__(self) -> str:
        return f"TableWriter({self.table.location!r}, commit_every_s={self.commit_every_s}, max_parts={self.max_parts})"

    def add(self, table: pa.Table, metadata: RunMetadata) -> None:
        """Add one part of run ``metadata.run_id``: ``table`` holds its rows in the run schema as
        :meth:`tracker.Run.to_arrow` gives them (the vocabulary in its schema metadata), ``metadata`` the
        run's metadata with this part's generations (a later part of a generation already added holds its later
        steps). Returns at once, unless the queue is full."""
        if not isinstance(table, pa.Table):
            raise TypeError(f"table must be a pyarrow.Table (Run.to_arrow()), got {type(table).__name__}")
        if not isinstance(metadata, RunMetadata):
            raise TypeError(f"metadata must be a tracker RunMetadata, got {type(metadata).__name__}")
        check_run_id(metadata.run_id)
        lacking = [n for n in ID_SCHEMA.names if n not in table.schema.names]
        if lacking:
            raise ValueError(f"table must have the run schema's id columns; it lacks {lacking}")
        size = int(table.nbytes)
        with self._cond:
            if self._closing:
                raise ValueError(f"this TableWriter of '{self.table.location}' is closed")
            while self._queue and (
                len(self._queue) >= 2 * self.max_parts or self._pending_bytes + size > self.max_pending_bytes
            ):
                self._cond.wait()
            if not self._queue:
                self._first_at = time.monotonic()
            self._queue.append((table, metadata, size))
            self._pending_bytes += size
            self._added += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Commit every part added so far, and wait for it. RuntimeError naming the table for the first
        failure since the last flush (its parts are not in the table)."""
        with self._cond:
            target = self._flush_to = self._added
            self._cond.notify_all()
            while self._done < target and self._thread.is_alive():
                self._cond.wait()
            failure, self._failure = self._failure, None
        if failure is not None:
            raise RuntimeError(
                f"logitscope could not commit parts into the table at '{self.table.location}': {failure}"
            ) from failure

    def close(self) -> None:
        """Flush, then stop the thread. Safe to call again (and called at interpreter exit)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join()
            self._closed = True
            atexit.unregister(self.close)

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the thread

    def _due(self) -> bool:
        if not self._queue:
            return False
        waited = time.monotonic() - self._first_at
        return (
            self._closing
            or self._flush_to > self._done
            or len(self._queue) >= self.max_parts
            or waited >= self.commit_every_s
        )

    def _loop(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._due() and not (self._closing and not self._queue):
                    timeout = (
                        None if not self._queue else max(0.0, self.commit_every_s - (time.monotonic() - self._first_at))
                    )
                    self._cond.wait(timeout)
                if self._closing and not self._queue:
                    return
                batch, self._queue = self._queue, []
                self._pending_bytes = 0
                self._cond.notify_all()
            try:
                self._commit(batch)
            except BaseException as exc:  # noqa: BLE001 - kept for flush() to raise, the thread goes on
                with self._cond:
                    self._failure = self._failure or exc
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()

    def _commit(self, batch: list[tuple[pa.Table, RunMetadata, int]]) -> None:
        """The parts of each run (of one set of columns) as one file, every file in one commit."""
        groups: dict[tuple[str, tuple[str, ...]], list[tuple[pa.Table, RunMetadata]]] = {}
        for table, metadata, _ in batch:
            groups.setdefault((metadata.run_id, tuple(table.schema.names)), []).append((table, metadata))
        staged: list[Staged] = []
        for parts in groups.values():
            vocab = (parts[0][0].schema.metadata or {}).get(META_VOCAB)
            rows = pa.concat_tables([t.replace_schema_metadata(None) for t, _ in parts], promote_options="permissive")
            if vocab is not None:
                rows = rows.replace_schema_metadata({META_VOCAB: vocab})
            generations = [g for _, m in parts for g in m.generations]
            merged = replace(parts[0][1], generations=sorted(generations, key=lambda g: g.get("generation", -1)))
            staged.append(self.table.stage(rows, merged, self.compression))
        self.table.commit(staged)
        self.commits += 1
        self.parts_committed += len(batch)
