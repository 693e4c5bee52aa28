"""logitscope inside a vLLM V1 engine: a batch-level logits processor that records the requests that ask.

Load it as any vLLM V1 logits processor, by class or by name::

    LLM(model, logits_processors=[LogitscopeLogitsProcessor])
    python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --logits-processors tracker.recording.engines.vllm:LogitscopeLogitsProcessor

A request is tracked when its ``SamplingParams.extra_args`` holds ``{"logitscope": true}`` or
``{"logitscope": {...}}`` with the keys of :mod:`tracker.recording.engines.requests` (``storage``, ``top_k``,
``title``, ``request_id``; over HTTP, ``"vllm_xargs": {"logitscope": "<that object as JSON>"}``). A malformed
value is refused when the request arrives (the server answers 400, naming the key). Every other request costs
nothing per step; an engine tracking nothing costs one check per step.

Where runs land is the server's configuration, read from the environment of the engine process when the
processor is built:

- ``LOGITSCOPE_RUNS``: the table runs are written to, a folder or a URL (default ``logitscope-runs`` in the
  server's working directory); each ended request is committed as a part of its run within about a second,
  many requests per commit, and the run grows while the server runs.
- ``LOGITSCOPE_STORAGE`` (default ``float32``) and ``LOGITSCOPE_TOP_K`` (default 20): what a request that
  names none gets.
- ``LOGITSCOPE_MEMORY_LIMIT``: bytes of host memory for the rows of every tracked request of the engine
  together (default 1 GiB); past it the oldest rows are written early, as further parts of their requests.

What is recorded, per tracked request and step: the logits the request's row holds when the processor runs
(after vLLM's allowed-token mask, bad words, min-tokens and logit bias; before penalties, temperature,
min-p, top-k and top-p), bit for bit, as the ``natural`` stage; and the token vLLM sampled, read from the
request's output ids, the list vLLM hands its processors and extends after every step. Under asynchronous
scheduling (vLLM's default on GPUs) a request's last token is only a placeholder when it leaves: it is
recorded as unknown. A step whose sample vLLM discarded (a chunked prefill's partial steps) is recorded
again; only its last row is kept. A request preempted and resumed continues as a new generation from the step
it resumes at. The run's metadata names the model (its served name), and ``extra["engine"]`` the engine, its
version, the model's path, revision and dtype; each generation holds the request's prompt, its sampling
parameters, its ``title`` and ``request_id``.

The processor answers ``is_argmax_invariant() -> False`` so that vLLM calls it at every step, greedy
requests included; it returns the logits untouched. With tensor parallelism every rank builds processors;
only rank 0 records. The engine's writer thread is closed when the engine's process exits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from tracker.recording.engines.recording import EngineRecording
from tracker.recording.engines.requests import Request, RequestOptions, env_int, tensor_parallel_rank

__all__ = ["LogitscopeLogitsProcessor", "EXTRA_ARGS_KEY", "VLLM_IMPORT_ERROR"]

EXTRA_ARGS_KEY = "logitscope"

try:  # vLLM's own base class when vLLM imports; the class works without it (tests, reading code)
    from vllm.v1.sample.logits_processor import LogitsProcessor as _VLLMBase

    VLLM_IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any failure to import vLLM means "no vLLM here"
    _VLLMBase = object  # type: ignore[assignment,misc]
    VLLM_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

#: The request parameters kept in each generation's metadata (how its tokens were drawn).
SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "bad_words", "n",
)  # fmt: skip


def _is_swap(direction: Any) -> bool:
    return getattr(direction, "name", direction) == "SWAP"


def _sampling_summary(params: Any) -> dict[str, Any]:
    """The request's sampling parameters that say how its tokens were drawn (JSON-ready), and ``"sampler":
    "vllm"``: the run's reader computes vLLM's sampling stages from them (:mod:`tracker.reading.engine_stages`)."""
    out: dict[str, Any] = {"sampler": "vllm"}
    for key in SAMPLING_KEYS:
        value = getattr(params, key, None)
        if value is None:
            continue
        if isinstance(value, dict):
            value = {str(k): v for k, v in value.items()}
        elif isinstance(value, (set, tuple)):
            value = list(value)
        out[key] = value
    return out


def engine_facts(vllm_config: Any) -> dict[str, Any]:
    """What a run's metadata says of the engine: the model's served name, and the engine, its version, the
    model's path, revision and dtype."""
    model_config = getattr(vllm_config, "model_config", None)
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    path = getattr(model_config, "model", None)
    try:
        from vllm import __version__ as version
    except Exception:  # noqa: BLE001 - no vLLM here (tests of the class alone)
        version = None
    engine = {"name": "vllm", "version": version, "model": path}
    for key in ("revision", "dtype", "max_model_len"):
        value = getattr(model_config, key, None)
        if value is not None:
            engine[key] = str(value).removeprefix("torch.") if key == "dtype" else value
    name = served or (os.path.basename(str(path).rstrip("/")) if path else None)
    return {"model": name, "extra": {"engine": engine}}


