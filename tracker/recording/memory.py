"""Host memory for recorded rows: buffers reused rather than freshly faulted in, pinned staging per device,
and the bound that the recorders of a tracker (or of a whole engine) share.

- :class:`HostPool`: host buffers by size. A buffer given back (a chunk spilled or written, ``clear()``, a
  recorder collected) is handed out again only once nothing views it (a table a user kept from an earlier
  read). Giving back takes no lock: buffers come back from garbage-collector finalizers, which may run inside
  any code, the pool's own included (a lock there deadlocked a test run).
- :class:`PinnedRing`: on CUDA, the pinned slots that ``non_blocking`` copies land in, one ring per device
  shared by every recorder of the process. A chunk's columns are carved out of one slot.
- :class:`MemoryBound`: the bytes of host chunks the recorders sharing it may hold; past it they spill.

Fresh buffers of 64 KiB or more are mapped with their pages populated in one system call, so that a chunk's
first rows do not fault pages in one by one on the decoding thread.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["HostBuffer", "HostPool", "MemoryBound", "PinnedRing", "SHARED_POOL", "carve", "trim_heap"]

_MAP_MIN = 64 << 10
_ALIGN = 64  # a column's offset within a buffer: any dtype's alignment, and a cache line


def _allocate(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh host memory as a uint8 array; from 64 KiB, an anonymous mapping whose pages are
    populated in the mapping call (Linux ``MAP_POPULATE``) instead of faulted in as they are first written."""
    flag = getattr(mmap, "MAP_POPULATE", None)
    if flag is not None and nbytes >= _MAP_MIN:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag)
        return np.frombuffer(mapping, dtype=np.uint8)
    return np.empty(nbytes, dtype=np.uint8)


