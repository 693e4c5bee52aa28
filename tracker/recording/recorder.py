"""Device to host, a batch at a time: each step's rows into preallocated chunks, chunks into Arrow record batches.

Per step a host hands the recorder the batch's rows at once: :meth:`Recorder.begin_step` reserves one row per
batch row (its generation, sequence and step: a step may hold rows of many generations, as an engine's batch
does), :meth:`Recorder.write` records a stage of them, :meth:`Recorder.set_chosen` gives the last step's rows
their chosen tokens. Each call is a few batched tensor operations on the rows' device (the storage mode's
work: :mod:`tracker.recording.modes`) and one copy per column into the current chunk (:mod:`.chunks`): on a
CPU straight into host memory (float32 rows with ``index=`` are selected and copied in one operation), on
CUDA with ``non_blocking`` copies into a pinned staging slot, drained into host memory only when the ring has
no free slot or someone reads. No Python loop over rows, no synchronisation per step.

Rows whose statistics are recorded (every storage but CPU float32, :data:`~tracker.recording.modes.STATISTICS`)
get the chosen token's logit, probability and rank when that token arrives: until then the recorder keeps the
last step's exact rows (the stored copy where it is exact, else a copy nobody else can write into).

Memory: the recorders sharing a :class:`~tracker.recording.memory.MemoryBound` hold at most its bytes of host
chunks; past it, the oldest complete chunks spill (:mod:`tracker.recording.spill_handoff`: Arrow IPC files,
each written once by the run's writer thread, read back through a memory map). An engine takes rows out
instead, by generation (:meth:`Recorder.take_generations`, :meth:`Recorder.take_oldest`), and writes
them as parts of its runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tracker.format.schema import run_schema
from tracker.recording.chunks import (
    IN_FLIGHT,
    Chunk,
    ChunkMemory,
    CudaStaging,
    StepRows,
    chunk_rows,
    conform,
    fill_stats,
    to_batch,
)
from tracker.recording.memory import SHARED_POOL, HostPool, MemoryBound
from tracker.recording.modes import Storage, stats_when_recorded
from tracker.recording.record_stats import chosen_stats, eos_on
from tracker.recording.rows_out import RowsOut
from tracker.recording.spill_handoff import Describe, SpillHandoff, SpillWarning

__all__ = ["Recorder", "SpillWarning", "StepRows", "Storage"]


class Recorder(RowsOut):
    """Rows of logits from any device into Arrow record batches.

    Args:
        storage: how each stage's row is kept (:class:`~tracker.recording.modes.Storage`).
        stages: the stages recorded, in order (more can be added later).
        chunk_bytes: target size of one chunk of rows (see :func:`chunk_rows`); a chunk holds at least one step.
        memory_limit: bytes of host chunks kept in memory (its own bound), unless ``bound`` is given.
        spill_dir: folder for spilled chunks (a subfolder per run); by default a temporary folder removed with
            the recorder (or, if the process dies, by the next process that spills).
        ring_slots: pinned staging slots per CUDA device (the process's ring; see :mod:`.memory`).
        pool: where host buffers come from and go back to (default: the process-wide one).
        spill_queue: chunks that may wait for the spill writer before recording waits for the disk.
        statistics: when the rows' statistics are computed (:data:`~tracker.recording.modes.STATISTICS`).
        bound: a :class:`MemoryBound` shared with other recorders (an engine's); its owner takes rows out
            (:meth:`take_oldest`) rather than this recorder spilling them.

    Attributes:
        eos_token_ids: end-of-sequence ids, for the ``p_eos`` statistic.
        spilled_bytes, chunk_writes: bytes of spilled chunks on disk, chunk files written.
    """

    def __init__(
        self,
        storage: Storage,
        stages: Sequence[str],
        *,
        chunk_bytes: int = 32 << 20,
        memory_limit: int | None = 2 << 30,
        spill_dir: str | Path | None = None,
        ring_slots: int = 3,
        run_id: str = "run",
        pool: HostPool | None = None,
        spill_queue: int = 2,
        statistics: str = "auto",
        bound: MemoryBound | None = None,
    ) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
        if ring_slots < 2:
            raise ValueError(f"ring_slots must be >= 2 (one filling, one draining), got {ring_slots}")
        stats_when_recorded(statistics, Storage("float32"), torch.device("cpu"))  # refuses a bad value by name
        self.statistics = statistics
        self.record_stats = statistics == "record"  # decided at the first step (stats_when_recorded)
        self.requested = self.storage = Storage.parse(storage)  # "auto" is resolved at the first step
        self.stages: list[str] = list(stages)
        self.chunk_bytes, self.ring_slots, self.run_id = int(chunk_bytes), int(ring_slots), run_id
        self.vocab_size: int | None = None
        self.version = 0
        self.describe: Describe | None = None
        self.eos_token_ids: list[int] = []
        self._bound = MemoryBound(memory_limit) if bound is None else bound
        self._spills = bound is None  # an engine's recorders are emptied by their owner, not spilled
        self._bound.join(self)
        self._pool = SHARED_POOL if pool is None else pool
        self._memory = ChunkMemory(self._pool, self.ring_slots)
        self._chunks: list[Chunk] = []
        self._active: Chunk | None = None
        self._ended: set[int] = set()
        self._lock = threading.RLock()
        self._handoff = SpillHandoff(Path(spill_dir) if spill_dir is not None else None, spill_queue)
        self._spill_queue = int(spill_queue)
        self._steps = self._next_index = 0
        self._arange = np.arange(64, dtype=np.int32)
        self._eos: dict[Any, torch.Tensor] = {}
        self._retained: StepRows | None = None  # the last step's rows, kept until their chosen tokens come
        self._retained_rows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    # ---------------------------------------------------------------- state

    @staticmethod
    def staging_for(device: torch.device) -> CudaStaging | None:
        """The staging used for rows on ``device``: pinned and asynchronous on CUDA, none (direct copies) on CPU."""
        return CudaStaging() if device.type == "cuda" else None

    memory_limit = property(lambda self: self._bound.limit, doc="The bound's bytes (None: no bound).")
    host_bytes = property(lambda self: sum(c.nbytes for c in self._chunks), doc="Bytes of host chunks held.")
    chunks_spilled = property(lambda self: sum(c.spilled is not None for c in self._chunks), doc="Chunks on disk.")
    rows = property(lambda self: sum(c.n for c in self._chunks), doc="Rows recorded.")
    chunk_nbytes = property(
        lambda self: self._chunks[-1].nbytes if self._chunks else 0, doc="The newest chunk's bytes."
    )
    spill_path = property(lambda self: self._handoff.folder, doc="The folder of this run's spilled chunks, if any.")
    spilled_bytes = property(lambda self: self._handoff.spilled_bytes, doc="Bytes of spilled chunks on disk.")
    chunk_writes = property(lambda self: self._handoff.chunk_writes, doc="Chunk files written (each spilled once).")

    def add_stage(self, stage: str) -> None:
        """Record one more stage from the next step on (earlier rows hold nulls for it)."""
        with self._lock:
            if stage not in self.stages:
                self.stages.append(stage)
                self._seal_active()
                self.version += 1

    def schema(self) -> pa.Schema:
        """The Arrow schema of the recorded rows (statistics included when recorded; no run metadata, no flags)."""
        vocab = self.vocab_size or 0
        k = self.storage.k_for(vocab) if vocab else 0
        return run_schema(self.storage_kind, self.stages, vocab, k, flags=False, stats=True)

    @property
    def storage_kind(self) -> str:
        """The storage rows are kept in (before the first step ``"auto"`` is undecided: an empty run says float32)."""
        return "float32" if self.storage.kind == "auto" else self.storage.kind

    def has_room(self, batch: int) -> bool:
        """Whether the next :meth:`begin_step` of ``batch`` rows fits in the chunk being filled (no new chunk,
        no more host memory). Host bookkeeping only."""
        chunk = self._active
        return chunk is not None and chunk.capacity - chunk.n >= batch

    # ---------------------------------------------------------------- writing

    def begin_step(
        self,
        generation: int | np.ndarray,
        step: int | np.ndarray,
        batch: int,
        vocab_size: int,
        device: torch.device,
        sequence: np.ndarray | None = None,
    ) -> StepRows:
        """Reserve ``batch`` rows for a step; their values come with :meth:`write`.

        ``generation`` and ``step``: one for every row, or an array of one per row (an engine's batch holds
        requests of many generations at different steps); ``sequence``: each row's sequence in its generation
        (default ``0..batch-1``). Every step; host bookkeeping only (no device value read). When a chunk fills
        it may wait: for the oldest staging chunk's copies when every pinned slot is in flight (copies
        enqueued chunks ago), and for the spill writer when its queue is full. Raises, once, the disk's
        refusal of a spilled chunk (:meth:`raise_failure`), before reserving.
        """
        with self._lock:
            device = torch.device(device)
            if self.vocab_size is None:
                self.vocab_size = int(vocab_size)
                self.storage = self.requested.resolve(self.stages, self.vocab_size, batch, self.memory_limit)
                self.record_stats = stats_when_recorded(self.statistics, self.storage, device)
            elif vocab_size != self.vocab_size:
                first = int(np.asarray(generation).reshape(-1)[0])
                raise ValueError(
                    f"logits: vocabulary size changed from {self.vocab_size} to {vocab_size} (generation {first}); "
                    "a run holds one vocabulary size. Call clear() before tracking a model with another vocabulary."
                )
            self._retained, self._retained_rows = None, {}
            chunk = self._active
            if chunk is None or chunk.capacity - chunk.n < batch or chunk.device != device:
                self._seal_active()
                chunk = self._active = self._new_chunk(batch, device)
            if self._handoff.pending or self._handoff.failure is not None:
                self.raise_failure()
            self._steps += 1
            start, end = chunk.n, chunk.n + batch
            chunk.n = end
            chunk.generation[start:end] = generation
            if sequence is None:
                if self._arange.shape[0] < batch:
                    self._arange = np.arange(batch, dtype=np.int32)
                sequence = self._arange[:batch]
            chunk.sequence[start:end] = sequence
            chunk.step[start:end] = step
            chunk.arrays["chosen"][start:end] = -1
            chunk.version += 1
            self.version += 1
            return StepRows(chunk, start, batch)

    def write(
        self,
        rows: StepRows,
        stage: str,
        values: torch.Tensor,
        natural: torch.Tensor | None = None,
        owned: bool = False,
        index: torch.Tensor | None = None,
    ) -> None:
        """Record ``values [count, V]`` as ``stage`` for the reserved rows (or, with ``index``, the rows
        ``values[index]`` of a larger batch: selected and copied in one operation), with their statistics.

        ``natural``: the rows before the processor, unmodified (by default this step's natural rows) for the
        removed mass, the margin and top-k's natural logits. ``owned``: nobody else holds ``values`` (it may be
        kept for the chosen token's statistics without a copy). Every step and stage; batched kernels and
        ``non_blocking`` copies only: does not synchronise with the device.
        """
        with self._lock:
            chunk = rows.chunk
            written = chunk.written.get(stage)
            if written is None:
                return  # the stage was added after this chunk began; later chunks carry it
            chunk.check_writable("write")
            count, vocab = (len(index) if index is not None else values.shape[0]), self.vocab_size or 0
            if values.ndim != 2 or values.shape[1] != vocab or count != rows.count:
                raise ValueError(f"{stage} values must have shape {(rows.count, vocab)}, got {tuple(values.shape)}")
            start, end, staging = rows.start, rows.end, chunk.host is None
            if not self.record_stats and chunk.host is not None and values.device.type == "cpu":
                dst = chunk.buffers[f"{stage}:logits"][start:end]  # float32 rows, statistics when read
                if index is not None and values.dtype == dst.dtype:
                    torch.index_select(values, 0, index, out=dst)
                else:
                    dst.copy_(values if index is None else values.index_select(0, index))
            else:
                self._store(rows, stage, values.detach(), natural, owned, index, staging)
            if staging:
                chunk.note_stream()
            written[start:end] = True
            chunk.version += 1
            self.version += 1

    def _store(
        self,
        rows: StepRows,
        stage: str,
        x: torch.Tensor,
        natural: torch.Tensor | None,
        owned: bool,
        index: torch.Tensor | None,
        staging: bool,
    ) -> None:
        """The storage mode's work on the rows' device, one copy per column into the chunk, and the rows kept
        for the chosen token's statistics. No synchronisation."""
        if index is not None:
            x, owned = x.index_select(0, index.to(x.device)), True
        if stage != "natural" and natural is None and self._retained is rows and "natural" in self._retained_rows:
            natural = self._retained_rows["natural"][0]
        nat = None if stage == "natural" or natural is None else natural.detach()
        eos = eos_on(self._eos, self.eos_token_ids, self.vocab_size or 0, x.device) if self.record_stats else None
        stored = self.storage.store(x, nat, eos, self.record_stats)
        chunk, start, end = rows.chunk, rows.start, rows.end
        for name, tensor in stored.columns.items():
            chunk.buffers[f"{stage}:{name}"][start:end].copy_(tensor, non_blocking=staging)
        if stored.stats is not None:
            if not owned:  # the stored copy where it is the exact row (float32 on the CPU), else a copy of its own
                exact = self.storage.kind == "float32" and x.dtype == torch.float32 and x.is_cpu and not staging
                x = chunk.buffers[f"{stage}:logits"][start:end] if exact else x.clone()
            if self._retained is not rows:
                self._retained, self._retained_rows = rows, {}
            self._retained_rows[stage] = (
                x,
                stored.stats,
                stored.columns.get("logits") if not self.storage.full else None,
            )
            chunk.stats_known[stage][start:end] = True

    def mark_error(self, rows: StepRows) -> None:
        """Flag the rows: the wrapped processor failed at this step (host flags only; no synchronisation)."""
        with self._lock:
            rows.chunk.processor_error[rows.start : rows.end] = True
            rows.chunk.version += 1
            self.version += 1

    def supersede(self, rows: StepRows, positions: np.ndarray) -> None:
        """Rows ``positions`` of ``rows`` were computed again at a later step (an engine discarded their sample):
        they are left out of the run and need no chosen token. Host flags only."""
        with self._lock:
            rows.chunk.superseded[rows.start + np.asarray(positions, dtype=np.int64)] = True
            rows.chunk.version += 1
            self.version += 1

    def set_chosen(self, rows: StepRows, tokens: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Record the tokens chosen for the reserved rows (a tensor on any device, a numpy array or ints; a
        negative id means unknown, left null).

        While the step's rows are still kept (the chosen tokens come before the next step), each recorded
        stage's chosen-token logit, probability and rank are computed on the rows' device. Every step;
        batched kernels and ``non_blocking`` copies only: does not synchronise with the device.
        """
        with self._lock:
            chunk = rows.chunk
            if chunk.on_disk and self._handoff.pending:
                self._collect()  # a chunk the writer could not write is back in memory, writable again
            chunk.check_writable("set_chosen")
            if isinstance(tokens, torch.Tensor):
                src = tokens.detach().reshape(-1)
            else:
                src = torch.from_numpy(np.asarray(tokens, dtype=np.int64).reshape(-1))
            if src.numel() != rows.count:
                raise ValueError(f"chosen tokens must be one per row ({rows.count}), got {src.numel()}")
            start, end = rows.start, rows.end
            staging = chunk.host is None and src.device == chunk.device
            if src.device.type == "cpu":
                np.copyto(chunk.arrays["chosen"][start:end], src.numpy(), casting="unsafe")
            else:
                chunk.buffers["chosen"][start:end].copy_(src.to(torch.int64), non_blocking=staging)
            if self._retained is rows:
                for stage, (values, stats, kept) in self._retained_rows.items():
                    tokens_here = src if src.device == values.device else src.to(values.device, non_blocking=True)
                    found = chosen_stats(values, tokens_here, stats, kept)
                    chunk.buffers[f"{stage}:cstats"][start:end].copy_(found, non_blocking=chunk.host is None)
                    chunk.chosen_known[stage][start:end] = True
            if chunk.host is None:
                chunk.note_stream()
            chunk.chosen_set[start:end] = True
            chunk.version += 1
            self.version += 1

    def raise_failure(self) -> None:
        """Raise, once, the disk's refusal of a chunk (a RuntimeError naming the folder); its rows stayed in
        memory and nothing spills until :meth:`clear`. Recording calls this (each step, ``finish``), queries not."""
        with self._lock:
            if self._handoff.pending:
                self._collect()
            failure, self._handoff.failure = self._handoff.failure, None
            if failure is not None:
                raise failure

    def end_generation(self, generation: int) -> None:
        """No more chosen tokens will come for ``generation`` (its rows may spill)."""
        with self._lock:
            self._ended.add(generation)

    # ---------------------------------------------------------------- reading

    def batches(self) -> list[pa.RecordBatch]:
        """Every row so far as record batches (CUDA staging drained: synchronises once). Spilled chunks are
        memory-mapped files; rows an engine took out, or recorded again later, are left out."""
        with self._lock:
            self._drain_staging(everything=True)
            self._collect()
            schema = self.schema()
            return [self._batch_of(chunk, schema) for chunk in self._chunks if chunk.n]

    def flush(self) -> None:
        """Wait until chunks queued for the disk are written and mapped back."""
        with self._lock:
            self._handoff.flush()
            self._collect()

    def clear(self) -> None:
        """Forget every row, delete spill files, keep buffers for reuse."""
        with self._lock:
            self._handoff.reset()
            for chunk in self._chunks:
                self._memory.release(chunk)
            self._chunks.clear()
            self._active = None
            self._ended.clear()
            self._retained, self._retained_rows = None, {}
            self.vocab_size = None
            self.storage = self.requested
            self._steps = 0
            self.version += 1

    def close(self) -> None:
        """Stop the spill writer's thread (after writing what it was given) and forget every row."""
        self.clear()
        self._handoff.close()

    # ---------------------------------------------------------------- internals

    def _layout(self, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"chosen": ((capacity,), torch.int64)}
        for stage in self.stages:
            for name, (shape, dtype) in self.storage.layout(stage, self.vocab_size or 0).items():
                layout[name] = ((capacity, *shape), dtype)
        return layout

    def _new_chunk(self, batch: int, device: torch.device) -> Chunk:
        per_row = self.storage.row_bytes(self.stages, self.vocab_size or 0)
        capacity = chunk_rows(batch, per_row, self.chunk_bytes, self.memory_limit, self._spill_queue)
        index, self._next_index = self._next_index, self._next_index + 1
        transfer = self.staging_for(device)
        drain_one = lambda: self._drain_staging(everything=False)
        chunk = self._memory.chunk(index, capacity, self.stages, self._layout(capacity), device, transfer, drain_one)
        self._chunks.append(chunk)
        return chunk

    def _seal_active(self) -> None:
        """The active chunk takes no more rows; spill old chunks if over the memory bound."""
        self._active = None
        self._enforce_bound()

    def _drain_staging(self, everything: bool) -> bool:
        """Move staging chunks into host memory: the oldest one, or all of them. True if any moved."""
        drained = False
        for chunk in self._chunks:
            if not chunk.staging or (chunk is self._active and not everything):
                continue
            if chunk is self._active:
                self._active = None
            self._memory.to_host(chunk)
            drained = True
            if not everything:
                break
        self._enforce_bound()
        return drained

    def _enforce_bound(self) -> None:
        """Queue the oldest complete chunks for the disk while the bound's recorders hold more than it allows
        (room kept for the next chunk and those on their way). Each chunk is queued once."""
        self._collect()
        if self.memory_limit is None or not self._spills:
            return
        sizes = [c.nbytes for c in self._chunks if c.nbytes]
        on_the_way = sum(c.nbytes for c in self._chunks if c.spilling)
        room = (sizes[-1] if sizes else 0) * (self._spill_queue + IN_FLIGHT)
        excess = self._bound.used() - on_the_way + room - self.memory_limit
        for chunk in list(self._chunks):
            if excess <= 0 or self._handoff.stopped:
                break
            if chunk is self._active or chunk.on_disk or chunk.host is None or not chunk.complete(self._ended):
                continue
            batch = self._to_batch(chunk, self.schema())
            if self._handoff.send(chunk, batch, self.schema(), self.run_id, self.describe):
                excess -= chunk.nbytes

    def _collect(self) -> None:
        """Map the chunks the writer finished and give their buffers back."""
        for chunk in self._handoff.collect(lambda c: c in self._chunks, self.schema):
            self._memory.release(chunk)
            rows_per_step = self.rows / max(1, self._steps)
            self._handoff.notice(self.storage, self.stages, self.vocab_size or 0, rows_per_step, self.memory_limit or 0)

    def _batch_of(self, chunk: Chunk, schema: pa.Schema) -> pa.RecordBatch:
        if chunk.spilled is not None:
            return conform(chunk.spilled, schema)
        key = (chunk.version, tuple(self.stages))
        if chunk.cached is not None and chunk.cached[:2] == key:
            return chunk.cached[2]
        gone = chunk.superseded[: chunk.n] | chunk.taken[: chunk.n]
        rows = np.flatnonzero(~gone) if gone.any() else None
        batch = self._to_batch(chunk, schema, rows)
        chunk.cached = (chunk.version, tuple(self.stages), batch)  # the version after the statistics were filled
        return batch

    def _to_batch(self, chunk: Chunk, schema: pa.Schema, rows: np.ndarray | None = None) -> pa.RecordBatch:
        """The chunk's rows as a record batch, with the statistics of rows recorded without them (and chosen
        tokens' that came after their rows were let go) computed first."""
        if chunk.host is not None:
            fill_stats(chunk, self.stages, eos_on(self._eos, self.eos_token_ids, self.vocab_size or 0, chunk.device))
        return to_batch(chunk, schema, self.stages, self.storage, self.vocab_size or 0, rows)
