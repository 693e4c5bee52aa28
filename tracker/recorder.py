"""Device to host: each step's rows into preallocated chunks, chunks into Arrow record batches.

A *chunk* is a block of rows (one per sequence and step) with one buffer per
recorded column. Per step the recorder only copies: on a CPU, straight into
the current chunk's host buffers (the copy is also the snapshot an in-place
processor cannot disturb); on CUDA, with ``non_blocking`` copies into pinned
staging buffers (a :class:`~tracker.buffers.PinnedRing` slot), recording a
CUDA event, with no synchronisation. A staging chunk is drained into host
memory only when the ring has no free slot or someone reads, by which time its
copies have long finished. Nothing turns into Arrow until it is read.

Past ``memory_limit`` bytes of host chunks, the oldest complete chunks spill
to Arrow IPC files (see :mod:`tracker.spill`), each written once by a
background writer with a bounded queue; once a chunk is on disk it is read
back through a memory map and its buffers are reused.

Every stage's row also gets its statistics (:mod:`tracker.compute`
``row_stats``: log-sum-exp, allowed count, maximum, entropy, NaN count, EOS
probability, removed mass and margin) computed on the row's device when it is
written, and the chosen token's logit, probability and rank when the chosen
token arrives: the step's device rows stay referenced until then (one step's
worth), and the few values per row are copied like the rest, without a sync.

Storage (:class:`Storage`): the whole row as float32, float16 or bfloat16
(converted on the device before the copy), or the top ``k`` values with their
ids (selected on the device), or ``"auto"``: the fullest of those that keeps
500 steps of the batch within the memory bound, decided at the first step.
"""

from __future__ import annotations

import shutil
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import torch

from tracker.buffers import SHARED_POOL, BufferPool, HostBuffer, PinnedRing
from tracker.compute import CHOSEN_STATS, ROW_STATS, chosen_stats, row_stats
from tracker.schema import META_VOCAB, STAT_COLUMNS, STORAGE_KINDS, run_schema
from tracker.spill import (
    RUN_JSON,
    VOCAB_FILE,
    SpillWriter,
    atomic_path,
    chunk_name,
    read_ipc,
    remove_stale_spill_folders,
    temporary_spill_folder,
    write_ipc,
)

__all__ = ["Storage", "StepRows", "Recorder", "SpillWarning"]


class SpillWarning(UserWarning):
    """A run outgrew its memory bound and spills to disk (said once per run)."""