@dataclass(eq=False)
class HostBuffer:
    """One block of host memory. ``owner`` is the array every view refers back to, so its reference count
    says whether a view (a tensor, a numpy array, an Arrow buffer) is still alive."""

    owner: np.ndarray
    nbytes: int

    def unviewed(self) -> bool:
        return sys.getrefcount(self.owner) <= 2  # this object's reference and getrefcount's argument


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def layout_bytes(layout: Layout) -> int:
    """Bytes :func:`carve` needs for ``layout`` (each column aligned to 64 bytes)."""
    total = 0
    for shape, dtype in layout.values():
        total += -(-max(1, math.prod(shape) * dtype.itemsize) // _ALIGN) * _ALIGN
    return total


def carve(memory: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Tensors for ``layout`` laid one after the other in the uint8 tensor ``memory`` (host or pinned)."""
    out, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        size = math.prod(shape) * dtype.itemsize
        out[name] = memory[offset : offset + size].view(dtype).view(shape)
        offset += -(-max(1, size) // _ALIGN) * _ALIGN
    return out


class HostPool:
    """Host buffers by size, reused once no view of them is alive (recorders share :data:`SHARED_POOL`).

    Attributes:
        allocated_bytes: bytes ever allocated (a measure of fresh memory touched).
        max_free_bytes: at most this many bytes are kept for reuse; older ones are let go.
    """

    def __init__(self, max_free_bytes: int = 1 << 30) -> None:
        self.max_free_bytes = max_free_bytes
        self.allocated_bytes = 0
        self._free: list[HostBuffer] = []
        self._returned: deque[HostBuffer] = deque()  # appended without a lock (atomic), sorted in by take()
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        """Bytes of buffers given back and not handed out again."""
        return sum(b.nbytes for b in list(self._free) + list(self._returned))

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of exactly ``nbytes``: an unviewed one from the pool, else a new one."""
        with self._lock:
            while self._returned:
                self._free.append(self._returned.popleft())
            for i, buf in enumerate(self._free):
                if buf.nbytes == nbytes and buf.unviewed():
                    return self._free.pop(i)
            self.allocated_bytes += nbytes
            total = sum(b.nbytes for b in self._free)
            while self._free and total > self.max_free_bytes:
                total -= self._free.pop(0).nbytes
        return HostBuffer(_allocate(nbytes), nbytes)

    def give(self, buf: HostBuffer) -> None:
        """Return a buffer (handed out again once nothing views it). Takes no lock: safe in a finalizer."""
        self._returned.append(buf)

    def give_all(self, bufs: list[HostBuffer]) -> None:
        """Return every buffer of ``bufs`` (a recorder's, when it is collected). Takes no lock."""
        self._returned.extend(bufs)
        bufs.clear()

    def clear(self) -> None:
        """Let go of every free buffer (their memory returns to the system once unviewed)."""
        with self._lock:
            self._returned.clear()
            self._free.clear()


#: The pool recorders use unless given their own.
SHARED_POOL = HostPool()


class MemoryBound:
    """The host bytes the chunks of the recorders sharing this bound may hold (``limit``; None: no bound).

    A tracker has one of its own (its ``memory_limit``); an engine's processor has one for every request it
    tracks, whatever their number. Recorders register themselves; :meth:`used` sums what they hold.
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"memory_limit must be a number of bytes >= 0 or None, got {limit!r}")
        self.limit = limit
        self._members: weakref.WeakSet[Any] = weakref.WeakSet()

    def join(self, recorder: Any) -> None:
        self._members.add(recorder)

    def used(self) -> int:
        """Bytes of host chunks the member recorders hold now (chunks on their way to disk included)."""
        return sum(r.host_bytes for r in list(self._members))


class PinnedRing:
    """Pinned staging slots of ``slot_bytes`` each for one CUDA device, at most ``slots`` of them made, reused
    round-robin; a recorder carves a chunk's columns out of a slot (:func:`carve`). Giving a slot back takes no
    lock (a collected recorder's slots come back from its finalizer)."""

    def __init__(self, slots: int = 3, slot_bytes: int = 32 << 20) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.free: list[torch.Tensor] = []
        self.made = 0
        self._returned: deque[torch.Tensor] = deque()
        self._lock = threading.Lock()

    def take(self, make: Any) -> torch.Tensor | None:
        """A free slot (made with ``make(slot_bytes)`` while fewer than ``slots`` exist), or None when every
        slot is in flight. Host bookkeeping only (no synchronisation)."""
        with self._lock:
            while self._returned:
                self.free.append(self._returned.popleft())
            if self.free:
                return self.free.pop()
            if self.made < self.slots:
                self.made += 1
                return make(self.slot_bytes)
        return None

    def give(self, slot: torch.Tensor) -> None:
        """Take a slot back (its copies have landed): one of this ring's; another (made beyond it) is let go."""
        if slot.numel() == self.slot_bytes:
            self._returned.append(slot)


_RINGS: dict[Any, PinnedRing] = {}
_RINGS_LOCK = threading.Lock()


def ring_for(device: torch.device, slots: int, slot_bytes: int) -> PinnedRing:
    """The process's ring for ``device`` (made on first use with ``slots`` slots of at least ``slot_bytes``;
    a later, larger need replaces it, the slots in flight of the old one let go as their chunks drain)."""
    with _RINGS_LOCK:
        ring = _RINGS.get(device)
        if ring is None or ring.slot_bytes < slot_bytes:
            ring = _RINGS[device] = PinnedRing(max(2, slots), slot_bytes)
        return ring


def pinned_bytes() -> dict[str, int]:
    """Pinned staging bytes this process holds, by device: one ring per device, whatever the number of tracked
    requests or recorders (what the GPU proof reports after tracking 64 rows)."""
    with _RINGS_LOCK:
        return {str(device): ring.made * ring.slot_bytes for device, ring in _RINGS.items()}


def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc (macOS, musl, Windows)
        return None


_MALLOC_TRIM = _malloc_trim() if sys.platform.startswith("linux") else None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there is none.

    A run that spills frees its chunks' Arrow objects while the step's temporaries keep being served from the
    heap, and glibc keeps the pages freed behind them: resident memory grew by about 0.3 MB a step at 50k tokens
    (470 MB over 1,500 steps) while the recorded rows stayed within the bound. The spill writer calls this
    every few MB written, off the recording thread.
    """
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
