"""Writing an engine's requests as parts of runs in a table, off the engine's thread.

Each request is one generation of its run. When it ends, :class:`PartWriter` takes its rows out of the recorder
(on its own thread) and hands them to a :class:`~tracker.format.table_writer.TableWriter`, which commits the
parts of many requests together, about once a second: a run is in the table (``LOGITSCOPE_RUNS``, a folder or
URL), and grows, while the server runs, and every reader (``Run.load``, the dashboard, ``logitscope query``,
plain DuckDB or Polars) sees each request whole once committed. Past the engine's memory bound, the oldest rows
of requests still running are handed over early, as a part of their generation of their own; and when the
engine goes idle, what the running requests recorded so far is (vLLM tells a processor that a request finished
only at its next step). Each row is written once. :meth:`PartWriter.close` writes what is left (requests still
running, as far as they got) and commits it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from processors.vocab import Vocabulary, vocab_for
from tracker.format.provenance import library_version
from tracker.format.schema import RunMetadata
from tracker.format.table_writer import TableWriter
from tracker.format.worker import Worker
from tracker.reading.run import Run
from tracker.recording.recorder import Recorder
from tracker.recording.run_metadata import now

if TYPE_CHECKING:
    from tracker.recording.engines.requests import Request

__all__ = ["PartWriter"]


class PartWriter:
    """Hands ended requests, as parts of runs, to the table at ``root``, in order, from its own thread.

    Args:
        root: the table's folder or URL.
        facts: ``model`` and ``extra`` for every run's metadata (the engine, its version, the model's dtype...).
        tokenizer: called once, on the writer's thread, for the vocabulary stored with the runs (None: ids).
        commit_every_s: the longest an ended request waits for its commit.
    """

    def __init__(
        self, root: str | Path, facts: dict[str, Any], tokenizer: Callable[[], Any], commit_every_s: float = 1.0
    ) -> None:
        self.table = TableWriter(root, commit_every_s=commit_every_s)
        self.facts = facts
        self.created_at = now()
        self._tokenizer = tokenizer
        self._vocab: dict[int, Vocabulary] = {}
        self._worker = Worker("logitscope-parts", depth=256)
        self._live: dict[int, Request] = {}  # generation -> request, while it runs
        self._pending: deque[Future[Any]] = deque()  # in submission order: the worker runs them in turn
        self._failed: list[Future[Any]] = []
        self._ending: list[tuple[Recorder, Request]] = []  # ended, waiting for the writer (one job for them all)
        self._end_queued = False
        self._lock = threading.Lock()
        self.closed = False

    # ---------------------------------------------------------------- called on the engine's thread

    def started(self, request: Request) -> None:
        self._live[request.generation] = request

    def live(self) -> list[Request]:
        """The requests that started and have not ended."""
        return list(self._live.values())

    def end(self, recorder: Recorder, request: Request) -> None:
        """Write ``request``'s rows as a part (returns at once). Requests that end before the writer gets to
        them are written together: a part per storage, one copy out of the recorder."""
        with self._lock:
            self._ending.append((recorder, request))
            queued, self._end_queued = self._end_queued, True
        if not queued:
            self._submit(self._write_ended)

    def checkpoint(self, requests: list[tuple[Recorder, Request]]) -> None:
        """Write the rows ``requests`` hold now as parts (one per storage), keeping them running (returns at once)."""
        self._submit(self._write_checkpoint, requests)

    def spill(self, recorders: list[Recorder]) -> Future[Any]:
        """Take the oldest complete chunk of rows out of each recorder and write them early (returns at once)."""
        return self._submit(self._write_spill, recorders)

    def flush(self) -> None:
        """Wait until every part asked for so far is committed. Raises the first failure (once)."""
        with self._lock:
            pending, self._pending, self._failed = [*self._failed, *self._pending], deque(), []
        failure = None
        for future in pending:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - raised below, once
                failure = failure or exc
        if failure is not None:
            where = self.table.table.location
            raise RuntimeError(f"logitscope could not write a request's part into '{where}': {failure}") from failure
        self.table.flush()

    def close(self, recorders: dict[Any, Recorder] | None = None) -> None:
        """Write the requests still running as far as they got (with ``recorders``), commit everything, stop both
        threads. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if recorders is not None:
            for request in list(self._live.values()):
                self.end(recorders[request.options.key], request)
        self._worker.close()
        self.table.close()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future = self._worker.submit(fn, *args)
        with self._lock:
            while self._pending and self._pending[0].done():  # the oldest only: a scan of all, with 64 requests
                done = self._pending.popleft()  # ending at one step, cost 0.2 ms a step
                if done.exception() is not None:
                    self._failed.append(done)  # until flush raises it
            self._pending.append(future)
        return future

    # ---------------------------------------------------------------- on the writer's thread

    def _write_ended(self) -> None:
        with self._lock:
            ending, self._ending, self._end_queued = self._ending, [], False
        ended = [(c, r) for c, r in ending if self._live.pop(r.generation, None) is not None]  # not written already
        for recorder, requests in _by_recorder(ended):
            self._write(recorder, requests, recorder.take_generations([r.generation for r in requests]), ended=True)

    def _write_checkpoint(self, requests: list[tuple[Recorder, Request]]) -> None:
        running = [(c, r) for c, r in requests if r.generation in self._live]  # not ended meanwhile
        for recorder, group in _by_recorder(running):
            # the engine may have stepped since the checkpoint was asked for: rows awaiting their tokens stay
            taken = recorder.take_generations([r.generation for r in group], running=True)
            self._write(recorder, group, taken, ended=True)

    def _write_spill(self, recorders: list[Recorder]) -> bool:
        """The oldest complete rows of each recorder as early parts of their generations; False when no recorder
        had complete rows to take out."""
        freed = False
        for recorder in recorders:
            taken = recorder.take_oldest()
            freed |= taken is not None
            for generation, batches in (taken or {}).items():
                self._write(recorder, [self._live[generation]], batches, ended=False)  # running: ended took its rows
        return freed

    def _write(self, recorder: Recorder, requests: list[Request], batches: list, ended: bool) -> None:
        """Hand the rows ``batches`` (if any) to the table as a part of the requests' generations; their metadata
        says how long each request is so far and, when it may have ended, when."""
        if not any(b.num_rows for b in batches):
            return
        if len(requests) > 1:  # those with rows here (one whose rows all went early, or none came, adds nothing)
            held = set(np.unique(np.concatenate([b.column("generation").to_numpy() for b in batches])).tolist())
            requests = [r for r in requests if r.generation in held]
        entries = [r.entry() for r in requests]
        if ended:
            stamp = now()
            for entry, request in zip(entries, requests):
                entry.update(ended_at=stamp, lengths=[len(request.outputs)])
        vocab = recorder.vocab_size or 0
        metadata = RunMetadata(
            run_id=requests[0].run_id,
            storage=recorder.storage_kind,
            top_k=recorder.storage.k_for(vocab),
            stages=list(recorder.stages),
            vocab_size=vocab,
            eos_token_ids=list(recorder.eos_token_ids),
            model=self.facts.get("model"),
            generations=entries,
            library_version=library_version(),
            created_at=self.created_at,
            extra=dict(self.facts.get("extra") or {}),
        )
        run = Run([b for b in batches if b.num_rows], metadata, self._vocabulary(vocab))
        self.table.add(run.to_arrow(), metadata)

    def _vocabulary(self, size: int) -> Vocabulary:
        """The tokenizer's vocabulary (loaded once, on this thread), or ``<id>`` placeholders."""
        vocab = self._vocab.get(size)
        if vocab is None:
            tokenizer = self._tokenizer()
            vocab = Vocabulary.placeholder(size) if tokenizer is None else vocab_for(tokenizer, size)
            self._vocab[size] = vocab
        return vocab


def _by_recorder(requests: list[tuple[Recorder, Request]]) -> list[tuple[Recorder, list[Request]]]:
    """The requests grouped by the recorder (the storage) holding their rows, in order."""
    groups: dict[int, tuple[Recorder, list[Request]]] = {}
    for recorder, request in requests:
        groups.setdefault(id(recorder), (recorder, []))[1].append(request)
    return list(groups.values())
