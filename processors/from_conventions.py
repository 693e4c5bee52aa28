"""Adapters from the conventions users have to logitscope's processor protocol.

``from_vllm``, ``from_dynamo`` and ``from_trtllm`` wrap a function of that
convention as a :class:`~processors.protocol.LogitsProcessor`, applied row by
row (``from_trtllm(batched=True)`` once per step). ``from_transformers`` wraps
a transformers-convention function; that adapter lives in
:mod:`processors.protocol`, since it is the protocol's own convention. The
table of conventions is in :mod:`processors.adapters`.

These conventions hand a row's ids to the function as lists of ints, so the
adapters read them on the host: from the host's copy in
:class:`~processors.protocol.BatchContext` when it keeps one (logitscope's
``Generator``; then ``from_vllm`` without the prompt reads nothing from the
device), else from ``input_ids`` (a device read per row and step). Each
``process`` says which it does; whatever the user's function reads is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from processors.protocol import (
    BatchContext,
    FromTransformers,
    LogitsProcessor,
    ProcessorError,
    callable_name,
    require_callable,
)

__all__ = [
    "from_transformers",
    "from_vllm",
    "from_dynamo",
    "from_trtllm",
    "FromTransformers",
    "FromVLLM",
    "FromDynamo",
    "FromTensorRTLLM",
]


class _PerRequest:
    """The callable for each row: one shared function, or one instance per row.

    vLLM and Dynamo make a processor per request. With ``factory`` each row of
    a generation gets its own instance (made on first use, dropped by
    :meth:`reset`), so per-request state never mixes rows.
    """

    def __init__(self, fn: Any, factory: Callable[[], Any] | None, adapter: str) -> None:
        if (fn is None) == (factory is None):
            raise TypeError(f"{adapter}: give exactly one of fn or factory")
        require_callable(fn if factory is None else factory, adapter)
        self.fn = fn
        self.factory = factory
        self._rows: list[Any] = []

    @property
    def name(self) -> str:
        return callable_name(self.fn if self.factory is None else self.factory)

    def for_row(self, row: int) -> Any:
        if self.factory is None:
            return self.fn
        while len(self._rows) <= row:
            made = self.factory()
            require_callable(made, "factory()")
            self._rows.append(made)
        return self._rows[row]

    def reset(self) -> None:
        self._rows = []
        if self.fn is not None:
            reset = getattr(self.fn, "reset", None)
            if callable(reset):
                reset()


def _check_row(name: str, out: Any, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.shape != like.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ProcessorError(
            f"processor {name} returned {got} for one row, expected a tensor of shape {tuple(like.shape)}"
        )
    return out


class FromVLLM(LogitsProcessor):
    """A vLLM per-request processor, applied to each row.

    ``fn(output_ids, logits_row) -> logits_row``, or with ``with_prompt=True``
    ``fn(prompt_ids, output_ids, logits_row) -> logits_row``. The ids are
    lists of ints; ``logits_row`` is the row ``[V]``. Give ``fn`` to use one
    callable for every row (right for stateless processors), or ``factory`` to
    make one per row for each generation, as vLLM makes one per request.
    """

    inplace = True  # vLLM processors may write into the row they are given

    def __init__(
        self,
        fn: Callable[..., torch.Tensor] | None = None,
        *,
        factory: Callable[[], Callable[..., torch.Tensor]] | None = None,
        with_prompt: bool = False,
    ) -> None:
        self.rows = _PerRequest(fn, factory, "from_vllm")
        self.with_prompt = bool(with_prompt)

    @property
    def name(self) -> str:
        return self.rows.name

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Each row through its function. Synchronises: once per row for the prompt ids
        (``with_prompt``), and for the output ids unless the host keeps them (``ctx.generated``)."""
        out_rows = []
        for i in range(ctx.batch_size):
            fn = self.rows.for_row(i)
            output_ids = ctx.output_ids(i)
            if self.with_prompt:
                out = fn(ctx.prompt_ids(i), output_ids, logits[i])
            else:
                out = fn(output_ids, logits[i])
            out_rows.append(_check_row(self.name, out, logits[i]))
        return torch.stack(out_rows)

    def reset(self) -> None:
        self.rows.reset()

    def __repr__(self) -> str:
        return f"FromVLLM({self.name}, with_prompt={self.with_prompt})"