_STALE_CHECKED = False

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: When rows get their statistics (entropy, chosen token's probability and rank, removed mass, margin, ...):
#: ``"record"``, as they are recorded (kernels on the rows' device, copied with them: cheap and asynchronous
#: on an accelerator; several passes over each row on a CPU); ``"read"``, computed from the stored rows when
#: a query needs them (full storage only); ``"auto"``: when recorded unless the rows are kept whole in float32
#: on a CPU (top-k, float16 and bfloat16 rows are not the full-precision row the statistics need; on an
#: accelerator recording them costs a few asynchronous kernels), else when read (exactly the same values).
STATISTICS = ("auto", "record", "read")
_MAX_CHUNK_ROWS = 4096
_MEMCPY = (torch.float32, torch.float16)
#: Steps of a batch that ``storage="auto"`` keeps within the memory bound.
AUTO_STEPS = 500


@dataclass(frozen=True)
class Storage:
    """How a stage's row is kept.

    Attributes:
        kind: ``"float32"``, ``"float16"``, ``"bfloat16"`` (the whole row) or
            ``"topk"`` (the ``top_k`` largest logits, their ids, the row's
            log-sum-exp and allowed count).
        top_k: values kept per row in top-k storage.
    """

    kind: str = "float32"
    top_k: int = 0

    @classmethod
    def parse(cls, storage: str, top_k: int = 20) -> "Storage":
        """A storage mode by name: one of :data:`STORAGE_KINDS`, or ``"auto"`` (see :meth:`resolve`)."""
        if storage not in STORAGE_KINDS and storage != "auto":
            raise ValueError(f"storage must be one of {STORAGE_KINDS} or 'auto', got {storage!r}")
        if storage in ("topk", "auto"):
            if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
                raise ValueError(f"top_k must be an int >= 1 for storage='topk', got {top_k!r}")
            return cls(storage, int(top_k))
        return cls(storage, 0)

    def resolve(self, stages: Sequence[str], vocab_size: int, batch: int, memory_limit: int | None) -> "Storage":
        """The mode ``"auto"`` stands for, decided at the first step: the fullest that keeps
        :data:`AUTO_STEPS` steps of the batch in ``memory_limit``.

        float32 when it fits (or when there is no bound, or a zero bound: the
        user chose to spill), else bfloat16, else top-k. At 128k tokens and
        the default 2 GiB bound: float32 up to batch 4, bfloat16 up to 8,
        top-k beyond (a batch of 64 in float32 would fill the bound in 32 steps).
        """
        if self.kind != "auto":
            return self
        if not memory_limit:
            return Storage("float32")
        for kind in ("float32", "bfloat16"):
            if Storage(kind).row_bytes(stages, vocab_size) * batch * AUTO_STEPS <= memory_limit:
                return Storage(kind)
        return Storage("topk", self.top_k)

    @property
    def full(self) -> bool:
        return self.kind != "topk"

    def k_for(self, vocab_size: int) -> int:
        """The number of values kept per row for a vocabulary (top_k, at most the vocabulary)."""
        return min(self.top_k, vocab_size) if not self.full else 0

    def layout(self, stage: str, vocab_size: int, stats: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Buffer name -> (shape of one row, dtype) for one stage (values, then the packed statistics, if ``stats``)."""
        if self.full:
            out = {f"{stage}:logits": ((vocab_size,), _TORCH_DTYPES[self.kind])}
        else:
            k = self.k_for(vocab_size)
            out = {f"{stage}:ids": ((k,), torch.int32), f"{stage}:logits": ((k,), torch.float32)}
            if stage != "natural":
                out[f"{stage}:natural"] = ((k,), torch.float32)
        if stats or not self.full:  # top-k rows cannot be summed up later: their statistics are always kept
            out[f"{stage}:stats"] = ((len(ROW_STATS),), torch.float32)
            out[f"{stage}:cstats"] = ((len(CHOSEN_STATS),), torch.float32)
        return out

    def row_bytes(self, stages: Sequence[str], vocab_size: int, stats: bool = True) -> int:
        """Bytes one row takes in host memory (and about as much on disk) for these stages."""
        total = 8  # chosen
        for stage in stages:
            for shape, dtype in self.layout(stage, vocab_size, stats).values():
                total += int(np.prod(shape, dtype=np.int64)) * torch.tensor([], dtype=dtype).element_size()
        return total


@dataclass(slots=True)
class StepRows:
    """The rows one step reserved: ``count`` consecutive rows of ``chunk`` from ``start``."""

    chunk: "_Chunk"
    start: int
    count: int
    generation: int
    step: int

    @property
    def end(self) -> int:
        return self.start + self.count


def summarise_topk(x: torch.Tensor, k: int, natural: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Top-k storage of rows ``x [B, V]`` on their device: the ``k`` largest logits and their ids.

    NaN entries are never selected (they count as ``-inf``). ``natural`` (the
    rows before the processor) gives the natural logits at the same ids, so a
    constrained top-k row still knows what the model wanted. No synchronisation.
    """
    x = x.float()
    x = x.masked_fill(torch.isnan(x), float("-inf"))
    values, ids = torch.topk(x, k, dim=1)
    out = {"ids": ids.to(torch.int32), "logits": values}
    if natural is not None:
        out["natural"] = natural.float().gather(1, ids)
    return out


class CudaStaging:
    """How rows leave a CUDA device: pinned slots, ``non_blocking`` copies, one event per stream.

    The recorder only calls :meth:`empty`, :meth:`mark` (after enqueuing
    copies) and :meth:`wait` (before reading a slot); tests put a
    host-memory stand-in in its place to exercise the same bookkeeping on CPU.
    """

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def mark(self, chunk: "_Chunk") -> None:
        """Record an event after the copies just enqueued on the current stream (no synchronisation)."""
        stream = torch.cuda.current_stream(chunk.device)
        event = chunk.events.get(stream.cuda_stream)
        if event is None:
            event = chunk.events[stream.cuda_stream] = torch.cuda.Event()
        event.record(stream)

    def wait(self, chunk: "_Chunk") -> None:
        """Block until the chunk's copies have landed (only when its slot is needed or read)."""
        for event in chunk.events.values():
            event.synchronize()


class _Chunk:
    """Rows of one block: id columns in numpy, recorded values in (pinned or host) tensors."""

    def __init__(
        self,
        index: int,
        capacity: int,
        stages: Sequence[str],
        buffers: dict[str, torch.Tensor],
        host: list[HostBuffer] | None,
        device: torch.device,
        transfer: CudaStaging | None = None,
    ) -> None:
        self.index = index
        self.transfer = transfer
        self.capacity = capacity
        self.n = 0
        self.device = device
        self.generation = np.zeros(capacity, dtype=np.int32)
        self.sequence = np.zeros(capacity, dtype=np.int32)
        self.step = np.zeros(capacity, dtype=np.int32)
        self.processor_error = np.zeros(capacity, dtype=bool)
        self.chosen_set = np.zeros(capacity, dtype=bool)
        self.written = {stage: np.zeros(capacity, dtype=bool) for stage in stages}
        self.chosen_known = {stage: np.zeros(capacity, dtype=bool) for stage in stages}  # chosen statistics
        self.buffers = buffers
        self.arrays = {name: _numpy(t) for name, t in buffers.items()}  # numpy views, for plain copies
        self.host = host  # None while the buffers are a pinned staging slot
        self.events: dict[int, Any] = {}
        self.spilled: pa.RecordBatch | None = None
        self.spilling = False  # queued for the spill writer, still in memory
        self.version = 0
        self.cached: tuple[int, tuple[str, ...], pa.RecordBatch] | None = None

    @property
    def staging(self) -> bool:
        return self.host is None and self.spilled is None

    @property
    def on_disk(self) -> bool:
        """Spilled, or on its way to disk: never spilled again."""
        return self.spilled is not None or self.spilling

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.host) if self.host else 0

    def complete(self, ended: set[int]) -> bool:
        """Every row's chosen token is known, or its generation is over."""
        rows = slice(0, self.n)
        pending = ~self.chosen_set[rows]
        return not pending.any() or bool(np.isin(self.generation[rows][pending], list(ended)).all())

    def note_stream(self) -> None:
        if self.transfer is not None:
            self.transfer.mark(self)

    def wait(self) -> None:
        if self.transfer is not None:
            self.transfer.wait(self)


class Recorder:
    """Rows of logits from any device into Arrow record batches.

    Args:
        storage: how each stage's row is kept (:class:`Storage`).
        stages: the stages recorded, in order (more can be added later).
        chunk_bytes: target size of one chunk of rows (a chunk always holds at
            least one step of the batch).
        memory_limit: bytes of host chunks kept in memory (chunks on their
            way to disk included); past it, complete chunks spill to Arrow IPC
            files, written once each by a background writer. ``None`` never
            spills.
        spill_dir: folder for spilled chunks (a subfolder per run is made);
            by default a temporary folder removed with the recorder (or, if
            the process dies, by the next process that records).
        ring_slots: pinned staging chunks per CUDA device.
        pool: where host buffers come from and go back to (default: the
            process-wide :data:`~tracker.buffers.SHARED_POOL`).
        spill_queue: chunks that may wait for the writer before recording
            waits for the disk.

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
        self.record_stats = statistics == "record"  # decided at the first step (see _decide_stats)
        self.requested = storage  # "auto" is resolved at the first step (and again after clear())
        self.storage = storage
        self.stages: list[str] = list(stages)
        self.chunk_bytes = int(chunk_bytes)
        self.memory_limit = memory_limit
        self.spill_root = Path(spill_dir) if spill_dir is not None else None
        self.run_id = run_id
        self.vocab_size: int | None = None
        self.version = 0
        self.describe: Callable[[], tuple[bytes, bytes]] | None = None
        self.eos_token_ids: list[int] = []
        self.spilled_bytes = 0
        self.chunk_writes = 0
        self._ring_slots = int(ring_slots)
        self._rings: dict[torch.device, PinnedRing] = {}
        self._pool = SHARED_POOL if pool is None else pool
        self._owned: list[HostBuffer] = []  # host buffers held by this recorder's chunks
        weakref.finalize(self, self._pool.give_all, self._owned)
        self._chunks: list[_Chunk] = []
        self._active: _Chunk | None = None
        self._ended: set[int] = set()
        self._lock = threading.RLock()
        self._spill_dir: Path | None = None
        self._spill_cleanup: Any = None
        self._writer = SpillWriter(spill_queue)
        self._landed: list[tuple[_Chunk, Path, int]] = []  # written by the writer, not yet mapped
        self._described_generation = -1
        self._noticed = False
        self._steps = 0
        self._next_index = 0
        self._arange = np.arange(64, dtype=np.int32)
        self._eos: dict[Any, torch.Tensor] = {}
        # The last step's device rows and statistics, until its chosen tokens come.
        self._retained: StepRows | None = None
        self._retained_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

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

    @property
    def rows(self) -> int:
        return sum(c.n for c in self._chunks)

    @property
    def spill_path(self) -> Path | None:
        """The folder holding this run's spilled chunks, once something spilled."""
        return self._spill_dir

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
        return run_schema(self.storage_kind, self.stages, vocab, k, flags=False, stats=self.record_stats or not self.storage.full)

    def _decide_stats(self, device: torch.device) -> bool:
        """Whether rows get their statistics when recorded (see :data:`STATISTICS`)."""
        if self.statistics != "auto":
            return self.statistics == "record"
        return self.storage.kind != "float32" or device.type != "cpu"

    @property
    def storage_kind(self) -> str:
        """The storage mode rows are kept in (before the first step ``"auto"`` is undecided: no row holds
        values yet, and an empty run describes itself as ``"float32"``)."""
        return "float32" if self.storage.kind == "auto" else self.storage.kind

    # ---------------------------------------------------------------- writing

    def begin_step(self, generation: int, step: int, batch: int, vocab_size: int, device: torch.device) -> StepRows:
        """Reserve ``batch`` rows for a step; their values come with :meth:`write`."""
        with self._lock:
            if self.vocab_size is None:
                self.vocab_size = int(vocab_size)
                self.storage = self.requested.resolve(self.stages, self.vocab_size, batch, self.memory_limit)
                self.record_stats = self._decide_stats(torch.device(device))
            elif vocab_size != self.vocab_size:
                raise ValueError(
                    f"logits: vocabulary size changed from {self.vocab_size} to {vocab_size} "
                    f"(generation {generation}, step {step}); a run holds one vocabulary size. "
                    "Call clear() before tracking a model with another vocabulary."
                )
            self._retained, self._retained_rows = None, {}
            self._steps += 1
            device = torch.device(device)
            chunk = self._active
            if chunk is None or chunk.capacity - chunk.n < batch or chunk.device != device:
                self._seal_active()
                chunk = self._active = self._new_chunk(batch, device)
            elif self._landed:
                self._collect()
            start = chunk.n
            end = start + batch
            chunk.n = end
            chunk.generation[start:end] = generation
            chunk.sequence[start:end] = self._row_ids(batch)
            chunk.step[start:end] = step
            chunk.processor_error[start:end] = False
            chunk.chosen_set[start:end] = False
            for flags in (*chunk.written.values(), *chunk.chosen_known.values()):
                flags[start:end] = False
            chunk.arrays["chosen"][start:end] = -1
            chunk.version += 1
            self.version += 1
            return StepRows(chunk, start, batch, generation, step)

    def _row_ids(self, batch: int) -> np.ndarray:
        ids = self._arange
        if ids.shape[0] < batch:
            ids = self._arange = np.arange(max(batch, 2 * ids.shape[0]), dtype=np.int32)
        return ids[:batch]

    def write(self, rows: StepRows, stage: str, values: torch.Tensor, natural: torch.Tensor | None = None) -> None:
        """Record ``values [count, V]`` as ``stage`` for the reserved rows, with their statistics.

        ``natural`` (the rows before the processor, unmodified) supplies the
        natural logits at the stage's top-k ids and the removed mass and
        margin; by default the natural rows written for this step are used.
        Kernels and ``non_blocking`` copies only: no synchronisation.
        """
        with self._lock:
            self._write(rows, stage, values, natural)

    def _eos_on(self, device: torch.device) -> torch.Tensor | None:
        if not self.eos_token_ids:
            return None
        key = (device, tuple(self.eos_token_ids), self.vocab_size)
        eos = self._eos.get(key)
        if eos is None:  # once per device (a host-to-device copy, never a read)
            ids = [i for i in self.eos_token_ids if 0 <= i < (self.vocab_size or 0)]
            eos = self._eos[key] = torch.tensor(ids, dtype=torch.int64).to(device)
        return eos

    def _write(self, rows: StepRows, stage: str, values: torch.Tensor, natural: torch.Tensor | None) -> None:
        chunk = rows.chunk
        written = chunk.written.get(stage)
        if written is None:
            return  # the stage was added after this chunk began; later chunks carry it
        self._check_writable(chunk, "write")
        shape = values.shape
        if len(shape) != 2 or shape[0] != rows.count or shape[1] != self.vocab_size:
            raise ValueError(f"{stage} values must have shape {(rows.count, self.vocab_size)}, got {tuple(shape)}")
        staging = chunk.host is None
        start, end = rows.start, rows.end
        src = values.detach()
        retained = self._retained_rows if self._retained is rows else {}
        if stage != "natural" and natural is None and "natural" in retained:
            natural = retained["natural"][0]
        if natural is not None:
            natural = natural.detach()
        if self.storage.full:
            name = f"{stage}:logits"
            dst = chunk.buffers[name]
            if not staging and src.dtype == dst.dtype and src.dtype in _MEMCPY and src.device.type == "cpu":
                # a plain memcpy: torch would split a long row across threads for no gain
                np.copyto(chunk.arrays[name][start:end], src.numpy())
            else:
                if staging and src.dtype != dst.dtype:
                    src = src.to(dst.dtype)  # convert on the device, copy the smaller row
                dst[start:end].copy_(src, non_blocking=staging)
            src = values.detach()
        else:
            k = self.storage.k_for(self.vocab_size or 0)
            summary = summarise_topk(src, k, None if stage == "natural" else natural)
            for name, tensor in summary.items():
                chunk.buffers[f"{stage}:{name}"][start:end].copy_(tensor, non_blocking=staging)
        if f"{stage}:stats" in chunk.buffers:
            stats = row_stats(src, self._eos_on(src.device), None if stage == "natural" else natural)
            chunk.buffers[f"{stage}:stats"][start:end].copy_(stats, non_blocking=staging)
            if self._retained is not rows:
                self._retained, self._retained_rows = rows, {}
            self._retained_rows[stage] = (src, stats)
            if natural is not None and stage != "natural" and "natural" in self._retained_rows:
                # an in-place processor changed the natural rows after they were written: keep its snapshot
                self._retained_rows["natural"] = (natural, self._retained_rows["natural"][1])
        if staging:
            chunk.note_stream()
        written[start:end] = True
        chunk.version += 1
        self.version += 1

    def mark_error(self, rows: StepRows) -> None:
        """Flag the rows: the wrapped processor failed at this step."""
        with self._lock:
            rows.chunk.processor_error[rows.start : rows.end] = True
            rows.chunk.version += 1
            self.version += 1

    def set_chosen(self, rows: StepRows, tokens: torch.Tensor | Sequence[int]) -> None:
        """Record the tokens chosen for the reserved rows (a tensor on any device, or ints).

        While the step's rows are still held (the chosen tokens come before
        the next step), each stage's chosen-token logit, probability and rank
        are computed on the rows' device and copied without a sync.
        """
        with self._lock:
            self._set_chosen(rows, tokens)

    def _set_chosen(self, rows: StepRows, tokens: torch.Tensor | Sequence[int]) -> None:
        chunk = rows.chunk
        self._check_writable(chunk, "set_chosen")
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

    def end_generation(self, generation: int) -> None:
        """No more chosen tokens will come for ``generation`` (its rows may spill)."""
        with self._lock:
            self._ended.add(generation)

    # ---------------------------------------------------------------- reading

    def batches(self) -> list[pa.RecordBatch]:
        """Every row so far as record batches (drains CUDA staging: synchronises once).

        Spilled chunks are memory-mapped files; chunks on their way to disk are
        read from memory.
        """
        with self._lock:
            self._drain_staging(everything=True)
            self._collect()
            schema = self.schema()
            return [self._batch_of(chunk, schema) for chunk in self._chunks if chunk.n]

    def flush(self) -> None:
        """Wait until every chunk queued for the disk is written and mapped back."""
        with self._lock:
            self._writer.flush()
            self._collect()

    def clear(self) -> None:
        """Forget every row, delete spill files, keep buffers for reuse."""
        with self._lock:
            self._writer.flush()
            self._landed.clear()
            for chunk in self._chunks:
                self._release(chunk)
            self._chunks.clear()
            self._active = None
            self._ended.clear()
            self._retained, self._retained_rows = None, {}
            self.vocab_size = None
            self.storage = self.requested
            self.spilled_bytes = 0
            self.chunk_writes = 0
            self._described_generation = -1
            self._noticed = False
            self._steps = 0
            self.version += 1
            if self._spill_dir is not None:
                shutil.rmtree(self._spill_dir, ignore_errors=True)
                self._spill_dir = None

    # ---------------------------------------------------------------- internals

    def _check_writable(self, chunk: _Chunk, what: str) -> None:
        if chunk.on_disk:
            raise RuntimeError(
                f"{what}: rows of generation {int(chunk.generation[0])} already spilled to disk; "
                "tell the tracker the chosen tokens before the next generation starts"
            )

    def _layout(self, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        vocab = self.vocab_size or 0
        layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"chosen": ((capacity,), torch.int64)}
        for stage in self.stages:
            for name, (shape, dtype) in self.storage.layout(stage, vocab, self.record_stats).items():
                layout[name] = ((capacity, *shape), dtype)
        return layout

    def _capacity(self, batch: int) -> int:
        per_row = self.storage.row_bytes(self.stages, self.vocab_size or 0, self.record_stats)
        rows = max(batch, min(_MAX_CHUNK_ROWS, self.chunk_bytes // max(per_row, 1)))
        return -(-rows // batch) * batch  # whole steps

    def _host_buffers(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        host: list[HostBuffer] = []
        tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in layout.items():
            nbytes = int(np.prod(shape, dtype=np.int64)) * torch.tensor([], dtype=dtype).element_size()
            buf = self._pool.take(max(nbytes, 1))
            host.append(buf)
            self._owned.append(buf)
            tensors[name] = buf.tensor(shape, dtype)
        return tensors, host

    def _new_chunk(self, batch: int, device: torch.device) -> _Chunk:
        index = self._next_index
        self._next_index += 1
        transfer = self.staging_for(device)
        if transfer is not None:
            ring = self._rings.get(device)
            capacity = self._capacity(batch)
            if ring is None or (ring.layout is not None and ring.layout[0] < capacity):
                ring = self._rings[device] = PinnedRing(self._ring_slots)
            capacity = max(capacity, ring.layout[0] if ring.layout is not None else 0)
            layout = self._layout(capacity)
            key = (capacity, tuple((k, v[0], str(v[1])) for k, v in layout.items()))

            def make() -> dict[str, torch.Tensor]:
                return {name: transfer.empty(shape, dtype) for name, (shape, dtype) in layout.items()}

            slot = ring.take(key, make)
            if slot is None:  # every slot is in flight: drain the oldest (its copies are long done)
                drained = self._drain_staging(everything=False)
                slot = ring.take(key, make) if drained else None
                slot = slot if slot is not None else make()
            chunk = _Chunk(index, capacity, self.stages, slot, None, device, transfer)
            chunk._ring_key = key  # type: ignore[attr-defined]
        else:
            capacity = self._capacity(batch)
            tensors, host = self._host_buffers(self._layout(capacity))
            chunk = _Chunk(index, capacity, self.stages, tensors, host, device)
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
            if not chunk.staging:
                continue
            if chunk is self._active:
                if not everything:
                    continue
                self._active = None
            chunk.wait()
            layout = {name: (tuple(t.shape), t.dtype) for name, t in chunk.buffers.items()}
            tensors, host = self._host_buffers(layout)
            for name, tensor in tensors.items():
                tensor[: chunk.n].copy_(chunk.buffers[name][: chunk.n])
            ring = self._rings[chunk.device]
            ring.give(chunk._ring_key, chunk.buffers)  # type: ignore[attr-defined]
            chunk.buffers, chunk.host = tensors, host
            chunk.arrays = {name: _numpy(t) for name, t in tensors.items()}
            chunk.events.clear()
            chunk.version += 1
            drained = True
            if not everything:
                break
        self._enforce_bound()
        return drained

    def _enforce_bound(self) -> None:
        """Queue the oldest complete chunks for the disk while host memory is over the bound.

        Each chunk is queued once (chunks on disk or on their way are never
        considered again), so the work is linear in the run's length.
        """
        self._collect()
        if self.memory_limit is None:
            return
        # Room for the chunk about to be filled too, so rows in memory stay within the bound plus one chunk.
        sizes = [c.nbytes for c in self._chunks if c.nbytes]
        excess = self.host_bytes + (sizes[-1] if sizes else 0) - self.memory_limit
        for chunk in list(self._chunks):
            if excess <= 0:
                break
            if chunk is self._active or chunk.on_disk or chunk.host is None or not chunk.complete(self._ended):
                continue
            excess -= chunk.nbytes
            self._spill(chunk)

    def _spill_folder(self) -> Path:
        if self._spill_dir is None:
            if self.spill_root is not None:
                self._spill_dir = self.spill_root / self.run_id
                self._spill_dir.mkdir(parents=True, exist_ok=True)
            else:
                global _STALE_CHECKED
                if not _STALE_CHECKED:
                    _STALE_CHECKED = True
                    remove_stale_spill_folders()
                self._spill_dir = temporary_spill_folder()
                self._spill_cleanup = weakref.finalize(self, shutil.rmtree, str(self._spill_dir), True)
        return self._spill_dir

    def _spill(self, chunk: _Chunk) -> None:
        """Hand a complete chunk to the background writer (blocks only while its queue is full)."""
        folder = self._spill_folder()
        schema = self.schema()
        batch = _to_batch(chunk, schema, self.stages, self.storage, self.vocab_size or 0)
        newest = int(chunk.generation[: chunk.n].max()) if chunk.n else -1
        if self.describe is not None and newest > self._described_generation:
            # once per generation reaching the disk: the metadata then names it (serialising a large
            # vocabulary for every chunk would cost more than the chunk)
            run_json, vocab = self.describe()
            if not (folder / VOCAB_FILE).exists():
                write_ipc(folder / VOCAB_FILE, [], pa.schema([], metadata={META_VOCAB: vocab}))
            with atomic_path(folder / RUN_JSON) as tmp:
                tmp.write_bytes(run_json)
            self._described_generation = newest
        path = folder / chunk_name(chunk.index)
        chunk.spilling = True
        landed = self._landed

        def done(nbytes: int, seconds: float) -> None:
            landed.append((chunk, path, nbytes))  # list.append is atomic; mapped by the recording thread

        self._writer.submit(path, batch, schema, done)

    def _collect(self) -> None:
        """Map the chunks the writer finished and give their buffers back."""
        while self._landed:
            chunk, path, nbytes = self._landed.pop(0)
            if chunk not in self._chunks:
                continue  # cleared meanwhile
            mapped = read_ipc(path).to_batches()
            chunk.spilled = mapped[0] if mapped else None
            chunk.spilling = False
            self.spilled_bytes += nbytes
            self.chunk_writes += 1
            self._release(chunk)
            if chunk.spilled is None:
                chunk.spilled = pa.RecordBatch.from_pylist([], schema=self.schema())
            self._notice()

    def _notice(self) -> None:
        """Say once that the run spills, how fast the disk takes it, and what would keep it in memory."""
        if self._noticed or self._writer.seconds <= 0:
            return
        self._noticed = True
        vocab = self.vocab_size or 0
        rows = max(1, self.rows)
        per_step = self.storage.row_bytes(self.stages, vocab) * rows / max(1, self._steps)
        rate = self._writer.bytes_written / self._writer.seconds
        fits = {
            kind: int((self.memory_limit or 0) // max(1, Storage.parse(kind).row_bytes(self.stages, vocab) * rows / max(1, self._steps)))
            for kind in ("float32", "bfloat16", "topk")
        }
        others = "; ".join(f"storage={k!r} keeps {v:,} steps" for k, v in fits.items() if k != self.storage.kind)
        warnings.warn(
            f"the tracker's rows outgrew memory_limit={self.memory_limit:,} bytes and spill to {self._spill_dir} "
            f"({per_step / 1e6:,.1f} MB per step in storage={self.storage.kind!r}; the disk took {rate / 1e6:,.0f} MB/s, "
            f"so recording goes at most {rate / max(per_step, 1):,.0f} steps/s while it spills). "
            f"In memory_limit: {others}. Pass storage='bfloat16' or storage='topk', or a larger memory_limit, "
            "to keep the run in memory.",
            SpillWarning,
            stacklevel=6,
        )

    def _release(self, chunk: _Chunk) -> None:
        """Give a chunk's buffers back: host buffers to the pool, a staging slot to its ring."""
        if chunk.staging:
            chunk.wait()
            self._rings[chunk.device].give(chunk._ring_key, chunk.buffers)  # type: ignore[attr-defined]
        for buf in chunk.host or ():
            self._owned.remove(buf)
            self._pool.give(buf)
        chunk.buffers = {}
        chunk.arrays = {}
        chunk.host = []
        chunk.cached = None
        chunk.events.clear()

    def _batch_of(self, chunk: _Chunk, schema: pa.Schema) -> pa.RecordBatch:
        if chunk.spilled is not None:
            return _conform(chunk.spilled, schema)
        key = (chunk.version, tuple(self.stages))
        if chunk.cached is not None and chunk.cached[:2] == key:
            return chunk.cached[2]
        batch = _to_batch(chunk, schema, self.stages, self.storage, self.vocab_size or 0)
        chunk.cached = (*key, batch)
        return batch


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with the columns of ``schema``: stages it lacks become nulls."""
    if batch.schema.names == schema.names:
        return batch
    columns = []
    for field in schema:
        if field.name in batch.schema.names:
            columns.append(batch.column(field.name))
        else:
            columns.append(pa.nulls(batch.num_rows, field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a host tensor (bfloat16 as uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def _to_batch(chunk: _Chunk, schema: pa.Schema, stages: Sequence[str], storage: Storage, vocab: int) -> pa.RecordBatch:
    """The chunk's rows as a record batch: values zero-copy, id and statistics columns copied (no ``_nonfinite`` flags)."""
    n = chunk.n
    chosen = chunk.buffers["chosen"][:n].numpy().copy()
    unknown = ~chunk.chosen_set[:n] | (chosen < 0)
    arrays: list[pa.Array] = [
        pa.array(chunk.generation[:n].copy()),
        pa.array(chunk.sequence[:n].copy()),
        pa.array(chunk.step[:n].copy()),
        pa.array(chosen, mask=unknown),
        pa.array(chunk.processor_error[:n].copy()),
    ]
    k = storage.k_for(vocab)
    for stage in stages:
        fields = [f for f in schema if f.name.startswith(f"{stage}_")]
        written = chunk.written.get(stage)
        if written is None:  # stage added after this chunk began
            arrays += [pa.nulls(n, f.type) for f in fields]
            continue
        written = written[:n]
        mask = None if written.all() else pa.array(~written)
        stats = chunk.buffers[f"{stage}:stats"][:n].numpy() if f"{stage}:stats" in chunk.buffers else None
        cstats = chunk.buffers[f"{stage}:cstats"][:n].numpy() if f"{stage}:cstats" in chunk.buffers else None
        no_choice = ~(chunk.chosen_known[stage][:n] & written)
        for field in fields:
            suffix = field.name[len(stage) + 1 :]
            if suffix == "logits" and storage.full:
                flat = pa.array(_numpy(chunk.buffers[f"{stage}:logits"][:n]).reshape(-1))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, vocab, mask=mask))
            elif suffix.startswith("topk_"):
                flat = pa.array(_numpy(chunk.buffers[f"{stage}:{suffix[5:]}"][:n]).reshape(-1))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, k, mask=mask))
            elif suffix in ROW_STATS and stats is not None:
                values = stats[:, ROW_STATS.index(suffix)]
                invalid = ~written | np.isnan(values)  # not recorded, or not defined (no EOS ids known)
                values = np.where(invalid, 0, values).astype(_STAT_NUMPY[suffix])
                arrays.append(pa.array(values, mask=invalid))
            elif suffix in CHOSEN_STATS and cstats is not None:
                values = cstats[:, CHOSEN_STATS.index(suffix)]
                invalid = no_choice | np.isnan(values)
                values = np.where(invalid, 0, values).astype(_STAT_NUMPY[suffix])
                arrays.append(pa.array(values, mask=invalid))
            else:
                raise AssertionError(f"no buffer for column {field.name}")
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_STAT_NUMPY = {name: (np.int32 if t == pa.int32() else np.float32) for name, t in STAT_COLUMNS.items()}
