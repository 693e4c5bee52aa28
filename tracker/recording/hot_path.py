"""The decode step's common case, in as few Python operations as it takes: CPU float32 rows.

Every step of a transformers-style host does the same bookkeeping: check that
the input extends the last one, read the last step's chosen tokens from its
last column, reserve the step's rows, copy the natural and constrained rows
into the current chunk. Spelled with torch operations each costs a few
microseconds of dispatch; at 32k tokens the two 128 KiB copies cost less
than that bookkeeping did. Here the same work is done on numpy views of the
host tensors, in one lock round trip for the reservation.

Each function below handles only the plain case (float32 rows on the CPU,
stored as float32 without per-step statistics, or copied into the float32
staging of a run kept in half precision or top-k (:mod:`~tracker.recording.deferred`),
room in the active chunk, no spill failure pending) and says so by its return
value; otherwise it does nothing and the caller takes the full path, which
records the same values and raises the same errors.
``tests/test_tracker_hot_path.py`` compares the two.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from processors import protocol
from tracker.recording.chunks import Chunk, StepRows
from tracker.recording.record_stats import eos_on
from tracker.recording.streaming import copy_rows

if TYPE_CHECKING:
    from tracker.recording.deferred import DeferredRows
    from tracker.recording.spill_handoff import SpillHandoff
    from tracker.recording.storage import Storage

__all__ = ["HOST_IDS", "PlainSteps", "host_ids", "ids_continue", "ids_in_range"]

HOST_IDS = (torch.int64, torch.int32)  # id tensors read as they are (a numpy view)
_FEW = 64  # up to this many ids are compared in Python, cheaper than numpy's reductions
_FLOAT32 = torch.float32


def host_ids(ids: torch.Tensor) -> np.ndarray | None:
    """A numpy view of ``ids`` when it is an int64 or int32 tensor whose values are free to read (on the CPU:
    :func:`~processors.protocol.free_to_read`), else None. Every step; does not synchronise (a tensor on an
    accelerator is not read)."""
    if ids.dtype not in HOST_IDS or not protocol.free_to_read(ids):
        return None
    return ids.numpy()


def ids_continue(ids: np.ndarray, last: np.ndarray) -> bool:
    """Whether ``ids [B, L + 1]`` extends ``last [B, L]`` column for column (host arrays of the same dtype):
    :func:`~processors.protocol.continues` for CPU tensors, on numpy views. Every step; no synchronisation."""
    if ids.shape[0] != last.shape[0] or ids.shape[1] != last.shape[1] + 1 or ids.dtype != last.dtype:
        return False
    head = ids[:, :-1]
    if ids.shape[0] == 1:  # one row: compare the bytes (a memcmp), cheaper than an elementwise pass
        return head.tobytes() == last.tobytes()
    return bool((head == last).all())


def ids_in_range(values: np.ndarray, vocab_size: int) -> bool:
    """Whether every id of ``values`` (a host array) lies in ``[0, vocab_size)``; ``vocab_size <= 0``: no
    bound known yet, every id passes. Every step; no synchronisation."""
    if vocab_size <= 0 or values.size == 0:
        return True
    if values.size <= _FEW:
        listed = values.ravel().tolist()
        return min(listed) >= 0 and max(listed) < vocab_size
    return bool(values.min() >= 0) and bool(values.max() < vocab_size)


class PlainSteps:
    """The recorder's plain case (a mixin of :class:`~tracker.recording.recorder.Recorder`): a step's
    reservation, the last step's chosen tokens and a stage's copy, each in one lock round trip and a few numpy
    operations, when the rows are float32 on the CPU kept as float32 with no statistics on the decoding
    thread, or staged as float32 for a background thread to store (:meth:`_staged`). The general methods do
    the same work for every case."""

    _lock: threading.RLock
    _active: Chunk | None
    _handoff: SpillHandoff
    _arange: np.ndarray
    _retained: StepRows | None
    _deferred: DeferredRows
    _steps: int
    _eos: dict
    eos_token_ids: list[int]
    storage: Storage
    record_stats: bool
    deferred: bool
    vocab_size: int | None
    version: int

    def _plain(self) -> bool:
        """Rows are stored as they come, with no per-step statistics and no staging."""
        return self.storage.kind == "float32" and not self.record_stats and not self.deferred

    def _staged(self) -> bool:
        """Rows kept in half precision or top-k on a CPU, whose conversion and statistics a background thread
        does from a float32 copy (:class:`~tracker.recording.deferred.DeferredRows`)."""
        return self.deferred

    def plain_step(
        self,
        previous: StepRows | None,
        chosen: np.ndarray | None,
        generation: int,
        step: int,
        natural: torch.Tensor,
    ) -> StepRows | None:
        """``set_chosen(previous, chosen)``, ``begin_step`` and ``write(rows, "natural", natural)`` at once, in
        the plain case; None (nothing done) otherwise, or when a chunk must be sealed or the disk refused a
        chunk. ``chosen``: the last step's tokens, already checked against the vocabulary. Every step; a
        memcpy and a few numpy writes: does not synchronise."""
        with self._lock:
            chunk = self._active
            batch = natural.shape[0]
            if (
                chunk is None
                or chunk.capacity - chunk.n < batch
                or chunk.device.type != "cpu"
                or self._handoff.pending
                or self._handoff.failure is not None
                or not self._writable(chunk, "natural", natural, batch)
            ):
                return None
            if previous is not None and (chosen is None or not self._plain_chosen(previous, chosen)):
                return None
            rows = self._reserve(chunk, generation, step, batch)
            # staging the natural rows ends the last staged step (queued for the background thread) and
            # begins this one; a natural stage is never refused
            self._put(rows, "natural", natural, None)
            return rows

    def plain_chosen(self, rows: StepRows, chosen: np.ndarray) -> bool:
        """:meth:`set_chosen` of host ids (already checked against the vocabulary) in the plain case, True when
        done; False (nothing done) otherwise. Every step; numpy writes only: does not synchronise."""
        with self._lock:
            return self._plain_chosen(rows, chosen)

    def _plain_chosen(self, rows: StepRows, chosen: np.ndarray) -> bool:
        chunk = rows.chunk
        staged = self._staged()
        if chunk.on_disk or chunk.host is None or chosen.size != rows.count or not (self._plain() or staged):
            return False  # the full path collects, refuses or computes the chosen token's statistics
        if staged and self._retained is not None:
            return False  # rows stored on this thread wait for the chosen token's statistics
        start = rows.start
        end = start + rows.count
        chunk.arrays["chosen"][start:end] = chosen.reshape(-1)  # as np.copyto(casting="unsafe"), cheaper
        if staged:  # the staged rows get the chosen token's statistics when stored
            self._deferred.chosen(rows, torch.from_numpy(chosen.astype(np.int64).reshape(-1)), owned=True)
        chunk.chosen_set[start:end] = True
        chunk.version += 1
        self.version += 1
        return True

    def _reserve(self, chunk: Chunk, generation: int, step: int, batch: int) -> StepRows:
        """The next ``batch`` rows of ``chunk`` for a step (it has room): their id columns, no value yet.
        Call it holding the recorder's lock. Every step; numpy writes only."""
        self._steps += 1
        start = chunk.n
        end = chunk.n = start + batch
        # rows are reserved once, in order: their flags are still the zeros they were made with
        chunk.generation[start:end] = generation
        if self._arange.shape[0] < batch:
            self._arange = np.arange(batch, dtype=np.int32)
        chunk.sequence[start:end] = self._arange[:batch]
        chunk.step[start:end] = step
        chunk.arrays["chosen"][start:end] = -1
        chunk.version += 1
        self.version += 1
        return StepRows(chunk, start, batch, generation, step)

    def plain_write(
        self, rows: StepRows, stage: str, values: torch.Tensor, natural: torch.Tensor | None = None
    ) -> bool:
        """:meth:`write` of ``values`` as ``stage`` in the plain case (a memcpy into the chunk or into staging),
        True when done; False (nothing done) otherwise. Call it holding the recorder's lock. Does not
        synchronise."""
        if rows.chunk.on_disk or not self._writable(rows.chunk, stage, values, rows.count):
            return False
        return self._put(rows, stage, values, natural)

    def _writable(self, chunk: Chunk, stage: str, values: torch.Tensor, count: int) -> bool:
        """Whether ``values`` can be copied into ``chunk`` as ``count`` rows of ``stage`` as they are: float32 CPU
        rows of the run's vocabulary, a host chunk that records the stage, the plain case."""
        return (
            values.dtype is _FLOAT32
            and values.is_cpu
            and not values.requires_grad
            and values.ndim == 2
            and values.shape[0] == count
            and values.shape[1] == self.vocab_size
            and chunk.host is not None
            and stage in chunk.written
            and self._retained is None
            and (self._plain() or self._staged())
        )

    def _put(self, rows: StepRows, stage: str, values: torch.Tensor, natural: torch.Tensor | None) -> bool:
        """Copy writable ``values`` (:meth:`_writable`) as ``stage`` of ``rows``: into the chunk (streaming
        stores: :func:`copy_rows`), or into staging, marked written; False (nothing done) where staging
        refuses them (a ``natural`` other than the rows staged as this step's natural stage)."""
        chunk, start, end = rows.chunk, rows.start, rows.end
        if self._staged():
            eos = None
            if self.record_stats and f"{stage}:stats" in chunk.buffers:
                eos = eos_on(self._eos, self.eos_token_ids, self.vocab_size or 0, values.device)
            vocab = self.vocab_size or 0
            if not self._deferred.stage(rows, stage, values, natural, eos, self.storage, vocab):
                return False
        else:
            copy_rows(chunk.arrays[f"{stage}:logits"][start:end], values.numpy())
        chunk.written[stage][start:end] = True
        chunk.version += 1
        self.version += 1
        return True
