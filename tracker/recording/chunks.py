"""Chunks: blocks of recorded rows in (pinned or host) buffers, and how they become Arrow record batches.

A :class:`Chunk` holds the rows of several steps, of any generations: the id columns in numpy, each recorded
column in a tensor of its own. :class:`StepRows` names the rows one step reserved. On CUDA a chunk's buffers
are first carved out of a pinned staging slot filled by ``non_blocking`` copies; :class:`CudaStaging` records
an event after them and waits for it only when the slot is needed or read. :func:`to_batch` turns a chunk's
rows (all, or some) into a record batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tracker.format.schema import STAT_COLUMNS, column_stages
from tracker.recording.memory import HostBuffer, HostPool, Layout, PinnedRing, carve, layout_bytes, ring_for
from tracker.recording.modes import Storage
from tracker.recording.record_stats import CHOSEN_STATS, ROW_STATS, chosen_stats, row_stats

__all__ = ["IN_FLIGHT", "Chunk", "ChunkMemory", "CudaStaging", "StepRows", "chunk_rows", "conform", "numpy_view"]
__all__ += ["fill_stats", "to_batch"]

#: Chunks in memory beside the rows kept and the spill queue's: the one filling, the one being written, one
#: written but not yet mapped back, and a spare whose buffers wait for the next chunk.
IN_FLIGHT = 4
_MAX_CHUNK_ROWS = 4096
_MIN_SHARE = 1 << 20  # below this a bound is kept only as well as chunks of one step allow


def chunk_rows(batch: int, row_bytes: int, chunk_bytes: int, memory_limit: int | None, spill_queue: int) -> int:
    """Rows per chunk: about ``chunk_bytes`` (at most ``memory_limit / (spill_queue + IN_FLIGHT)``, but not below
    1 MiB: past the bound that many chunks are in memory at once), in whole steps of ``batch`` rows."""
    target = chunk_bytes
    if memory_limit is not None:
        target = min(target, max(memory_limit // (spill_queue + IN_FLIGHT), _MIN_SHARE))
    rows = min(_MAX_CHUNK_ROWS, target // max(row_bytes, 1))
    return max(1, rows // batch) * batch


@dataclass(slots=True)
class StepRows:
    """The rows one step reserved: ``count`` consecutive rows of ``chunk`` from ``start``."""

    chunk: Chunk
    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count


class CudaStaging:
    """How rows leave a CUDA device: pinned slots, ``non_blocking`` copies, one event per stream.

    The recorder calls :meth:`empty` (a new slot), :meth:`mark` (after enqueuing copies) and :meth:`wait`
    (before reading a slot); tests put a host-memory stand-in in its place to run the same bookkeeping on a CPU.
    """

    def empty(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 host tensor of ``nbytes`` (once per slot; no synchronisation)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def mark(self, chunk: Chunk) -> None:
        """Record an event after the copies just enqueued on the current stream (no synchronisation)."""
        stream = torch.cuda.current_stream(chunk.device)
        event = chunk.events.get(stream.cuda_stream)
        if event is None:
            event = chunk.events[stream.cuda_stream] = torch.cuda.Event()
        event.record(stream)

    def wait(self, chunk: Chunk) -> None:
        """Block until the chunk's copies have landed: synchronises with those events, only when the chunk's
        slot is needed or its rows are read (never per step)."""
        for event in chunk.events.values():
            event.synchronize()


class Chunk:
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
        slot: torch.Tensor | None = None,
    ) -> None:
        self.index, self.capacity, self.n, self.device = index, capacity, 0, device
        self.transfer, self.slot = transfer, slot  # a pinned slot while staging
        self.generation = np.zeros(capacity, dtype=np.int32)
        self.sequence = np.zeros(capacity, dtype=np.int32)
        self.step = np.zeros(capacity, dtype=np.int32)
        self.processor_error = np.zeros(capacity, dtype=bool)
        self.chosen_set = np.zeros(capacity, dtype=bool)
        self.superseded = np.zeros(capacity, dtype=bool)  # recorded again later (its row of the step is the last)
        self.taken = np.zeros(capacity, dtype=bool)  # handed to their generation's part: no longer the recorder's
        self.written = {stage: np.zeros(capacity, dtype=bool) for stage in stages}
        self.stats_known = {stage: np.zeros(capacity, dtype=bool) for stage in stages}  # row statistics computed
        self.chosen_known = {stage: np.zeros(capacity, dtype=bool) for stage in stages}  # chosen statistics
        self.buffers = buffers
        self.arrays = {name: numpy_view(t) for name, t in buffers.items()}  # numpy views (pinned memory too)
        self.host = host  # None while the buffers are a pinned staging slot
        self.events: dict[int, Any] = {}
        self.spilled: pa.RecordBatch | None = None
        self.spilling = False  # queued for the spill writer, still in memory
        self.version = 0
        self.cached: tuple[int, tuple[str, ...], pa.RecordBatch] | None = None

    @property
    def staging(self) -> bool:
        return self.host is None and self.spilled is None and self.slot is not None

    @property
    def on_disk(self) -> bool:
        """Spilled, or on its way to disk: never spilled again, never written to again."""
        return self.spilled is not None or self.spilling

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.host) if self.host else 0

    def complete(self, ended: set[int]) -> bool:
        """Every row's chosen token is known (or will never be: superseded, or its generation is over)."""
        rows = slice(0, self.n)
        pending = ~(self.chosen_set[rows] | self.superseded[rows])
        return not pending.any() or bool(np.isin(self.generation[rows][pending], list(ended)).all())

    def check_writable(self, what: str) -> None:
        """Refuse to change rows that are on disk or on their way there."""
        if self.on_disk:
            raise RuntimeError(
                f"{what}: rows of generation {int(self.generation[0])} already spilled to disk; "
                "tell the tracker the chosen tokens before the next generation starts"
            )

    def note_stream(self) -> None:
        """After a step's copies into a staging slot: record an event (every step; no synchronisation)."""
        if self.transfer is not None and self.host is None:
            self.transfer.mark(self)

    def wait(self) -> None:
        """Block until a staging chunk's copies have landed (synchronises; only when its slot is needed again or
        its rows are read, never per step)."""
        if self.transfer is not None:
            self.transfer.wait(self)


