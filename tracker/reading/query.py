"""SQL across runs: :func:`open_dataset` gives DuckDB views of every run under a path or a storage URL.

>>> runs = open_dataset("runs/")                  # a run file, a folder of runs, a run_id= dataset, s3://...
>>> runs.sql("SELECT run_id, avg(entropy_natural) FROM steps GROUP BY run_id").to_pandas()

Views (their columns: ``docs/guide.md``, "At scale"):

- ``runs``: one row per run, from its files' metadata (Parquet footers): no value is read;
- ``steps``: one row per run, generation, sequence and step: the chosen token and every per-step statistic
  of :meth:`tracker.Run.stats`, one column per statistic and stage;
- ``sequences``: one row per run, generation and sequence: its prompt, generated text and step count;
- ``candidates``: the ``k`` best tokens of every step and stage, in long form.

A view's table is made the first time a query names it and kept: ``runs`` from the footers;
``steps`` and ``sequences`` run by run, reading only the id and statistics columns of runs that recorded
their statistics (others are loaded one at a time and their statistics computed from the rows);
``candidates`` run by run, reading each run's values. What stays in memory is the views' tables (scalars
per step, ``k`` rows per step and stage for candidates), never more than one run's values.

Runs are listed through :func:`tracker.format.fs.resolve` (any filesystem pyarrow or fsspec serves): a file is
one run; a folder holding ``run_id=...`` folders is a dataset (each folder holding its completion marker
is a run, read for the parts the marker lists; a run still being written is left out); any other folder's ``.parquet``/``.arrow`` files are runs, grouped by their run id. DuckDB only
reads the tables handed to it from Python: its own file and network access is switched off, with the
download of extensions, and the setting locked, so a query can neither read nor write anything else.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from processors.vocab import Vocabulary
from tracker.format.checks import DamagedRowError, check_rows, check_schemas
from tracker.format.fs import resolve
from tracker.format.layout import (
    ID_COLUMNS,
    IPC_SUFFIXES,
    PARQUET_SUFFIXES,
    NoRunError,
    RunFileError,
    arrow_reason,
    metadata_from,
    open_part,
    vocabulary_from,
)
from tracker.format.marker import COMPLETE, complete_runs, read_marker
from tracker.format.schema import GENERATIONS_COLUMN, META_RUN, META_VOCAB, STAT_COLUMNS, RunMetadata, check_generations
from tracker.reading.run import Run
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


@dataclass
class _Source:
    """One run's files on a filesystem and what their footers say."""

    fs: pafs.FileSystem
    files: list[str]
    metadata: RunMetadata
    vocab_raw: bytes | None
    rows: int = 0
    steps: int = 0
    size: int = 0
    schemas: list[pa.Schema] = field(default_factory=list)

    @property
    def has_stats(self) -> bool:
        return all("natural_entropy" in s.names for s in self.schemas)

    def _read(self, path: str, schema: pa.Schema, columns: list[str] | None) -> pa.Table:
        """``columns`` (default: all) of one file, through the checked reading ``Run.load`` uses."""
        try:
            return open_part(path, self.fs, path).read(columns or schema.names)  # type: ignore[arg-type]
        except (pa.ArrowException, OSError) as exc:
            raise RunFileError(path, arrow_reason(exc)) from exc

    def load(self, vocabularies: dict[tuple[bytes, int], Vocabulary], columns: list[str] | None = None) -> Run:
        """The run, with only ``columns`` (and the ids) read when given; vocabularies shared by their bytes."""
        if columns is not None:
            columns = list(ID_COLUMNS) + [c for c in columns if c not in ID_COLUMNS]
        tables = [self._read(p, s, columns) for p, s in zip(self.files, self.schemas)]
        batches = [
            b for t in tables for b in t.select([n for n in t.column_names if n != GENERATIONS_COLUMN]).to_batches()
        ]
        raw = self.vocab_raw
        vocab = None
        if raw is not None:
            key = (raw, self.metadata.vocab_size)  # one copy per vocabulary, checked against each width
            if key not in vocabularies:
                try:
                    vocabularies[key] = vocabulary_from(raw, self.metadata.vocab_size)  # type: ignore[assignment]
                except ValueError as exc:
                    raise RunFileError(self.files[0], str(exc)) from exc
            vocab = vocabularies[key]
        check_rows(self.where, batches, self.metadata)
        return Run(batches, self.metadata, vocab)

    @property
    def where(self) -> str:
        """The run's file, or the folder of its files: what its errors name."""
        return self.files[0] if len(self.files) == 1 else posixpath.dirname(self.files[0])

    def stats_columns(self) -> list[str]:
        """The columns :meth:`tracker.Run.stats` reads in a run with recorded statistics (and, in top-k
        storage, the ``k``-wide ids, checked as every reader checks them)."""
        ids = [f"{stage}_topk_ids" for stage in self.metadata.stages] if self.metadata.storage == "topk" else []
        return [f"{stage}_{name}" for stage in self.metadata.stages for name in STAT_COLUMNS] + ids


