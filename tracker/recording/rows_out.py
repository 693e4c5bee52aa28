"""Taking rows out of a recorder whole, by generation: how an engine writes each request as it ends.

A serving engine's recorder holds the rows of every request it tracks in shared chunks.
:meth:`RowsOut.take_generations` copies generations' rows out (when their requests end), and
:meth:`RowsOut.take_oldest` every row of the oldest complete chunk (past the engine's memory bound); rows taken
are forgotten, and a chunk whose rows were all taken is given back at once, so an idle engine holds no memory
for rows. A mixin of :class:`~tracker.recording.recorder.Recorder`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from tracker.recording.chunks import Chunk, ChunkMemory, StepRows

__all__ = ["RowsOut"]


class RowsOut:
    """Generations' rows out of the recorder's chunks (see the module)."""

    _lock: threading.RLock
    _chunks: list[Chunk]
    _active: Chunk | None
    _ended: set[int]
    _memory: ChunkMemory
    _retained: StepRows | None
    version: int

    def schema(self) -> pa.Schema: ...

    def _to_batch(self, chunk: Chunk, schema: pa.Schema, rows: np.ndarray | None = None) -> pa.RecordBatch: ...

    def take_generations(self, generations: Sequence[int], running: bool = False) -> list[pa.RecordBatch]:
        """Take the rows of ``generations`` out of memory (copied, ordered by generation, then as recorded;
        superseded rows left out): the recorder forgets them, and chunks left with no row of their own are given
        back. For an engine, whose requests are written as they end, those that ended together at once (a
        batch per chunk, not per request: 64 requests ending at one step took 0.1 s one by one); ``running``: the
        requests go on (an idle engine's checkpoint), so only their rows whose chosen token is known are taken,
        the rest wait for their tokens and a later part. Drains staging chunks holding them (synchronises with
        their copies)."""
        with self._lock:
            if not running:
                self._ended.update(int(g) for g in generations)
            wanted = np.asarray(list(generations), dtype=np.int64)
            out = []
            for chunk in [c for c in self._chunks if c.n and not c.on_disk]:
                mask = np.isin(chunk.generation[: chunk.n], wanted)
                if running:
                    mask &= chunk.chosen_set[: chunk.n] | chunk.superseded[: chunk.n]
                if (batch := self._take(chunk, mask)) is not None:
                    out.append(batch)
            if len(out) > 1 and len(wanted) > 1:  # a generation's rows in several chunks: together again
                table = pa.Table.from_batches(out)
                order = np.argsort(table.column("generation").to_numpy(), kind="stable")
                out = table.take(order).combine_chunks().to_batches()
            return out

    def take_oldest(self) -> dict[int, list[pa.RecordBatch]] | None:
        """Take every row of the oldest complete chunk out of memory (copied), by generation, and give its buffers
        back; None when no chunk but the one filling is complete. For an engine over its memory bound: the rows go
        to their generations' parts now, the rest when each generation ends."""
        with self._lock:
            for chunk in self._chunks:
                if chunk is not self._active and chunk.n and not chunk.on_disk and chunk.complete(self._ended):
                    batch = self._take(chunk, np.ones(chunk.n, dtype=bool))
                    return {} if batch is None else _by_generation(batch)
            return None

    def _take(self, chunk: Chunk, mask: np.ndarray) -> pa.RecordBatch | None:
        """The rows ``mask`` of ``chunk`` not taken yet, out of memory, as one batch ordered by generation, then as
        recorded (copied; superseded rows left out; None without such rows); the chunk is given back once all its
        rows are taken."""
        mask = mask & ~chunk.taken[: chunk.n]
        out = None
        if mask.any():
            if chunk.staging:
                self._memory.to_host(chunk)
            picked = np.flatnonzero(mask & ~chunk.superseded[: chunk.n])
            if len(picked):
                picked = picked[np.argsort(chunk.generation[picked], kind="stable")]
                out = self._to_batch(chunk, self.schema(), picked)
            chunk.taken[: chunk.n] |= mask
            self._release_if_taken(chunk)
        return out

    def _release_if_taken(self, chunk: Chunk) -> None:
        """Give back a chunk whose rows were all taken out (the active one too, unless its rows await tokens)."""
        if not chunk.taken[: chunk.n].all() or (self._retained is not None and self._retained.chunk is chunk):
            return
        if chunk is self._active:
            self._active = None
        self._memory.release(chunk)
        self._chunks.remove(chunk)
        self.version += 1


def _by_generation(batch: pa.RecordBatch) -> dict[int, list[pa.RecordBatch]]:
    """A batch ordered by generation as slices of it, by generation."""
    generations = batch.column("generation").to_numpy()
    found, starts = np.unique(generations, return_index=True)
    ends = [*starts[1:].tolist(), len(generations)]
    return {int(g): [batch.slice(a, b - a)] for g, a, b in zip(found.tolist(), starts.tolist(), ends)}
