"""A recorded run as data: Arrow in memory, Parquet (or Arrow IPC) on disk, the same analysis API either way.

>>> run = tracker.run                      # or Run.load("runs/", run_id=...)
>>> run.to_parquet("run.parquet")          # one self-contained file, written atomically
>>> run.to_dataset("runs/")                # runs/run_id=<id>/part-00000.parquet
>>> Run.load("run.parquet").get_top_tokens(k=5)

Many runs saved with :meth:`Run.to_dataset` under one folder form a
Hive-partitioned dataset (``run_id=...``) that ``pyarrow.dataset`` and DuckDB
read as they are (``read_parquet('runs/**/*.parquet', hive_partitioning=true)``).
Runs with different vocabulary sizes or storage modes have different column
types: read those with DuckDB's ``union_by_name=true``.

A Parquet run keeps its generations' metadata (prompts, per-row sampling) in
the ``generation_meta`` column, not in the footer, and refuses run metadata
past :data:`~tracker.format.schema.MAX_METADATA_BYTES`. Pages carry CRC checksums,
checked on every read; the file is flushed to disk before it is renamed into
place, and temporary files that a killed export left in the folder are
removed by the next export there. A damaged file raises :class:`RunFileError`
naming the file and what is wrong with it. Files are read and written through
:mod:`tracker.format.layout`, which the dashboard reads runs with too.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from processors.vocab import Vocabulary
from tracker.format.checks import check_rows
from tracker.format.columns import restore
from tracker.format.dataset import write_run
from tracker.format.layout import (
    PartialRunWarning,
    RunFileError,
    metadata_from,
    open_layout,
    vocabulary_from,
)
from tracker.format.run_file import write_parquet
from tracker.format.schema import (
    GENERATIONS_COLUMN,
    META_RUN,
    META_VOCAB,
    RunMetadata,
    check_columns,
    check_generations,
    flag_column,
    generations_from_column,
    run_schema,
)
from tracker.reading.analysis import Analysis, stage_matrix
from tracker.reading.insight import Insight
from tracker.reading.rows import nonfinite_rows

__all__ = ["Run", "RunFileError", "check_columns", "generations_from_column"]


class Run(Insight, Analysis):
    """Rows of a run, its metadata and vocabulary; answers the analysis API.

    Args:
        batches: the rows (record batches of the run schema).
        metadata: what the run says about itself.
        vocab: the vocabulary, or a function building it on first use.
    """

    def __init__(
        self,
        batches: list[pa.RecordBatch],
        metadata: RunMetadata,
        vocab: Vocabulary | Callable[[], Vocabulary] | None = None,
    ) -> None:
        self._batches = list(batches)
        self.metadata = metadata
        self._vocab_source = vocab
        self._exported: list[pa.RecordBatch] | None = None
        #: The file or folder the run was loaded from (named by the errors of damaged rows); None in memory.
        self.source: str | None = None

    # ---------------------------------------------------------------- data

    def _record_batches(self) -> list[pa.RecordBatch]:
        return self._batches

    @property
    def vocab(self) -> Vocabulary:
        source = self._vocab_source
        if isinstance(source, Vocabulary):
            return source
        vocab = source() if callable(source) else Vocabulary.placeholder(self.metadata.vocab_size)
        self._vocab_source = vocab
        return vocab

    @property
    def run_id(self) -> str:
        return self.metadata.run_id

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self._batches)

    def schema(self, run_json: bytes | None = None) -> pa.Schema:
        """The run's Arrow schema with its metadata (run JSON, by default the whole metadata, and vocabulary)."""
        m = self.metadata
        stats = bool(self._batches) and "natural_entropy" in self._batches[0].schema.names
        base = run_schema(m.storage, m.stages, m.vocab_size, m.top_k, stats=stats)
        return base.with_metadata(
            {META_RUN: m.to_json() if run_json is None else run_json, META_VOCAB: self.vocab.serialize()}
        )

    def to_arrow(self) -> pa.Table:
        """The run as one Arrow table with metadata and ``_nonfinite`` flags.

        The recorded values are not copied (the table shares the recorder's
        buffers); the flags are computed on the first export, in one summing
        pass per stage, and kept.
        """
        return self._table(self.schema())

    def _table(self, schema: pa.Schema) -> pa.Table:
        if not self._batches:
            return schema.empty_table()
        if self._exported is None:
            self._exported = [self._with_flags(b, schema) for b in self._batches]
        return pa.Table.from_batches(self._exported).replace_schema_metadata(schema.metadata)

    def _with_flags(self, batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
        """``batch`` in the export schema, computing the ``_nonfinite`` flags it lacks."""
        names = batch.schema.names
        if all(flag_column(stage) in names for stage in self.metadata.stages):
            return batch
        columns = []
        for field in schema:
            if field.name in names:
                columns.append(batch.column(field.name))
                continue
            stage = field.name[: -len("_nonfinite")]
            if f"{stage}_nan" in names:  # from the statistics recorded with the rows
                nan = batch.column(f"{stage}_nan").fill_null(0).to_numpy(zero_copy_only=False)
                lse = batch.column(f"{stage}_lse").fill_null(0.0).to_numpy(zero_copy_only=False)
                flags = (nan > 0) | (lse == np.inf)
            elif self.metadata.storage == "topk":
                lse = batch.column(f"{stage}_lse").fill_null(0.0).to_numpy(zero_copy_only=False)
                flags = np.isnan(lse) | (lse == np.inf)
            else:
                valid = batch.column(f"{stage}_logits").is_valid().to_numpy(zero_copy_only=False)
                matrix = stage_matrix(batch, stage, self.metadata.vocab_size)
                flags = nonfinite_rows(matrix) & valid
            columns.append(pa.array(flags))
        return pa.RecordBatch.from_arrays(columns, schema=schema.remove_metadata())

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"Run(run_id={m.run_id!r}, rows={self.num_rows}, generations={len(self.generations()) if self._batches else 0}, "
            f"stages={m.stages}, storage={m.storage!r}, vocab_size={m.vocab_size})"
        )

    # ---------------------------------------------------------------- writing

    def to_parquet(self, path: str | os.PathLike[str], *, compression: str | None = "zstd") -> str | Path:
        """Write the run as one Parquet file, atomically (temporary file, flushed to disk, then renamed); a
        URL (``s3://...``) is written as one upload, which its store shows only once complete.

        Row groups are kept small (about 8 MiB) so that reading one step back
        is cheap; value columns skip dictionary encoding; every page carries a
        checksum. The generations' metadata goes in the ``generation_meta``
        column; the rest of the run metadata must fit
        :data:`~tracker.format.schema.MAX_METADATA_BYTES` (ValueError otherwise).
        Temporary files a killed export left beside ``path`` are removed
        first. Returns the path. (The file's layout: :func:`tracker.format.run_file.write_parquet`.)
        """
        return self._write(path, compression)

    def _write(self, path: str | os.PathLike[str], compression: str | None, scratch: Path | None = None) -> str | Path:
        if not self._batches and not self.metadata.vocab_size:
            raise ValueError(
                "nothing recorded yet: run a generation with the tracker first (an empty run is not written)"
            )
        return write_parquet(self.to_arrow(), path, self.metadata, compression=compression, scratch=scratch)

    def to_dataset(self, root: str | os.PathLike[str], *, compression: str | None = "zstd") -> str | Path:
        """Write the run into a Hive-partitioned dataset: ``root/run_id=<id>/part-00000.parquet``, then the
        run's completion marker ``_complete.json`` (see :mod:`tracker.format.dataset`).

        ``root`` is a folder or a URL (``s3://bucket/runs``, see :mod:`tracker.format.fs`). Any number of processes
        may write into one dataset at once; a run is visible to readers only once its marker is written. The
        partition column is the folder name, not a file column, so
        ``pyarrow.dataset.dataset(root, partitioning="hive")`` and DuckDB's
        ``hive_partitioning`` add ``run_id`` to every row. Returns the part (its URL for a URL root).
        Locally the part is written in ``root`` (hidden, then renamed into its folder): an export killed
        midway adds no ``run_id=...`` folder, and the next export into ``root`` removes what it left.
        """
        return write_run(self, root, compression)

    def rescore(self, model: Any, tokenizer: Any = None, **options: Any) -> Run:
        """This run's tokens through ``model``: a new run holding its distributions at every recorded step.

        Options and guarantees: :func:`tracker.recording.rescore.rescore` (which needs torch; reading runs does not).
        """
        from tracker.recording.rescore import rescore

        return rescore(self, model, tokenizer, **options)

    # ---------------------------------------------------------------- reading

    @classmethod
    def from_arrow(cls, table: pa.Table) -> Run:
        """A run from a table written by :meth:`to_arrow`, or read from :meth:`to_parquet`'s file by any Parquet
        reader (the columns are given the run schema back: :mod:`tracker.format.columns`).

        ValueError saying what is wrong when the metadata, the vocabulary or
        a column's type is damaged.
        """
        meta = table.schema.metadata or {}
        try:
            metadata = metadata_from(meta.get(META_RUN))
            table = restore(table, metadata, "table", arrow_schema=True)  # a file's layout: the run schema back
            if GENERATIONS_COLUMN in table.schema.names:
                entries = generations_from_column(table.column(GENERATIONS_COLUMN))
                check_generations(entries, metadata.vocab_size)
                metadata = replace(metadata, generations=metadata.generations + entries)
                table = table.drop_columns([GENERATIONS_COLUMN])
            check_columns(table.schema, metadata)
            vocab = vocabulary_from(meta.get(META_VOCAB))
        except ValueError as exc:
            raise ValueError(f"table: {exc}") from exc
        return cls(table.to_batches(), metadata, vocab)

    def with_engine_stages(self) -> Run:
        """This run with the stages vLLM's sampler applied after ``natural`` (penalties, temperature, min-p,
        top-k, top-p and the distribution sampled from), computed from the recorded rows, the requests'
        parameters and their output tokens (:mod:`tracker.reading.engine_stages`); the run itself when vLLM
        did not sample it or it has them already. The recorded columns are shared, not copied."""
        from tracker.reading.engine_stages import applies, derive, engine_metadata

        if not applies(self.metadata):
            return self
        return Run(derive(self._batches, self.metadata), engine_metadata(self.metadata), self._vocab_source)

    @classmethod
    def load(cls, path: str | os.PathLike[str], run_id: str | None = None, *, engine_stages: bool = True) -> Run:
        """Load a run: a Parquet or Arrow IPC file, a run folder, a dataset root, or a spill folder; any
        but a spill folder may be a URL (``s3://bucket/runs``, see :mod:`tracker.format.fs`).

        A dataset root holding several ``run_id=...`` folders, or a folder of
        separate run files, needs ``run_id`` (runs are never merged); a
        ``run_id`` that is not at ``path`` is a ValueError.
        No model and no tokenizer are needed: the vocabulary is in the file.
        A spill folder holds only the rows that had spilled to disk, and a
        ``run_id=`` folder without its ``_complete.json`` only the parts
        written so far: loading either warns
        (:class:`~tracker.format.layout.PartialRunWarning`). A dataset root shows only
        its complete runs.
        A run recorded inside vLLM gets the stages of vLLM's sampler computed
        from its rows (:meth:`with_engine_stages`; ``engine_stages=False``: the
        recorded stages alone).
        FileNotFoundError when nothing is at ``path``; :class:`RunFileError`
        naming the file and the fault when it is not a readable run (see
        :mod:`tracker.format.layout`).
        """
        layout = open_layout(path, run_id)
        if layout.note is not None:
            warnings.warn(layout.note, PartialRunWarning, stacklevel=2)
        batches = layout.batches()
        check_rows(layout.path, batches, layout.metadata)
        run = cls(batches, layout.metadata, layout.vocabulary())
        run.source = str(layout.path)
        if not engine_stages:
            return run
        try:
            staged = run.with_engine_stages()
        except ValueError as exc:  # a request's sampling parameters, damaged
            raise RunFileError(layout.path, str(exc)) from exc
        staged.source = run.source
        return staged
