"""One engine request recorded as one generation, written as its own Parquet part of a run when it ends.

Serving engines (vLLM, SGLang) sample in a worker process, far from the
user, and keep requests for as long as the server lives. So each tracked
request gets its own :class:`~tracker.LogitTrackingProcessor` recording (its
rows are freed when it ends), and each ended request is written, atomically,
as ``<runs>/run_id=<run>/part-<generation>.parquet``, then the run's completion
marker is replaced by one listing every part so far (marked growing, see
:func:`tracker.format.dataset.write_marker`): :meth:`tracker.Run.load`, the dashboard
and ``logitscope query`` read those parts as one run while the server keeps running. Writing happens on a background thread, never in the engine's
step.

Options a request may give (engine-independent; see the engines' modules for
where they come from):

- ``storage``: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"topk"``;
- ``top_k``: values kept per row with ``storage="topk"``;
- ``title``: a label kept in the generation's metadata;
- ``request_id``: the caller's id for the request, kept in the generation's
  metadata (engines do not tell their processors a request's id).

Requests with different ``storage``/``top_k`` go to different runs (a run
holds one storage): the run id is the server's, followed by the storage when
it is not the server's default.
"""

from __future__ import annotations

import atexit
import json
import numbers
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from processors import BatchContext
from tracker.format.dataset import run_summary, write_marker
from tracker.format.layout import folder_arg
from tracker.format.run_file import write_parquet
from tracker.recording.processor import LogitTrackingProcessor
from tracker.recording.recorder import StepRows
from tracker.recording.run_metadata import new_run_id, now

__all__ = ["RequestOptions", "RequestRecording", "PartWriter", "OPTION_KEYS", "STORAGES"]

OPTION_KEYS = ("storage", "top_k", "title", "request_id")
STORAGES = ("float32", "float16", "bfloat16", "topk")


class RequestOptions:
    """What one request asked for, checked: ``options`` is ``True`` (or 1), a dict of :data:`OPTION_KEYS`, or
    that dict's JSON text (what an HTTP client can send through vLLM's ``vllm_xargs``).

    ``None``, ``False`` or 0 mean "not tracked" (:meth:`parse` returns None).
    A bad value is a ValueError naming the key, the value and what is allowed.
    """

    __slots__ = ("storage", "top_k", "title", "request_id")

    def __init__(self, storage: str, top_k: int, title: str | None, request_id: str | None) -> None:
        self.storage, self.top_k, self.title, self.request_id = storage, top_k, title, request_id

    @classmethod
    def parse(cls, options: Any, default_storage: str, default_top_k: int, where: str) -> RequestOptions | None:
        if options is None or options is False or (type(options) is int and options == 0):
            return None
        if options is True or (type(options) is int and options == 1):
            options = {}
        if isinstance(options, str):  # an HTTP client's vllm_xargs hold strings and numbers, not objects
            try:
                options = json.loads(options)
            except ValueError:
                raise ValueError(f"{where} is a string but not JSON: {options!r}") from None
        if not isinstance(options, Mapping):
            raise ValueError(
                f"{where} must be true/1, false/0, or an object (or its JSON text) with keys {list(OPTION_KEYS)}, "
                f"got {options!r}"
            )
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; allowed: {list(OPTION_KEYS)}")
        storage = options.get("storage", default_storage)
        if storage not in STORAGES:
            raise ValueError(f"{where}['storage'] must be one of {list(STORAGES)}, got {storage!r}")
        top_k = options.get("top_k", default_top_k)
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
            raise ValueError(f"{where}['top_k'] must be an int >= 1, got {top_k!r}")
        labels = {}
        for key in ("title", "request_id"):
            value = options.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{where}[{key!r}] must be a string, got {value!r}")
            labels[key] = value
        return cls(storage, int(top_k), labels["title"], labels["request_id"])

    def run_suffix(self, default_storage: str, default_top_k: int) -> str:
        """What tells this request's run apart from the server's default one ('' when it is the default)."""
        if self.storage == default_storage and (self.storage != "topk" or self.top_k == default_top_k):
            return ""
        return f"-{self.storage}{self.top_k if self.storage == 'topk' else ''}"


