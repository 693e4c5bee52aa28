"""Host memory for recorded rows: large buffers, reused rather than freshly touched.

Writing logits into memory touched for the first time costs more than the
copy itself (page faults: see ``shared/reference/measured-here.md``), so the
recorder takes its chunk buffers from a :class:`BufferPool`:

- new buffers are mapped with all their pages populated in one system call,
  or, for a recorder's next chunk, touched ahead of time on a background
  thread (:meth:`BufferPool.prepare`), so that the decode thread finds them
  resident;
- buffers given back (after a spill, ``clear()``, or when a recorder is
  garbage-collected) are reused, by any recorder of the process, but only when
  nothing outside the pool still views them: a table a user kept from an
  earlier read keeps its buffer out of circulation, so it never changes under
  them;
- on CUDA, pinned (page-locked) staging buffers for non-blocking copies come
  from :class:`PinnedRing`, a fixed number of slots reused round-robin.

:func:`trim_heap` hands the C heap's free pages back to the system (glibc
only); a run that spills calls it as chunks reach the disk.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["HostBuffer", "BufferPool", "SHARED_POOL", "PinnedRing", "numpy_dtype_for", "trim_heap", "exiting"]

_MAP_MIN = 64 << 10  # smaller buffers (16 pages or fewer) come from the heap
_TOUCH_PIECE = 1 << 20  # pages touched per numpy call off the decode thread (see prefault)
_PAGE = 4096

_NUMPY_VIEW = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.int16,  # numpy has no bfloat16: same bits, viewed back in torch
    torch.int64: np.int64,
    torch.int32: np.int32,
}


def numpy_dtype_for(dtype: torch.dtype) -> type:
    """The numpy type whose bits match ``dtype`` (int16 for bfloat16)."""
    try:
        return _NUMPY_VIEW[dtype]
    except KeyError:
        raise ValueError(f"no host buffer type for {dtype}; supported: {sorted(map(str, _NUMPY_VIEW))}") from None


def _allocate(nbytes: int, populate: bool = True) -> np.ndarray:
    """``nbytes`` of fresh host memory as a uint8 array, its pages faulted in at once where possible.

    On Linux: an anonymous mapping with ``MAP_POPULATE`` on plain 4 KiB
    pages, one system call instead of a fault per page. Measured on this
    project's VMs (``benchmarks/bench_tracker.py`` history): first touch of
    such memory costs a steady ~0.35 ms per MB, where numpy's huge-page-advised
    memory cost 1-2 ms per MB the first time in a process and 0.04 ms per MB
    afterwards; the pool already takes care of "afterwards".

    ``populate=False``: the pages are left for :func:`prefault` (the mapping
    call with ``MAP_POPULATE`` holds the interpreter lock while the kernel
    faults every page in, so it is no use on a background thread).
    """
    flag = getattr(mmap, "MAP_POPULATE", None)
    if flag is not None and nbytes >= _MAP_MIN:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (flag if populate else 0)
        mapping = mmap.mmap(-1, nbytes, flags=flags)
        return np.frombuffer(mapping, dtype=np.uint8)
    return np.empty(nbytes, dtype=np.uint8)


def prefault(owner: np.ndarray) -> None:
    """Touch every page of ``owner`` (writes a zero byte per page), one 1 MiB piece per numpy call.

    Meant for a background thread: numpy releases the interpreter lock for
    the strided writes, and the pieces keep each page-table lock short, so a
    decode thread allocating meanwhile is not held up (measured: the median
    of a 20 us loop on the other thread did not move while 256 MiB were
    touched). It writes, so nothing may use the buffer until it is done
    (:func:`populate` has no such limit, where the kernel has it).
    """
    flat = owner.reshape(-1).view(np.uint8)
    for start in range(0, flat.shape[0], _TOUCH_PIECE):
        flat[start : start + _TOUCH_PIECE : _PAGE] = 0


def _libc_madvise() -> Any:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later: fault pages in writable without changing what they hold
_MADVISE = _libc_madvise() if sys.platform.startswith("linux") else None
_POPULATES: list[bool] = []  # whether this kernel takes MADV_POPULATE_WRITE (found on first use)


def populates() -> bool:
    """Whether :func:`populate` works here (Linux 5.14 or later, glibc or musl): checked once on a one-page map."""
    if not _POPULATES:
        ok = False
        if _MADVISE is not None and getattr(mmap, "MAP_ANONYMOUS", None) is not None:
            probe = mmap.mmap(-1, _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = np.frombuffer(probe, dtype=np.uint8)
            ok = _MADVISE(view.ctypes.data, _PAGE, _MADV_POPULATE_WRITE) == 0
            del view
            probe.close()
        _POPULATES.append(ok)
    return _POPULATES[0]


def populate(keep: object, address: int, nbytes: int) -> None:
    """Fault in the pages of ``nbytes`` at ``address`` (a mapping ``keep`` holds alive meanwhile), 1 MiB per call.

    ``MADV_POPULATE_WRITE`` changes no byte, so the buffer may be written
    meanwhile: a decode thread that reaches a page first faults it in itself,
    and otherwise finds it resident. ctypes releases the interpreter lock for
    each call. A failing call (memory pressure) leaves the rest to be faulted
    in when written.
    """
    for start in range(0, nbytes, _TOUCH_PIECE):
        if _MADVISE(address + start, min(_TOUCH_PIECE, nbytes - start), _MADV_POPULATE_WRITE) != 0:
            return


def _fresh(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh memory for the calling thread to use at once: where the kernel can populate a
    mapping while it is written (:func:`populate`), mapped now and populated on the background thread,
    else with every page populated in the mapping call (:func:`_allocate`)."""
    if nbytes < _MAP_MIN or not populates():
        return _allocate(nbytes)
    owner = _allocate(nbytes, populate=False)
    if isinstance(owner.base, memoryview):  # an anonymous mapping (the heap's arrays are faulted in as used)
        _preparer().submit(populate, owner.base, owner.ctypes.data, nbytes)
    return owner


