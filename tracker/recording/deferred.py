"""Low-precision and top-k rows of a CPU run: copied as float32 on the decode thread, stored off it.

A row kept as float16 or bfloat16 (minus its largest logit) or as its top
``k`` values needs the full float32 row for its statistics
(:mod:`tracker.recording.record_stats`), for the offset, the conversion and the
selection: several passes over the row, many times the copy itself. On a CPU
(``statistics`` other than ``"record"``) the decode thread only copies each
written row into a float32 *staging block* (:class:`DeferredRows`), and a
background thread does the rest, step by step, with the same function the
recording path runs (:func:`store_stage`, on the same rows of the same
step), so the stored values are bit for bit those ``statistics="record"``
gives.

A step's rows wait in staging until the next step begins (its chosen tokens
arrive before that); then the background thread stores them. Staging is
bounded (:data:`DEFAULT_LIMIT`, or a quarter of the recorder's memory bound,
counted against that bound): when it is full, the decode thread stores the
oldest waiting step itself. The background thread runs at the lowest
scheduling priority (it must not slow the decode thread, nor a model's
threads), so nothing ever waits for it: past the bound staging holds at most
the rows of the step being written and of the step that thread is storing, and
a read (a query, ``finish()``, a spill, ``flush()``) stores every waiting step
of the rows it reads on the calling thread, the one that thread is on
included (the same values, written twice), so a batch handed out always holds
every written row as recorded. The background thread takes no lock of the
recorder. ``clear()`` does not wait for it either: a step it is storing then
finds its chunk released, and the views it holds keep that memory out of the
pool until it is done.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tracker.recording.buffers import BufferPool, HostBuffer, background_thread, exiting
from tracker.recording.chunks import Chunk, StepRows
from tracker.recording.record_stats import chosen_stats, group_maxima, offset_rows, stage_stats, summarise_topk
from tracker.recording.storage import Storage
from tracker.recording.streaming import copy_rows

__all__ = ["DEFAULT_LIMIT", "DeferredRows", "STAGED_DTYPES", "store_stage"]

_MEMCPY = (torch.float32, torch.float16)
#: Row types a float32 staging row holds exactly (so the statistics of the copy are those of the row).
STAGED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Bytes of staging without a memory bound (with one: a quarter of it).
DEFAULT_LIMIT = 512 << 20
_BLOCK_BYTES = 8 << 20

#: The one background thread that stores staged rows (at the lowest priority: nothing ever waits for it).
_worker = background_thread("logitscope-deferred", low_priority=True)


def store_stage(
    chunk: Chunk,
    stage: str,
    start: int,
    end: int,
    values: torch.Tensor,
    nat: torch.Tensor | None,
    eos: torch.Tensor | None,
    storage: Storage,
    vocab: int,
    with_stats: bool,
    owned: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Store ``values`` as ``stage`` for rows ``start:end`` of ``chunk`` in ``storage`` (converted, offset or
    selected), with their statistics when ``with_stats``; returns the rows the chosen-token statistics are
    read from (``values`` itself when ``owned``: nobody else writes into it, else a copy) and their statistics.

    ``nat``: the natural rows (for top-k's natural logits, the removed mass and the margin). Kernels and
    ``non_blocking`` copies only (into a CUDA chunk's pinned slot): does not synchronise with the device.
    """
    staging, src = chunk.host is None, values.detach()
    kept = pre = shift = None  # half-precision rows as stored; their statistics, and the max they are kept minus
    exact = src if owned else None  # rows nobody else can write into (a later processor may)
    if storage.full:
        name = f"{stage}:logits"
        dst = chunk.buffers[name]
        if dst.dtype != torch.float32 and with_stats:
            pre, shift = offset_rows(src, eos, nat)
            src = src.float() - shift[:, None]
        if not staging and src.dtype == dst.dtype and src.dtype in _MEMCPY and src.device.type == "cpu":
            # a plain memcpy: torch would split a long row across threads for no gain
            copy_rows(chunk.arrays[name][start:end], src.numpy())
        else:
            if staging and src.dtype != dst.dtype:
                src = src.to(dst.dtype)  # convert on the device, copy the smaller row
            dst[start:end].copy_(src, non_blocking=staging)
        if dst.dtype != torch.float32:
            kept = src if src.dtype == dst.dtype else dst[start:end]
        same = dst.dtype == values.dtype and dst.device == values.device and shift is None
        exact, src = dst[start:end] if same else exact, values.detach()
    else:
        for name, tensor in summarise_topk(src, storage.k_for(vocab), nat).items():
            chunk.buffers[f"{stage}:{name}"][start:end].copy_(tensor, non_blocking=staging)
    if not with_stats:
        return None
    stats, stored = stage_stats(src, eos, nat, kept, pre, shift)
    chunk.buffers[f"{stage}:stats"][start:end].copy_(stored, non_blocking=staging)
    if f"{stage}:gmax" in chunk.buffers:  # the index a read's searches start from (float32 rows only)
        chunk.buffers[f"{stage}:gmax"][start:end].copy_(group_maxima(src), non_blocking=staging)
        chunk.maxima_known[stage][start:end] = True
    return (src.clone() if exact is None else exact), stats