class ChunkMemory:
    """Where one recorder's chunks get their buffers and give them back: host memory from a
    :class:`~tracker.recording.memory.HostPool` (one buffer a chunk, its columns carved out of it), pinned slots
    from the process's ring for the chunk's CUDA device. What the recorder still holds goes back to the pool
    when it is collected."""

    def __init__(self, pool: HostPool, ring_slots: int) -> None:
        self.pool, self.ring_slots = pool, ring_slots
        self.owned: list[HostBuffer] = []
        self.slots: list[tuple[PinnedRing, torch.Tensor, Chunk]] = []  # pinned slots of chunks still staging
        weakref.finalize(self, _give_back, pool, self.owned, self.slots)

    def host(self, layout: Layout) -> tuple[dict[str, torch.Tensor], HostBuffer]:
        buf = self.pool.take(layout_bytes(layout))
        self.owned.append(buf)
        with torch.inference_mode(False):  # ordinary tensors, written later whether in inference mode or not
            return carve(torch.from_numpy(buf.owner), layout), buf

    def chunk(
        self,
        index: int,
        capacity: int,
        stages: Sequence[str],
        layout: Layout,
        device: torch.device,
        transfer: CudaStaging | None,
        drain_one: Callable[[], bool],
    ) -> Chunk:
        """A new chunk: in host memory, or (with ``transfer``) in a pinned slot of the device's ring. When every
        slot is in flight, ``drain_one()`` moves the recorder's oldest staging chunk to host memory (its copies
        are long done); if none can move, a slot beyond the ring is made, let go when drained."""
        if transfer is None:
            tensors, buf = self.host(layout)
            return Chunk(index, capacity, stages, tensors, [buf], device)
        ring = ring_for(device, self.ring_slots, layout_bytes(layout))
        with torch.inference_mode(False):  # ordinary tensors, written later whether in inference mode or not
            slot = ring.take(transfer.empty)
            if slot is None and drain_one():
                slot = ring.take(transfer.empty)
            if slot is None:
                slot = transfer.empty(layout_bytes(layout))
            chunk = Chunk(index, capacity, stages, carve(slot, layout), None, device, transfer, slot)
        self.slots.append((ring, slot, chunk))
        return chunk

    def to_host(self, chunk: Chunk) -> None:
        """Move a staging chunk's rows into host memory and give its slot back. Synchronises with the chunk's
        copies (their events): only when a slot is needed again or the rows are read, never per step."""
        chunk.wait()
        tensors, buf = self.host({name: (tuple(t.shape), t.dtype) for name, t in chunk.buffers.items()})
        for name, tensor in tensors.items():
            tensor[: chunk.n].copy_(chunk.buffers[name][: chunk.n])
        self._give_slot(chunk.slot)
        chunk.slot, chunk.buffers, chunk.host = None, tensors, [buf]
        chunk.arrays = {name: numpy_view(t) for name, t in tensors.items()}
        chunk.events.clear()
        chunk.version += 1

    def release(self, chunk: Chunk) -> None:
        """Give a chunk's buffers back: host memory to the pool, a staging slot to its ring (after its copies)."""
        if chunk.staging:
            chunk.wait()
            self._give_slot(chunk.slot)
        for buf in chunk.host or ():
            self.owned.remove(buf)
            self.pool.give(buf)
        chunk.slot, chunk.buffers, chunk.arrays, chunk.host, chunk.cached = None, {}, {}, [], None
        chunk.events.clear()

    def _give_slot(self, slot: torch.Tensor) -> None:
        for i, (ring, held, _) in enumerate(self.slots):
            if held is slot:
                del self.slots[i]
                ring.give(slot)
                return


