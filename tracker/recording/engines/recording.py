"""A serving engine's tracked requests, recorded a batch at a time and written as parts of runs as they end.

An engine samples in a worker process, far from the user, and keeps requests for as long as the server
lives, so what it tracks goes to storage. :class:`EngineRecording` is the engine-independent half of an
engine's processor (:mod:`tracker.recording.engines.vllm` is the other): per step, the tracked rows of the
engine's batch are recorded in one call per storage (:meth:`EngineRecording.record`: one selection, the
storage mode's batched work, one copy), into one :class:`~tracker.recording.recorder.Recorder` per storage
the requests ask for, all under one :class:`~tracker.recording.memory.MemoryBound`, whatever the number of
requests. A request is a generation of its run, and a few ids on the host while it runs; when it ends, its
rows are taken out of the recorder and written as a part of its run in a table, off the engine's step
(:mod:`tracker.recording.engines.parts`). Past the bound, the oldest rows go to their requests early, as further
parts; nothing is written twice.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracker.format.worker import name_os_thread
from tracker.recording.chunks import StepRows
from tracker.recording.engines.parts import PartWriter
from tracker.recording.engines.requests import Request, RequestOptions
from tracker.recording.memory import MemoryBound
from tracker.recording.modes import Storage
from tracker.recording.recorder import Recorder
from tracker.recording.run_metadata import new_run_id

__all__ = ["EngineRecording"]

#: Ended requests remembered in case they come back (a preempted request is resumed by the same engine).
_REMEMBERED = 4096


class EngineRecording:
    """The tracked requests of one engine process: recorders by storage, one memory bound, one part writer.

    Args:
        root: the folder runs are written under (``run_id=<run>/``).
        facts: what the run's metadata says of the engine: ``model`` (its name) and ``extra`` (engine, version,
            dtype, revision...).
        tokenizer: called once, when the first part is written: the tokenizer for token texts (None: ids).
        default_storage, default_top_k: what a request that names none gets.
        memory_limit: bytes of host memory for every tracked request's rows together; past it the oldest rows
            go to their requests' parts early.
        eos_token_ids: end-of-sequence ids, for the ``p_eos`` statistic.
    """

    def __init__(
        self,
        root: str | Path,
        facts: dict[str, Any],
        tokenizer: Callable[[], Any],
        default_storage: str = "float32",
        default_top_k: int = 20,
        memory_limit: int | None = 1 << 30,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.default = RequestOptions.parse({}, default_storage, default_top_k, "the default storage")
        self.run_id = new_run_id()
        self.bound = MemoryBound(memory_limit)
        self.eos_token_ids = list(eos_token_ids)
        self.writer = PartWriter(root, facts, tokenizer)
        self._recorders: dict[tuple[str, int], Recorder] = {}
        self._generations = itertools.count()
        self._last: list[tuple[Recorder, StepRows, list[Request], np.ndarray]] = []
        self._ended: OrderedDict[int, Request] = OrderedDict()  # recently ended, by their output list's id
        self._spilling = None  # the writer's pending job taking rows out past the bound
        self.lock = threading.RLock()  # the engine's thread and the idle watch
        self._idle = _IdleWatch(self)
        ref = weakref.ref(self)
        atexit.register(lambda: (r := ref()) is not None and r.close())  # after the writer's own: LIFO

    def start(self, options: RequestOptions, prompt_ids: Sequence[int], outputs: list[int], sampling: dict) -> Request:
        """A new tracked request (host bookkeeping only); ``outputs`` is the list the engine extends. A request
        that left the batch and comes back with the same output list (preempted, then resumed) continues its
        generation: its later rows are a further part of it."""
        with self.lock:
            return self._start(options, prompt_ids, outputs, sampling)

    def _start(self, options: RequestOptions, prompt_ids: Sequence[int], outputs: list[int], sampling: dict) -> Request:
        resumed = self._ended.pop(id(outputs), None)
        if resumed is not None and resumed.outputs is outputs:
            self.writer.started(resumed)
            return resumed
        suffix = "" if options.key == self.default.key else f"-{options.storage}{options.key[1] or ''}"
        request = Request(next(self._generations), options, self.run_id + suffix, outputs, list(prompt_ids), sampling)
        if options.key not in self._recorders:
            storage = Storage.parse(options.storage, options.top_k)
            recorder = Recorder(storage, ["natural"], run_id=request.run_id, bound=self.bound)
            recorder.eos_token_ids = self.eos_token_ids
            self._recorders[options.key] = recorder
        self.writer.started(request)
        return request

    def finish_step(self) -> None:
        """Give the last step's rows their chosen tokens, read from each request's output ids (those whose ids
        did not grow had their sample discarded, as a chunked prefill's partial steps do: their rows are left
        out, the step is recorded again). Host reads and one batched call per recorder; no device value read."""
        with self.lock:
            last, self._last = self._last, []
        for recorder, rows, requests, steps in last:
            lengths = np.fromiter((len(r.outputs) for r in requests), np.int64, len(requests))
            tokens = [r.outputs[s] if n > s else -1 for r, s, n in zip(requests, steps.tolist(), lengths.tolist())]
            stalled = lengths <= steps
            if stalled.any():
                recorder.supersede(rows, np.flatnonzero(stalled))
            recorder.set_chosen(rows, np.asarray(tokens, dtype=np.int64))

    def end(self, request: Request) -> None:
        """The request left the batch: its part is written on the writer thread. Call after :meth:`finish_step`.
        It is remembered for a while, by its output list, in case it comes back (preempted)."""
        self.writer.end(self._recorders[request.options.key], request)
        self._ended[id(request.outputs)] = request  # holds the list: its id is not reused meanwhile
        while len(self._ended) > _REMEMBERED:
            self._ended.popitem(last=False)

    def record(self, logits: torch.Tensor, groups: Sequence[tuple[torch.Tensor, list[Request]]]) -> None:
        """Record this step's tracked rows: per group (requests of one storage), ``logits[index]`` as the
        requests' natural rows, at each request's step (its output length). Batched work and one copy per
        group; reads no device value (does not synchronise). Waits for the writer only when the rows held
        exceed the memory bound."""
        self._idle.stepped()
        if not all(self._recorders[requests[0].options.key].has_room(len(requests)) for _, requests in groups):
            self._hold_bound()  # only a new chunk adds host memory
        vocab = int(logits.shape[1])
        for index, requests in groups:
            recorder = self._recorders[requests[0].options.key]
            steps = np.fromiter((len(r.outputs) for r in requests), np.int64, len(requests))
            generations = np.fromiter((r.generation for r in requests), np.int64, len(requests))
            rows = recorder.begin_step(generations, steps, len(requests), vocab, logits.device, sequence=0)
            recorder.write(rows, "natural", logits, index=index)
            self._last.append((recorder, rows, requests, steps))

    def _hold_bound(self) -> None:
        """Before a step that starts a new chunk: keep room for one more chunk of each recorder under the bound,
        by having the writer take the oldest complete rows out (parts written early); wait for it only when there
        is no room."""
        limit = self.bound.limit
        if limit is None:
            return
        room = sum(r.chunk_nbytes for r in self._recorders.values())
        while self.bound.used() + room > limit:
            if self._spilling is None:
                self._spilling = self.writer.spill(list(self._recorders.values()))
            freed = self._spilling.result()  # waits for the disk; raises what the writer could not do
            self._spilling = None
            if not freed:
                break  # nothing complete to take out: the bound is smaller than the rows of a step or two

    def checkpoint(self) -> bool:
        """The engine went idle: its requests may have finished without the engine saying so yet (it says when it
        next steps, which may be never). Give the last step its chosen tokens and write every running request's
        rows so far as parts of them (a request that goes on adds further parts). False, nothing done, while the
        last step's tokens are not all in the output lists yet (the step is still running)."""
        with self.lock:
            if any(len(r.outputs) <= s for _, _, requests, steps in self._last for r, s in zip(requests, steps)):
                return False  # a step still in progress (its tokens not appended yet): not idle after all
            self.finish_step()
            self.writer.checkpoint([(self._recorders[r.options.key], r) for r in self.writer.live()])
            return True

    def flush(self) -> None:
        """Wait until every ended request's part is committed; raises a write that failed."""
        self.writer.flush()

    def close(self) -> None:
        """Write every request's part (those still running as far as they got), mark the runs complete (no
        longer growing), stop the writer's thread. Runs at the engine process's exit too. Idempotent."""
        if self.writer.closed:
            return
        self._idle.stop()
        self.finish_step()
        self.writer.close(self._recorders)
        for recorder in self._recorders.values():
            recorder.close()


