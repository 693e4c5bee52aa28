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
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracker.analysis import Analysis, stage_matrix
from tracker.compute import nonfinite_rows
from tracker.schema import META_RUN, META_VOCAB, RunMetadata, flag_column, run_schema
from tracker.spill import CHUNK_GLOB, RUN_JSON, VOCAB_FILE, atomic_path, read_ipc
from tracker.vocab import Vocabulary

__all__ = ["Run"]

_ROW_GROUP_BYTES = 8 << 20


class Run(Analysis):
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

    def schema(self) -> pa.Schema:
        """The run's Arrow schema with its metadata (run JSON and vocabulary)."""
        m = self.metadata
        stats = bool(self._batches) and "natural_entropy" in self._batches[0].schema.names
        base = run_schema(m.storage, m.stages, m.vocab_size, m.top_k, stats=stats)
        return base.with_metadata({META_RUN: m.to_json(), META_VOCAB: self.vocab.serialize()})

    def to_arrow(self) -> pa.Table:
        """The run as one Arrow table with metadata and ``_nonfinite`` flags.

        The recorded values are not copied (the table shares the recorder's
        buffers); the flags are computed on the first export, in one summing
        pass per stage, and kept.
        """
        schema = self.schema()
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
                flags = nonfinite_rows(matrix).numpy() & valid
            columns.append(pa.array(flags))
        return pa.RecordBatch.from_arrays(columns, schema=schema.remove_metadata())

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"Run(run_id={m.run_id!r}, rows={self.num_rows}, generations={len(self.generations()) if self._batches else 0}, "
            f"stages={m.stages}, storage={m.storage!r}, vocab_size={m.vocab_size})"
        )

    # ---------------------------------------------------------------- writing

    def _row_group_rows(self) -> int:
        m = self.metadata
        width = m.top_k if m.storage == "topk" else m.vocab_size
        per_row = max(1, width * 4 * max(1, len(m.stages)))
        return max(1, _ROW_GROUP_BYTES // per_row)

    def to_parquet(self, path: str | os.PathLike[str], *, compression: str | None = "zstd") -> Path:
        """Write the run as one Parquet file, atomically (temporary file, then rename).

        Row groups are kept small (about 8 MiB) so that reading one step back
        is cheap; value columns skip dictionary encoding. Returns the path.
        """
        target = Path(path)
        table = self.to_arrow()
        with atomic_path(target) as tmp:
            pq.write_table(
                table,
                tmp,
                compression=compression,
                row_group_size=self._row_group_rows(),
                use_dictionary=["generation", "sequence"],
                write_statistics=["generation", "sequence", "step", "chosen"],
            )
        return target

    def to_dataset(self, root: str | os.PathLike[str], *, compression: str | None = "zstd") -> Path:
        """Write the run into a Hive-partitioned folder: ``root/run_id=<id>/part-00000.parquet``.

        The partition column is the folder name, not a file column, so
        ``pyarrow.dataset.dataset(root, partitioning="hive")`` and DuckDB's
        ``hive_partitioning`` add ``run_id`` to every row. Returns the file.
        """
        folder = Path(root) / f"run_id={self.run_id}"
        return self.to_parquet(folder / "part-00000.parquet", compression=compression)

    # ---------------------------------------------------------------- reading

    @classmethod
    def from_arrow(cls, table: pa.Table) -> "Run":
        """A run from a table written by :meth:`to_arrow` (its schema carries the metadata)."""
        meta = table.schema.metadata or {}
        if META_RUN not in meta:
            raise ValueError(
                "table: no logitscope run metadata in its schema (key 'logitscope.run'); "
                "was it written by Run.to_arrow / to_parquet?"
            )
        metadata = RunMetadata.from_json(meta[META_RUN])
        vocab = Vocabulary.deserialize(meta[META_VOCAB]) if META_VOCAB in meta else None
        return cls(table.to_batches(), metadata, vocab)

    @classmethod
    def load(cls, path: str | os.PathLike[str], run_id: str | None = None) -> "Run":
        """Load a run: a Parquet or Arrow IPC file, a run folder, a dataset root, or a spill folder.

        A dataset root holding several ``run_id=...`` folders needs ``run_id``.
        No model and no tokenizer are needed: the vocabulary is in the file.
        """
        source = Path(path)
        if not source.exists():
            raise FileNotFoundError(f"path: no run at '{source}'")
        if source.is_file():
            if source.suffix in (".arrow", ".feather", ".ipc"):
                return cls.from_arrow(read_ipc(source))
            return cls.from_arrow(pq.read_table(source, memory_map=True))
        runs = sorted(p for p in source.iterdir() if p.is_dir() and p.name.startswith("run_id="))
        if runs:
            if run_id is None:
                if len(runs) > 1:
                    names = [p.name.split("=", 1)[1] for p in runs]
                    raise ValueError(f"'{source}' holds {len(runs)} runs; pass run_id= one of {names}")
                return cls.load(runs[0])
            folder = source / f"run_id={run_id}"
            if not folder.is_dir():
                raise ValueError(f"run_id={run_id!r} is not in '{source}'")
            return cls.load(folder)
        if (source / RUN_JSON).exists():
            return cls._load_spill(source)
        parts = sorted(source.glob("*.parquet"))
        if not parts:
            raise FileNotFoundError(f"path: '{source}' holds no run (no .parquet parts, no spill files)")
        tables = [pq.read_table(p, memory_map=True) for p in parts]
        return cls.from_arrow(pa.concat_tables(tables))

    @classmethod
    def _load_spill(cls, folder: Path) -> "Run":
        """A run from a spill folder (what a crashed or still running generation left on disk)."""
        metadata = RunMetadata.from_json((folder / RUN_JSON).read_bytes())
        vocab = None
        if (folder / VOCAB_FILE).exists():
            meta = read_ipc(folder / VOCAB_FILE).schema.metadata or {}
            vocab = Vocabulary.deserialize(meta[META_VOCAB]) if META_VOCAB in meta else None
        batches = [b for p in sorted(folder.glob(CHUNK_GLOB)) for b in read_ipc(p).to_batches()]
        return cls(batches, metadata, vocab)
