"""Where a recorder's chunk buffers come from and go back to.

Host buffers come from a :class:`~tracker.recording.buffers.BufferPool` (memory touched
before, reused once nothing views it); on CUDA a chunk first lives in a
pinned staging slot of a :class:`~tracker.recording.buffers.PinnedRing` per device,
filled by ``non_blocking`` copies, and moves into host buffers when its slot
is needed or its rows are read (:meth:`ChunkMemory.to_host`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch

from tracker.recording.buffers import BufferPool, HostBuffer, PinnedRing
from tracker.recording.chunks import Chunk, CudaStaging, numpy_view

__all__ = ["ChunkMemory", "Layout", "IN_FLIGHT", "chunk_rows"]

#: Buffer name -> (shape, dtype) of a whole chunk's buffer.
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]

#: Chunks in memory beside the rows kept and the spill queue's: the one filling, the one being
#: written, one written but not yet mapped back, and a spare whose buffers wait for the next chunk.
IN_FLIGHT = 4

_MAX_CHUNK_ROWS = 4096
_MIN_SHARE = 1 << 20  # below this a bound is kept only as well as chunks of one step allow


def chunk_rows(batch: int, row_bytes: int, chunk_bytes: int, memory_limit: int | None, spill_queue: int) -> int:
    """Rows per chunk: about ``chunk_bytes``, in whole steps of ``batch`` rows (at least one step).

    Under a memory bound a chunk is also at most ``memory_limit / (spill_queue + IN_FLIGHT)`` bytes (but
    not less than 1 MiB): past the bound that many chunks are in memory while others go to disk, so
    larger chunks would hold the bound only in the recorder's count of rows kept, not in memory.
    """
    target = chunk_bytes
    if memory_limit is not None:
        target = min(target, max(memory_limit // (spill_queue + IN_FLIGHT), _MIN_SHARE))
    rows = min(_MAX_CHUNK_ROWS, target // max(row_bytes, 1))
    return max(1, rows // batch) * batch


class ChunkMemory:
    """The host buffers and pinned slots of one recorder's chunks.

    Args:
        pool: where host buffers come from; the buffers this recorder still
            holds go back to it when this object is collected.
        ring_slots: pinned staging slots per CUDA device.
    """

    def __init__(self, pool: BufferPool, ring_slots: int) -> None:
        self.pool = pool
        self.ring_slots = int(ring_slots)
        self._rings: dict[torch.device, PinnedRing] = {}
        self._owned: list[HostBuffer] = []  # host buffers held by the recorder's chunks
        self._given: weakref.WeakSet[HostBuffer] = weakref.WeakSet()  # given back, maybe idle in the pool
        self._preparing: Future[list[HostBuffer]] | None = None  # the next chunk's buffers, being touched
        weakref.finalize(self, pool.give_all, self._owned)

    def host(self, layout: Layout) -> tuple[dict[str, torch.Tensor], list[HostBuffer]]:
        """Host tensors for ``layout`` (from the pool), and the buffers under them.

        Waits for buffers :meth:`prepare` is still touching (they were asked
        for a chunk's worth of steps ago, so usually they are ready).
        """
        self._wait_prepared()
        host: list[HostBuffer] = []
        tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in layout.items():
            buf = self.pool.take(_nbytes(shape, dtype))
            self._given.discard(buf)
            host.append(buf)
            self._owned.append(buf)
            tensors[name] = buf.tensor(shape, dtype)
        return tensors, host

    def prepare(self, layout: Layout) -> None:
        """Have the pool hold buffers for one more chunk of ``layout``, their pages touched on a background
        thread, so that the next chunk's first writes do not fault pages in on the decode thread.

        Once per chunk, on the recording thread; does not wait. Sizes the pool
        already holds (a chunk given back after a spill or ``clear()``) are not
        made again, so a spilling run, whose written chunks come back as spares,
        holds no more than before. The buffers are idle spares of this
        recorder until taken (a later :meth:`release` may let them go).
        """
        self._wait_prepared()
        sizes = [_nbytes(shape, dtype) for shape, dtype in layout.values()]
        self._preparing = self.pool.prepare(sizes)

    def _wait_prepared(self) -> None:
        if self._preparing is not None:
            future, self._preparing = self._preparing, None
            for buf in future.result():
                self._given.add(buf)

    def staged_capacity(self, device: torch.device, capacity: int) -> int:
        """Rows a staging chunk on ``device`` holds: ``capacity``, or the ring's slots' if larger.

        A ring whose slots are smaller than ``capacity`` is replaced (its
        slots in flight are let go when their chunks drain).
        """
        ring = self._rings.get(device)
        if ring is None or (ring.layout is not None and ring.layout[0] < capacity):
            ring = self._rings[device] = PinnedRing(self.ring_slots)
        return max(capacity, ring.layout[0] if ring.layout is not None else 0)

    def slot(
        self, device: torch.device, capacity: int, layout: Layout, transfer: CudaStaging, drain_one: Callable[[], bool]
    ) -> tuple[dict[str, torch.Tensor], tuple]:
        """A pinned slot for ``layout`` and its ring key. When every slot is in flight, ``drain_one()``
        moves the oldest staging chunk to host memory (its copies are long done); if none can move,
        a slot beyond the ring is made."""
        ring = self._rings[device]
        key = (capacity, tuple((k, v[0], str(v[1])) for k, v in layout.items()))

        def make() -> dict[str, torch.Tensor]:
            return {name: transfer.empty(shape, dtype) for name, (shape, dtype) in layout.items()}

        slot = ring.take(key, make)
        if slot is None:
            slot = ring.take(key, make) if drain_one() else None
            slot = slot if slot is not None else make()
        return slot, key

    def to_host(self, chunk: Chunk) -> None:
        """Move a staging chunk's rows into host buffers and give its slot back.

        Synchronises with the chunk's copies (their events), so it runs only
        when every pinned slot is in flight or the rows are read, not per step.
        """
        chunk.wait()
        layout = {name: (tuple(t.shape), t.dtype) for name, t in chunk.buffers.items()}
        tensors, host = self.host(layout)
        for name, tensor in tensors.items():
            tensor[: chunk.n].copy_(chunk.buffers[name][: chunk.n])
        self._rings[chunk.device].give(chunk.ring_key, chunk.buffers)
        chunk.buffers, chunk.host = tensors, host
        chunk.arrays = {name: numpy_view(t) for name, t in tensors.items()}
        chunk.events.clear()
        chunk.version += 1

    def release(self, chunk: Chunk, spare: int | None = None) -> None:
        """Give a chunk's buffers back: host buffers to the pool, a staging slot to its ring (after waiting
        for its copies: a chunk still staging synchronises with its events).

        ``spare``: at most this many bytes of the buffers this recorder gave
        back stay idle (resident) in the pool for its next chunks; older ones
        are let go. A run that spills then holds its rows and one spare chunk,
        not every chunk written since its last new chunk. ``None`` keeps them
        all (for the next tracker, after ``clear()``).
        """
        if chunk.staging:
            chunk.wait()
            self._rings[chunk.device].give(chunk.ring_key, chunk.buffers)
        for buf in chunk.host or ():
            self._owned.remove(buf)
            self.pool.give(buf)
            self._given.add(buf)
        chunk.buffers = {}
        chunk.arrays = {}
        chunk.host = []
        chunk.cached = None
        chunk.events.clear()
        if spare is not None:
            self._wait_prepared()  # buffers still being touched count as spares too
            self._let_go(spare)

    def _let_go(self, spare: int) -> None:
        """Drop this recorder's oldest idle buffers from the pool until at most ``spare`` bytes stay."""
        with self.pool.lock:
            idle = [buf for buf in self.pool.free if buf in self._given]
            extra = sum(buf.nbytes for buf in idle) - spare
            for buf in idle:
                if extra <= 0:
                    break
                self.pool.free.remove(buf)
                self._given.discard(buf)
                extra -= buf.nbytes


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a buffer of ``shape`` and ``dtype`` (at least 1)."""
    return max(1, math.prod(shape) * dtype.itemsize)  # once per buffer and chunk: no torch or numpy call
