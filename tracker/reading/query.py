"""SQL across runs: :func:`open_dataset` gives DuckDB views of every run under a path or a storage URL.

>>> runs = open_dataset("runs/")                  # a run file, a folder of runs, a run_id= dataset, s3://...
>>> runs.sql("SELECT run_id, avg(entropy_natural) FROM steps GROUP BY run_id").to_pandas()

Views (their columns: ``docs/guide.md``, "At scale"):

- ``runs``: one row per run, from its files' metadata (Parquet footers): no value is read;
- ``steps``: one row per run, generation, sequence and step: the chosen token and every per-step statistic
  of :meth:`tracker.Run.stats`, one column per statistic and stage;
- ``sequences``: one row per run, generation and sequence: its prompt, generated text and step count;
- ``candidates``: the ``k`` best tokens of every step and stage, in long form.

A view's table is made the first time a query names it and kept: ``runs`` from the footers (a table's
committed parts: what this machine learnt of them, :mod:`tracker.format.table_index`); ``steps`` and
``sequences`` from the id and statistics columns of the runs that recorded their statistics, all at once
(:mod:`tracker.reading.query_steps`; other runs are loaded one at a time and their statistics computed
from the rows); ``candidates`` run by run, reading each run's values. What stays in memory is the views'
tables (scalars per step, ``k`` rows per step and stage for candidates), never more than one run's values.

Runs are found by :mod:`tracker.format.discovery` (:mod:`tracker.reading.query_sources`), on any filesystem
pyarrow or fsspec serves: a file is one run; a table holds the runs its commits name; a folder of
``run_id=...`` folders holds those with a completion marker; any other folder's ``.parquet``/``.arrow``
files are runs, grouped by their run id. DuckDB only
reads the tables handed to it from Python: its own file and network access is switched off, with the
download of extensions, and the setting locked, so a query can neither read nor write anything else.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from processors.vocab import Vocabulary
from tracker.format.checks import DamagedRowError, RunFileError
from tracker.reading.engine_stages import applies as _engine_stages
from tracker.reading.query_sources import RunSource, find_sources
from tracker.reading.selection import count_arg

__all__ = ["Dataset", "open_dataset", "VIEWS", "QueryError", "QueryLimitError"]

#: The views a query can name.
VIEWS = ("runs", "steps", "sequences", "candidates")

#: DuckDB settings: no file, network or extension access of its own, and no way for a query to change that.
_DUCKDB_CONFIG = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "enable_external_access": False,
    "python_enable_replacements": False,  # a Python variable named like a view is not a table
    "lock_configuration": True,
}


def _computes_stages(metadata: Any) -> bool:
    """Whether a run gets stages computed from its rows when read (vLLM's sampler): then its rows are read too.
    Damaged sampling parameters count as yes: loading the run says what is wrong, naming its file."""
    try:
        return _engine_stages(metadata)
    except ValueError:
        return True


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class QueryError(ValueError):
    """A query DuckDB refused; the message is DuckDB's, on one line."""


class QueryLimitError(QueryError):
    """A query stopped at a limit it was given: ``limit`` is ``"timeout"`` or ``"memory"``; the message says
    which, and how much."""

    def __init__(self, limit: str, message: str) -> None:
        self.limit = limit
        super().__init__(message)


_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)


def memory_size(memory: str | None) -> str | None:
    """``memory`` as DuckDB's ``memory_limit`` reads it (``"500MB"``, ``"4GB"``), or None; ValueError else."""
    if memory is not None and (not isinstance(memory, str) or not _SIZE.match(memory)):
        raise ValueError(f"memory must be a size such as '500MB' or '4GB', got {memory!r}")
    return None if memory is None else memory.strip()


def _timeout_arg(timeout: float | None) -> float | None:
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf")
    ):
        raise ValueError(f"timeout must be a number of seconds > 0, or None for no limit, got {timeout!r}")
    return timeout