class RequestRecording:
    """One request's rows: a generation of batch 1 recorded step by step through a tracker's Recorder.

    ``record(row, step)`` keeps the row ``[1, V]`` as the step's natural
    logits; ``choose(token)`` gives the last recorded step its chosen token.
    A step recorded twice (the engine computed a row whose sample it then
    discarded, as a chunked prefill does) keeps only its last row when the
    part is written.
    """

    def __init__(
        self,
        generation: int,
        prompt_ids: Sequence[int],
        options: RequestOptions,
        tokenizer: Any,
        sampling: dict[str, Any],
        memory_limit: int | None,
    ) -> None:
        self.options = options
        self.tracker = LogitTrackingProcessor(
            None,
            tokenizer,
            storage=options.storage,  # type: ignore[arg-type]
            top_k=options.top_k,
            memory_limit=memory_limit,
        )
        shared = self.tracker._shared
        shared.next_generation = generation
        shared.expect_sampling([sampling])
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long).view(1, -1)
        self.generation = shared.open_generation(BatchContext(input_ids=ids, prompt_length=ids.shape[1]), 1, None)
        self.recorder = self.tracker.recorder
        self.last_rows: StepRows | None = None
        self.last_step = -1
        self.chosen_known = True
        self.steps = 0

    def record(self, row: torch.Tensor, step: int) -> None:
        """Keep ``row [1, V]`` as ``step``'s logits. Runs every step; non-blocking copies only (no sync)."""
        rows = self.recorder.begin_step(self.generation.id, step, 1, int(row.shape[1]), row.device)
        self.recorder.write(rows, "natural", row)
        self.last_rows, self.last_step, self.chosen_known = rows, step, False
        self.steps += 1

    def choose(self, token: int) -> None:
        """The token chosen at the last recorded step (a host int; ``-1`` or less: unknown, left unset)."""
        if self.last_rows is not None and not self.chosen_known and token >= 0:
            self.recorder.set_chosen(self.last_rows, [token])
            self.chosen_known = True

    def table(self, run_id: str, generated: int) -> tuple[pa.Table, Any]:
        """The request's rows (superseded rows of a step dropped) and the run metadata of its part.

        Drains the recording (on CUDA: waits for its copies; called off the engine's thread).
        """
        shared = self.tracker._shared
        shared.note_lengths([generated])
        self.recorder.end_generation(self.generation.id)
        run = self.tracker.run
        table = run.to_arrow()
        if table.num_rows:
            steps = table.column("step").to_numpy()
            last = len(steps) - 1 - np.unique(steps[::-1], return_index=True)[1]  # each step's last row
            if len(last) != len(steps):
                table = table.take(pa.array(np.sort(last)))
        entry = dict(shared.generations[-1])
        entry["ended_at"] = now()
        for key in ("title", "request_id"):
            value = getattr(self.options, key)
            if value is not None:
                entry[key] = value
        metadata = replace(run.metadata, run_id=run_id, generations=[entry])
        return table, metadata

    def close(self) -> None:
        """Free the rows (and spill files) of the recording."""
        self.tracker.recorder.clear()


class PartWriter:
    """Writes ended requests as parts of runs under ``root``, one background thread, in order.

    ``write(recording, run_id, generated)`` returns at once; :meth:`flush`
    waits for every part asked for so far (and raises the first failure).
    A part is written atomically: a reader sees it whole or not at all.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = folder_arg("runs", root)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitscope-parts")
        self._pending: list[Future[Path]] = []
        self._runs: dict[str, dict[str, Any]] = {}  # per run: its parts, bytes and summary so far (the thread's)
        self._lock = threading.Lock()
        atexit.register(self.flush, raise_errors=False)

    def write(self, recording: RequestRecording, run_id: str, generated: int) -> None:
        future = self._pool.submit(self._write, recording, run_id, generated)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
            self._pending.append(future)

    def _write(self, recording: RequestRecording, run_id: str, generated: int) -> Path:
        try:
            table, metadata = recording.table(run_id, generated)
            summary = run_summary(recording.tracker.run)
            folder = self.root / f"run_id={run_id}"
            path = write_parquet(
                table, folder / f"part-{recording.generation.id:09d}.parquet", metadata, scratch=self.root
            )
            self._mark(folder, run_id, Path(path), summary)
            return path
        finally:
            recording.close()

    def _mark(self, folder: Path, run_id: str, part: Path, summary: dict[str, Any]) -> None:
        """Replace the run's completion marker with one listing every part so far (this writer's thread only):
        the run is listed, and grows, while the server runs."""
        seen = self._runs.get(run_id)
        if seen is None:
            seen = self._runs[run_id] = {"parts": [], "bytes": 0, "summary": dict(summary, generations=0, rows=0)}
        total = seen["summary"]
        seen["parts"].append(part.name)
        seen["bytes"] += part.stat().st_size
        for key in ("steps", "sequences"):
            total[key] = max(int(total.get(key) or 0), int(summary.get(key) or 0))
        total["rows"] += int(summary.get("rows") or 0)
        total["generations"] += 1
        total["prompt"] = summary.get("prompt", "")
        write_marker(
            pafs.LocalFileSystem(), str(folder), run_id, list(seen["parts"]), seen["bytes"], total, growing=True
        )

    def flush(self, raise_errors: bool = True) -> list[Path]:
        """Wait for every part asked for so far; the paths written. Raises the first failure (once)."""
        with self._lock:
            pending, self._pending = self._pending, []
        paths, failure = [], None
        for future in pending:
            try:
                paths.append(future.result())
            except Exception as exc:  # noqa: BLE001 - raised below, once
                failure = failure or exc
        if failure is not None and raise_errors:
            raise RuntimeError(
                f"logitscope could not write a request's part under '{self.root}': {failure}"
            ) from failure
        return paths


def server_run_id() -> str:
    """A new run id for a server process (each engine process writes its own run)."""
    return new_run_id()