def fill_stats(chunk: Chunk, stages: Sequence[str], eos: torch.Tensor | None) -> bool:
    """Compute the statistics its float32 host rows lack (written without them: statistics when read), for all
    of them at once: each stage's row statistics (against the natural row of the same step for the removed mass
    and margin), and the chosen token's where it is known (in top-k rows, where it is among the kept tokens).
    True if anything was computed. Host arrays only."""
    n, changed = chunk.n, False
    if chunk.host is None or chunk.buffers["natural:logits"].dtype != torch.float32:
        return False
    for stage in stages:
        written = chunk.written.get(stage)
        if written is None:
            continue
        values = chunk.buffers[f"{stage}:logits"]
        todo = _rows(written[:n] & ~chunk.stats_known[stage][:n])
        if todo is not None:
            natural = None if stage == "natural" else chunk.buffers["natural:logits"][todo]
            chunk.arrays[f"{stage}:stats"][todo] = row_stats(values[todo], eos, natural).numpy()
            chunk.stats_known[stage][todo] = changed = True
        todo = _rows(written[:n] & chunk.stats_known[stage][:n] & chunk.chosen_set[:n] & ~chunk.chosen_known[stage][:n])
        if todo is None:
            continue
        tokens, ids = chunk.buffers["chosen"][todo], chunk.buffers.get(f"{stage}:ids")
        if ids is not None:  # top-k rows: the chosen token's statistics where it is among the kept tokens
            todo = np.arange(n)[todo]
            hit = ids[todo] == tokens[:, None]
            kept = hit.any(dim=1).numpy()
            todo, tokens = todo[kept], hit[kept].int().argmax(dim=1)  # its place among the kept (the row's rank)
            if not todo.size:
                continue
        found = chosen_stats(values[todo], tokens, chunk.buffers[f"{stage}:stats"][todo])
        chunk.arrays[f"{stage}:cstats"][todo] = found.numpy()
        chunk.chosen_known[stage][todo] = changed = True
    if changed:
        chunk.version += 1
    return changed


