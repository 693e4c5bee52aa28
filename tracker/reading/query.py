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
import re
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from processors.vocab import Vocabulary
from tracker.format.fs import resolve
from tracker.format.layout import (
    ID_COLUMNS,
    IPC_SUFFIXES,
    PARQUET_SUFFIXES,
    NoRunError,
    RunFileError,
    arrow_reason,
    metadata_from,
    vocabulary_from,
)
from tracker.format.marker import COMPLETE, complete_runs, read_marker
from tracker.format.schema import GENERATIONS_COLUMN, META_RUN, META_VOCAB, STAT_COLUMNS, RunMetadata, check_columns
from tracker.format.schema import generations_from_column as _generations
from tracker.reading.engine_stages import applies as _engine_stages
from tracker.reading.run import Run
from tracker.reading.selection import count_arg

__all__ = ["Dataset", "open_dataset", "VIEWS", "QueryError"]

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


def _computes_stages(metadata: RunMetadata) -> bool:
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
        wanted = [n for n in (columns or schema.names) if n in schema.names]
        try:
            with self.fs.open_input_file(path) as f:
                if path.endswith(IPC_SUFFIXES):
                    return pa.ipc.open_file(f).read_all().select(wanted)
                return pq.ParquetFile(f, page_checksum_verification=True).read(columns=wanted)
        except (pa.ArrowException, OSError) as exc:
            raise RunFileError(path, arrow_reason(exc)) from exc

    def load(self, vocabularies: dict[bytes, Vocabulary], columns: list[str] | None = None) -> Run:
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
            if raw not in vocabularies:
                try:
                    vocabularies[raw] = vocabulary_from(raw)  # type: ignore[assignment]
                except ValueError as exc:
                    raise RunFileError(self.files[0], str(exc)) from exc
            vocab = vocabularies[raw]
        try:  # a run vLLM sampled: its sampler's stages, computed from its rows
            return Run(batches, self.metadata, vocab).with_engine_stages()
        except ValueError as exc:
            raise RunFileError(self.files[0], str(exc)) from exc

    def stats_columns(self) -> list[str]:
        """The columns :meth:`tracker.Run.stats` reads in a run with recorded statistics."""
        return [f"{stage}_{name}" for stage in self.metadata.stages for name in STAT_COLUMNS]


def _footer(fs: pafs.FileSystem, path: str) -> tuple[pa.Schema, int, int, list[dict]]:
    """``(schema, rows, steps, generations)`` of one run file, from its footer (Parquet; the small
    ``generation_meta`` column too) or, for an Arrow IPC file, from reading it."""
    try:
        with fs.open_input_file(path) as f:
            if path.endswith(IPC_SUFFIXES):
                table = pa.ipc.open_file(f).read_all()
                steps = table.column("step") if "step" in table.schema.names else pa.array([], pa.int32())
                high = pc.max(steps).as_py()
                gens = (
                    _generations(table.column(GENERATIONS_COLUMN)) if GENERATIONS_COLUMN in table.schema.names else []
                )
                return table.schema, table.num_rows, 0 if high is None else high + 1, gens
            file = pq.ParquetFile(f, page_checksum_verification=True)
            meta, schema = file.metadata, file.schema_arrow
            high = -1
            if "step" in schema.names:
                index = schema.get_field_index("step")
                for g in range(meta.num_row_groups):
                    stats = meta.row_group(g).column(index).statistics
                    if stats is not None and stats.has_min_max:
                        high = max(high, int(stats.max))
            gens = (
                _generations(file.read(columns=[GENERATIONS_COLUMN]).column(0))
                if GENERATIONS_COLUMN in schema.names
                else []
            )
            return schema, meta.num_rows, high + 1, gens
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise RunFileError(path, arrow_reason(exc)) from exc
    except ValueError as exc:
        raise RunFileError(path, str(exc)) from exc


def _sources_of(fs: pafs.FileSystem, files: list[str]) -> list[_Source]:
    """The runs held by ``files`` (parts of one run share its run id), checked against their metadata.
    Runs of one model share one copy of their vocabulary's bytes."""
    runs: dict[str, _Source] = {}
    vocabularies: dict[bytes, bytes] = {}
    for path in files:
        schema, rows, steps, gens = _footer(fs, path)
        meta = schema.metadata or {}
        try:
            metadata = metadata_from(meta.get(META_RUN))
            missing = [n for n in ID_COLUMNS if n not in schema.names]
            if missing:
                raise ValueError(f"it lacks the id columns {missing} every run has")
            check_columns(schema, metadata, complete=False)
        except ValueError as exc:
            raise RunFileError(path, str(exc)) from exc
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
    return list(runs.values())


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


def find_sources(location: str | os.PathLike[str]) -> list[_Source]:
    """Every run at ``location`` (see the module docstring), sorted by run id; NoRunError when none is there.

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
    return sorted(_sources_of(fs, files), key=lambda s: s.metadata.run_id)


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
    """

    def __init__(self, location: str, sources: list[_Source], k: int) -> None:
        try:
            import duckdb
        except ImportError as exc:
            raise ImportError(f"open_dataset needs duckdb ({exc}); install it: pip install duckdb") from exc

        self.location = location
        self.k = k
        self._sources = sources
        self._tables: dict[str, pa.Table] = {}
        self._registered: set[str] = set()
        self._vocabularies: dict[bytes, Vocabulary] = {}
        self.connection = duckdb.connect(":memory:", config=dict(_DUCKDB_CONFIG))

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

                tables = [candidates_table(s.load(self._vocabularies), self.k) for s in self._sources]
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

        steps, sequences = [], []
        for source in self._sources:
            columns = source.stats_columns() if source.has_stats and not _computes_stages(source.metadata) else None
            s, q = steps_tables(source.load(self._vocabularies, columns))
            steps.append(s)
            sequences.append(q)
        self._tables["steps"] = pa.concat_tables(steps, promote_options="permissive")
        self._tables["sequences"] = pa.concat_tables(sequences) if sequences else SEQUENCES_SCHEMA.empty_table()

    def sql(self, query: str) -> pa.Table:
        """The answer to ``query`` (DuckDB's SQL over :data:`VIEWS`) as an Arrow table (``.to_pandas()`` for a
        DataFrame). QueryError with DuckDB's message, on one line, when DuckDB refuses it."""
        import duckdb

        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"query must be SQL text, got {query!r}")
        while True:  # a view's table is made when DuckDB first misses it
            try:
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
            except duckdb.Error as exc:
                raise QueryError(_one_line(exc)) from exc


def open_dataset(location: str | os.PathLike[str], *, k: int = 10) -> Dataset:
    """The runs at ``location`` (a run file, a folder of runs, a ``run_id=...`` dataset, or a URL of any of
    them) as DuckDB views; ``k``: tokens per step and stage in ``candidates`` (at most the stored ``top_k``
    in top-k storage). Reads the runs' footers now and their values only when a query needs them.

    FileNotFoundError (:class:`~tracker.format.layout.NoRunError`) when no run is there;
    :class:`~tracker.format.layout.RunFileError` naming a file that is not a readable run.
    """
    k = count_arg("k", k)
    return Dataset(str(location), find_sources(location), k)
