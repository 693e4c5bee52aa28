"""A run on disk, read step by step: what the dashboard needs without loading the whole file.

``tracker.Run.load`` reads every row of a run into memory, which is right for
analysis in Python but not for a page that shows one step at a time of a run
that may hold 10,000 steps of a 128k vocabulary (5 GB per stage in float32).
:class:`RunReader` opens a run by its metadata and its id columns only, then
reads the value columns of a step from the one block that holds it: a
Parquet row group (the tracker writes row groups of about 8 MiB) or a record
batch of a memory-mapped Arrow IPC file. Blocks read are kept in a small
least-recently-used cache, so moving back and forth between nearby steps
reads nothing twice. ``blocks_read`` and ``bytes_read`` count what was read,
for tests and benchmarks.

Readable layouts are those :mod:`tracker.format.layout` opens (the same reader as
``tracker.Run.load``): a ``.parquet`` or Arrow IPC file, a folder of Parquet
parts (a ``run_id=...`` dataset partition), a dataset root holding one run,
and a spill folder. Anything else, a truncated file, or a run written with a
newer schema raises :class:`BadRunError` with a message meant for the person
looking at the page.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa

import tracker
from processors.vocab import Vocabulary
from tracker.format.checks import check_topk, damaged_lse, row_stats_damage, stats_damage
from tracker.format.fs import is_url
from tracker.format.layout import (
    ID_COLUMNS,
    IPC_SUFFIXES,
    PARQUET_SUFFIXES,
    NoRunError,
    Part,
    RunFileError,
    RunLayout,
    arrow_reason,
    open_layout,
)
from tracker.format.schema import FIELD_DTYPE, ID_SCHEMA, META_RUN, RunMetadata, as_float32, row_offsets, run_schema
from tracker.reading import engine_stages
from tracker.reading.engine_requests import History, vllm_requests
from tracker.reading.selection import sequence_end

__all__ = ["BadRunError", "RunReader", "StageRow", "StepRow", "Track", "IPC_SUFFIXES", "PARQUET_SUFFIXES"]

_CACHE_BYTES = 256 << 20


class BadRunError(Exception):
    """A path that cannot be shown as a run; ``str()`` says which path and why, in plain words."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"'{path}' cannot be opened as a logitscope run: {reason}")


@dataclass(frozen=True)
class Track:
    """The rows of one sequence of one generation, in step order, cut after its first end-of-sequence token.

    Attributes:
        generation, sequence: what was selected.
        steps: ``[T]`` step numbers (0 is the first generated token).
        chosen: ``[T]`` chosen token ids, -1 where unknown.
        rows: ``[T]`` row numbers in the reader's index.
    """

    generation: int
    sequence: int
    steps: np.ndarray
    chosen: np.ndarray
    rows: np.ndarray

    @property
    def length(self) -> int:
        return int(self.steps.shape[0])

    def position(self, step: int) -> int:
        """Index into this track of ``step``; ValueError naming the recorded range otherwise."""
        hits = np.nonzero(self.steps == step)[0]
        if hits.size == 0:
            raise ValueError(
                f"step={step} is not recorded for generation {self.generation}, sequence {self.sequence}; "
                f"recorded steps are {int(self.steps.min()) if self.length else 0}..{int(self.steps.max()) if self.length else -1}"
            )
        return int(hits[0])


@dataclass(frozen=True)
class StageRow:
    """One stage's values at one step.

    Full storage sets ``logits`` (``[V]`` float32); top-k storage sets
    ``ids``/``values`` (the stored best tokens and their logits) and, for
    stages after ``natural``, ``natural_at_ids``. ``lse`` is the row's
    log-sum-exp and ``allowed`` how many tokens had a logit above ``-inf``
    (both known in every storage; a row holding ``+inf`` has ``lse`` ``+inf``
    and ``allowed`` its count of ``+inf`` tokens: a one-hot on them). ``recorded`` is False when the stage was
    not recorded at this step (the wrapped processor raised, or the stage was
    added later). ``recorded_stats`` holds the statistics recorded from the
    whole row (``entropy``, ``p_chosen``, ``removed_mass``), where the run has them.
    """

    stage: str
    recorded: bool
    logits: np.ndarray | None = None
    ids: np.ndarray | None = None
    values: np.ndarray | None = None
    natural_at_ids: np.ndarray | None = None
    lse: float = float("nan")
    allowed: int = 0
    recorded_stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRow:
    """Every stage of one (generation, sequence, step) row, and the token chosen there (-1: unknown)."""

    generation: int
    sequence: int
    step: int
    chosen: int
    processor_error: bool
    stages: dict[str, StageRow]