class _IdleWatch:
    """The engine's idleness, watched on a thread of its own (started at the first step, stopped by
    :meth:`EngineRecording.close`): when no step came for ``max(min_idle, 4 x`` the usual time between steps``)``
    after rows were recorded, :meth:`EngineRecording.checkpoint` writes them. An engine steps while it has
    requests to run, so an idle one has finished them (or waits for memory), and its processor is only told so
    at its next step: without this, a server stopped while idle (its worker process killed) would lose them."""

    def __init__(self, recording: EngineRecording, min_idle: float = 0.5) -> None:
        self._recording = weakref.ref(recording)
        self.min_idle = min_idle
        self._last = 0.0
        self._interval = 0.0  # moving average of the time between steps
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stepped(self) -> None:
        """A step recorded rows (the engine's thread; a clock read)."""
        now_ = time.monotonic()
        if self._last:
            self._interval = 0.9 * self._interval + 0.1 * (now_ - self._last)
        self._last, self._dirty = now_, True
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="logitscope-idle", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        name_os_thread()
        while not self._stop.wait(self.min_idle / 2):
            recording = self._recording()
            if recording is None:
                return
            if self._dirty and time.monotonic() - self._last > max(self.min_idle, 4 * self._interval):
                self._dirty = not recording.checkpoint()
            del recording
