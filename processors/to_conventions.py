"""Adapters from logitscope's processor protocol to the conventions other hosts call.

``to_vllm``, ``to_dynamo`` and ``to_trtllm`` turn a logitscope processor into
a callable of that convention; ``to_transformers`` returns the processor
itself, which follows that convention already. The table of conventions is in
:mod:`processors.adapters`.

Each call builds a one-row (or one-request) :class:`~processors.protocol.BatchContext`
from the host's id lists, which copies them to the logits' device. The
adapters read nothing back from the device, except the ids of a Dynamo host
that passes them as a device tensor (one read per call); what the wrapped
processor reads is said by its ``process``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import numbers
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from processors.protocol import BatchContext, LogitsProcessor, ProcessorError, PromptBoundary, as_processor

__all__ = [
    "to_transformers",
    "to_vllm",
    "to_dynamo",
    "to_trtllm",
    "VLLMProcessor",
    "DynamoProcessor",
    "TensorRTLLMProcessor",
]


@contextlib.contextmanager
def _on_stream(stream_ptr: int | None, device: torch.device) -> Iterator[None]:
    """Run on the CUDA stream a TensorRT-LLM host handed over, if any."""
    if stream_ptr is None or device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr, device=device)):
        yield


def _row_context(token_ids: Sequence[int], prompt_length: int, device: torch.device) -> BatchContext:
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device).view(1, -1)
    return BatchContext(input_ids=ids, prompt_length=prompt_length)


def _tell_last_token(processor: LogitsProcessor, ids: torch.Tensor, prompt_length: int, **ctx: Any) -> None:
    """A request is over: ``ids [B, L]`` are its final ids; its processor hears the last column (``on_sampled``,
    no call of the host shows it) and the generated lengths (``on_generation_end``). No synchronisation."""
    processor.on_sampled(ids[:, -1], BatchContext(input_ids=ids[:, :-1], prompt_length=prompt_length, **ctx))
    processor.on_generation_end([ids.shape[1] - prompt_length] * ids.shape[0])


def _one_row(logits: Any) -> torch.Tensor:
    """``logits`` as ``[1, V]``: a host of one row per call hands ``[V]`` (or ``[1, V]``); anything else is refused."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor row [vocab], got {type(logits).__name__}")
    if not (logits.ndim == 1 or (logits.ndim == 2 and logits.shape[0] == 1)) or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must be one request's row, shape [vocab] or [1, vocab] with vocab > 0, got shape "
            f"{tuple(logits.shape)} (this convention calls the processor once per request)"
        )
    return logits.reshape(1, -1)


def _apply_in_place(processor: LogitsProcessor, row: torch.Tensor, ctx: BatchContext) -> None:
    batch = _one_row(row)
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
    """A logitscope processor as a vLLM per-request callable (``vllm.logits_process.LogitsProcessor``).

    ``__call__(output_ids, logits)`` or, with ``with_prompt=True``,
    ``__call__(prompt_ids, output_ids, logits)``; returns the processed row.
    vLLM V1 calls this form through its ``AdapterLogitsProcessor``: a
    subclass's ``new_req_logits_processor(params)`` returns one callable per
    request (the callable's signature says which form it takes). For tracking
    a whole server, :mod:`tracker.recording.engines.vllm` is the batch-level processor.
    vLLM makes one callable per request and calls them interleaved, request
    after request within a step, so each callable holds its own copy of the
    processor (a tracker's copy shares its recording: each request becomes a
    generation of the run). When one callable sees its request start again
    (no output yet, or fewer outputs than last time) it resets the processor.
    :meth:`finish` tells it the request's last token, which no call shows.
    The copy is ``copy.deepcopy``: a processor that holds something large (a
    model) should define ``__deepcopy__`` to share it.
    """

    def __init__(self, processor: Any, *, with_prompt: bool = False) -> None:
        self.processor = copy.deepcopy(as_processor(processor))
        self.with_prompt = bool(with_prompt)
        # vLLM's AdapterLogitsProcessor passes the prompt only to a callable whose signature has 3 parameters
        names = ("prompt_ids", "output_ids", "logits") if self.with_prompt else ("output_ids", "logits")
        kind = inspect.Parameter.POSITIONAL_ONLY
        self.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])
        self._last_outputs: int | None = None
        self._prompt: tuple[int, ...] = ()

    def __call__(self, *args: Any) -> torch.Tensor:
        """The processed row (no synchronisation of its own; see the module docstring)."""
        expected = 3 if self.with_prompt else 2
        if len(args) != expected:
            form = "(prompt_ids, output_ids, logits)" if self.with_prompt else "(output_ids, logits)"
            raise TypeError(f"this vLLM processor takes {form}, got {len(args)} arguments")
        if self.with_prompt:
            prompt_ids, output_ids, logits = args
        else:
            prompt_ids, (output_ids, logits) = (), args
        row = _one_row(logits)
        n_out = len(output_ids)
        if self._last_outputs is not None and n_out <= self._last_outputs:
            self.processor.reset()
        self._last_outputs, self._prompt = n_out, tuple(prompt_ids)
        ids = list(prompt_ids) + list(output_ids)
        ctx = _row_context(ids, len(prompt_ids), logits.device)
        out = self.processor.process(row, ctx)
        return out.view_as(logits)

    def finish(self, output_ids: Sequence[int]) -> None:
        """The request is over: ``output_ids`` are all its generated ids, the last one chosen after the last call.

        The processor hears that token (``on_sampled``) and the request's
        length (``on_generation_end``): a tracker records the last step's
        chosen token this way. Does not synchronise.
        """
        if self._last_outputs is None or len(output_ids) != self._last_outputs + 1:
            seen = "no call yet" if self._last_outputs is None else f"{self._last_outputs} outputs at the last call"
            raise ValueError(
                f"output_ids must be the request's outputs at its last call plus the token chosen then ({seen}), "
                f"got {len(output_ids)} ids"
            )
        _tell_last_token(
            self.processor, torch.tensor([[*self._prompt, *output_ids]], dtype=torch.long), len(self._prompt)
        )


