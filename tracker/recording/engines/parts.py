"""Writing an engine's requests as parts of runs, on one background thread.

Each request is one generation of its run. When it ends, :class:`PartWriter` takes its rows out of the
recorder and writes them, atomically, as ``<root>/run_id=<run>/part-<generation>.parquet``, then replaces the
run's completion marker with one listing every part so far (marked growing while the server runs; see
:func:`tracker.format.dataset.write_marker`), so :meth:`tracker.Run.load`, the dashboard and ``logitscope
query`` read the run while the server keeps running. Past the engine's memory bound, the oldest rows of
requests still running are written early, as further parts of their generation
(``part-<generation>-<piece>.parquet``), listed in the marker once the generation ends; each row is written
once. :meth:`PartWriter.close` writes what is left (requests still running included, as far as they got)
and marks the runs complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from processors.vocab import Vocabulary, vocab_for
from tracker.format.dataset import write_marker
from tracker.format.layout import folder_arg
from tracker.format.provenance import library_version
from tracker.format.run_file import write_parquet
from tracker.format.schema import RunMetadata
from tracker.format.worker import Worker
from tracker.reading.run import Run
from tracker.recording.recorder import Recorder
from tracker.recording.run_metadata import now

if TYPE_CHECKING:
    from tracker.recording.engines.requests import Request

__all__ = ["PartWriter"]

_PROMPT_CHARS = 200


class PartWriter:
    """Writes ended requests as parts of runs under ``root``, in order, on its own thread.

    Args:
        root: the dataset folder.
        facts: ``model`` and ``extra`` for every run's metadata (the engine, its version, the model's dtype...).
        tokenizer: called once, on the writer's thread, for the vocabulary written with the parts (None: ids).
    """

    def __init__(self, root: str | Path, facts: dict[str, Any], tokenizer: Callable[[], Any]) -> None:
        self.root = folder_arg("runs", root)
        self.facts = facts
        self._tokenizer = tokenizer
        self._vocab: dict[int, Vocabulary] = {}
        self._worker = Worker("logitscope-parts", depth=256)
        self._live: dict[int, Request] = {}  # generation -> request, while it runs
        self._pieces: dict[int, tuple[list[str], int]] = {}  # generation -> parts written early, their rows
        self._parts_of: dict[int, int] = {}  # generation -> parts written so far (names are numbered)
        self._runs: dict[str, dict[str, Any]] = {}  # run id -> parts, bytes and summary so far (this thread's)
        self._pending: list[Future[Any]] = []
        self._lock = threading.Lock()
        self.closed = False

    # ---------------------------------------------------------------- called on the engine's thread

    def started(self, request: Request) -> None:
        self._live[request.generation] = request

    def live(self) -> list[Request]:
        """The requests that started and have not ended."""
        return list(self._live.values())

    def end(self, recorder: Recorder, request: Request) -> None:
        """Write ``request``'s part (returns at once)."""
        self._submit(self._write_end, recorder, request)

    def checkpoint(self, recorder: Recorder, request: Request) -> None:
        """Write the rows ``request`` holds now, as a part of it, keeping it running (the engine went idle: the
        request may have finished without the engine saying so yet). Returns at once."""
        self._submit(self._write_checkpoint, recorder, request)

    def spill(self, recorders: list[Recorder]) -> Future[Any]:
        """Take the oldest complete chunk of rows out of each recorder and write them early (returns at once)."""
        return self._submit(self._write_spill, recorders)

    def flush(self) -> list[Path]:
        """Wait for every part asked for so far; the paths written. Raises the first failure (once)."""
        with self._lock:
            pending, self._pending = self._pending, []
        paths, failure = [], None
        for future in pending:
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - raised below, once
                failure = failure or exc
                continue
            paths.extend(result if isinstance(result, list) else [result] if result is not None else [])
        if failure is not None:
            raise RuntimeError(
                f"logitscope could not write a request's part under '{self.root}': {failure}"
            ) from failure
        return paths

    def close(self, recorders: dict[Any, Recorder] | None = None) -> None:
        """Write the requests still running as far as they got (with ``recorders``), mark every run complete
        (no longer growing), stop the thread. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if recorders is not None:
            for request in list(self._live.values()):
                self._submit(self._write_end, recorders[request.options.key], request)
        self._submit(self._complete_runs)
        self._worker.close()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future = self._worker.submit(fn, *args)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
            self._pending.append(future)
        return future

    # ---------------------------------------------------------------- on the writer's thread

    def _write_end(self, recorder: Recorder, request: Request) -> Path | None:
        if self._live.pop(request.generation, None) is None:
            return None  # written already (a request ended twice: removed, then at close)
        return self._write_now(recorder, request)

    def _write_checkpoint(self, recorder: Recorder, request: Request) -> Path | None:
        if request.generation not in self._live:
            return None  # ended meanwhile: its part took its rows
        return self._write_now(recorder, request)

    def _write_now(self, recorder: Recorder, request: Request) -> Path | None:
        """Write the rows the generation holds now as a part of it, listed in its run's marker at once (with
        those written early); None when it holds none that are not written already."""
        batches = recorder.take_generation(request.generation)
        pieces, early = self._pieces.pop(request.generation, ([], 0))
        rows = sum(b.num_rows for b in batches)
        path = None
        if rows:
            entry = dict(request.entry(), ended_at=now(), lengths=[len(request.outputs)])
            path = self._write(recorder, request, batches, entry, self._name(request.generation))
            pieces = [*pieces, path.name]
        if pieces:
            self._mark(request.run_id, pieces, recorder, request, early + rows)
        return path

    def _write_spill(self, recorders: list[Recorder]) -> bool:
        """The oldest complete rows of each recorder as early parts of their generations; False when no
        recorder had complete rows to take out."""
        freed = False
        for recorder in recorders:
            taken = recorder.take_oldest()
            freed |= taken is not None
            for generation, batches in (taken or {}).items():
                request = self._live[generation]  # running: an ended request's part took its rows
                pieces, rows = self._pieces.get(generation, ([], 0))
                path = self._write(recorder, request, batches, request.entry(), self._name(generation))
                self._pieces[generation] = ([*pieces, path.name], rows + sum(b.num_rows for b in batches))
        return freed

    def _name(self, generation: int) -> str:
        """The next part's name: ``part-<generation>.parquet``, then ``part-<generation>-<n>.parquet`` for the
        parts written early (past the memory bound) or after the request came back (preempted)."""
        count = self._parts_of.get(generation, 0)
        self._parts_of[generation] = count + 1
        return f"part-{generation:09d}.parquet" if count == 0 else f"part-{generation:09d}-{count:04d}.parquet"

    def _write(self, recorder: Recorder, request: Request, batches: list, entry: dict, name: str) -> Path:
        metadata = self._metadata(recorder, request, entry)
        run = Run([b for b in batches if b.num_rows], metadata, self._vocabulary(recorder.vocab_size or 0))
        folder = self.root / f"run_id={request.run_id}"
        return Path(write_parquet(run.to_arrow(), folder / name, metadata, scratch=self.root))

    def _metadata(self, recorder: Recorder, request: Request, entry: dict[str, Any]) -> RunMetadata:
        vocab = recorder.vocab_size or 0
        return RunMetadata(
            run_id=request.run_id,
            storage=recorder.storage_kind,
            top_k=recorder.storage.k_for(vocab),
            stages=list(recorder.stages),
            vocab_size=vocab,
            eos_token_ids=list(recorder.eos_token_ids),
            model=self.facts.get("model"),
            sampling=request.sampling,
            generations=[entry],
            library_version=library_version(),
            created_at=request.started_at,
            extra=dict(self.facts.get("extra") or {}),
        )

    def _vocabulary(self, size: int) -> Vocabulary:
        """The tokenizer's vocabulary (loaded once, on this thread), or ``<id>`` placeholders."""
        vocab = self._vocab.get(size)
        if vocab is None:
            tokenizer = self._tokenizer()
            vocab = Vocabulary.placeholder(size) if tokenizer is None else vocab_for(tokenizer, size)
            self._vocab[size] = vocab
        return vocab

    def _mark(self, run_id: str, names: list[str], recorder: Recorder, request: Request, rows: int) -> None:
        """Replace the run's completion marker with one listing every part so far: the run is listed, and grows,
        while the server runs. Its summary is the run's: the first request's prompt, the longest sequence."""
        folder = self.root / f"run_id={run_id}"
        seen = self._runs.get(run_id)
        if seen is None:
            vocab = recorder.vocab_size or 0
            prompt = self._vocabulary(vocab).decode_shown(request.prompt_ids)[:_PROMPT_CHARS]
            summary = {
                "title": "", "model": self.facts.get("model") or "", "processors": "none",
                "sampling": request.sampling, "created_at": request.started_at, "storage": recorder.storage_kind,
                "top_k": recorder.storage.k_for(vocab), "stages": list(recorder.stages), "vocab_size": vocab,
                "rows": 0, "steps": 0, "sequences": 1, "generations": 0, "prompt": prompt,
            }  # fmt: skip
            seen = self._runs[run_id] = {"parts": [], "bytes": 0, "summary": summary, "folder": folder, "ids": set()}
        seen["parts"] += names
        seen["bytes"] += sum((folder / n).stat().st_size for n in names)
        total = seen["summary"]
        total["rows"] += rows
        total["steps"] = max(total["steps"], len(request.outputs))
        seen["ids"].add(request.generation)  # a request that came back is still one generation
        total["generations"] = len(seen["ids"])
        write_marker(
            pafs.LocalFileSystem(), str(folder), run_id, list(seen["parts"]), seen["bytes"], total, growing=True
        )

    def _complete_runs(self) -> None:
        """Every run this writer wrote: its marker, no longer growing."""
        for run_id, seen in self._runs.items():
            write_marker(
                pafs.LocalFileSystem(), str(seen["folder"]), run_id, list(seen["parts"]), seen["bytes"], seen["summary"]
            )