def _give_back(pool: HostPool, owned: list[HostBuffer], slots: list[tuple[PinnedRing, torch.Tensor, Chunk]]) -> None:
    """A collected recorder's buffers back to the pool, and its staging slots to their rings once their copies have
    landed (waits for them). Takes no lock (a finalizer may run inside any code)."""
    pool.give_all(owned)
    for ring, slot, chunk in slots:
        chunk.wait()
        ring.give(slot)
    slots.clear()


def _rows(mask: np.ndarray) -> slice | np.ndarray | None:
    """The rows ``mask`` selects: a slice where they are consecutive (views, no copy of the rows), else their
    indices; None when there are none."""
    picked = np.flatnonzero(mask)
    if not picked.size:
        return None
    first, last = int(picked[0]), int(picked[-1])
    return slice(first, last + 1) if last - first + 1 == picked.size else picked


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
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


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a host tensor (bfloat16 as uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def to_batch(
    chunk: Chunk,
    schema: pa.Schema,
    stages: Sequence[str],
    storage: Storage,
    vocab: int,
    rows: np.ndarray | None = None,
) -> pa.RecordBatch:
    """The chunk's rows as a record batch (no ``_nonfinite`` flags): all of them, values zero-copy, or the rows
    ``rows`` (indices, in that order), copied. Id and statistics columns are always copied."""
    n = chunk.n
    pick = slice(0, n) if rows is None else rows
    count = n if rows is None else len(rows)

    def values(name: str) -> np.ndarray:
        view = numpy_view(chunk.buffers[name])
        return view[:n] if rows is None else view[rows]

    chosen = chunk.buffers["chosen"].numpy()[pick].copy()
    unknown = ~chunk.chosen_set[pick] | (chosen < 0)
    arrays: list[pa.Array] = [
        pa.array(chunk.generation[pick].copy()),
        pa.array(chunk.sequence[pick].copy()),
        pa.array(chunk.step[pick].copy()),
        pa.array(chosen, mask=unknown),
        pa.array(chunk.processor_error[pick].copy()),
    ]
    k = storage.k_for(vocab)
    owner = column_stages(schema.names, stages)
    for stage in stages:
        fields = [f for f in schema if owner.get(f.name) == stage]
        written = chunk.written.get(stage)
        if written is None:  # stage added after this chunk began
            arrays += [pa.nulls(count, f.type) for f in fields]
            continue
        written = written[pick]
        mask = None if written.all() else pa.array(~written)
        stats = values(f"{stage}:stats") if f"{stage}:stats" in chunk.buffers else None
        cstats = values(f"{stage}:cstats") if f"{stage}:cstats" in chunk.buffers else None
        no_choice = ~(chunk.chosen_known[stage][pick] & written)
        for field in fields:
            suffix = field.name[len(stage) + 1 :]
            if suffix == "logits" and storage.full:
                flat = pa.array(values(f"{stage}:logits").reshape(-1))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, vocab, mask=mask))
            elif suffix.startswith("topk_"):
                flat = pa.array(values(f"{stage}:{suffix[5:]}").reshape(-1))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, k, mask=mask))
            elif suffix in ROW_STATS and stats is not None:
                column = stats[:, ROW_STATS.index(suffix)]
                invalid = ~written | np.isnan(column)  # not recorded, or not defined (no EOS ids known)
                arrays.append(pa.array(np.where(invalid, 0, column).astype(_STAT_NUMPY[suffix]), mask=invalid))
            elif suffix in CHOSEN_STATS and cstats is not None:
                column = cstats[:, CHOSEN_STATS.index(suffix)]
                invalid = no_choice | np.isnan(column)
                arrays.append(pa.array(np.where(invalid, 0, column).astype(_STAT_NUMPY[suffix]), mask=invalid))
            else:
                raise AssertionError(f"no buffer for column {field.name}")
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_STAT_NUMPY = {name: (np.int32 if t == pa.int32() else np.float32) for name, t in STAT_COLUMNS.items()}
