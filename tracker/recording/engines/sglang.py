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
batch, so the recordings live in one recording per class and process (the
engine-independent :class:`~tracker.recording.engines.recording.EngineRecording`
vLLM's processor uses too: one batched call per storage per step, one memory
bound, one writer). A request ends when SGLang marks it finished or frees it: it
is written, as a part of the process's run in the table ``LOGITSCOPE_RUNS``, at
the processor's next call in that process, when the engine goes idle, at
:meth:`LogitscopeLogitProcessor.flush`, or at exit. A malformed
``custom_params["logitscope"]`` is logged and the request not recorded
(raising in SGLang's sampler would fail the whole batch). With tensor
parallelism every rank runs the sampler; only rank 0 records. SGLang's
sampling stages after the row are not computed (vLLM's are:
:mod:`tracker.reading.engine_stages`).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tracker.recording.engines.recording import EngineRecording
from tracker.recording.engines.requests import Request, RequestOptions, env_int, tensor_parallel_rank

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


class _Recorder:
    """The tracked requests of one processor class in one process: their recording, and SGLang's requests."""

    def __init__(self, owner: type[LogitscopeLogitProcessor]) -> None:
        storage = owner.storage or os.environ.get("LOGITSCOPE_STORAGE") or "float32"
        top_k = owner.top_k or env_int("LOGITSCOPE_TOP_K", 20)
        self.tokenizer = owner.tokenizer
        self.recording = EngineRecording(
            owner.runs or os.environ.get("LOGITSCOPE_RUNS") or "logitscope-runs",
            {"model": None, "extra": {"engine": {"name": "sglang", "version": _version()}}},
            lambda: self.tokenizer,
            storage,
            top_k,
            owner.memory_limit or env_int("LOGITSCOPE_MEMORY_LIMIT", 1 << 30),
        )
        self.tracked: dict[str, tuple[Request, Any]] = {}  # SGLang's request id -> (our request, SGLang's)
        self.writes = tensor_parallel_rank("sglang.srt.distributed.parallel_state") == 0

    def record(self, logits: torch.Tensor, params: Sequence[Any] | None) -> None:
        """Record each asking row of ``logits`` at its request's step (one batched call per storage); end the
        requests SGLang has finished. Host reads only, besides the recorder's copies (no synchronisation)."""
        if not self.writes:
            return
        recording = self.recording
        with recording.lock:
            recording.finish_step()  # the last call's rows get their tokens, now in the requests' output ids
            groups: dict[Any, tuple[list[int], list[Request]]] = {}
            seen = set()
            for row, entry in enumerate(params or ()):
                request = self._tracked(entry)
                if request is not None:
                    index, requests = groups.setdefault(request.options.key, ([], []))
                    index.append(row)
                    requests.append(request)
                    seen.add(request.generation)
            for key in [k for k, (r, req) in self.tracked.items() if r.generation not in seen and _finished(req)]:
                recording.end(self.tracked.pop(key)[0])
            if groups:
                device = logits.device
                batches = [(torch.tensor(i, dtype=torch.int64).to(device), r) for i, r in groups.values()]
                recording.record(logits, batches)

    def _tracked(self, entry: Any) -> Request | None:
        """The tracked request a row's ``custom_params`` belongs to (started on its first row), or None."""
        if not isinstance(entry, dict) or not entry.get(PARAMS_KEY):
            return None
        req = entry.get("__req__")
        key = str(getattr(req, "rid", ""))
        known = self.tracked.get(key)
        if known is not None and known[0].outputs is req.output_ids:
            return known[0]
        if known is not None:  # SGLang restarted it from its prompt (a retracted request with embeddings)
            self.recording.end(self.tracked.pop(key)[0])
        try:
            default = self.recording.default
            options = RequestOptions.parse(
                entry[PARAMS_KEY], default.storage, default.top_k, f'custom_params["{PARAMS_KEY}"]'
            )
        except ValueError as exc:
            _LOG.warning("logitscope does not record request %s: %s", key, exc)
            return None
        if options is None:
            return None
        if options.request_id is None:
            options.request_id = key  # SGLang tells its request id: kept unless the client gave one
        if self.tokenizer is None:
            self.tokenizer = getattr(req, "tokenizer", None)
        sampling = _sampling_summary(req.sampling_params)
        request = self.recording.start(options, list(req.origin_input_ids), req.output_ids, sampling)
        self.tracked[key] = (request, weakref.proxy(req) if _weakrefable(req) else req)
        return request

    def flush(self) -> None:
        """Write every request SGLang has finished and wait until their parts are committed."""
        with self.recording.lock:
            self.recording.finish_step()
            for key in [k for k, (_, req) in self.tracked.items() if _finished(req)]:
                self.recording.end(self.tracked.pop(key)[0])
        self.recording.flush()


def _finished(req: Any) -> bool:
    try:
        return bool(req.finished())
    except ReferenceError:  # SGLang freed it: it has ended
        return True


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _version() -> str | None:
    try:
        from sglang import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001 - no SGLang here (the class alone)
        return None


_RECORDERS: dict[type, _Recorder] = {}
_RECORDERS_LOCK = threading.Lock()


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
    def flush(cls) -> None:
        """Write every request SGLang has finished and wait until their parts are committed."""
        _recorder(cls).flush()


def _recorder(owner: type[LogitscopeLogitProcessor]) -> _Recorder:
    recorder = _RECORDERS.get(owner)
    if recorder is None:
        with _RECORDERS_LOCK:
            recorder = _RECORDERS.get(owner)
            if recorder is None:
                recorder = _RECORDERS[owner] = _Recorder(owner)
    return recorder