@dataclass(eq=False)
class _Block:
    """Float32 rows of one vocabulary size, handed out in order to staged writes."""

    buffer: HostBuffer
    rows: np.ndarray  # [capacity, V] float32
    used: int = 0
    live: int = 0  # staged writes in it not yet released


@dataclass(eq=False)
class _Write:
    """One stage's rows of one step, staged as float32 until stored."""

    chunk: Chunk
    stage: str
    start: int
    end: int
    block: _Block
    offset: int
    natural: _Write | None
    eos: torch.Tensor | None
    stats: torch.Tensor | None = None  # the row statistics, once stored
    chosen_done: bool = False
    dropped: bool = False  # the same stage written again on the decode thread: that write stands

    def values(self) -> torch.Tensor:
        return torch.from_numpy(self.block.rows[self.offset : self.offset + self.end - self.start])


@dataclass(eq=False)
class _Step:
    """The staged writes of one step (current while its step is in progress, then queued until stored)."""

    rows: StepRows
    storage: Storage
    vocab: int
    writes: list[_Write] = field(default_factory=list)
    source: Any = None  # the natural tensor as handed in (compared by identity only), while current
    tokens: torch.Tensor | None = None  # the chosen tokens, told while the step was current
    workers: int = 0  # threads storing it now
    stored: bool = False  # one of them finished
    failed: bool = False  # the background thread could not store it (a read stores it, raising the error)


