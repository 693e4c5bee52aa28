"""Handing complete chunks to the disk: the run's spill folder, the background writer, what goes beside.

The recorder decides *which* chunks leave memory (the oldest complete ones,
while host memory is over its bound); :class:`SpillHandoff` takes them from
there: it makes the run's spill folder (a temporary one, removed with the
recorder, unless the user gave ``spill_dir``), writes the run's metadata
beside the chunks once per generation reaching the disk, queues each chunk
once for :class:`~tracker.format.spill.SpillWriter`, maps the written files back
when the recorder next looks, and says once that the run spills. Every few
MB written, the writer thread also hands the C heap's free pages back
(:func:`~tracker.recording.memory.trim_heap`).

When the disk refuses (no space, a ``spill_dir`` that cannot be made or
written), nothing is lost: the chunk stays in memory, spilling stops for the
run (until ``clear()``), and :attr:`SpillHandoff.failure` holds the error for
the recording thread to raise once.
"""

from __future__ import annotations

import shutil
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from tracker.format.schema import META_VOCAB
from tracker.format.spill import (
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
from tracker.recording.chunks import Chunk
from tracker.recording.memory import trim_heap
from tracker.recording.modes import Storage

__all__ = ["Describe", "SpillHandoff", "SpillWarning"]

_TRIM_EVERY = 4 << 20  # bytes written between two trims of the C heap (each costs a few milliseconds)

#: What the recorder calls for the files beside spilled chunks: the run's metadata as JSON, and its
#: serialised vocabulary or None when the run has no real one (readers then show ``<id>`` placeholders).
Describe = Callable[[], tuple[bytes, bytes | None]]

_STALE_CHECKED = False


class SpillWarning(UserWarning):
    """A run outgrew its memory bound and spills to disk (said once per run)."""


class SpillHandoff:
    """Complete chunks on their way to disk, and the files written beside them.

    Args:
        root: the user's ``spill_dir`` (a subfolder per run is made), or None
            for a temporary folder removed when this object is collected (or,
            if the process dies, by the next process that spills).
        queue: chunks that may wait for the writer before :meth:`send` blocks.

    Attributes:
        spilled_bytes: bytes of spilled chunks on disk.
        chunk_writes: chunk files written and mapped back (each chunk once).
    """

    def __init__(self, root: Path | None, queue: int) -> None:
        self.root = root
        self.folder: Path | None = None
        self.writer = SpillWriter(queue)
        self.spilled_bytes = 0
        self.chunk_writes = 0
        self._landed: list[tuple[Chunk, Path, int]] = []  # written by the writer, not yet mapped
        self._refused: list[tuple[Chunk, BaseException]] = []  # the writer's failures, not yet taken back
        self.failure: RuntimeError | None = None  # the first failure, until the recorder raises it
        self.stopped = False  # a write failed: no more spilling until reset()
        self._described_generation = -1
        self._noticed = False
        self._cleanup: Any = None
        self._untrimmed = [0]  # bytes written since the heap was last trimmed (by the writer thread only)

    @property
    def pending(self) -> bool:
        """Whether the writer finished (or failed) chunks that :meth:`collect` has not taken back yet."""
        return bool(self._landed or self._refused)

    def _where(self) -> str:
        if self.root is not None:
            return f"spill_dir={str(self.root)!r}"
        return f"the temporary spill folder {str(self.folder)!r}" if self.folder else "a temporary spill folder"

    def _fail(self, error: BaseException) -> None:
        """Keep the first failure for the recorder to raise, and stop spilling until :meth:`reset`."""
        if self.stopped:
            return
        self.stopped = True
        failure = RuntimeError(
            f"spilling the tracker's rows to {self._where()} failed: {error}. Nothing recorded is lost: "
            "the rows stay in memory, and the run no longer spills (its memory_limit no longer holds) until "
            "clear(). Free disk space or pass a writable spill_dir for the next run."
        )
        failure.__cause__ = error
        self.failure = failure

    def _folder_for(self, run_id: str) -> Path:
        if self.folder is None:
            if self.root is not None:
                folder = self.root / run_id
                folder.mkdir(parents=True, exist_ok=True)
                self.folder = folder
            else:
                global _STALE_CHECKED
                if not _STALE_CHECKED:
                    _STALE_CHECKED = True
                    remove_stale_spill_folders()
                self.folder = temporary_spill_folder()
                self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        return self.folder

    def send(
        self, chunk: Chunk, batch: pa.RecordBatch, schema: pa.Schema, run_id: str, describe: Describe | None
    ) -> bool:
        """Queue ``chunk``'s rows (``batch``) for the disk; blocks only while the writer's queue is full.

        The first time a generation reaches the disk, ``describe()`` gives the
        run's metadata (and vocabulary, written once) to store beside the
        chunks, so the folder reads as a run even if the process dies.
        Returns False, the chunk left in memory, when spilling has stopped or
        the folder or its metadata cannot be written (:attr:`failure` says why).
        """
        if self.stopped:
            return False
        try:
            folder = self._folder_for(run_id)
            newest = int(chunk.generation[: chunk.n].max()) if chunk.n else -1
            if describe is not None and newest > self._described_generation:
                # once per generation reaching the disk: the metadata then names it (serialising a large
                # vocabulary for every chunk would cost more than the chunk)
                run_json, vocab = describe()
                if vocab is not None and not (folder / VOCAB_FILE).exists():
                    write_ipc(folder / VOCAB_FILE, [], pa.schema([], metadata={META_VOCAB: vocab}))
                with atomic_path(folder / RUN_JSON) as tmp:
                    tmp.write_bytes(run_json)
                self._described_generation = newest
        except OSError as exc:
            self._fail(exc)
            return False
        path = folder / chunk_name(chunk.index)
        chunk.spilling = True
        landed, refused = self._landed, self._refused  # not self: the writer thread keeps the last callbacks
        untrimmed = self._untrimmed

        def done(nbytes: int, seconds: float) -> None:
            landed.append((chunk, path, nbytes))  # list.append is atomic; mapped by the recording thread
            untrimmed[0] += nbytes
            if untrimmed[0] >= _TRIM_EVERY:  # on the writer thread, off the recording path
                untrimmed[0] = 0
                trim_heap()

        def failed(error: BaseException) -> None:
            refused.append((chunk, error))

        self.writer.submit(path, batch, schema, done, failed)
        return True

    def collect(self, held: Callable[[Chunk], bool], schema: Callable[[], pa.Schema]) -> list[Chunk]:
        """Map the chunks the writer finished back from disk; returns those ``held`` still keeps.

        A mapped chunk's ``spilled`` is its record batch read through a
        memory map (``schema()``'s empty batch for an empty file); its
        buffers are the caller's to give back. A chunk the writer could not
        write stays in memory, as it was before it was queued.
        """
        while self._refused:
            chunk, error = self._refused.pop(0)
            chunk.spilling = False
            self._fail(error)
        mapped: list[Chunk] = []
        while self._landed:
            chunk, path, nbytes = self._landed.pop(0)
            if not held(chunk):
                continue  # cleared meanwhile
            batches = read_ipc(path).to_batches()
            chunk.spilled = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=schema())
            chunk.spilling = False
            self.spilled_bytes += nbytes
            self.chunk_writes += 1
            mapped.append(chunk)
        return mapped

    def flush(self) -> None:
        """Wait until every queued chunk is written (then :meth:`collect` maps them)."""
        self.writer.flush()

    def close(self) -> None:
        """Write what is queued, then stop the writer's thread."""
        self.writer.close()

    def reset(self) -> None:
        """Forget every chunk and delete the spill folder (the next spill makes a new one)."""
        self.writer.flush()
        self._landed.clear()
        self._refused.clear()
        self.failure, self.stopped = None, False
        self.spilled_bytes = 0
        self.chunk_writes = 0
        self._described_generation = -1
        self._noticed = False
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def notice(
        self, storage: Storage, stages: Sequence[str], vocab: int, rows_per_step: float, memory_limit: int
    ) -> None:
        """Say once that the run spills, how fast the disk takes it, and which storage would keep it in memory."""
        if self._noticed or self.writer.seconds <= 0:
            return
        self._noticed = True
        rate = self.writer.bytes_written / self.writer.seconds
        rows = max(1.0, rows_per_step)
        per_step = storage.row_bytes(stages, vocab) * rows
        fits = {
            kind: int(memory_limit // max(1, Storage.parse(kind).row_bytes(stages, vocab) * rows))
            for kind in ("float32", "bfloat16", "topk")
            if kind != storage.kind
        }
        others = "; ".join(f"storage={k!r} keeps {v:,} steps" for k, v in fits.items())
        warnings.warn(
            f"the tracker's rows outgrew memory_limit={memory_limit:,} bytes and spill to {self.folder} "
            f"({per_step / 1e6:,.1f} MB per step in storage={storage.kind!r}; the disk took {rate / 1e6:,.0f} MB/s, "
            f"so recording goes at most {rate / max(per_step, 1):,.0f} steps/s while it spills). "
            f"In memory_limit: {others}. Pass storage='bfloat16' or storage='topk', or a larger memory_limit, "
            "to keep the run in memory.",
            SpillWarning,
            stacklevel=6,
        )