def yield_to_decoding() -> None:
    """Lower the calling thread's scheduling priority to the lowest (Linux, where a thread has a priority of
    its own; elsewhere nothing): where the cores are busy, the decode thread and the model's threads run
    first. A background thread at the normal priority takes a core from a model's intra-op threads, and
    every parallel kernel of the step then waits at its barrier for the thread that lost its core."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


def background_thread(name: str, low_priority: bool = False) -> Callable[[], ThreadPoolExecutor]:
    """A getter of one process-wide background thread called ``name``, started on its first use; with
    ``low_priority``, at the lowest scheduling priority (:func:`yield_to_decoding`): for work nobody waits
    for while the model runs (a read that needs it does it on its own thread)."""
    started: list[ThreadPoolExecutor] = []
    lock = threading.Lock()

    def get() -> ThreadPoolExecutor:
        with lock:
            if not started:
                start = yield_to_decoding if low_priority else None
                started.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=start))
            return started[0]

    return get


_EXITING = threading.Event()


def exiting() -> bool:
    """Whether the interpreter is shutting down: background work still queued then is dropped, not done
    (nothing will read it), so that a script ending right after a long run does not wait for it."""
    return _EXITING.is_set()


try:  # called before the interpreter joins the worker threads (the private hook concurrent.futures uses)
    threading._register_atexit(_EXITING.set)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another interpreter, or already shutting down
    pass

#: The one background thread that touches buffers ahead of time.
_preparer = background_thread("logitscope-prefault")


def _malloc_trim() -> object:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc (macOS, musl, Windows)
        return None


_MALLOC_TRIM = _malloc_trim() if sys.platform.startswith("linux") else None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there is none.

    Why: glibc serves the step's temporaries (the host's and the processor's
    copies of the logits, 0.2-1 MB each) from its heap once one of that size
    was freed, and keeps the pages they leave free behind longer-lived small
    allocations (each chunk's id columns, each spilled chunk's Arrow objects),
    so a run that spilled 8 MiB chunks grew resident memory by about 0.3 MB
    per step at 50k tokens and batch 4 (470 MB over 1500 steps) while its
    rows stayed within the bound. Usually a few milliseconds (up to a few
    hundred on a large fragmented heap); the spill writer calls it, off the
    recording thread, which may wait for the heap's lock meanwhile.
    """
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