class RunReader:
    """Read a run on disk by step; see the module docstring.

    Opening reads the metadata and the id columns (generation, sequence,
    step, chosen, processor_error) of every row, nothing else. The reader is
    safe to share between threads (Streamlit sessions).

    Args:
        path: a run file or run folder (see the module docstring).
        cache_bytes: bytes of blocks kept after reading them.
    """

    def __init__(self, path: str | Path, *, cache_bytes: int = _CACHE_BYTES) -> None:
        self.path: Path | str = path if is_url(path) else Path(path)  # a URL stays one (Path would spoil it)
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self._cache_bytes = int(cache_bytes)
        self._cache: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()
        self._cached_bytes = 0
        self._checked: set[tuple[int, int]] = set()
        self._lock = threading.RLock()
        self.blocks_read = 0
        self.bytes_read = 0
        self._layout = self._open(self.path)
        self._parts: list[Part] = self._layout.parts
        self.metadata: RunMetadata = self._layout.metadata
        self.note: str | None = self._layout.note  # e.g. a spill folder holds only the spilled rows
        self._index = self._read_index()
        self._engine = self._engine_stages()
        if not self._index["step"].size:  # nothing to pick or show (a filtered or sliced table written as a run)
            raise BadRunError(self.path, "it holds no recorded steps (0 rows)")
        _ = self.vocab  # read (and checked against the rows' width) at open: every page shows tokens

    # ---------------------------------------------------------------- opening

    @staticmethod
    def _open(path: Path | str) -> RunLayout:
        try:
            layout = open_layout(path)
        except (RunFileError, NoRunError) as exc:
            raise BadRunError(exc.path, exc.reason) from exc
        except ValueError as exc:  # a dataset root holding several runs
            raise BadRunError(path, str(exc)) from exc
        if not layout.parts:
            raise BadRunError(path, "the spill folder holds no chunk-*.arrow files yet")
        return layout

    def _read_index(self) -> dict[str, np.ndarray]:
        parts: dict[str, list[np.ndarray]] = {
            k: [] for k in ("generation", "sequence", "step", "chosen", "error", "part", "block", "local")
        }
        read: list[tuple[pa.Table, list[int]]] = []
        for part in self._parts:
            try:
                ids, sizes = part.read_ids(), part.block_sizes()
            except (pa.ArrowException, OSError) as exc:
                raise BadRunError(part.path, arrow_reason(exc)) from exc
            if sum(sizes) != ids.num_rows:
                raise BadRunError(part.path, f"its blocks hold {sum(sizes)} rows but its id columns {ids.num_rows}")
            read.append((ids, sizes))
        try:  # nulls, chosen ids outside the vocabulary, a row twice: before any value is used
            tables = [ids for ids, _ in read]
            self._layout.check_rows(
                pa.concat_tables(tables, promote_options="permissive") if read else ID_SCHEMA.empty_table()
            )
        except RunFileError as exc:
            raise BadRunError(exc.path, exc.reason) from exc
        for p, (ids, sizes) in enumerate(read):
            parts["generation"].append(ids.column("generation").to_numpy())
            parts["sequence"].append(ids.column("sequence").to_numpy())
            parts["step"].append(ids.column("step").to_numpy())
            parts["chosen"].append(ids.column("chosen").fill_null(-1).to_numpy())
            parts["error"].append(ids.column("processor_error").to_numpy())
            parts["part"].append(np.full(ids.num_rows, p, dtype=np.int64))
            parts["block"].append(np.repeat(np.arange(len(sizes), dtype=np.int64), sizes))
            parts["local"].append(
                np.concatenate([np.arange(n, dtype=np.int64) for n in sizes]) if sizes else np.zeros(0, np.int64)
            )
        return {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in parts.items()}

    def _engine_stages(self) -> tuple[dict, History] | None:
        """A run vLLM sampled gets its sampler's stages, computed block by block as they are read
        (:mod:`tracker.reading.engine_stages`): its requests and every step's chosen token, or None."""
        try:
            if not engine_stages.applies(self.metadata):
                return None
            requests = vllm_requests(self.metadata)
        except ValueError as exc:  # a request's sampling parameters, damaged
            raise BadRunError(self.path, str(exc)) from exc
        index = self._index
        self.metadata = engine_stages.engine_metadata(self.metadata)
        return requests, History(index["generation"], index["sequence"], index["step"], index["chosen"])

    # ---------------------------------------------------------------- what the run holds

    @cached_property
    def vocab(self) -> Vocabulary:
        """The run's vocabulary (``<id>`` placeholders when the run carries none)."""
        try:
            vocab = self._layout.vocabulary()
        except RunFileError as exc:
            raise BadRunError(exc.path, exc.reason) from exc
        return vocab if vocab is not None else Vocabulary.placeholder(self.metadata.vocab_size)

    @property
    def num_rows(self) -> int:
        return int(self._index["step"].shape[0])

    @property
    def num_blocks(self) -> int:
        return int(sum(len(part.block_sizes()) for part in self._parts))

    @property
    def stages(self) -> list[str]:
        return list(self.metadata.stages)

    @property
    def size_bytes(self) -> int:
        return int(sum(part.nbytes for part in self._parts))

    def generations(self) -> list[int]:
        return sorted(set(self._index["generation"].tolist()))

    def sequences(self, generation: int) -> list[int]:
        index = self._index
        return sorted(set(index["sequence"][index["generation"] == generation].tolist()))

    def prompt(self, generation: int, sequence: int = 0) -> str:
        """The prompt text of a row of a generation, special tokens by name ("" when the run did not keep it)."""
        for entry in self.metadata.generations:
            if int(entry.get("generation", -1)) == generation:
                rows = entry.get("prompt_ids") or []
                if 0 <= sequence < len(rows):
                    return self.vocab.decode_shown(rows[sequence])
        return ""

    def track(self, generation: int, sequence: int, *, include_finished: bool = False) -> Track:
        """The rows of a sequence in step order (by default cut where it ended: :func:`tracker.reading.selection.sequence_end`)."""
        key = ("track", generation, sequence, include_finished)
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        index = self._index
        in_generation = index["generation"] == generation
        if not in_generation.any():
            raise ValueError(f"generation={generation} is not in this run; its generations are {self.generations()}")
        rows = np.nonzero(in_generation & (index["sequence"] == sequence))[0]
        if rows.size == 0:
            raise ValueError(
                f"sequence={sequence} is not in generation {generation}; its sequences are {self.sequences(generation)}"
            )
        rows = rows[np.argsort(index["step"][rows], kind="stable")]
        chosen = index["chosen"][rows]
        if not include_finished:
            end = sequence_end(index["step"][rows], chosen, self.metadata, generation, sequence)
            rows, chosen = rows[:end], chosen[:end]
        result = Track(generation, sequence, index["step"][rows].astype(np.int64), chosen.astype(np.int64), rows)
        self._memo[key] = result
        return result

    @cached_property
    def _memo(self) -> dict[object, Track]:
        return {}

    # ---------------------------------------------------------------- reading values

    def _block(self, part: int, block: int) -> pa.Table:
        """Every column of one block (ids, values, flags), from the cache or the file."""
        key = (part, block)
        with self._lock:
            table = self._cache.get(key)
            if table is not None:
                self._cache.move_to_end(key)
                return table
            source = self._parts[part]
            try:
                table, nbytes = source.read_block(block, ID_COLUMNS + self._value_columns(part))
            except (pa.ArrowException, OSError) as exc:
                raise BadRunError(source.path, f"block {block} could not be read: {arrow_reason(exc)}") from exc
            if key not in self._checked:  # the block's scalar statistics, once per reader
                damage = stats_damage(table, self._layout.metadata)
                if damage is not None:
                    raise BadRunError(source.path, f"block {block}: {damage}")
                self._checked.add(key)
            if self._engine is not None:
                batch = table.combine_chunks().to_batches()[0] if table.num_rows else None
                if batch is not None:
                    derived = engine_stages.derive_batch(batch, self._layout.metadata, *self._engine)
                    table = pa.Table.from_batches([derived])
            self.blocks_read += 1
            self.bytes_read += nbytes
            size = int(table.nbytes)
            if size <= self._cache_bytes:
                self._cache[key] = table
                self._cached_bytes += size
                while self._cached_bytes > self._cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= int(old.nbytes)
            return table

    def _value_columns(self, part: int) -> tuple[str, ...]:
        """The value columns (and flags) the metadata declares that this part holds."""
        m = self.metadata
        names = set(self._parts[part].schema.names)
        declared = run_schema(m.storage, m.stages, m.vocab_size, m.top_k).names
        with_stats = run_schema(m.storage, m.stages, m.vocab_size, m.top_k, stats=True).names  # recorded statistics
        declared = list(dict.fromkeys([*declared, *with_stats]))
        return tuple(n for n in declared if n not in ID_COLUMNS and n in names)

    def rows(self, track: Track, start: int, stop: int) -> pa.Table:
        """The full rows (id and value columns) of ``track`` positions ``[start, stop)``, in step order."""
        if not 0 <= start <= stop <= track.length:
            raise ValueError(f"start, stop must satisfy 0 <= start <= stop <= {track.length}, got {start}, {stop}")
        index = self._index
        wanted = track.rows[start:stop]
        pieces: list[pa.Table] = []
        keys = (
            np.stack([index["part"][wanted], index["block"][wanted]], axis=1)
            if wanted.size
            else np.zeros((0, 2), np.int64)
        )
        i = 0
        while i < wanted.size:
            part, block = int(keys[i, 0]), int(keys[i, 1])
            j = i
            while j < wanted.size and keys[j, 0] == part and keys[j, 1] == block:
                j += 1
            table = self._block(part, block)
            local = index["local"][wanted[i:j]]
            if int(local[-1]) - int(local[0]) + 1 == local.size and bool(np.all(np.diff(local) == 1)):
                pieces.append(table.slice(int(local[0]), local.size))  # consecutive rows: no copy
            else:
                pieces.append(table.take(pa.array(local)))
            i = j
        metadata = {META_RUN: self.metadata.to_json()}
        if not pieces:
            source = self._parts[0].schema
            names = ID_COLUMNS + self._value_columns(0)
            return pa.schema([source.field(n) for n in names], metadata=metadata).empty_table()
        tables = [p.replace_schema_metadata(None) for p in pieces]
        table = pa.concat_tables(tables, promote_options="default").replace_schema_metadata(metadata)
        try:
            check_topk(self.path, table, self.metadata)  # the window's k-wide ids only
        except RunFileError as exc:
            raise BadRunError(exc.path, exc.reason) from exc
        return table

    def window(self, track: Track, start: int, stop: int) -> tracker.Run:
        """Positions ``[start, stop)`` of ``track`` as a :class:`tracker.Run`, for its analysis API."""
        table = self.rows(track, start, stop).combine_chunks()  # one block: the analysis works per block
        return tracker.Run(table.to_batches(max_chunksize=max(1, table.num_rows)), self.metadata, lambda: self.vocab)

    def step(self, track: Track, position: int) -> StepRow:
        """Every stage of the row at ``position`` of ``track``, reading only the block that holds it."""
        if not 0 <= position < track.length:
            raise ValueError(f"position must be in [0, {track.length}), got {position}")
        index = self._index
        row = int(track.rows[position])
        part = int(index["part"][row])
        table = self._block(part, int(index["block"][row]))
        local = int(index["local"][row])
        stages = {stage: self._stage_row(table, stage, local) for stage in self.metadata.stages}
        return StepRow(
            track.generation,
            track.sequence,
            int(track.steps[position]),
            int(track.chosen[position]),
            bool(index["error"][row]),
            stages,
        )

    def _stage_row(self, table: pa.Table, stage: str, local: int) -> StageRow:
        m = self.metadata
        if f"{stage}_topk_ids" not in table.column_names and f"{stage}_logits" not in table.column_names:
            return StageRow(stage, recorded=False)
        stats = {}
        for name in ("entropy", "p_chosen", "removed_mass"):
            if f"{stage}_{name}" in table.column_names:
                value = table.column(f"{stage}_{name}")[local].as_py()
                if value is not None:
                    stats[name] = float(value)
        if m.storage != "topk":
            column = _single(table.column(f"{stage}_logits"))
            if column.is_null()[local].as_py():
                return StageRow(stage, recorded=False)
            width = m.vocab_size
            child = column.values.slice((column.offset + local) * width, width)
            kind = (table.schema.field(f"{stage}_logits").metadata or {}).get(FIELD_DTYPE, b"float32")
            logits = as_float32(child.to_numpy(zero_copy_only=False), kind)
            offset = row_offsets(table, stage, np.array([local]))
            logits = logits if offset is None else logits + offset[0]  # half precision: kept minus the row's max
            lse, allowed = _row_lse(logits)
            said = [
                table.column(f"{stage}_{n}")[local].as_py() if f"{stage}_{n}" in table.column_names else None
                for n in ("lse", "nan")
            ]
            if reason := row_stats_damage(logits, lse, *said, 1e-3 if kind == b"float32" else 5e-2):
                at = ", ".join(f"{n} {table.column(n)[local].as_py()}" for n in ("generation", "sequence", "step"))
                raise BadRunError(self.path, f"the row of stage {stage!r} at {at} {reason}; the file is damaged")
            return StageRow(stage, True, logits=logits, lse=lse, allowed=allowed, recorded_stats=stats)
        ids_column = _single(table.column(f"{stage}_topk_ids"))
        if ids_column.is_null()[local].as_py():
            return StageRow(stage, recorded=False)
        k = ids_column.type.list_size
        ids = (
            ids_column.values.slice((ids_column.offset + local) * k, k).to_numpy(zero_copy_only=False).astype(np.int64)
        )
        values_column = _single(table.column(f"{stage}_topk_logits"))
        values = values_column.values.slice((values_column.offset + local) * k, k).to_numpy(zero_copy_only=False)
        natural = None
        if f"{stage}_topk_natural" in table.column_names:
            nat_column = _single(table.column(f"{stage}_topk_natural"))
            natural = nat_column.values.slice((nat_column.offset + local) * k, k).to_numpy(zero_copy_only=False)
        lse = table.column(f"{stage}_lse")[local].as_py()
        allowed = table.column(f"{stage}_allowed")[local].as_py()
        if (ids.size and (ids.min() < 0 or ids.max() >= m.vocab_size)) or damaged_lse(
            values[None, :].astype(np.float64), np.array([np.nan if lse is None else lse])
        )[0]:
            raise BadRunError(
                self.path,
                f"the row of stage {stage!r} at block row {local} is damaged: token ids outside [0, {m.vocab_size}) "
                "or a log-sum-exp its stored logits cannot give (below the largest, or +inf without a +inf)",
            )
        return StageRow(
            stage,
            True,
            ids=ids,
            values=values.astype(np.float32),
            natural_at_ids=None if natural is None else natural.astype(np.float32),
            lse=float("nan") if lse is None else float(lse),
            allowed=0 if allowed is None else int(allowed),
            recorded_stats=stats,
        )

    def clear_cache(self) -> None:
        """Forget the blocks read (the next reads go to the file again)."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"RunReader('{self.path}', run_id={m.run_id!r}, rows={self.num_rows}, blocks={self.num_blocks}, "
            f"storage={m.storage!r}, stages={m.stages}, vocab_size={m.vocab_size})"
        )


def _row_lse(logits: np.ndarray) -> tuple[float, int]:
    """A full row's log-sum-exp and allowed count as the record keeps them: NaN entries left out; a row
    holding ``+inf`` has log-sum-exp ``+inf`` and allows its ``+inf`` tokens (it is a one-hot on them)."""
    posinf = np.isposinf(logits)
    if posinf.any():
        return float("inf"), int(posinf.sum())
    finite = logits[logits > -np.inf]  # NaN compares False: left out
    if not finite.size:
        return float("-inf"), 0
    top = float(finite.max())
    return float(top + np.log(np.exp(finite - top).sum(dtype=np.float64))), int(finite.size)


def _single(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
