"""A serving engine's request, as logitscope tracks it: what it asked for, and the ids it is known by.

Options a request may give (engine-independent; see the engines' modules for where they come from):

- ``storage``: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"topk"``;
- ``top_k``: values kept per row with ``storage="topk"``;
- ``title``: a label kept in the generation's metadata;
- ``request_id``: the caller's id for the request, kept in the generation's metadata (engines do not tell
  their processors a request's id).

Requests with different ``storage``/``top_k`` go to different runs (a run holds one storage): the run id is
the server's, followed by the storage when it is not the server's default.
"""

from __future__ import annotations

import importlib
import json
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tracker.recording.run_metadata import now

__all__ = ["OPTION_KEYS", "Request", "RequestOptions", "STORAGES", "env_int", "tensor_parallel_rank"]

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

    @property
    def key(self) -> tuple[str, int]:
        """The recorder (and run) this request's rows go to."""
        return (self.storage, self.top_k if self.storage == "topk" else 0)


@dataclass(eq=False)
class Request:
    """A tracked request while it runs: its generation, where its rows go, and the output ids the engine keeps
    extending (read for each step's chosen token)."""

    generation: int
    options: RequestOptions
    run_id: str
    outputs: list[int]
    prompt_ids: list[int]
    sampling: dict[str, Any]
    started_at: str = field(default_factory=now)

    def entry(self) -> dict[str, Any]:
        """The generation's metadata entry (prompt, sampling, labels)."""
        entry: dict[str, Any] = {
            "generation": self.generation,
            "batch_size": 1,
            "prompt_ids": [list(self.prompt_ids)],
            "sampling": [self.sampling],
            "started_at": self.started_at,
        }
        for key in ("title", "request_id"):
            if getattr(self.options, key) is not None:
                entry[key] = getattr(self.options, key)
        return entry


def env_int(name: str, default: int) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty); ValueError naming it
    otherwise. The engines' settings (``LOGITSCOPE_TOP_K``, ``LOGITSCOPE_MEMORY_LIMIT``) come this way."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def tensor_parallel_rank(parallel_state: str) -> int:
    """This process's tensor-parallel rank in the engine whose parallel-state module is ``parallel_state``
    (vLLM's ``vllm.distributed.parallel_state``, SGLang's ``sglang.srt.distributed.parallel_state``); 0
    outside a parallel group, or where the engine cannot say. Every rank builds processors; only rank 0
    records."""
    try:
        state = importlib.import_module(parallel_state)
        if state.model_parallel_is_initialized():
            return int(state.get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no such engine, or no parallel state: a single process
        pass
    return 0
