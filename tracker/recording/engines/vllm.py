"""logitscope inside a vLLM V1 engine: a batch-level logits processor that records the requests that ask.

Load it as any vLLM V1 logits processor, by class or by name::

    LLM(model, logits_processors=[LogitscopeLogitsProcessor])
    vllm serve MODEL --logits-processors tracker.recording.engines.vllm:LogitscopeLogitsProcessor

A request is tracked when its ``SamplingParams.extra_args`` holds
``{"logitscope": true}`` or ``{"logitscope": {...}}`` with the keys of
:mod:`tracker.recording.engines.requests` (``storage``, ``top_k``, ``title``,
``request_id``); every other request costs one dictionary look-up per step.
Where the run lands is the server's configuration, read from the environment
of the engine process when the processor is built:

- ``LOGITSCOPE_RUNS``: the dataset folder (default ``logitscope-runs`` in the
  server's working directory); each ended request becomes
  ``run_id=<run>/part-<generation>.parquet`` there.
- ``LOGITSCOPE_STORAGE`` (default ``float32``) and ``LOGITSCOPE_TOP_K``
  (default 20): what a request that names none gets.
- ``LOGITSCOPE_MEMORY_LIMIT``: bytes of host memory per tracked request
  before its rows spill to disk (default 256 MiB).

What is recorded, per tracked request and step: the logits the request's row
holds when the processor runs (after vLLM's allowed-token mask, bad words,
min-tokens and logit bias, before penalties, temperature, min-p, top-k and
top-p), bit for bit, as the ``natural`` stage; and the token vLLM sampled,
read from the request's output ids, the list vLLM hands its processors and
extends after every step. The last token of a request is in that list when it
is removed under synchronous scheduling; under asynchronous scheduling (vLLM's
default) vLLM has only written a placeholder ``-1`` there by then, so the last
step's chosen token is recorded as unknown. vLLM does not tell processors a
request's id: pass yours as ``request_id`` to find it in the run. A request
that leaves the batch and comes back (preemption) continues as a new
generation from the step it resumes at.

The processor answers ``is_argmax_invariant() -> False`` so that vLLM calls
it at every step, greedy requests included; it returns the logits untouched.
With tensor parallelism every rank builds processors; only rank 0 writes.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import torch

from tracker.recording.engines.requests import PartWriter, RequestOptions, RequestRecording, server_run_id

__all__ = ["LogitscopeLogitsProcessor", "EXTRA_ARGS_KEY", "VLLM_IMPORT_ERROR"]

EXTRA_ARGS_KEY = "logitscope"

try:  # vLLM's own base class when vLLM imports; the class works without it (tests, reading code)
    from vllm.v1.sample.logits_processor import LogitsProcessor as _VLLMBase

    VLLM_IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any failure to import vLLM means "no vLLM here"
    _VLLMBase = object  # type: ignore[assignment,misc]
    VLLM_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _is_swap(direction: Any) -> bool:
    return getattr(direction, "name", direction) == "SWAP"


def _sampling_summary(params: Any) -> dict[str, Any]:
    """The request's sampling parameters that say how its tokens were drawn (JSON-ready), and ``"sampler":
    "vllm"``: the run's reader computes vLLM's sampling stages from them (:mod:`tracker.reading.engine_stages`)."""
    out: dict[str, Any] = {"sampler": "vllm"}
    keys = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")
    for key in (*keys, "repetition_penalty", "frequency_penalty", "presence_penalty"):
        value = getattr(params, key, None)
        if value is not None:
            out[key] = value
    return out


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no vLLM, or no distributed state: a single process
        pass
    return 0


class _Tracked:
    """A tracked request in the batch: its recording and the output-id list vLLM keeps extending."""

    __slots__ = ("recording", "outputs", "run_id")

    def __init__(self, recording: RequestRecording, outputs: list[int], run_id: str) -> None:
        self.recording, self.outputs, self.run_id = recording, outputs, run_id

    def observe(self, row: torch.Tensor) -> None:
        """This step's row: first the token chosen at the last step, then the row. Host reads only."""
        recording, outputs = self.recording, self.outputs
        step = len(outputs)
        if recording.last_rows is not None and step > recording.last_step:
            recording.choose(outputs[recording.last_step])
        recording.record(row, step)

    def end(self) -> int:
        """The request left the batch: its last token if vLLM wrote it; the tokens generated."""
        recording, outputs = self.recording, self.outputs
        if recording.last_rows is not None and len(outputs) > recording.last_step:
            recording.choose(outputs[recording.last_step])
        return len(outputs)