@dataclass(eq=False)
class HostBuffer:
    """One block of host memory; typed tensor views of it are made with :meth:`tensor`.

    ``owner`` is the array every view refers back to, so its reference count
    says whether any view (a torch tensor, a numpy array, an Arrow buffer) is
    still alive.
    """

    owner: np.ndarray
    nbytes: int

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A writable tensor over the start of this buffer."""
        np_type = numpy_dtype_for(dtype)
        count = math.prod(shape)
        itemsize = np.dtype(np_type).itemsize
        if count * itemsize > self.nbytes:
            raise ValueError(f"buffer of {self.nbytes} bytes cannot hold {shape} of {dtype}")
        view = self.owner[: count * itemsize].view(np_type).reshape(shape)
        out = torch.from_numpy(view)
        return out.view(dtype) if dtype == torch.bfloat16 else out

    def unreferenced(self) -> bool:
        """True when no view of this buffer is alive outside the pool."""
        # One reference from this object, one from getrefcount's argument.
        return sys.getrefcount(self.owner) <= 2


@dataclass
class BufferPool:
    """Host buffers by size, reused once no view of them is alive.

    Recorders share :data:`SHARED_POOL` by default, so a new tracker reuses
    the memory of trackers that were cleared or garbage-collected (first
    touch of fresh memory is the expensive part of recording) instead of
    faulting in fresh pages.

    Attributes:
        free: buffers given back, oldest first.
        allocated_bytes: bytes ever allocated (a measure of fresh memory touched).
        max_free_bytes: at most this many bytes are kept for reuse; older ones are let go.
    """

    free: list[HostBuffer] = field(default_factory=list)
    allocated_bytes: int = 0
    max_free_bytes: int = 1 << 30
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: buffers :meth:`prepare` is touching off the calling thread, by size, with the future that gives them
    coming: list[tuple[Future[list[HostBuffer]], list[int]]] = field(default_factory=list, repr=False)

    @property
    def free_bytes(self) -> int:
        return sum(b.nbytes for b in self.free)

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of exactly ``nbytes``: a reusable one from the pool, else a new one.

        When :meth:`prepare` is still touching a buffer of that size (asked for
        by any recorder, one since collected included), waits for it rather
        than making another: the shared background thread may be behind.
        """
        while True:
            with self.lock:
                for i, buf in enumerate(self.free):
                    if buf.nbytes == nbytes and buf.unreferenced():
                        return self.free.pop(i)
                self.coming = [(f, sizes) for f, sizes in self.coming if not f.done()]
                coming = next((f for f, sizes in self.coming if nbytes in sizes), None)
                if coming is None:
                    self.allocated_bytes += nbytes
                    break
            wait([coming])  # then look again: it gave its buffers to the pool (or failed)
        return HostBuffer(_fresh(nbytes), nbytes)

    def prepare(self, sizes: Sequence[int]) -> Future[list[HostBuffer]] | None:
        """Have buffers of ``sizes`` ready in the pool soon, touched off the calling thread.

        Sizes the pool already holds free (and unviewed) buffers of, or is
        still touching for an earlier call, are not made again. Where the kernel can populate a mapping while it is in
        use (:func:`populates`), the others are made at once and given to the
        pool, the large ones' pages faulted in on a background thread
        (:func:`populate`): a chunk that needs them before that is done takes
        them anyway and faults the rest in itself, never waiting (the small
        ones, from the heap, are touched here: 16 pages at most). Elsewhere
        they are mapped and touched on the background thread
        (:func:`prefault`), then given to the pool. Returns the future of the
        new buffers (None when none were needed): wait for it before
        :meth:`take`-ing those sizes, so they are not made twice. The decode
        thread calls this once per chunk; it does not wait.
        """
        with self.lock:  # buffers another prepare is still touching count too: take() waits for them
            have = Counter(b.nbytes for b in self.free if b.unreferenced())
            have.update(size for future, sizes in self.coming if not future.done() for size in sizes)
        need = []
        for size in sizes:
            if have[size] > 0:
                have[size] -= 1
            else:
                need.append(int(size))
        if not need:
            return None
        with self.lock:
            self.allocated_bytes += sum(need)  # counted when asked for, so a reader sees it at once
        mapped = populates()  # mapped buffers are usable at once, populated off this thread
        # where mapped buffers can be, small ones (heap memory, at most 16 pages) are made and touched here too:
        # queued behind the large buffers' population on the one background thread, a chunk that needed them
        # would wait for all of it
        ready = [HostBuffer(_fresh(size), size) for size in need if mapped]
        for buf in ready:
            if buf.nbytes < _MAP_MIN:
                prefault(buf.owner)
            self.give(buf)
        rest = [size for size in need if not mapped]  # touched before they are given
        if not rest:
            done: Future[list[HostBuffer]] = Future()
            done.set_result(ready)
            return done
        future = _preparer().submit(lambda: ready + self._make_touched(rest))
        with self.lock:
            self.coming.append((future, rest))
        return future

    def _make_touched(self, sizes: list[int]) -> list[HostBuffer]:
        bufs = []
        for size in sizes:
            owner = _allocate(size, populate=False)
            prefault(owner)
            bufs.append(HostBuffer(owner, size))
        for buf in bufs:
            self.give(buf)
        return bufs

    def give(self, buf: HostBuffer) -> None:
        """Return a buffer; it is handed out again only once nothing views it."""
        with self.lock:
            self.free.append(buf)
            total = self.free_bytes
            while self.free and total > self.max_free_bytes:
                total -= self.free.pop(0).nbytes

    def give_all(self, bufs: list[HostBuffer]) -> None:
        for buf in list(bufs):
            self.give(buf)
        bufs.clear()

    def clear(self) -> None:
        """Let go of every free buffer (their memory returns to the system once unviewed)."""
        with self.lock:
            self.free.clear()