def _footer(fs: pafs.FileSystem, path: str) -> tuple[pa.Schema, int, int, list[dict]]:
    """``(schema, rows, steps, generations)`` of one run file, read as ``Run.load`` reads it (every IPC record
    batch checked against its buffers before a value is touched): a Parquet file from its footer (and the
    small ``generation_meta`` column), an Arrow IPC file from its ids."""
    try:
        part = open_part(path, fs, path)  # type: ignore[arg-type]
        return part.schema, sum(part.block_sizes()), part.steps(), part.generations()
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise RunFileError(path, arrow_reason(exc)) from exc
    except RunFileError:
        raise
    except ValueError as exc:
        raise RunFileError(path, str(exc)) from exc


def _sources_of(fs: pafs.FileSystem, files: list[str], skipped: list[RunFileError] | None = None) -> list[_Source]:
    """The runs held by ``files`` (parts of one run share its run id), their columns checked against their
    metadata as ``Run.load`` checks them. Runs of one model share one copy of their vocabulary's bytes.
    With ``skipped`` (the files of a folder), a run that cannot be read is left out and its error added
    there; without it, RunFileError."""
    runs: dict[str, _Source] = {}
    vocabularies: dict[bytes, bytes] = {}
    for path in files:
        try:
            schema, rows, steps, gens = _footer(fs, path)
            meta = schema.metadata or {}
            try:
                metadata = metadata_from(meta.get(META_RUN))
                check_generations(gens, metadata.vocab_size)
            except ValueError as exc:
                raise RunFileError(path, str(exc)) from exc
            check_schemas([(path, schema)], metadata, spill=True)  # this file alone; its run's files below
        except RunFileError as exc:
            if skipped is None:
                raise
            skipped.append(exc)
            continue
        source = runs.get(metadata.run_id)
        if source is None:
            raw = meta.get(META_VOCAB)
            raw = None if raw is None else vocabularies.setdefault(raw, raw)
            source = runs[metadata.run_id] = _Source(fs, [], metadata, raw)
        source.files.append(path)
        source.schemas.append(schema)
        source.metadata = replace(source.metadata, generations=source.metadata.generations + gens)
        source.rows += rows
        source.steps = max(source.steps, steps)
        source.size += fs.get_file_info(path).size or 0
    kept = []
    for source in runs.values():
        try:
            check_schemas(list(zip(source.files, source.schemas)), source.metadata)
            kept.append(source)
        except RunFileError as exc:
            if skipped is None:
                raise
            skipped.append(exc)
    return kept


def _run_files(fs: pafs.FileSystem, folder: str) -> list[str]:
    """A folder's run files (not hidden ones: temporary files of a write in progress), sorted."""
    infos = fs.get_file_info(pafs.FileSelector(folder))
    return sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and i.base_name.endswith(PARQUET_SUFFIXES + IPC_SUFFIXES)
        and not i.base_name.startswith((".", "_"))
    )


def _marked_parts(fs: pafs.FileSystem, folder: str) -> list[str]:
    """The parts a complete run's marker lists (a part written after its marker, or left by a failed write,
    is not the run's)."""
    with fs.open_input_stream(f"{folder}/{COMPLETE}") as f:
        raw = f.read()
    try:
        return [f"{folder}/{name}" for name in read_marker(raw)["parts"]]
    except ValueError as exc:
        raise RunFileError(f"{folder}/{COMPLETE}", f"a damaged completion marker: {exc}") from exc


