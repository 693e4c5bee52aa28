"""Row statistics of a CPU run's chunks, computed off the decode thread.

On a CPU, float32 rows are recorded without their statistics by default
(``statistics="auto"``): on the decode thread they would cost the step a few
passes over each row. Instead, as each chunk is sealed (full, or closed by a
new stage), :class:`ChunkStats` computes its rows' statistics on one
background thread (the same :func:`~tracker.recording.record_stats.row_stats` and
:func:`~tracker.recording.record_stats.chosen_stats` the recording path runs, so the
values are those ``statistics="record"`` gives), and the first query finds
them in the statistics columns instead of summing every row up.

The same pass keeps each row's group maxima
(:func:`tracker.reading.rows.group_max`, in the chunk's ``{stage}:gmax``
buffers): the index the read side's candidate searches start from
(:mod:`tracker.reading.candidates`), so the first ``get_top_tokens`` or
``to_dataframe`` does not fold every row again. They are handed to the
tracker's :class:`~tracker.Run` beside its record batches, never written to a
file: a run read from disk has no such index and folds its rows when asked.
(Rows recorded with their statistics get their maxima the same way, on their
device: :func:`tracker.recording.deferred.store_stage`.)

Rows the background thread has not reached when they are read (the chunk
still filling, the last step's chosen tokens) are computed then, by
:meth:`ChunkStats.complete` under the recorder's lock, so a batch handed out
always carries every written row's statistics. The background thread reads
rows that were written (they never change afterwards) without the lock and
stores its results under it, only while the chunk still owns the same
buffers: a chunk released by ``clear()`` or spilled meanwhile is left alone,
and the views it holds keep those buffers out of the pool until it is done.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from tracker.reading.rows import group_max
from tracker.recording.buffers import background_thread, exiting
from tracker.recording.chunks import Chunk
from tracker.recording.record_stats import chosen_stats, eos_on, row_stats

__all__ = ["ChunkStats"]

_BLOCK_BYTES = 8 << 20  # rows per computation: about 8 MiB of float32 (bounded scratch memory)

#: The one background thread that computes chunks' statistics, at the lowest priority: it must not take a
#: core from the model's threads (a read finds what it has not reached and computes that itself).
_worker = background_thread("logitscope-stats", low_priority=True)


class ChunkStats:
    """Statistics of sealed chunks, computed on a background thread; the rest when read.

    Args:
        lock: the recorder's lock (held while flags and results are read and stored).
    """

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._eos: dict[Any, torch.Tensor] = {}
        self._pending: dict[int, tuple[Future[None], Chunk, list[str], list[int]]] = {}

    def submit(self, chunk: Chunk, stages: list[str], eos_ids: list[int]) -> None:
        """Compute ``chunk``'s statistics on the background thread (once per chunk; does not wait).
        ``eos_ids``: the end-of-sequence ids, for ``p_eos``."""
        if chunk.host is None or chunk.n == 0:
            return
        stages, eos_ids = list(stages), list(eos_ids)
        self._pending[id(chunk)] = (_worker().submit(self._later, chunk, stages, eos_ids), chunk, stages, eos_ids)

    def _later(self, chunk: Chunk, stages: list[str], eos_ids: list[int]) -> None:
        """The background thread's work on one chunk; skipped once the interpreter is shutting down (nothing
        will read it then, and the exit would wait for it)."""
        if not exiting():
            self._fill(chunk, stages, eos_ids)

    def complete(self, chunk: Chunk, stages: list[str], eos_ids: list[int]) -> None:
        """Compute, now, the statistics of every written row the background thread has not stored.

        Called with the recorder's lock held, before a chunk's rows are
        turned into a record batch (a read, or a spill).
        """
        self._pending.pop(id(chunk), None)
        if chunk.host is not None and chunk.n:
            self._fill(chunk, stages, eos_ids)

    def forget(self) -> None:
        """Drop the record of submitted work (``clear()``): what still runs stores nothing."""
        self._pending.clear()

    def wait(self) -> None:
        """Block until the work submitted so far is done, doing a share of it on the calling thread.

        A backlog (the background thread falls behind a loop with no model
        between steps) is shared: the calling thread takes the chunks not
        started yet from the newest back, while the background thread goes on
        from the oldest, so on two cores it takes about half as long. No
        chunk is computed twice. Called outside the recorder's lock.
        """
        items = list(self._pending.items())
        for _, (future, chunk, stages, eos_ids) in reversed(items):
            if future.cancel():  # not started: the background thread will not take it
                self._fill(chunk, stages, eos_ids)
        for key, (future, *_) in items:
            if not future.cancelled():
                future.result()
            self._pending.pop(key, None)

    def _fill(self, chunk: Chunk, stages: list[str], eos_ids: list[int]) -> None:
        with self._lock:
            buffers = chunk.buffers
            if not buffers or chunk.on_disk:
                return
            n = chunk.n
            chosen = chunk.buffers["chosen"][:n].clone()
            rows = {}
            for stage in stages:
                written = chunk.written.get(stage)
                if written is None or f"{stage}:stats" not in buffers:
                    continue
                todo = written[:n] & ~chunk.stats_known[stage][:n]
                ctodo = written[:n] & chunk.chosen_set[:n] & ~chunk.chosen_known[stage][:n]
                if todo.any() or ctodo.any():
                    rows[stage] = (todo, ctodo)
            natural_written = chunk.written["natural"][:n].copy() if "natural" in chunk.written else None
            vocab = int(buffers[f"{next(iter(rows))}:logits"].shape[1]) if rows else 0
        if not rows:
            return
        eos = eos_on(self._eos, eos_ids, vocab, torch.device("cpu"))
        with torch.inference_mode():  # reads only; the buffers may be inference tensors
            results = {
                stage: self._compute(buffers, stage, todo, ctodo, chosen, eos, natural_written)
                for stage, (todo, ctodo) in rows.items()
            }
        with self._lock:
            if chunk.buffers is not buffers or chunk.on_disk:
                return  # released (clear) or handed to the disk meanwhile
            for stage, (done, stats, maxima, cdone, cstats) in results.items():
                # through the numpy views: buffers made under torch.inference_mode refuse in-place torch writes
                if done.size:
                    chunk.arrays[f"{stage}:stats"][done] = stats.numpy()
                    chunk.stats_known[stage][done] = True
                    if maxima is not None:
                        chunk.arrays[f"{stage}:gmax"][done] = maxima
                        chunk.maxima_known[stage][done] = True
                if cdone.size:
                    chunk.arrays[f"{stage}:cstats"][cdone] = cstats.numpy()
                    chunk.chosen_known[stage][cdone] = True

    @staticmethod
    def _compute(
        buffers: dict[str, torch.Tensor],
        stage: str,
        todo: np.ndarray,
        ctodo: np.ndarray,
        chosen: torch.Tensor,
        eos: torch.Tensor | None,
        natural_written: np.ndarray | None,
    ) -> tuple[np.ndarray, torch.Tensor, np.ndarray | None, np.ndarray, torch.Tensor]:
        """Statistics (and group maxima, where the chunk keeps them) of the ``todo`` rows and chosen-token
        statistics of the ``ctodo`` rows of one stage."""
        values = buffers[f"{stage}:logits"]
        natural = buffers.get("natural:logits") if stage != "natural" else None
        per = max(1, _BLOCK_BYTES // (4 * max(1, values.shape[1])))
        need = np.flatnonzero(todo | ctodo)
        stored = buffers[f"{stage}:stats"]
        indexed = f"{stage}:gmax" in buffers
        done, cdone, stats_parts, cstats_parts, maxima_parts = [], [], [], [], []
        for first in range(0, need.size, per):
            idx = need[first : first + per]
            x = _rows(values, idx)
            fresh = todo[idx]
            if fresh.any():
                with_natural = natural is not None and natural_written is not None and natural_written[idx].all()
                stats = row_stats(x, eos, _rows(natural, idx) if with_natural else None)
                stats_parts.append(stats[torch.from_numpy(fresh)])
                done.append(idx[fresh])
                if indexed:
                    rows = x.numpy()
                    maxima_parts.append(group_max(rows if fresh.all() else rows[fresh]))
                known = torch.where(torch.from_numpy(fresh)[:, None], stats, stored[torch.from_numpy(idx)])
            else:
                known = stored[torch.from_numpy(idx)]
            pick = ctodo[idx]
            if pick.any():
                sel = torch.from_numpy(np.flatnonzero(pick))
                cstats_parts.append(chosen_stats(x[sel], chosen[torch.from_numpy(idx[pick])], known[sel]))
                cdone.append(idx[pick])
        empty = torch.zeros(0, stored.shape[1]), torch.zeros(0, buffers[f"{stage}:cstats"].shape[1])
        return (
            np.concatenate(done) if done else np.zeros(0, np.int64),
            torch.cat(stats_parts) if stats_parts else empty[0],
            np.concatenate(maxima_parts) if maxima_parts else None,
            np.concatenate(cdone) if cdone else np.zeros(0, np.int64),
            torch.cat(cstats_parts) if cstats_parts else empty[1],
        )


def _rows(tensor: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
    """Rows ``idx`` of ``tensor``: a view when they are consecutive, else a copy."""
    if idx.size and int(idx[-1]) - int(idx[0]) + 1 == idx.size:
        return tensor[int(idx[0]) : int(idx[-1]) + 1]
    return tensor[torch.from_numpy(idx)]