class FromDynamo(LogitsProcessor):
    """A Dynamo-style processor ``fn(input_ids, logits_row) -> None`` that works in place.

    ``input_ids`` is the row's prompt and generated tokens (a list of ints,
    no padding). The given logits are modified in place and returned. Give
    ``fn`` to use one callable for every row, or ``factory`` to make one per
    row for each generation (Dynamo makes one per request).
    """

    inplace = True

    def __init__(
        self,
        fn: Callable[[Sequence[int], torch.Tensor], None] | None = None,
        *,
        factory: Callable[[], Callable[[Sequence[int], torch.Tensor], None]] | None = None,
    ) -> None:
        self.rows = _PerRequest(fn, factory, "from_dynamo")

    @property
    def name(self) -> str:
        return self.rows.name

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Each row through its function, in place. Synchronises once per row (its ids as a list)."""
        if not logits.is_contiguous():
            logits = logits.contiguous()
        for i in range(ctx.batch_size):
            result = self.rows.for_row(i)(ctx.token_ids(i), logits[i])
            if result is not None:
                raise ProcessorError(
                    f"processor {self.name} returned {type(result).__name__}; a Dynamo-style "
                    "processor works in place and returns None (use from_vllm or "
                    "from_transformers for one that returns logits)"
                )
        return logits

    def reset(self) -> None:
        self.rows.reset()

    def __repr__(self) -> str:
        return f"FromDynamo({self.name})"


class FromTensorRTLLM(LogitsProcessor):
    """A TensorRT-LLM-style processor that works in place.

    Per request (``batched=False``): ``fn(req_id, logits [1, 1, V], token_ids
    [[...]], stream_ptr, client_id) -> None``, called once per row with the row
    as a beam of one. Batched: ``fn(req_ids, [logits...], [token_ids...],
    stream_ptr, client_ids) -> None`` once per step. ``req_id`` is the row's
    request id from the context (the row index when the host gives none);
    ``stream_ptr`` is the current CUDA stream on a GPU and ``None`` on the CPU.
    """

    inplace = True

    def __init__(self, fn: Callable[..., None], *, batched: bool = False) -> None:
        require_callable(fn, "from_trtllm")
        self.fn = fn
        self.batched = bool(batched)

    @property
    def name(self) -> str:
        return callable_name(self.fn)

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """The rows through ``fn``, in place. Synchronises once per row (its ids as a list)."""
        if not logits.is_contiguous():
            logits = logits.contiguous()
        vocab = logits.shape[-1]
        stream_ptr = torch.cuda.current_stream(logits.device).cuda_stream if logits.is_cuda else None
        views = [logits[i].view(1, 1, vocab) for i in range(ctx.batch_size)]
        req_ids = [ctx.request_id(i) for i in range(ctx.batch_size)]
        token_ids = [[ctx.token_ids(i)] for i in range(ctx.batch_size)]
        if self.batched:
            results = [self.fn(req_ids, views, token_ids, stream_ptr, [None] * ctx.batch_size)]
        else:
            results = [self.fn(req_ids[i], views[i], token_ids[i], stream_ptr, None) for i in range(ctx.batch_size)]
        if any(r is not None for r in results):
            raise ProcessorError(
                f"processor {self.name} returned a value; a TensorRT-LLM-style processor "
                "works in place and returns None"
            )
        return logits

    def __repr__(self) -> str:
        return f"FromTensorRTLLM({self.name}, batched={self.batched})"


def from_transformers(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> FromTransformers:
    """Adapt ``fn(input_ids [B, L], scores [B, V]) -> scores`` (transformers)."""
    return FromTransformers(fn)


def from_vllm(
    fn: Callable[..., torch.Tensor] | None = None,
    *,
    factory: Callable[[], Callable[..., torch.Tensor]] | None = None,
    with_prompt: bool = False,
) -> FromVLLM:
    """Adapt a vLLM per-request processor (``with_prompt`` selects the 3-argument form).

    ``fn`` serves every row; ``factory()`` makes one per row and generation.
    """
    return FromVLLM(fn, factory=factory, with_prompt=with_prompt)


def from_dynamo(
    fn: Callable[[Sequence[int], torch.Tensor], None] | None = None,
    *,
    factory: Callable[[], Callable[[Sequence[int], torch.Tensor], None]] | None = None,
) -> FromDynamo:
    """Adapt a Dynamo-style in-place processor ``fn(input_ids, logits_row) -> None``.

    ``fn`` serves every row; ``factory()`` makes one per row and generation.
    """
    return FromDynamo(fn, factory=factory)


def from_trtllm(fn: Callable[..., None], *, batched: bool = False) -> FromTensorRTLLM:
    """Adapt a TensorRT-LLM-style in-place processor (``batched`` selects the list form)."""
    return FromTensorRTLLM(fn, batched=batched)