_RUNS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("title", pa.string()),
        ("model", pa.string()),
        ("processors", pa.string()),
        ("sampling", pa.string()),
        ("storage", pa.string()),
        ("top_k", pa.int32()),
        ("stages", pa.list_(pa.string())),
        ("vocab_size", pa.int64()),
        ("eos_token_ids", pa.list_(pa.int64())),
        ("generations", pa.int32()),
        ("sequences", pa.int64()),
        ("steps", pa.int64()),
        ("rows", pa.int64()),
        ("created_at", pa.string()),
        ("library_version", pa.string()),
        ("extra", pa.string()),
        ("files", pa.list_(pa.string())),
        ("size_bytes", pa.int64()),
    ]
)


def _run_row(source: RunSource) -> dict[str, Any]:
    m = source.metadata
    title = m.extra.get("title") if isinstance(m.extra, dict) else None
    return {
        "run_id": m.run_id,
        "title": None if title is None else str(title),
        "model": m.model,
        "processors": m.processors or "none",
        "sampling": None if m.sampling is None else json.dumps(m.sampling),
        "storage": m.storage,
        "top_k": m.top_k,
        "stages": list(m.stages),
        "vocab_size": m.vocab_size,
        "eos_token_ids": [int(i) for i in m.eos_token_ids if isinstance(i, int)],
        "generations": source.generations,
        "sequences": source.sequences,
        "steps": source.steps,
        "rows": source.rows,
        "created_at": m.created_at or None,
        "library_version": m.library_version or None,
        "extra": json.dumps(m.extra),
        "files": source.names,
        "size_bytes": source.size,
    }