class DeferredRows:
    """Float32 staging of a CPU run's low-precision and top-k rows, stored on a background thread.

    All methods but the background work run under the recorder's lock.

    Args:
        pool: where staging blocks come from and go back to.
    """

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        # the queue, the blocks and their counts (the background thread takes it briefly)
        self._guard = threading.RLock()
        self._queue: deque[_Step] = deque()  # steps done with, oldest first, not yet stored
        self._current: _Step | None = None
        self._block: _Block | None = None
        self._free: list[_Block] = []
        self._blocks: list[_Block] = []
        self._running = False  # the background thread has work submitted
        self._preparing: Future[list[HostBuffer]] | None = None  # the next block, its pages being touched
        self.limit = DEFAULT_LIMIT
        weakref.finalize(self, _give_back, pool, self._blocks)  # a recorder collected: its blocks serve the next

    @property
    def nbytes(self) -> int:
        """Bytes of staging blocks held (in use or free for reuse)."""
        return sum(b.buffer.nbytes for b in self._blocks)

    def configure(self, memory_limit: int | None) -> None:
        """At a run's first step: staging within a quarter of ``memory_limit`` (or :data:`DEFAULT_LIMIT`)."""
        self.limit = DEFAULT_LIMIT if memory_limit is None else memory_limit // 4

    # ------------------------------------------------------------ decode thread

    def stage(
        self,
        rows: StepRows,
        stage: str,
        values: torch.Tensor,
        natural: torch.Tensor | None,
        eos: torch.Tensor | None,
        storage: Storage,
        vocab: int,
    ) -> bool:
        """Copy ``values`` (the rows of ``stage``) into staging, to be stored later; False (nothing done) when
        they must be stored now: not float32/float16/bfloat16 rows on the CPU, or a ``natural`` other than
        the rows staged as this step's natural stage. Every step and stage; a memcpy (a conversion to float32
        for half-precision rows), and, while staging is full, storing the oldest waiting steps."""
        if values.device.type != "cpu" or values.dtype not in STAGED_DTYPES or rows.chunk.host is None:
            return False
        step = self._current if self._current is not None and self._current.rows is rows else None
        nat = None
        if stage != "natural":
            staged = [w for w in step.writes if w.stage == "natural" and not w.dropped] if step else []
            nat = staged[-1] if staged else None
            if natural is not None and (nat is None or natural is not step.source):  # type: ignore[union-attr]
                return False
        if step is None:
            self.next_step()
            step = self._current = _Step(rows, storage, vocab)
        else:
            self.supersede(rows, stage)
        block, offset = self._room(rows.count, vocab)
        dst = block.rows[offset : offset + rows.count]
        src = values.detach() if values.requires_grad else values
        if src.dtype == torch.float32:
            copy_rows(dst, src.numpy())  # streaming stores: the row is read long after, out of the cache
        else:
            torch.from_numpy(dst).copy_(src)
        step.writes.append(_Write(rows.chunk, stage, rows.start, rows.end, block, offset, nat, eos))
        if stage == "natural":
            step.source = values
        return True

    def supersede(self, rows: StepRows, stage: str) -> None:
        """``stage`` of ``rows`` is written again: earlier staged writes of it are not stored."""
        step = self._current
        if step is not None and step.rows is rows:
            for write in step.writes:
                write.dropped = write.dropped or write.stage == stage

    def chosen(self, rows: StepRows, tokens: torch.Tensor, owned: bool = False) -> None:
        """The chosen tokens of ``rows``: while their step is current its staged writes get the chosen
        token's statistics when stored (as recording them does; later, nothing). ``owned``: ``tokens`` are
        int64 on the CPU and nobody else writes into them (else they are copied)."""
        step = self._current
        if step is not None and step.rows is rows:
            step.tokens = tokens if owned else tokens.detach().to("cpu").clone()
            for write in step.writes:
                write.chosen_done = False

    def next_step(self) -> None:
        """The current step is over (another begins): queue it for the background thread. Every step."""
        step, self._current = self._current, None
        if step is None:
            return
        step.source = None
        with self._guard:
            if not any(self._pending(w, step) for w in step.writes):
                self._release(step)
                return
            self._queue.append(step)
            if not self._running:
                self._running = True
                _worker().submit(self._drain)

    # ------------------------------------------------------------ reads

    def complete(self, chunk: Chunk | None = None) -> None:
        """Store now, on this thread, every waiting step (or those with rows in ``chunk``), beside the
        background thread: a step it is storing is stored here too (the same values), not waited for, since
        it yields to this thread. Before a read, a spill or ``flush()``."""
        current = self._current
        if current is not None and (chunk is None or any(w.chunk is chunk for w in current.writes)):
            self._store(current)
        done: set[int] = set()
        while True:
            with self._guard:
                todo = [
                    s
                    for s in self._queue
                    if id(s) not in done and (chunk is None or any(w.chunk is chunk for w in s.writes))
                ]
                if not todo:
                    return
                step = next((s for s in todo if not s.workers), todo[0])
                step.workers += 1
            done.add(id(step))
            self._run(step, here=True)

    def forget(self) -> None:
        """Drop every staged row (``clear()``). A step the background thread is storing meanwhile finds its
        chunk released (and is dropped); the blocks it reads stay out of the pool's circulation until it is
        done, since it still views them."""
        with self._guard:
            self._queue.clear()
            self._current = None
            self._block = None
            self._free.clear()
            _give_back(self._pool, self._blocks)

    # ------------------------------------------------------------ internals

    @staticmethod
    def _pending(write: _Write, step: _Step) -> bool:
        return not write.dropped and (write.stats is None or (step.tokens is not None and not write.chosen_done))

    def _room(self, count: int, vocab: int) -> tuple[_Block, int]:
        """Rows for one write: in the current block, a free one, a new one within the limit, or one freed by
        storing the oldest waiting steps here."""
        with self._guard:  # the background thread gives blocks back under it
            return self._take_room(count, vocab)

    def _take_room(self, count: int, vocab: int) -> tuple[_Block, int]:
        block = self._block
        if block is not None and block.rows.shape[1] == vocab and block.rows.shape[0] - block.used >= count:
            block.used += count
            block.live += 1
            return block, block.used - count
        self._block = None
        if block is not None and block.live == 0:
            self._reuse(block)
        capacity = max(count, min(_BLOCK_BYTES, max(self.limit // 8, 1)) // (4 * vocab))
        while True:
            fits = [b for b in self._free if b.rows.shape[1] == vocab and b.rows.shape[0] >= count]
            if fits:
                block = fits[0]
                self._free.remove(block)
                break
            size = capacity * vocab * 4
            if self.nbytes + size <= self.limit or not self._store_oldest():
                block = self._new_block(size, capacity, vocab)
                break
            # else a step was stored (here or by the background thread): its rows may be free now
        block.used, block.live = count, 1
        self._block = block
        return block, 0

    def _new_block(self, size: int, capacity: int, vocab: int) -> _Block:
        """A block from the pool (touched ahead of time when asked for at the last new block), and the next
        one asked for, its pages touched off this thread, while the limit has room for it."""
        if self._preparing is not None:
            self._preparing.result()  # asked for a block's worth of steps ago: usually done
            self._preparing = None
        buffer = self._pool.take(size)
        block = _Block(buffer, buffer.owner[:size].view(np.float32).reshape(capacity, vocab))
        self._blocks.append(block)
        if self.nbytes + size <= self.limit:
            self._preparing = self._pool.prepare([size])
        return block

    def _store_oldest(self) -> bool:
        """Store here the oldest step nobody is storing; False if there is none (the background thread is on
        the only ones left: rather than wait for it, the caller takes a block past the limit)."""
        with self._guard:
            step = next((s for s in self._queue if not s.workers and not s.stored), None)
            if step is None:
                return False
            step.workers += 1
        self._run(step, here=True)
        return True

    def _drain(self) -> None:
        """The background thread: store queued steps, oldest first, until none is left."""
        while True:
            with self._guard:
                step = next((s for s in self._queue if not s.workers and not s.stored and not s.failed), None)
                if step is None or exiting():  # at exit nothing will read what is left
                    self._running = False
                    return
                step.workers += 1
            self._run(step, here=False)

    def _run(self, step: _Step, here: bool) -> None:
        """Store a claimed step; the last of the threads storing it gives its staging rows back. An error
        is raised on a calling thread (``here``); the background thread leaves the step to it."""
        stored = False
        try:
            self._store(step)
            stored = True
        except Exception:
            if here:
                raise
        finally:
            with self._guard:
                step.workers -= 1
                step.stored = step.stored or stored
                step.failed = step.failed or not stored
                if not step.workers and step.stored and step in self._queue:
                    self._queue.remove(step)
                    self._release(step)

    @staticmethod
    def _store(step: _Step) -> None:
        """Store a step's staged writes (and their chosen-token statistics, if its tokens are known)."""
        with torch.inference_mode():  # the chunk's buffers may be inference tensors
            for write in step.writes:
                if write.dropped:
                    continue
                values = write.values()
                if write.stats is None:
                    nat = write.natural.values() if write.natural is not None else None
                    stored = store_stage(
                        write.chunk, write.stage, write.start, write.end, values, nat, write.eos,
                        step.storage, step.vocab, True, True,
                    )  # fmt: skip
                    write.stats = stored[1] if stored is not None else None
                if step.tokens is not None and not write.chosen_done and write.stats is not None:
                    found = chosen_stats(values, step.tokens, write.stats)
                    write.chunk.buffers[f"{write.stage}:cstats"][write.start : write.end].copy_(found)
                    write.chunk.chosen_known[write.stage][write.start : write.end] = True
                    write.chosen_done = True

    def _release(self, step: _Step) -> None:
        """A stored (or empty) step gives its staging rows back; a block with no live rows is free again."""
        for write in step.writes:
            block = write.block
            block.live -= 1
            if block.live == 0 and block is not self._block:
                self._reuse(block)
        step.writes = []

    def _reuse(self, block: _Block) -> None:
        """An empty block goes on the free list (unless ``clear()`` gave it back meanwhile)."""
        if block in self._blocks:
            block.used = 0
            self._free.append(block)


def _give_back(pool: BufferPool, blocks: list[_Block]) -> None:
    """Give staging blocks back to the pool (emptying ``blocks``, so that nothing views them any more)."""
    buffers = [block.buffer for block in blocks]
    blocks.clear()
    for buffer in buffers:
        pool.give(buffer)