class LogitscopeLogitsProcessor(_VLLMBase):  # type: ignore[misc,valid-type]
    """A vLLM V1 logits processor that records the requests whose ``extra_args`` ask (see the module).

    Subclass it to fix the configuration in code instead of the environment
    (``runs``, ``storage``, ``top_k``, ``memory_limit``, ``tokenizer``
    class attributes; None reads the environment), and load the subclass by
    its name.
    """

    runs: str | None = None
    storage: str | None = None
    top_k: int | None = None
    memory_limit: int | None = None
    tokenizer: Any = None

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.default_storage = self.storage or os.environ.get("LOGITSCOPE_STORAGE") or "float32"
        self.default_top_k = self.top_k or _env_int("LOGITSCOPE_TOP_K", 20)
        RequestOptions.parse({}, self.default_storage, self.default_top_k, "LOGITSCOPE_STORAGE/LOGITSCOPE_TOP_K")
        self.row_memory = self.memory_limit or _env_int("LOGITSCOPE_MEMORY_LIMIT", 256 << 20)
        self.root = self.runs or os.environ.get("LOGITSCOPE_RUNS") or "logitscope-runs"
        self.run_id = server_run_id()
        self.writes = _tensor_parallel_rank() == 0
        self._config = vllm_config
        self._tokenizer = self.tokenizer
        self._writer: PartWriter | None = None
        self._rows: dict[int, _Tracked] = {}
        self._generations = itertools.count()

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
        """Follow the batch: removed rows end their requests, added rows start them, moves carry them.

        Order as vLLM documents it: removed, added, moved. Host work only (no device value is read).
        """
        if not batch_update:
            return
        rows = self._rows
        for index in batch_update.removed:
            self._end(rows.pop(index, None))
        for index, params, prompt_ids, outputs in batch_update.added:
            self._end(rows.pop(index, None))  # a request that left this row without a removal said
            tracked = self._start(params, prompt_ids, outputs)
            if tracked is not None:
                rows[index] = tracked
        for a, b, direction in batch_update.moved:
            moving = rows.pop(a, None)
            other = rows.pop(b, None)
            if moving is not None:
                rows[b] = moving
            if other is not None:
                if _is_swap(direction):
                    rows[a] = other
                else:
                    self._end(other)  # overwritten by a one-way move: it left the batch

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Record each tracked row of ``logits [B, V]``; return ``logits`` unchanged.

        Runs every step. Untracked batches cost one check; each tracked row
        is a view copied by the recorder with a ``non_blocking`` copy, its
        chosen token read from the host list vLLM keeps: reads no device
        value (does not synchronise).
        """
        if not self._rows:
            return logits
        for index, tracked in self._rows.items():
            tracked.observe(logits[index : index + 1])
        return logits

    # ---------------------------------------------------------------- requests

    def flush(self) -> list[Any]:
        """Wait until every ended request's part is written (the paths); raises a failed write."""
        return [] if self._writer is None else self._writer.flush()

    def _start(self, params: Any, prompt_ids: Sequence[int] | None, outputs: list[int]) -> _Tracked | None:
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
        recording = RequestRecording(
            next(self._generations), prompt_ids or [], options, self._load_tokenizer(), sampling, self.row_memory
        )
        run_id = self.run_id + options.run_suffix(self.default_storage, self.default_top_k)
        return _Tracked(recording, outputs, run_id)

    def _end(self, tracked: _Tracked | None) -> None:
        if tracked is None:
            return
        generated = tracked.end()
        if self._writer is None:
            self._writer = PartWriter(self.root)
        self._writer.write(tracked.recording, tracked.run_id, generated)

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