class DynamoProcessor:
    """A logitscope processor as a Dynamo-style in-place callable.

    ``__call__(input_ids, logits)`` modifies the row ``logits [V]`` in place
    and returns None. The first call after a reset (or an input that is not
    one token longer than the last) marks the prompt. Dynamo makes one processor per request (streams
    run concurrently), so the callable holds its own copy of the processor, as
    :class:`VLLMProcessor` does; :meth:`finish` tells it the last token.
    """

    def __init__(self, processor: Any) -> None:
        self.processor = copy.deepcopy(as_processor(processor))
        self._boundary = PromptBoundary()

    def reset(self) -> None:
        self._boundary.clear()
        self.processor.reset()

    def __call__(self, input_ids: Sequence[int], logits: torch.Tensor) -> None:
        """Process the row in place (synchronises only to read ``input_ids`` given as a device tensor)."""
        _one_row(logits)
        ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if self._boundary.starts_new_generation(len(ids)):
            self.reset()
        ctx = _row_context(ids, self._boundary.observe(len(ids)), logits.device)
        _apply_in_place(self.processor, logits, ctx)
        return None

    def finish(self, input_ids: Sequence[int]) -> None:
        """The request is over: ``input_ids`` are its final ids, the last call's plus the token chosen then.

        The processor hears that token (``on_sampled``) and the generated
        length (``on_generation_end``): a tracker records the last step's
        chosen token this way. Reads ``input_ids`` given as a device tensor.
        """
        ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        seen, prompt = self._boundary.last_length, self._boundary.prompt_length
        if seen is None or prompt is None or len(ids) != seen + 1:
            raise ValueError(
                f"input_ids must be the ids of the last call ({seen}) plus the token chosen then, got {len(ids)} ids"
            )
        _tell_last_token(self.processor, torch.tensor([ids], dtype=torch.long), prompt)


class TensorRTLLMProcessor:
    """A logitscope processor as a TensorRT-LLM-style in-place callable.

    ``__call__(req_id, logits [beam, 1, V], token_ids [[...] per beam],
    stream_ptr, client_id) -> None``. Each request gets its own copy of the
    processor (so per-sequence state never mixes requests), made when the
    request is first seen; the ``max_requests`` most recent are kept. On a GPU
    the work runs on the host's stream ``stream_ptr``.
    """

    def __init__(self, processor: Any, *, max_requests: int = 1024) -> None:
        if isinstance(max_requests, bool) or not isinstance(max_requests, numbers.Integral) or max_requests < 1:
            raise ValueError(f"max_requests must be an int >= 1, got {max_requests!r}")
        self.processor = as_processor(processor)
        self.max_requests = int(max_requests)
        self._requests: OrderedDict[Any, tuple[LogitsProcessor, PromptBoundary]] = OrderedDict()

    def _state(self, req_id: Any) -> tuple[LogitsProcessor, PromptBoundary]:
        state = self._requests.get(req_id)
        if state is None:
            processor = copy.deepcopy(self.processor)
            processor.reset()
            state = self._requests[req_id] = (processor, PromptBoundary())
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
        """Process the request's beams in place, on ``stream_ptr`` (no synchronisation of its own)."""
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

    def end_request(self, req_id: Any, token_ids: Sequence[Sequence[int]]) -> None:
        """The request ``req_id`` is over: ``token_ids`` are its final ids per beam (prompt and every token).

        Its processor hears the last step's tokens (``on_sampled``; no call of
        the host shows them) and each beam's generated length
        (``on_generation_end``); then the request is forgotten. A tracker
        records the last step's chosen tokens this way, as ``finish`` does for
        other hosts. Does not synchronise.
        """
        state = self._requests.get(req_id)
        if state is None:
            raise ValueError(
                f"req_id {req_id!r} is not a request in progress (none seen, ended, or dropped past max_requests)"
            )
        processor, boundary = state
        lengths = {len(t) for t in token_ids}
        seen, prompt = boundary.last_length, boundary.prompt_length
        if len(token_ids) == 0 or lengths != {(seen or 0) + 1} or prompt is None:
            raise ValueError(
                f"token_ids must hold each beam's ids as the request's last call saw them ({seen}) plus the token "
                f"chosen then, got lengths {sorted(lengths)}"
            )
        del self._requests[req_id]
        ids = torch.as_tensor([list(t) for t in token_ids], dtype=torch.long)
        _tell_last_token(processor, ids, prompt, request_ids=(req_id,) * ids.shape[0])

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