class LogitscopeLogitsProcessor(_VLLMBase):  # type: ignore[misc,valid-type]
    """A vLLM V1 logits processor that records the requests whose ``extra_args`` ask (see the module).

    Subclass it to fix the configuration in code instead of the environment (``runs``, ``storage``, ``top_k``,
    ``memory_limit``, ``tokenizer`` class attributes; None reads the environment), and load the subclass by its
    name.
    """

    runs: str | None = None
    storage: str | None = None
    top_k: int | None = None
    memory_limit: int | None = None
    tokenizer: Any = None

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.default_storage = self.storage or os.environ.get("LOGITSCOPE_STORAGE") or "float32"
        self.default_top_k = self.top_k or env_int("LOGITSCOPE_TOP_K", 20)
        RequestOptions.parse({}, self.default_storage, self.default_top_k, "LOGITSCOPE_STORAGE/LOGITSCOPE_TOP_K")
        self.writes = tensor_parallel_rank("vllm.distributed.parallel_state") == 0
        self._config = vllm_config
        self._tokenizer = self.tokenizer
        self.recording = EngineRecording(
            self.runs or os.environ.get("LOGITSCOPE_RUNS") or "logitscope-runs",
            engine_facts(vllm_config),
            self._load_tokenizer,
            self.default_storage,
            self.default_top_k,
            self.memory_limit or env_int("LOGITSCOPE_MEMORY_LIMIT", 1 << 30),
            _eos_ids(vllm_config),
        )
        self._rows: dict[int, Request] = {}  # batch index -> the tracked request there
        self._groups: list[tuple[torch.Tensor, list[Request]]] | None = []  # None: rebuild before the next step

    @property
    def run_id(self) -> str:
        return self.recording.run_id

    # ---------------------------------------------------------------- vLLM's interface

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Refuse a request whose ``extra_args["logitscope"]`` is malformed (vLLM answers HTTP 400)."""
        options = (getattr(sampling_params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        RequestOptions.parse(options, "float32", 20, f'extra_args["{EXTRA_ARGS_KEY}"]')

    def is_argmax_invariant(self) -> bool:
        """False: vLLM then calls :meth:`apply` at every step, greedy requests included (nothing is changed)."""
        return False

    def update_state(self, batch_update: Any) -> None:
        """Once per step, before :meth:`apply`: the last step's rows get their chosen tokens, then the batch's
        changes (in vLLM's order: removed, added, moved) end, start and move requests. Host work only."""
        with self.recording.lock:  # the idle watch writes from its own thread
            self.recording.finish_step()
            if batch_update:
                self._update(batch_update)

    def _update(self, batch_update: Any) -> None:
        rows = self._rows
        for index in batch_update.removed:
            self._end(rows.pop(index, None))
        for index, params, prompt_ids, outputs in batch_update.added:
            self._end(rows.pop(index, None))  # a request that left this row without a removal said
            request = self._start(params, prompt_ids, outputs)
            if request is not None:
                rows[index] = request
        for a, b, direction in batch_update.moved:
            moving, other = rows.pop(a, None), rows.pop(b, None)
            if moving is not None:
                rows[b] = moving
            if other is not None:
                if _is_swap(direction):
                    rows[a] = other
                else:
                    self._end(other)  # overwritten by a one-way move: it left the batch
        self._groups = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Record the tracked rows of ``logits [B, V]``; return ``logits`` unchanged.

        Runs every step. Nothing tracked: one check. Else one batched call per storage the tracked requests
        use (a row selection, the storage's work, one copy); the chosen tokens come from the host lists vLLM
        keeps. Reads no device value (does not synchronise).
        """
        if not self._rows:
            return logits
        with self.recording.lock:
            if self._groups is None:
                self._groups = self._regroup()
            self.recording.record(logits, self._groups)
        return logits

    # ---------------------------------------------------------------- requests

    def flush(self) -> None:
        """Wait until every ended request's part is committed to the table; raises a failed write."""
        self.recording.flush()

    def close(self) -> None:
        """Write what was recorded (requests still running as far as they got), mark the runs complete, and stop
        the writer's thread."""
        self.recording.close()

    def _regroup(self) -> list[tuple[torch.Tensor, list[Request]]]:
        """The tracked batch rows by storage, in batch order, with their index on the device (rebuilt when the
        batch changes: a host-to-device copy, no synchronisation)."""
        by_key: dict[Any, list[tuple[int, Request]]] = {}
        for index, request in sorted(self._rows.items()):
            by_key.setdefault(request.options.key, []).append((index, request))
        groups = []
        for members in by_key.values():
            index = torch.tensor([i for i, _ in members], dtype=torch.int64)
            if self.device.type != "cpu":
                index = index.pin_memory().to(self.device, non_blocking=True)
            groups.append((index, [r for _, r in members]))
        return groups

    def _start(self, params: Any, prompt_ids: Sequence[int] | None, outputs: list[int]) -> Request | None:
        options = RequestOptions.parse(
            (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY),
            self.default_storage,
            self.default_top_k,
            f'extra_args["{EXTRA_ARGS_KEY}"]',
        )
        if options is None or not self.writes:
            return None
        sampling = _sampling_summary(params)
        if outputs:
            sampling["resumed_at_step"] = len(outputs)
        return self.recording.start(options, prompt_ids or [], outputs, sampling)

    def _end(self, request: Request | None) -> None:
        if request is not None:
            self.recording.end(request)

    def _load_tokenizer(self) -> Any:
        """The model's tokenizer for token texts, loaded once from vLLM's configuration (None: ids only)."""
        if self._tokenizer is None and self._config is not None:
            model_config = getattr(self._config, "model_config", None)
            name = getattr(model_config, "tokenizer", None)
            if name:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(
                        name, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
                    )
                except Exception:  # noqa: BLE001 - token texts are a nicety; ids are recorded regardless
                    self._tokenizer = False
        return self._tokenizer or None


def _eos_ids(vllm_config: Any) -> list[int]:
    """The model's end-of-sequence ids from its configuration (for the ``p_eos`` statistic), or none."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else []
