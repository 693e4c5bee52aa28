"""Device to host: each step's rows into preallocated chunks, chunks into Arrow record batches.

A *chunk* (:mod:`tracker.recording.chunks`) is a block of rows (one per sequence and step) with one buffer per recorded
column. Per step the recorder only copies: on a CPU, straight into the current chunk's host buffers (the copy is
also the snapshot an in-place processor cannot disturb); on CUDA, with ``non_blocking`` copies into pinned
staging buffers (a :class:`~tracker.recording.buffers.PinnedRing` slot), recording a CUDA event, with no synchronisation.
A staging chunk is drained into host memory only when the ring has no free slot or someone reads, by which time
its copies have long finished. Nothing turns into Arrow until it is read. The common CPU float32 step takes a
shorter path with the same result (:mod:`tracker.recording.hot_path`).

Past ``memory_limit`` bytes of host chunks, the oldest complete chunks go to disk (:mod:`tracker.recording.spill_handoff`:
Arrow IPC files, each written once by a background writer with a bounded queue), read back through a memory map.

Every stage's row also gets its statistics (:mod:`tracker.recording.record_stats`) on its device when written, and the
chosen token's logit, probability and rank when that token arrives: until then the recorder keeps rows nobody
can write into (the stored copy where exact and on their device, ``owned`` rows, else a device copy per stage).
Those few values are copied like the rest, no sync. CPU float32 rows (``statistics="auto"``) get them off the
decode thread as each chunk is sealed (:mod:`tracker.recording.chunk_stats`); CPU float16, bfloat16 and top-k
rows are staged as float32 and stored, statistics and all, off it (:mod:`tracker.recording.deferred`).

Storage (:mod:`tracker.recording.storage`): the whole row as float32, or as float16 or bfloat16 minus its largest
logit (converted on the device before the copy), the top ``k`` values with their ids (selected on the
device), or ``"auto"``: the fullest that keeps 500 steps of the batch within the memory bound.
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
from tracker.recording.buffers import SHARED_POOL, BufferPool
from tracker.recording.chunk_memory import IN_FLIGHT, ChunkMemory, Layout, chunk_rows
from tracker.recording.chunk_stats import ChunkStats
from tracker.recording.chunks import Chunk, CudaStaging, StepRows, conform, to_batch
from tracker.recording.deferred import DeferredRows, store_stage
from tracker.recording.hot_path import PlainSteps
from tracker.recording.record_stats import chosen_stats, eos_on
from tracker.recording.spill_handoff import Describe, SpillHandoff, SpillWarning
from tracker.recording.storage import STATISTICS, Storage, stats_when_recorded

__all__ = ["Storage", "StepRows", "Recorder", "SpillWarning"]


class Recorder(PlainSteps):
    """Rows of logits from any device into Arrow record batches.

    Args:
        storage: how each stage's row is kept (:class:`Storage`).
        stages: the stages recorded, in order (more can be added later).
        chunk_bytes: target size of one chunk of rows, at most ``memory_limit / (spill_queue + 4)``
            (:func:`~tracker.recording.chunk_memory.chunk_rows`); a chunk always holds at least one step of the batch.
        memory_limit: bytes of host chunks kept in memory (chunks on their way to disk, and a spare one for the
            next, included); past it, complete chunks spill to Arrow IPC files, written once each by a background
            writer. ``None`` never spills.
        spill_dir: folder for spilled chunks (a subfolder per run is made); by default a temporary folder removed
            with the recorder (or, if the process dies, by the next process that records).
        ring_slots: pinned staging chunks per CUDA device.
        pool: where host buffers come from and go back to (default: the process-wide
            :data:`~tracker.recording.buffers.SHARED_POOL`).
        spill_queue: chunks that may wait for the writer before recording waits for the disk.

    Attributes:
        eos_token_ids: end-of-sequence ids, for the ``p_eos`` statistic.
        spilled_bytes: bytes of spilled chunks on disk.
        chunk_writes: chunk files written (each spilled chunk once).
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
        pool: BufferPool | None = None,
        spill_queue: int = 2,
        statistics: str = "auto",
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if memory_limit is not None and memory_limit < 0:
            raise ValueError(f"memory_limit must be >= 0 bytes or None, got {memory_limit}")
        if ring_slots < 2:
            raise ValueError(f"ring_slots must be >= 2 (one filling, one draining), got {ring_slots}")
        if statistics not in STATISTICS:
            raise ValueError(f"statistics must be one of {STATISTICS}, got {statistics!r}")
        self.statistics = statistics
        self.record_stats = statistics == "record"  # decided at the first step (see stats_when_recorded)
        self.background_stats = False  # CPU float32 rows by default: statistics computed off the decode thread
        self.deferred = False  # CPU low-precision and top-k rows: stored off the decode thread
        self.requested = storage  # "auto" is resolved at the first step (and again after clear())
        self.storage = storage
        self.stages: list[str] = list(stages)
        self.chunk_bytes = int(chunk_bytes)
        self.memory_limit = memory_limit
        self.run_id = run_id
        self.vocab_size: int | None = None
        self.version = 0
        self.describe: Describe | None = None
        self.eos_token_ids: list[int] = []
        self._pool = SHARED_POOL if pool is None else pool
        self._memory = ChunkMemory(self._pool, ring_slots)
        self._chunks: list[Chunk] = []
        self._active: Chunk | None = None
        self._ended: set[int] = set()
        self._lock = threading.RLock()
        self._handoff = SpillHandoff(Path(spill_dir) if spill_dir is not None else None, spill_queue)
        self._spill_queue = int(spill_queue)
        self._steps = 0
        self._next_index = 0
        self._arange = np.arange(64, dtype=np.int32)
        self._eos: dict[Any, torch.Tensor] = {}
        self._retained: StepRows | None = None  # the last step, its rows and statistics until its tokens come
        self._retained_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stats = ChunkStats(self._lock)
        self._deferred = DeferredRows(self._pool)

    # ---------------------------------------------------------------- state

    @staticmethod
    def staging_for(device: torch.device) -> CudaStaging | None:
        """The staging used for rows on ``device``: pinned and asynchronous on CUDA, none (direct copies) on CPU."""
        return CudaStaging() if device.type == "cuda" else None

    @property
    def host_bytes(self) -> int:
        """Bytes of host chunks held in memory (chunks on their way to disk included, spilled ones not)."""
        return sum(c.nbytes for c in self._chunks)

    @property
    def chunks_spilled(self) -> int:
        """Chunks whose rows are on disk."""
        return sum(c.spilled is not None for c in self._chunks)

    rows = property(lambda self: sum(c.n for c in self._chunks), doc="Rows recorded.")

    @property
    def spill_path(self) -> Path | None:
        """The folder holding this run's spilled chunks, once something spilled."""
        return self._handoff.folder

    spilled_bytes = property(lambda self: self._handoff.spilled_bytes, doc="Bytes of spilled chunks on disk.")
    chunk_writes = property(lambda self: self._handoff.chunk_writes, doc="Chunk files written (each spilled once).")

    def add_stage(self, stage: str) -> None:
        """Record one more stage from the next step on (earlier rows hold nulls for it)."""
        with self._lock:
            if stage in self.stages:
                return
            self.stages.append(stage)
            self._seal_active()
            self.version += 1

    def schema(self) -> pa.Schema:
        """The Arrow schema of the recorded rows (statistics included; no run metadata, no ``_nonfinite`` flags)."""
        vocab = self.vocab_size or 0
        k = self.storage.k_for(vocab) if vocab else 0
        stats = self.record_stats or self.background_stats or not self.storage.full
        return run_schema(self.storage_kind, self.stages, vocab, k, flags=False, stats=stats)

    @property
    def storage_kind(self) -> str:
        """The storage mode rows are kept in (before the first step ``"auto"`` is undecided: no row holds
        values yet, and an empty run describes itself as ``"float32"``)."""
        return "float32" if self.storage.kind == "auto" else self.storage.kind

    # ---------------------------------------------------------------- writing

    def begin_step(self, generation: int, step: int, batch: int, vocab_size: int, device: torch.device) -> StepRows:
        """Reserve ``batch`` rows for a step; their values come with :meth:`write`.

        Runs every step; reads no device value. When a chunk fills it may wait: for the oldest staging chunk's
        copies when every pinned slot is in flight (an event recorded chunks ago, long finished), and for the
        spill writer when its queue is full. Raises, once, the disk's refusal of a chunk (:meth:`raise_failure`),
        the step's rows unreserved. (The common CPU case takes :meth:`plain_step` instead.)
        """
        with self._lock:
            if self.vocab_size is None:
                self.vocab_size = int(vocab_size)
                self.storage = self.requested.resolve(self.stages, self.vocab_size, batch, self.memory_limit)
                self.record_stats = stats_when_recorded(self.statistics, self.storage, torch.device(device))
                self.background_stats = not self.record_stats and self.statistics == "auto"
                cpu = torch.device(device).type == "cpu"
                self.deferred = cpu and self.storage.kind != "float32" and self.statistics != "record"
                self._deferred.configure(self.memory_limit)
            elif vocab_size != self.vocab_size:
                raise ValueError(
                    f"logits: vocabulary size changed from {self.vocab_size} to {vocab_size} "
                    f"(generation {generation}, step {step}); a run holds one vocabulary size. "
                    "Call clear() before tracking a model with another vocabulary."
                )
            self._retained, self._retained_rows = None, {}
            self._deferred.next_step()
            chunk = self._active
            if chunk is None or chunk.capacity - chunk.n < batch or chunk.device != device:
                device = torch.device(device)
                if chunk is None or chunk.capacity - chunk.n < batch or chunk.device != device:
                    self._seal_active()
                    chunk = self._active = self._new_chunk(batch, device)
            handoff = self._handoff
            if handoff.pending or handoff.failure is not None:
                self.raise_failure()  # the disk refused a chunk (now or since the last step): said once
            return self._reserve(chunk, generation, step, batch)

    def write(
        self, rows: StepRows, stage: str, values: torch.Tensor, natural: torch.Tensor | None = None, owned: bool = False
    ) -> None:
        """Record ``values [count, V]`` as ``stage`` for the reserved rows, with their statistics.

        ``natural`` (the rows before the processor, unmodified; by default this step's) supplies the natural
        logits at the stage's top-k ids and the removed mass and margin. ``owned``: nobody else holds ``values``.
        Runs every step and stage. Kernels and ``non_blocking`` copies only: does not synchronise.
        """
        with self._lock:
            if not self.plain_write(rows, stage, values, natural):  # float32 rows kept or staged: a memcpy
                self._write(rows, stage, values, natural, owned)

    def _write(
        self, rows: StepRows, stage: str, values: torch.Tensor, natural: torch.Tensor | None, owned: bool
    ) -> None:
        chunk = rows.chunk
        written = chunk.written.get(stage)
        if written is None:
            return  # the stage was added after this chunk began; later chunks carry it
        chunk.check_writable("write")
        if (shape := tuple(values.shape)) != (rows.count, self.vocab_size):
            raise ValueError(f"{stage} values must have shape {(rows.count, self.vocab_size)}, got {tuple(shape)}")
        staging, start, end = chunk.host is None, rows.start, rows.end
        with_stats = self.record_stats and f"{stage}:stats" in chunk.buffers
        eos = eos_on(self._eos, self.eos_token_ids, self.vocab_size or 0, values.device) if with_stats else None
        retained_natural = self._retained is rows and "natural" in self._retained_rows
        vocab = self.vocab_size or 0
        if self.deferred and (natural is not None or not retained_natural):
            if self._deferred.stage(rows, stage, values, natural, eos, self.storage, vocab):
                written[start:end] = True
                chunk.version += 1
                self.version += 1
                return
        if self.deferred:
            self._deferred.supersede(rows, stage)  # this write stands, not an earlier staged one
        if stage != "natural" and natural is None and retained_natural:
            natural = self._retained_rows["natural"][0]
        nat = None if natural is None or stage == "natural" else natural.detach()
        kept = store_stage(chunk, stage, start, end, values, nat, eos, self.storage, vocab, with_stats, owned)
        if kept is not None:
            if self._retained is not rows:
                self._retained, self._retained_rows = rows, {}
            self._retained_rows[stage] = kept
        if staging:
            chunk.note_stream()
        written[start:end] = True
        chunk.version += 1
        self.version += 1

    def mark_error(self, rows: StepRows) -> None:
        """Flag the rows: the wrapped processor failed at this step (host flags only; no synchronisation)."""
        with self._lock:
            rows.chunk.processor_error[rows.start : rows.end] = True
            rows.chunk.version += 1
            self.version += 1

    def set_chosen(self, rows: StepRows, tokens: torch.Tensor | Sequence[int]) -> None:
        """Record the tokens chosen for the reserved rows (a tensor on any device, or ints).

        While the step's rows are still held (the chosen tokens come before the next step), each stage's
        chosen-token logit, probability and rank are computed on the rows' device. Runs every step; kernels and
        ``non_blocking`` copies only: does not synchronise with the device.
        """
        with self._lock:
            self._set_chosen(rows, tokens)

    def _set_chosen(self, rows: StepRows, tokens: torch.Tensor | Sequence[int]) -> None:
        chunk = rows.chunk
        if chunk.on_disk and self._handoff.pending:
            self._collect()  # a chunk the writer could not write is back in memory, writable again
        chunk.check_writable("set_chosen")
        if isinstance(tokens, torch.Tensor):
            src = tokens.detach().reshape(-1)
        else:
            src = torch.as_tensor(list(tokens), dtype=torch.int64)
        if src.numel() != rows.count:
            raise ValueError(f"chosen tokens must be one per row ({rows.count}), got {src.numel()}")
        start, end = rows.start, rows.end
        staging = chunk.host is None and src.device == chunk.device
        if src.device.type == "cpu" and not staging:
            np.copyto(chunk.arrays["chosen"][start:end], src.numpy(), casting="unsafe")
        else:
            chunk.buffers["chosen"][start:end].copy_(src.to(torch.int64), non_blocking=staging)
        if self.deferred:
            self._deferred.chosen(rows, src)
        if self._retained is rows:
            staging = chunk.host is None
            for stage, (values, stats) in self._retained_rows.items():
                tokens_here = src if src.device == values.device else src.to(values.device, non_blocking=True)
                found = chosen_stats(values, tokens_here, stats)
                chunk.buffers[f"{stage}:cstats"][start:end].copy_(found, non_blocking=staging)
                chunk.chosen_known[stage][start:end] = True
        if staging:
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
        """Every row so far as record batches (see :meth:`read`)."""
        return self.read()[0]

    def read(self) -> tuple[list[pa.RecordBatch], list[dict[str, np.ndarray]]]:
        """``(batches, maxima)``: every row so far as record batches, and per batch the group maxima of each
        stage whose rows all have them (read-only views; see :mod:`tracker.recording.chunk_stats`).

        Drains CUDA staging (synchronises once). Spilled chunks are memory-mapped files (no maxima); chunks on
        their way to disk are read from memory. Waits first (outside the lock) for queued background statistics.
        """
        self._stats.wait()  # no row's statistics computed twice; the rest are computed below
        with self._lock:
            self._deferred.complete()  # rows still in float32 staging: stored here
            self._drain_staging(everything=True)
            self._collect()
            schema = self.schema()
            chunks = [chunk for chunk in self._chunks if chunk.n]
            return [self._batch_of(chunk, schema) for chunk in chunks], [self._maxima_of(chunk) for chunk in chunks]

    def flush(self) -> None:
        """Wait until sealed chunks' statistics are computed, staged rows stored, and chunks queued for the disk
        written and mapped."""
        self._stats.wait()
        with self._lock:
            self._deferred.complete()
            self._handoff.flush()
            self._collect()

    def clear(self) -> None:
        """Forget every row, delete spill files, keep buffers for reuse."""
        with self._lock:
            self._handoff.reset()
            self._deferred.forget()  # before the chunks' buffers go back
            for chunk in self._chunks:
                self._memory.release(chunk)
            self._chunks.clear()
            self._active = None
            self._ended.clear()
            self._stats.forget()
            self._retained, self._retained_rows = None, {}
            self.vocab_size = None
            self.storage = self.requested
            self._steps = 0
            self.version += 1

    # ---------------------------------------------------------------- internals

    def _layout(self, capacity: int) -> Layout:
        vocab = self.vocab_size or 0
        layout: Layout = {"chosen": ((capacity,), torch.int64)}
        for stage in self.stages:
            stats = self.record_stats or self.background_stats
            for name, (shape, dtype) in self.storage.layout(stage, vocab, stats, stats).items():
                layout[name] = ((capacity, *shape), dtype)
        return layout

    def _capacity(self, batch: int) -> int:
        stats = self.record_stats or self.background_stats
        per_row = self.storage.row_bytes(self.stages, self.vocab_size or 0, stats, stats)
        return chunk_rows(batch, per_row, self.chunk_bytes, self.memory_limit, self._spill_queue)

    def _new_chunk(self, batch: int, device: torch.device) -> Chunk:
        index = self._next_index
        self._next_index += 1
        transfer = self.staging_for(device)
        if transfer is not None:
            capacity = self._memory.staged_capacity(device, self._capacity(batch))
            slot, key = self._memory.slot(
                device, capacity, self._layout(capacity), transfer, lambda: self._drain_staging(everything=False)
            )
            chunk = Chunk(index, capacity, self.stages, slot, None, device, transfer)
            chunk.ring_key = key
        else:
            capacity = self._capacity(batch)
            layout = self._layout(capacity)
            tensors, host = self._memory.host(layout)
            chunk = Chunk(index, capacity, self.stages, tensors, host, device)
            room = self.memory_limit is None or self.host_bytes + 2 * chunk.nbytes <= self.memory_limit
            if room and not any(c.on_disk for c in self._chunks):  # once spilling, written chunks are the spares
                self._memory.prepare(layout)  # the next chunk's pages, touched off this thread
        self._chunks.append(chunk)
        return chunk

    def _seal_active(self) -> None:
        """The active chunk takes no more rows (its statistics go to the background thread, where computed
        there); spill old chunks if over the memory bound."""
        if self._active is not None and self.background_stats:
            self._stats.submit(self._active, self.stages, self.eos_token_ids)
        self._active = None
        self._enforce_bound()

    def _drain_staging(self, everything: bool) -> bool:
        """Move staging chunks into host memory: the oldest one, or all of them. True if any moved."""
        drained = False
        for chunk in self._chunks:
            if not chunk.staging:
                continue
            if chunk is self._active:
                if not everything:
                    continue
                self._active = None
            self._memory.to_host(chunk)
            drained = True
            if not everything:
                break
        self._enforce_bound()
        return drained

    def _enforce_bound(self) -> None:
        """Queue the oldest complete chunks for the disk while host memory is over the bound.

        Each chunk is queued once, so the work is linear in the run's length. Chunks on their way
        stay in memory until written, and the buffers of one written chunk wait for the next
        chunk: the rows kept are the bound less room for those, so everything resident stays within it.
        """
        self._collect()
        if self.memory_limit is None:
            return
        sizes = [c.nbytes for c in self._chunks if c.nbytes]
        on_the_way = sum(c.nbytes for c in self._chunks if c.spilling)
        room = (sizes[-1] if sizes else 0) * (self._spill_queue + IN_FLIGHT)  # queued, and IN_FLIGHT's
        excess = self.host_bytes - on_the_way + room + self._deferred.nbytes - self.memory_limit
        for chunk in list(self._chunks):
            if excess <= 0:
                break
            if chunk is self._active or chunk.on_disk or chunk.host is None or not chunk.complete(self._ended):
                continue
            if self._handoff.stopped:
                break  # the disk refused a chunk: rows stay in memory (raise_failure says why)
            schema = self.schema()  # to disk; blocks only while the writer's queue is full
            if self.background_stats:
                self._stats.complete(chunk, self.stages, self.eos_token_ids)
            self._deferred.complete(chunk)
            batch = to_batch(chunk, schema, self.stages, self.storage, self.vocab_size or 0)
            if self._handoff.send(chunk, batch, schema, self.run_id, self.describe):
                excess -= chunk.nbytes

    def _collect(self) -> None:
        """Map the chunks the writer finished and give their buffers back."""
        for chunk in self._handoff.collect(lambda c: c in self._chunks, self.schema):
            self._memory.release(chunk, spare=chunk.nbytes)  # one chunk's buffers wait for the next chunk
            self._handoff.notice(
                self.storage, self.stages, self.vocab_size or 0, self.rows / max(1, self._steps), self.memory_limit or 0
            )

    def _maxima_of(self, chunk: Chunk) -> dict[str, np.ndarray]:
        """The group maxima of each stage of ``chunk`` whose written rows all have them (call after
        :meth:`_batch_of`, which computes what the background thread had not)."""
        if chunk.spilled is not None or chunk.host is None:
            return {}
        n, out = chunk.n, {}
        for stage, known in chunk.maxima_known.items():
            if f"{stage}:gmax" in chunk.arrays and known[:n].all():
                view = chunk.arrays[f"{stage}:gmax"][:n]
                view.flags.writeable = False
                out[stage] = view
        return out

    def _batch_of(self, chunk: Chunk, schema: pa.Schema) -> pa.RecordBatch:
        if chunk.spilled is not None:
            return conform(chunk.spilled, schema)
        key = (chunk.version, tuple(self.stages))
        if chunk.cached is not None and chunk.cached[:2] == key:
            return chunk.cached[2]
        if self.background_stats:
            self._stats.complete(chunk, self.stages, self.eos_token_ids)
        batch = to_batch(chunk, schema, self.stages, self.storage, self.vocab_size or 0)
        chunk.cached = (*key, batch)
        return batch
