"""logitscope inside SGLang: a ``CustomLogitProcessor`` that records the requests that ask.

SGLang (started with ``--enable-custom-logit-processor``) calls a request's
custom logit processor from its sampler, on the rows of the batch whose
requests name it, as ``processor(logits [m, V], custom_param_list)``: one
``custom_params`` dict per row, to which SGLang adds the request object under
``"__req__"`` (``sglang.srt.layers.sampler.apply_custom_logit_processor``).
A client names the processor by its serialised form and asks for tracking in
``custom_params``::

    from tracker.recording.engines.sglang import LogitscopeLogitProcessor

    requests.post(f"{server}/generate", json={
        "text": "Hello", "custom_logit_processor": LogitscopeLogitProcessor.to_str(),
        "sampling_params": {"temperature": 0.7, "custom_params": {"logitscope": {"request_id": "r1"}}},
    })

``custom_params["logitscope"]`` takes what the vLLM processor's
``extra_args["logitscope"]`` takes (:mod:`tracker.recording.engines.requests`);
a row without it (or with ``false``) is not recorded. ``to_str`` pickles the
class by reference: the server needs logitscope installed. Where runs land is
the server's environment, as for vLLM: ``LOGITSCOPE_RUNS``,
``LOGITSCOPE_STORAGE``, ``LOGITSCOPE_TOP_K``, ``LOGITSCOPE_MEMORY_LIMIT``
(or class attributes of a subclass, named instead).

What is recorded, per tracked request and step: the row the processor
receives (after SGLang's penalties, logit bias, min-new-tokens and grammar
mask, before temperature, min-p, top-k and top-p) as ``natural``, at step
``len(req.output_ids)`` (SGLang runs the sampler after the previous batch's
tokens are appended, also under overlap scheduling); the token chosen at a
step, read from ``req.output_ids`` at the request's next step or when it
ends. SGLang builds a new processor object from the serialised class for each
batch, so the recordings live in one recorder per class and process. A
request ends when SGLang marks it finished or frees it: it is written, as its
own Parquet part of the process's run, at the processor's next call in that
process, at :meth:`LogitscopeLogitProcessor.flush`, or at exit. A malformed
``custom_params["logitscope"]`` is logged and the request not recorded
(raising in SGLang's sampler would fail the whole batch). With tensor
parallelism every rank runs the sampler; only rank 0 records. SGLang's
sampling stages after the row are not computed (vLLM's are:
:mod:`tracker.reading.engine_stages`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tracker.recording.engines.requests import PartWriter, RequestOptions, RequestRecording, server_run_id

__all__ = ["LogitscopeLogitProcessor", "PARAMS_KEY", "SGLANG_IMPORT_ERROR"]

PARAMS_KEY = "logitscope"
_LOG = logging.getLogger(__name__)

try:  # SGLang's own base class (to_str/from_str) where SGLang imports
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor as _SGLangBase

    SGLANG_IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any failure to import SGLang means "no SGLang here"
    _SGLangBase = object  # type: ignore[assignment,misc]
    SGLANG_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def _sampling_summary(params: Any) -> dict[str, Any]:
    """The request's sampling parameters (JSON-ready), and ``"sampler": "sglang"``."""
    out: dict[str, Any] = {"sampler": "sglang"}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "max_new_tokens", "sampling_seed"):  # fmt: skip
        value = getattr(params, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out


class _Request:
    """A tracked request: its recording, a weak proxy of SGLang's request, and its output-id array (kept, so
    that the last token is read even after SGLang frees the request)."""

    __slots__ = ("recording", "req", "outputs", "run_id")

    def __init__(self, recording: RequestRecording, req: Any, run_id: str) -> None:
        self.recording, self.req, self.outputs, self.run_id = recording, req, req.output_ids, run_id

    def observe(self, row: torch.Tensor, step: int) -> None:
        """This step's row ``[1, V]``: first the token chosen at the last step, then the row. Host reads only."""
        recording = self.recording
        if recording.last_rows is not None and step > recording.last_step:
            recording.choose(int(self.outputs[recording.last_step]))
        recording.record(row, step)

    def finished(self) -> bool:
        try:
            return bool(self.req.finished())
        except ReferenceError:  # SGLang freed it: it has ended
            return True

    def end(self) -> int:
        recording, outputs = self.recording, self.outputs
        if recording.last_rows is not None and len(outputs) > recording.last_step:
            recording.choose(int(outputs[recording.last_step]))
        return len(outputs)


class _Recorder:
    """The tracked requests of one processor class in one process, and the writer of their parts."""

    def __init__(self, owner: type[LogitscopeLogitProcessor]) -> None:
        self.storage = owner.storage or os.environ.get("LOGITSCOPE_STORAGE") or "float32"
        self.top_k = owner.top_k or _env_int("LOGITSCOPE_TOP_K", 20)
        RequestOptions.parse({}, self.storage, self.top_k, "LOGITSCOPE_STORAGE/LOGITSCOPE_TOP_K")
        self.memory = owner.memory_limit or _env_int("LOGITSCOPE_MEMORY_LIMIT", 256 << 20)
        self.root = owner.runs or os.environ.get("LOGITSCOPE_RUNS") or "logitscope-runs"
        self.tokenizer = owner.tokenizer
        self.run_id = server_run_id()
        self.writer: PartWriter | None = None
        self.tracked: dict[str, _Request] = {}
        self.generations = itertools.count()
        self.lock = threading.Lock()
        self.writes = _tensor_parallel_rank() == 0
        atexit.register(self.flush, ending=True)

    def record(self, logits: torch.Tensor, params: Sequence[Any] | None) -> None:
        """Keep each asking row of ``logits`` as its request's step; end the requests SGLang has finished."""
        if not self.writes:
            return
        with self.lock:
            seen = set()
            for row, entry in enumerate(params or ()):
                tracked = self._tracked(entry)
                if tracked is not None:
                    tracked.observe(logits[row : row + 1], len(tracked.outputs))
                    seen.add(id(tracked))
            self._end([key for key, t in self.tracked.items() if id(t) not in seen and t.finished()])

    def _tracked(self, entry: Any) -> _Request | None:
        """The tracked request a row's ``custom_params`` belongs to (started on its first row), or None."""
        if not isinstance(entry, dict) or not entry.get(PARAMS_KEY):
            return None
        req = entry.get("__req__")
        key = str(getattr(req, "rid", ""))
        tracked = self.tracked.get(key)
        if tracked is not None and tracked.outputs is req.output_ids:
            return tracked
        if tracked is not None:  # SGLang restarted it from its prompt (a retracted request with embeddings)
            self._end([key])
        try:
            options = RequestOptions.parse(
                entry[PARAMS_KEY], self.storage, self.top_k, f'custom_params["{PARAMS_KEY}"]'
            )
        except ValueError as exc:
            _LOG.warning("logitscope does not record request %s: %s", key, exc)
            return None
        if options is None:
            return None
        tokenizer = self.tokenizer or getattr(req, "tokenizer", None)
        prompt = list(req.origin_input_ids)
        sampling = _sampling_summary(req.sampling_params)
        recording = RequestRecording(next(self.generations), prompt, options, tokenizer, sampling, self.memory)
        if options.request_id is None:
            recording.options.request_id = key  # SGLang tells its request id: kept unless the client gave one
        tracked = self.tracked[key] = _Request(
            recording, req, self.run_id + options.run_suffix(self.storage, self.top_k)
        )
        return tracked

    def _end(self, keys: list[str]) -> None:
        for key in keys:
            tracked = self.tracked.pop(key)
            generated = tracked.end()
            if self.writer is None:
                self.writer = PartWriter(self.root)
            self.writer.write(tracked.recording, tracked.run_id, generated)

    def flush(self, ending: bool = False) -> list[Any]:
        """Write every finished request (every tracked one when ``ending``) and wait for the writes."""
        with self.lock:
            self._end([key for key, t in self.tracked.items() if ending or t.finished()])
            writer = self.writer
        return [] if writer is None else writer.flush(raise_errors=not ending)


_RECORDERS: dict[type, _Recorder] = {}
_RECORDERS_LOCK = threading.Lock()


def _tensor_parallel_rank() -> int:
    """This process's tensor-parallel rank in SGLang (0 outside a parallel group): only rank 0 records."""
    try:
        from sglang.srt.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no SGLang, or no parallel state: a single process
        pass
    return 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


class LogitscopeLogitProcessor(_SGLangBase):  # type: ignore[misc,valid-type]
    """An SGLang custom logit processor that records the requests whose ``custom_params`` ask (see the module).

    Subclass it to fix the configuration in code (``runs``, ``storage``,
    ``top_k``, ``memory_limit``, ``tokenizer`` class attributes; None reads
    the environment) and send the subclass's ``to_str()``.
    """

    runs: str | None = None
    storage: str | None = None
    top_k: int | None = None
    memory_limit: int | None = None
    tokenizer: Any = None

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """Record the asking rows of ``logits [m, V]``; return ``logits`` unchanged. Runs every step: copies
        the rows without waiting for the device, reads the requests' output ids on the host."""
        _recorder(type(self)).record(logits, custom_param_list)
        return logits

    @classmethod
    def flush(cls) -> list[Any]:
        """Write every request SGLang has finished and wait for the writes (the parts' paths)."""
        return _recorder(cls).flush()


def _recorder(owner: type[LogitscopeLogitProcessor]) -> _Recorder:
    recorder = _RECORDERS.get(owner)
    if recorder is None:
        with _RECORDERS_LOCK:
            recorder = _RECORDERS.get(owner)
            if recorder is None:
                recorder = _RECORDERS[owner] = _Recorder(owner)
    return recorder