def find_sources(location: str | os.PathLike[str], skipped: list[RunFileError] | None = None) -> list[_Source]:
    """Every run at ``location`` (see the module docstring), sorted by run id; NoRunError when none is there.

    A run file given alone that cannot be read raises RunFileError; in a folder, with ``skipped``, such a
    file is left out and its error added there (the error when no run is left).

    In a dataset only complete runs count (a ``run_id=...`` folder holding its completion marker, read for
    the parts it lists, as :func:`tracker.format.dataset.list_runs` lists them): a run still being written is left out.
    """
    fs, path = resolve(location)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise NoRunError(location, "there is no file or folder at this path")
    if info.type == pafs.FileType.File:
        return _sources_of(fs, [path])
    entries = fs.get_file_info(pafs.FileSelector(path))
    partitions = [e for e in entries if e.type == pafs.FileType.Directory and e.base_name.startswith("run_id=")]
    complete = complete_runs(fs, path)
    files = [f for name in complete for f in _marked_parts(fs, f"{path.rstrip('/')}/{name}")]
    if not partitions:
        files = _run_files(fs, path)
    if not files:
        reason = (
            "its run_id=... folders hold no complete run yet (no completion marker)"
            if partitions
            else "the folder holds no run files (.parquet, .arrow) and no run_id=... folders"
        )
        raise NoRunError(location, reason)
    sources = _sources_of(fs, files, skipped)
    if not sources and skipped:
        raise skipped[0]
    return sorted(sources, key=lambda s: s.metadata.run_id)


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


def _run_row(source: _Source) -> dict[str, Any]:
    m = source.metadata
    title = m.extra.get("title") if isinstance(m.extra, dict) else None
    return {
        "run_id": m.run_id,
        "title": None if title is None else str(title),
        "model": m.model,
        "processors": m.processors,
        "sampling": None if m.sampling is None else json.dumps(m.sampling),
        "storage": m.storage,
        "top_k": m.top_k,
        "stages": list(m.stages),
        "vocab_size": m.vocab_size,
        "eos_token_ids": [int(i) for i in m.eos_token_ids if isinstance(i, int)],
        "generations": len(m.generations),
        "sequences": sum(int(g.get("batch_size") or 0) for g in m.generations),
        "steps": source.steps,
        "rows": source.rows,
        "created_at": m.created_at or None,
        "library_version": m.library_version or None,
        "extra": json.dumps(m.extra),
        "files": list(source.files),
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
        sources: list[_Source],
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
        self._registered: set[str] = set()
        self._vocabularies: dict[tuple[bytes, int], Vocabulary] = {}
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

    def table(self, view: str) -> pa.Table:
        """The whole table of one of :data:`VIEWS`, made on first use and kept."""
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        if view not in self._tables:
            if view == "runs":
                self._tables[view] = pa.Table.from_pylist([_run_row(s) for s in self._sources], schema=_RUNS_SCHEMA)
            elif view == "candidates":
                from tracker.reading.query_views import candidates_table

                tables = self._each_run(lambda s: candidates_table(s.load(self._vocabularies), self.k))
                self._tables[view] = pa.concat_tables(tables)
            else:
                self._steps()
            for name, table in self._tables.items():
                if name not in self._registered:
                    self.connection.register(name, table)
                    self._registered.add(name)
        return self._tables[view]

    def _steps(self) -> None:
        from tracker.reading.query_views import SEQUENCES_SCHEMA, steps_tables

        def tables(source: _Source) -> tuple[pa.Table, pa.Table]:
            return steps_tables(source.load(self._vocabularies, source.stats_columns() if source.has_stats else None))

        made = self._each_run(tables)
        steps, sequences = [s for s, _ in made], [q for _, q in made]
        self._tables["steps"] = pa.concat_tables(steps, promote_options="permissive")
        self._tables["sequences"] = pa.concat_tables(sequences) if sequences else SEQUENCES_SCHEMA.empty_table()

    def _each_run(self, make: Callable[[_Source], Any]) -> list[Any]:
        """``make(source)`` for every run; a run that cannot be read is left out and named in :attr:`skipped`
        (raised when the dataset is that one run)."""
        made, kept = [], []
        for source in self._sources:
            self._check_time()
            try:
                try:
                    made.append(make(source))
                except DamagedRowError as exc:  # a row its query found damaged: the file is
                    raise RunFileError(source.where, str(exc)) from exc
                kept.append(source)
            except RunFileError as exc:
                if self._alone:
                    raise
                self.skipped.append(exc)
        self._sources = kept
        return made

    def _check_time(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline[0]:
            raise self._timed_out()

    def _timed_out(self) -> QueryLimitError:
        seconds = self._deadline[1] if self._deadline is not None else 0
        return QueryLimitError("timeout", f"the query ran past its time limit of {seconds:g} s")

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
                    self.table(view)
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
    the machine's). Reads the runs' footers now and their values only when a query needs them.

    FileNotFoundError (:class:`~tracker.format.layout.NoRunError`) when no run is there;
    :class:`~tracker.format.layout.RunFileError` naming a file that is not a readable run.
    """
    k = count_arg("k", k)
    skipped: list[RunFileError] = []
    memory = memory_size(memory)
    return Dataset(str(location), find_sources(location, skipped), k, skipped, memory)