#: The pool recorders use unless given their own.
SHARED_POOL = BufferPool()


@dataclass
class PinnedRing:
    """A fixed number of pinned staging slots, reused round-robin (CUDA only).

    A slot is a dict of pinned tensors laid out by the recorder; ``layout`` is
    a hashable description of that layout, and slots of an older layout are
    dropped when the layout changes (a new stage, a larger batch).
    """

    slots: int = 3
    layout: Any = None
    free: list[dict[str, torch.Tensor]] = field(default_factory=list)
    outstanding: int = 0

    def take(self, layout: Any, make: Any) -> dict[str, torch.Tensor] | None:
        """A free slot for ``layout`` (made with ``make()`` while under ``slots``), or None when all are busy.

        Once per chunk; host bookkeeping only (no synchronisation: the caller
        waits for a slot's copies before giving it back).
        """
        if layout != self.layout:
            self.layout, self.free, self.outstanding = layout, [], 0
        if self.free:
            self.outstanding += 1
            return self.free.pop()
        if self.outstanding < self.slots:
            self.outstanding += 1
            return make()
        return None

    def give(self, layout: Any, slot: dict[str, torch.Tensor]) -> None:
        """Take a slot back for reuse (its copies have landed; host bookkeeping only, no synchronisation)."""
        if layout == self.layout:
            self.outstanding -= 1
            self.free.append(slot)
