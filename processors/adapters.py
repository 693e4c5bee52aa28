"""Adapters between logitscope's processor protocol and the conventions users have.

Each convention has an explicit adapter in each direction; nothing is guessed
from a function's parameter count.

=============== ====================================================== =============
convention      call                                                   returns
=============== ====================================================== =============
transformers    ``fn(input_ids [B, L], scores [B, V])``                 scores
vLLM            ``fn(output_ids, logits [V])``                          logits
vLLM + prompt   ``fn(prompt_ids, output_ids, logits [V])``              logits
Dynamo          ``fn(input_ids, logits [V])``, in place                 None
TensorRT-LLM    ``fn(req_id, logits [beam, 1, V], token_ids,``          None
                ``stream_ptr, client_id)``, in place
=============== ====================================================== =============

``from_*`` turns a function of that convention into a logitscope
:class:`~processors.protocol.LogitsProcessor`; ``to_*`` turns a logitscope
processor into a callable of that convention. logitscope processors already
follow the transformers convention, so :func:`to_transformers` returns the
processor itself.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import torch

from processors.protocol import BatchContext, LogitsProcessor, ProcessorError, _PromptBoundary

__all__ = [
    "as_processor",
    "from_transformers",
    "from_vllm",
    "from_dynamo",
    "from_trtllm",
    "to_transformers",
    "to_vllm",
    "to_dynamo",
    "to_trtllm",
    "FromTransformers",
    "FromVLLM",
    "FromDynamo",
    "FromTensorRTLLM",
    "VLLMProcessor",
    "DynamoProcessor",
    "TensorRTLLMProcessor",
]


def _callable_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class _PerRequest:
    """The callable for each row: one shared function, or one instance per row.

    vLLM and Dynamo make a processor per request. With ``factory`` each row of
    a generation gets its own instance (made on first use, dropped by
    :meth:`reset`), so per-request state never mixes rows.
    """

    def __init__(self, fn: Any, factory: Callable[[], Any] | None, adapter: str) -> None:
        if (fn is None) == (factory is None):
            raise TypeError(f"{adapter}: give exactly one of fn or factory")
        _require_callable(fn if factory is None else factory, adapter)
        self.fn = fn
        self.factory = factory
        self._rows: list[Any] = []

    @property
    def name(self) -> str:
        return _callable_name(self.fn if self.factory is None else self.factory)

    def for_row(self, row: int) -> Any:
        if self.factory is None:
            return self.fn
        while len(self._rows) <= row:
            made = self.factory()
            _require_callable(made, "factory()")
            self._rows.append(made)
        return self._rows[row]

    def reset(self) -> None:
        self._rows = []
        if self.fn is not None:
            reset = getattr(self.fn, "reset", None)
            if callable(reset):
                reset()


def _require_callable(fn: Any, adapter: str) -> None:
    if not callable(fn):
        raise TypeError(f"{adapter}: fn must be callable, got {type(fn).__name__}")


def _check_row(name: str, out: Any, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.shape != like.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ProcessorError(
            f"processor {name} returned {got} for one row, expected a tensor of shape {tuple(like.shape)}"
        )
    return out


@contextlib.contextmanager
def _on_stream(stream_ptr: int | None, device: torch.device) -> Iterator[None]:
    """Run on the CUDA stream a TensorRT-LLM host handed over, if any."""
    if stream_ptr is None or device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr, device=device)):
        yield


# --------------------------------------------------------------------------
# from other conventions to logitscope


class FromTransformers(LogitsProcessor):
    """A transformers-convention processor ``fn(input_ids, scores) -> scores``.

    transformers processors may modify ``scores`` in place, so this adapter
    says it may (``inplace = True``).
    """

    inplace = True

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        _require_callable(fn, "from_transformers")
        self.fn = fn

    @property
    def name(self) -> str:
        return _callable_name(self.fn)

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return self.fn(ctx.input_ids, logits)

    def reset(self) -> None:
        reset = getattr(self.fn, "reset", None)
        if callable(reset):
            reset()

    def __repr__(self) -> str:
        return f"FromTransformers({self.name})"


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
        _require_callable(fn, "from_trtllm")
        self.fn = fn
        self.batched = bool(batched)

    @property
    def name(self) -> str:
        return _callable_name(self.fn)

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
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
            results = [
                self.fn(req_ids[i], views[i], token_ids[i], stream_ptr, None)
                for i in range(ctx.batch_size)
            ]
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


def as_processor(item: Any) -> LogitsProcessor:
    """A logitscope processor for ``item``.

    logitscope processors pass through. Any other callable is taken to be in
    the transformers convention (``LogitsProcessorList`` accepts the same);
    functions of other conventions must be wrapped explicitly with
    :func:`from_vllm`, :func:`from_dynamo` or :func:`from_trtllm`.
    """
    if isinstance(item, LogitsProcessor):
        return item
    if callable(item):
        return FromTransformers(item)
    raise TypeError(
        f"a logits processor must be a processors.LogitsProcessor or a callable "
        f"(input_ids, scores) -> scores, got {type(item).__name__}"
    )


# --------------------------------------------------------------------------
# from logitscope to other conventions


def _row_context(token_ids: Sequence[int], prompt_length: int, device: torch.device) -> BatchContext:
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device).view(1, -1)
    return BatchContext(input_ids=ids, prompt_length=prompt_length)


def _apply_in_place(processor: LogitsProcessor, row: torch.Tensor, ctx: BatchContext) -> None:
    batch = row.reshape(1, -1)
    out = processor.process(batch, ctx)
    if out.shape != batch.shape:
        raise ProcessorError(
            f"processor {processor.name} returned shape {tuple(out.shape)}, expected {tuple(batch.shape)}"
        )
    if out.data_ptr() != batch.data_ptr():
        row.copy_(out.view_as(row))
    elif batch.data_ptr() != row.data_ptr():  # reshape had to copy
        row.copy_(batch.view_as(row))


def to_transformers(processor: Any) -> LogitsProcessor:
    """A processor usable in ``model.generate(logits_processor=[...])``.

    logitscope processors follow that convention already; this returns the
    processor itself (adapting a plain callable first).
    """
    return as_processor(processor)


class VLLMProcessor:
    """A logitscope processor as a vLLM per-request callable.

    ``__call__(output_ids, logits)`` or, with ``with_prompt=True``,
    ``__call__(prompt_ids, output_ids, logits)``; returns the processed row.
    vLLM makes one callable per request; when one instance sees a request
    start again (no output yet, or fewer outputs than last time) it resets the
    processor.
    """

    def __init__(self, processor: Any, *, with_prompt: bool = False) -> None:
        self.processor = as_processor(processor)
        self.with_prompt = bool(with_prompt)
        self._last_outputs: int | None = None

    def __call__(self, *args: Any) -> torch.Tensor:
        expected = 3 if self.with_prompt else 2
        if len(args) != expected:
            form = "(prompt_ids, output_ids, logits)" if self.with_prompt else "(output_ids, logits)"
            raise TypeError(f"this vLLM processor takes {form}, got {len(args)} arguments")
        if self.with_prompt:
            prompt_ids, output_ids, logits = args
        else:
            prompt_ids, (output_ids, logits) = (), args
        n_out = len(output_ids)
        if self._last_outputs is not None and n_out <= self._last_outputs:
            self.processor.reset()
        self._last_outputs = n_out
        ids = list(prompt_ids) + list(output_ids)
        ctx = _row_context(ids, len(prompt_ids), logits.device)
        out = self.processor.process(logits.reshape(1, -1), ctx)
        return out.view_as(logits)


class DynamoProcessor:
    """A logitscope processor as a Dynamo-style in-place callable.

    ``__call__(input_ids, logits)`` modifies the row ``logits [V]`` in place
    and returns None. The first call after a reset (or an input that does not
    grow) marks the prompt.
    """

    def __init__(self, processor: Any) -> None:
        self.processor = as_processor(processor)
        self._boundary = _PromptBoundary()

    def reset(self) -> None:
        self._boundary.clear()
        self.processor.reset()

    def __call__(self, input_ids: Sequence[int], logits: torch.Tensor) -> None:
        ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if self._boundary.starts_new_generation(len(ids)):
            self.reset()
        ctx = _row_context(ids, self._boundary.observe(len(ids)), logits.device)
        _apply_in_place(self.processor, logits, ctx)
        return None


class TensorRTLLMProcessor:
    """A logitscope processor as a TensorRT-LLM-style in-place callable.

    ``__call__(req_id, logits [beam, 1, V], token_ids [[...] per beam],
    stream_ptr, client_id) -> None``. Each request gets its own copy of the
    processor (so per-sequence state never mixes requests), made when the
    request is first seen; the ``max_requests`` most recent are kept. On a GPU
    the work runs on the host's stream ``stream_ptr``.
    """

    def __init__(self, processor: Any, *, max_requests: int = 1024) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.processor = as_processor(processor)
        self.max_requests = int(max_requests)
        self._requests: OrderedDict[Any, tuple[LogitsProcessor, _PromptBoundary]] = OrderedDict()

    def _state(self, req_id: Any) -> tuple[LogitsProcessor, _PromptBoundary]:
        state = self._requests.get(req_id)
        if state is None:
            processor = copy.deepcopy(self.processor)
            processor.reset()
            state = self._requests[req_id] = (processor, _PromptBoundary())
            while len(self._requests) > self.max_requests:
                self._requests.popitem(last=False)
        else:
            self._requests.move_to_end(req_id)
        return state

    def __call__(
        self,
        req_id: Any,
        logits: torch.Tensor,
        token_ids: Sequence[Sequence[int]],
        stream_ptr: int | None = None,
        client_id: Any = None,
    ) -> None:
        if logits.ndim != 3 or logits.shape[1] != 1:
            raise ValueError(f"logits must be [beam, 1, vocab], got shape {tuple(logits.shape)}")
        beams = logits.shape[0]
        if len(token_ids) != beams:
            raise ValueError(f"token_ids must have one list per beam ({beams}), got {len(token_ids)}")
        lengths = {len(t) for t in token_ids}
        if len(lengths) != 1:
            raise ValueError(f"every beam's token_ids must have the same length, got lengths {sorted(lengths)}")
        processor, boundary = self._state(req_id)
        length = lengths.pop()
        if boundary.starts_new_generation(length):
            boundary.clear()
            processor.reset()
        ids = torch.as_tensor([list(t) for t in token_ids], dtype=torch.long, device=logits.device)
        ctx = BatchContext(input_ids=ids, prompt_length=boundary.observe(length), request_ids=(req_id,) * beams)
        with _on_stream(stream_ptr, logits.device):
            batch = logits.view(beams, -1) if logits.is_contiguous() else logits.reshape(beams, -1)
            out = processor.process(batch, ctx)
            if out.data_ptr() != logits.data_ptr():
                logits.copy_(out.view_as(logits))
        return None

    def batched(
        self,
        req_ids: Sequence[Any],
        logits: Sequence[torch.Tensor],
        token_ids: Sequence[Sequence[Sequence[int]]],
        stream_ptr: int | None = None,
        client_ids: Sequence[Any] | None = None,
    ) -> None:
        """TensorRT-LLM's batched form: lists with one entry per request."""
        if not len(req_ids) == len(logits) == len(token_ids):
            raise ValueError(
                f"req_ids, logits and token_ids must have one entry per request, got lengths "
                f"{len(req_ids)}, {len(logits)}, {len(token_ids)}"
            )
        clients = client_ids if client_ids is not None else [None] * len(req_ids)
        for req_id, row, ids, client in zip(req_ids, logits, token_ids, clients):
            self(req_id, row, ids, stream_ptr, client)


def to_vllm(processor: Any, *, with_prompt: bool = False) -> VLLMProcessor:
    """A vLLM per-request callable (make one per request, as vLLM expects)."""
    return VLLMProcessor(processor, with_prompt=with_prompt)


def to_dynamo(processor: Any) -> DynamoProcessor:
    """A Dynamo-style in-place callable ``(input_ids, logits_row) -> None``."""
    return DynamoProcessor(processor)


def to_trtllm(processor: Any, *, max_requests: int = 1024) -> TensorRTLLMProcessor:
    """A TensorRT-LLM-style in-place callable; ``.batched`` is the list form."""
    return TensorRTLLMProcessor(processor, max_requests=max_requests)