class Dataset:
    """The runs under one location as DuckDB views (see the module docstring); made by :func:`open_dataset`.

    Attributes:
        location: the path or URL it was opened on.
        k: tokens per step and stage in the ``candidates`` view.
        connection: the DuckDB connection (the views are registered on it as queries name them).
        memory: the most memory DuckDB may use for a query (``"4GB"``; None: DuckDB's default, 80% of the
            machine's), beyond the views' tables themselves.
        skipped: the runs of a folder left out because they cannot be read (RunFileError naming each file):
            found when the folder was opened, or when a view first read a run's values (that run is then
            missing from the views made from then on).
    """

    def __init__(
        self,
        location: str,
        sources: list[RunSource],
        k: int,
        skipped: list[RunFileError] | None = None,
        memory: str | None = None,
    ) -> None:
        try:
            import duckdb
        except ImportError as exc:
            raise ImportError(f"open_dataset needs duckdb ({exc}); install it: pip install duckdb") from exc

        self.location = location
        self.k = k
        self._sources = sources
        self._tables: dict[str, pa.Table] = {}
        self._texts: list = []  # per sequence of the runs read all at once: its chosen ids (for ``sequences``)
        self._scanned: list[RunSource] = []  # those runs, in the order the texts refer to
        self._steps_columns: set[str] | None = None  # the columns of steps made so far (None: all)
        self._slow_sequences: list[pa.Table] = []
        self._registered: set[str] = set()
        self._vocabularies: dict[bytes, Vocabulary] = {}
        self.skipped: list[RunFileError] = list(skipped or [])
        self._alone = len(sources) == 1 and not self.skipped  # one run: its error is the query's
        self.memory = memory_size(memory)
        self._deadline: tuple[float, float] | None = None  # (monotonic end, seconds) while a query runs
        config = dict(_DUCKDB_CONFIG) | ({} if self.memory is None else {"memory_limit": self.memory})
        self.connection = duckdb.connect(":memory:", config=config)

    @property
    def run_ids(self) -> list[str]:
        return [s.metadata.run_id for s in self._sources]

    def __repr__(self) -> str:
        return f"Dataset({self.location!r}, runs={len(self._sources)}, k={self.k})"

    def table(self, view: str, columns: set[str] | None = None) -> pa.Table:
        """The table of one of :data:`VIEWS`, made on first use and kept; of ``steps``, with at least
        ``columns`` (None: all of them; a query reads only those it names)."""
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        if view == "steps" and view in self._tables and not self._has(columns):
            columns = None if columns is None or self._steps_columns is None else columns | self._steps_columns
            del self._tables["steps"]  # made again with more columns
            if "steps" in self._registered:
                self.connection.unregister("steps")
                self._registered.discard("steps")
        if view not in self._tables:
            if view == "runs":
                self._tables[view] = pa.Table.from_pylist([_run_row(s) for s in self._sources], schema=_RUNS_SCHEMA)
            elif view == "candidates":
                from tracker.reading.query_views import candidates_table

                tables = self._each_run(lambda s: candidates_table(s.load(self._vocabularies), self.k))
                self._tables[view] = pa.concat_tables(tables)
            elif view == "steps":
                self._steps(columns)
            else:
                self._sequences()
            for name, table in self._tables.items():
                if name not in self._registered:
                    self.connection.register(name, table)
                    self._registered.add(name)
        return self._tables[view]

    def _fast(self) -> list[RunSource]:
        """The runs whose views come from their statistics columns, all at once (not those read with stages
        computed from their rows, such as a vLLM run's sampler stages, nor those with a stage per processor)."""
        return [s for s in self._sources if self._scannable(s)]

    @staticmethod
    def _scannable(source: RunSource) -> bool:
        return source.has_stats and not source.metadata.stage_aliases and not _computes_stages(source.metadata)

    def _vocabulary(self, sources: Sequence[RunSource]) -> Callable[[int], Vocabulary]:
        def vocabulary(i: int) -> Vocabulary:
            found = sources[i].vocabulary(self._vocabularies)
            return found if found is not None else Vocabulary.placeholder(sources[i].metadata.vocab_size)

        return vocabulary

    def _has(self, columns: set[str] | None) -> bool:
        return self._steps_columns is None or (columns is not None and columns <= self._steps_columns)

    def _steps(self, columns: set[str] | None = None) -> None:
        """``steps`` with ``columns`` (None: all): runs with recorded statistics all at once from those
        columns, the others run by run (:mod:`tracker.reading.query_steps`, :mod:`tracker.reading.query_views`);
        what ``sequences`` needs of them is kept."""
        from tracker.reading.query_steps import scan_runs, steps_of_runs
        from tracker.reading.query_views import steps_tables

        fast = self._fast()
        steps = []
        if fast:
            scanned = scan_runs(fast, columns)
            try:
                table, self._texts = steps_of_runs(scanned, self._vocabularies, columns)
            except RunFileError:
                if not scanned.kept:
                    raise
                scanned = scan_runs(fast, columns, use_kept=False)  # what was kept failed the checks: the parts
                table, self._texts = steps_of_runs(scanned, self._vocabularies, columns)
            self._scanned = list(scanned.sources)  # what the texts refer to
            steps.append(table)
        self._steps_columns = None if columns is None else set(columns)
        slow = [s for s in self._sources if not self._scannable(s)]
        made = self._each_run(lambda source: steps_tables(source.load(self._vocabularies)), slow)
        steps += [s for s, _ in made]
        self._slow_sequences = [q for _, q in made]
        self._tables["steps"] = pa.concat_tables(steps, promote_options="permissive")

    def _each_run(self, make: Callable[[RunSource], Any], sources: list[RunSource] | None = None) -> list[Any]:
        """``make(source)`` for every run (of ``sources``); a run that cannot be read is left out of the views
        from then on and named in :attr:`skipped` (raised when the dataset is that one run)."""
        made, gone = [], []
        for source in self._sources if sources is None else sources:
            self._check_time()
            try:
                try:
                    made.append(make(source))
                except DamagedRowError as exc:  # a row its query found damaged: the file is
                    raise RunFileError(source.where, str(exc)) from exc
            except RunFileError as exc:
                if self._alone:
                    raise
                self.skipped.append(exc)
                gone.append(source)
        self._sources = [s for s in self._sources if s not in gone]
        return made

    def _check_time(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline[0]:
            raise self._timed_out()

    def _timed_out(self) -> QueryLimitError:
        seconds = self._deadline[1] if self._deadline is not None else 0
        return QueryLimitError("timeout", f"the query ran past its time limit of {seconds:g} s")

    def _sequences(self) -> None:
        from tracker.reading.query_steps import sequences_of_runs
        from tracker.reading.query_views import SEQUENCES_SCHEMA

        if "steps" not in self._tables:
            self._steps()
        fast = self._scanned
        tables = [sequences_of_runs(fast, self._vocabulary(fast), self._texts)] if fast else []
        tables += self._slow_sequences
        self._tables["sequences"] = pa.concat_tables(tables) if tables else SEQUENCES_SCHEMA.empty_table()

    def _named(self, query: str) -> set[str] | None:
        """The columns ``query`` names (DuckDB's parse of it), so that ``steps`` reads only those; None (all)
        for a ``*``, or a statement DuckDB does not describe."""
        import duckdb

        try:
            tree = json.loads(self.connection.execute("SELECT json_serialize_sql($q)", {"q": query}).fetchall()[0][0])
        except (duckdb.Error, ValueError, TypeError):
            return None
        if not isinstance(tree, dict) or tree.get("error") is not False:
            return None
        names: set[str] = set()
        stack: list[Any] = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                kind = node.get("class")
                if kind in ("STAR", "COLUMNS"):
                    return None
                if kind == "COLUMN_REF" and node.get("column_names"):
                    names.add(str(node["column_names"][-1]).lower())
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        return names

    def sql(self, query: str, *, timeout: float | None = None) -> pa.Table:
        """The answer to ``query`` (DuckDB's SQL over :data:`VIEWS`) as an Arrow table (``.to_pandas()`` for a
        DataFrame). QueryError with DuckDB's message, on one line, when DuckDB refuses it; QueryLimitError
        when it runs past ``timeout`` seconds (making the views it names included; None: no limit) or needs
        more than :attr:`memory`."""
        import duckdb

        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"query must be SQL text, got {query!r}")
        timeout = _timeout_arg(timeout)
        self._deadline = None if timeout is None else (time.monotonic() + timeout, timeout)
        timer = None if timeout is None else threading.Timer(timeout, self.connection.interrupt)
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            named = self._named(query)
            if "steps" in self._registered and not self._has(named):
                self.table("steps", named)  # the columns this query reads that steps does not hold yet
            while True:  # a view's table is made when DuckDB first misses it
                try:
                    self._check_time()
                    result = self.connection.sql(query)
                    if result is None:  # a statement without a result (SET, CREATE VIEW ...)
                        return pa.table({})
                    return result.to_arrow_table() if hasattr(result, "to_arrow_table") else result.arrow()
                except duckdb.CatalogException as exc:
                    missing = re.search(r"Table with name (\w+) does not exist", str(exc))
                    view = missing.group(1).lower() if missing else None
                    if view not in VIEWS or view in self._registered:
                        raise QueryError(f"{_one_line(exc)} (the views are {', '.join(VIEWS)})") from exc
                    self.table(view, named)
                except duckdb.InterruptException as exc:
                    raise self._timed_out() from exc
                except duckdb.OutOfMemoryException as exc:
                    limit = self.memory or "DuckDB's default (80% of this machine's)"
                    raise QueryLimitError("memory", f"the query needed more than its memory limit of {limit}") from exc
                except duckdb.Error as exc:
                    raise QueryError(_one_line(exc)) from exc
        finally:
            if timer is not None:
                timer.cancel()
            self._deadline = None


def open_dataset(location: str | os.PathLike[str], *, k: int = 10, memory: str | None = None) -> Dataset:
    """The runs at ``location`` (a run file, a folder of runs, a ``run_id=...`` dataset, or a URL of any of
    them) as DuckDB views; ``k``: tokens per step and stage in ``candidates`` (at most the stored ``top_k``
    in top-k storage); ``memory``: the most DuckDB may use for a query (``"4GB"``; default: DuckDB's, 80% of
    the machine's). Reads the runs' footers now and their values only when a query needs them; a file of a
    folder that cannot be read is left out and named in :attr:`Dataset.skipped`.

    FileNotFoundError (:class:`~tracker.format.layout.NoRunError`) when no run is there;
    :class:`~tracker.format.layout.RunFileError` naming a file that is not a readable run.
    """
    k = count_arg("k", k)
    memory = memory_size(memory)
    skipped: list[RunFileError] = []
    return Dataset(str(location), find_sources(location, skipped), k, skipped, memory)
