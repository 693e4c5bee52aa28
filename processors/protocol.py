"""The processor protocol that logitscope calls.

A logitscope processor is batch-level and functional: ``process(logits, ctx)``
takes next-token logits ``[B, V]`` and a :class:`BatchContext` describing the
rows, and returns logits of the same shape. Every processor is also callable
in the transformers convention ``processor(input_ids, scores) -> scores``, so
it can be handed to ``model.generate(logits_processor=[...])`` as it is; and
the other way round, :func:`as_processor` takes any callable of that
convention as a processor (:class:`FromTransformers`), which is how
:class:`ProcessorList` accepts transformers processors. The adapters of the
other conventions (vLLM, Dynamo, TensorRT-LLM) build on this module: see
:mod:`processors.adapters`.

Hosts that know more than transformers does (logitscope's ``Generator``) build
the context themselves; hosts that pass only ``input_ids`` get a context whose
prompt boundary is inferred: the first call after :meth:`reset` sees the
prompt, and an input that is not the last call's plus one token (shorter, as
long, longer by more, another batch size or, for inputs on the CPU, other first
columns) starts a new generation.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = [
    "BatchContext",
    "LogitsProcessor",
    "ProcessorList",
    "ProcessorError",
    "check_logits",
    "as_processor",
    "continues",
    "FromTransformers",
]


class ProcessorError(RuntimeError):
    """A processor broke its contract (wrong shape, dtype or device) or raised."""


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What a processor may know about the rows of a step.

    Attributes:
        input_ids: ``[B, L]`` int64, each row its (left-padded) prompt followed
            by the tokens generated so far.
        prompt_length: how many leading columns of ``input_ids`` are the padded
            prompt; ``input_ids[:, prompt_length:]`` are the generated tokens.
        attention_mask: ``[B, L]``, 0 where a row is left padding, or ``None``
            when the host has no padding.
        request_ids: one id per row (the request a row belongs to), or ``None``.
        generated: the host's copy of ``input_ids[:, prompt_length:]``, one
            list of ints per row, or ``None``. Hosts that keep the tokens on
            the host (logitscope's ``Generator``) pass it so that processors
            never read the device to learn them. Its first ``num_generated``
            entries per row are this step's; the host may append to the lists
            after the step, and processors must not modify them.
    """

    input_ids: torch.Tensor
    prompt_length: int
    attention_mask: torch.Tensor | None = None
    request_ids: tuple[Any, ...] | None = None
    generated: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if self.input_ids.ndim != 2:
            raise ValueError(f"input_ids must be 2-D [batch, length], got shape {tuple(self.input_ids.shape)}")
        length = self.input_ids.shape[1]
        if not 0 <= self.prompt_length <= length:
            raise ValueError(
                f"prompt_length must be in [0, {length}] for input_ids of length {length}, got {self.prompt_length}"
            )
        if self.attention_mask is not None and self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(self.input_ids.shape)}, "
                f"got {tuple(self.attention_mask.shape)}"
            )
        if self.request_ids is not None and len(self.request_ids) != self.batch_size:
            raise ValueError(f"request_ids must have one id per row ({self.batch_size}), got {len(self.request_ids)}")
        if self.generated is not None and len(self.generated) != self.batch_size:
            raise ValueError(
                f"generated must have one token list per row ({self.batch_size}), got {len(self.generated)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_generated(self) -> int:
        """Tokens generated so far (the same for every row of a step)."""
        return int(self.input_ids.shape[1]) - self.prompt_length

    @property
    def generated_ids(self) -> torch.Tensor:
        """``[B, num_generated]``: the tokens generated so far."""
        return self.input_ids[:, self.prompt_length :]

    def pad_length(self, row: int) -> int:
        """Left padding columns of ``row`` (0 when there is no attention mask)."""
        if self.attention_mask is None:
            return 0
        prompt_mask = self.attention_mask[row, : self.prompt_length]
        return int(self.prompt_length - int(prompt_mask.sum()))

    def prompt_ids(self, row: int) -> list[int]:
        """The prompt of ``row`` without its padding."""
        return self.input_ids[row, self.pad_length(row) : self.prompt_length].tolist()

    def output_ids(self, row: int) -> list[int]:
        """The tokens generated so far for ``row`` (from the host's copy when there is one)."""
        if self.generated is not None:
            return list(self.generated[row][: self.num_generated])
        return self.input_ids[row, self.prompt_length :].tolist()

    def token_ids(self, row: int) -> list[int]:
        """Prompt and generated tokens of ``row``, without padding."""
        return self.input_ids[row, self.pad_length(row) :].tolist()

    def request_id(self, row: int) -> Any:
        return row if self.request_ids is None else self.request_ids[row]

    def select(self, rows: Sequence[int] | torch.Tensor) -> BatchContext:
        """The context of a subset of rows (for processors that work row by row)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.input_ids.device)
        return BatchContext(
            input_ids=self.input_ids.index_select(0, index),
            prompt_length=self.prompt_length,
            attention_mask=None if self.attention_mask is None else self.attention_mask.index_select(0, index),
            request_ids=None if self.request_ids is None else tuple(self.request_ids[int(i)] for i in index.tolist()),
            generated=None if self.generated is None else [self.generated[int(i)] for i in index.tolist()],
        )


class PromptBoundary:
    """Infers the prompt boundary for hosts that pass only ``input_ids``.

    The first call after a reset sees the whole prompt; the host adds one
    token per step, so an input that is not the last call's plus one token
    (shorter, as long, longer by more: a new prompt; with tensors, another
    batch size or, on the CPU, other first columns) starts a new generation.
    """

    __slots__ = ("prompt_length", "last_length", "last_ids")

    def __init__(self) -> None:
        self.prompt_length: int | None = None
        self.last_length: int | None = None
        self.last_ids: torch.Tensor | None = None  # the last call's input (transformers convention)

    def starts_new_generation(self, length: int, input_ids: torch.Tensor | None = None) -> bool:
        """Whether a call with an input of ``length`` (``input_ids``, when the host gives a tensor) is not the
        next step of the last call. Does not synchronise (see :func:`continues`)."""
        if self.last_length is None:
            return False
        if input_ids is not None and self.last_ids is not None:
            return not continues(input_ids, self.last_ids)
        return length != self.last_length + 1

    def observe(self, length: int) -> int:
        """Record a call's input length; return the prompt length in force."""
        if self.prompt_length is None:
            self.prompt_length = length
        self.last_length = length
        return self.prompt_length

    def clear(self) -> None:
        self.prompt_length = None
        self.last_length = None
        self.last_ids = None


def free_to_read(*tensors: torch.Tensor) -> bool:
    """Whether reading these tensors' values costs nothing (host memory); on an accelerator it would
    synchronise, so per-step code decides by shapes there."""
    for tensor in tensors:  # a loop, not all(generator): this runs every step
        if not tensor.is_cpu:  # cheaper than tensor.device.type, which builds a device object
            return False
    return True


def continues(input_ids: torch.Tensor, last: torch.Tensor) -> bool:
    """Whether ``input_ids`` is the step after ``last``: same rows, one token longer, same first columns.

    The columns are compared only for tensors on the CPU (free there); on an
    accelerator that would read the device every step, so batch and length
    decide. Does not synchronise with the device.
    """
    if input_ids.shape[0] != last.shape[0] or input_ids.shape[1] != last.shape[1] + 1:
        return False
    if not free_to_read(input_ids, last):
        return True
    return bool(torch.equal(input_ids[:, :-1], last))


def check_logits(name: str, out: Any, like: torch.Tensor) -> torch.Tensor:
    """Return ``out`` if it is a tensor shaped, typed and placed like ``like`` (no synchronisation).

    Otherwise raise :class:`ProcessorError` naming the processor, what it
    returned and what was expected.
    """
    if out is None:
        raise ProcessorError(
            f"processor {name} returned None; a processor must return the logits. "
            "If it works in place on one row (the Dynamo convention), wrap it with "
            "processors.from_dynamo(...); TensorRT-LLM style: processors.from_trtllm(...)"
        )
    if not isinstance(out, torch.Tensor):
        raise ProcessorError(
            f"processor {name} returned {type(out).__name__}, expected a torch.Tensor of shape {tuple(like.shape)}"
        )
    if out.shape != like.shape:
        raise ProcessorError(
            f"processor {name} returned logits of shape {tuple(out.shape)}, "
            f"expected {tuple(like.shape)} (the shape it was given)"
        )
    if out.device != like.device:
        raise ProcessorError(f"processor {name} returned logits on {out.device}, expected {like.device}")
    if not out.is_floating_point():
        raise ProcessorError(f"processor {name} returned {out.dtype} logits, expected floating point")
    return out


class LogitsProcessor(abc.ABC):
    """Base class of logitscope's processors.

    Subclasses implement :meth:`process`. Processors that keep state per
    sequence override :meth:`reset`. A processor that modifies the logits it
    is given sets ``inplace = True`` and says so in its docstring, and its
    :meth:`process` says whether it synchronises with the device (hosts call
    it every step: one read of a device value makes the host wait).
    """

    inplace: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass's reset() also forgets the prompt boundary inferred for
        # transformers-style hosts, so that a host which calls reset() and then
        # passes a longer prompt is seen as starting afresh.
        own_reset = cls.__dict__.get("reset")
        if own_reset is not None and not getattr(own_reset, "_forgets_host", False):

            @functools.wraps(own_reset)
            def reset(self: LogitsProcessor) -> None:
                self._forget_host()
                own_reset(self)

            reset._forgets_host = True  # type: ignore[attr-defined]
            cls.reset = reset  # type: ignore[method-assign]

    @abc.abstractmethod
    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Return processed logits ``[B, V]`` for the rows described by ``ctx`` (say whether it synchronises)."""

    def reset(self) -> None:
        """Forget per-generation state. Hosts call it before each generation."""
        self._forget_host()

    def on_generation_start(self, sampling: Sequence[Mapping[str, Any]]) -> None:
        """Hear, before the first step, how each row will be sampled (one JSON-ready dict per row).

        logitscope's ``Generator`` calls it right after :meth:`reset` with each
        row's sampling parameters, its request and sample index and the seed
        in use; hosts that do not know them never call it. Default: nothing.
        """

    def on_sampled(self, tokens: torch.Tensor, ctx: BatchContext) -> None:
        """Hear the tokens chosen at this step (``[B]`` int64), from hosts that know them.

        ``ctx`` is the context the step's :meth:`process` saw. logitscope's
        ``Generator`` calls it after every step, the last one included, with
        ``tokens`` already on the host (a CPU tensor: reading it costs no
        synchronisation), before it queues the next forward pass: a processor
        may start preparing its next step here (grammar processors compute
        their next masks on a worker thread). Hosts such as
        ``model.generate`` do not call it, and processors learn the chosen
        tokens from the next call's ``input_ids`` instead. Must not
        synchronise (the default does nothing).
        """

    def on_generation_end(self, lengths: Sequence[int]) -> None:
        """Hear, after the last step, how many tokens each row generated (its finishing token included).

        A row that ends before the others (end of sequence, a stop string, its
        own ``max_new_tokens``) is fed padding for the steps that follow.
        logitscope's ``Generator`` calls it once per generation; hosts that do
        not know never call it. Default: nothing.
        """

    @property
    def wants_prefill_logits(self) -> bool:
        """True when the processor wants :meth:`on_prefill` (the host then keeps every prompt position's logits)."""
        return False

    def on_prefill(self, logits: torch.Tensor, ctx: BatchContext) -> None:
        """Hear the prefill logits ``[B, L, V]`` (every prompt position, left padding included), once per generation.

        Hosts that can (logitscope's ``Generator``) call it before the first
        step when :attr:`wants_prefill_logits` is True. Default: nothing.
        """

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The transformers convention: ``(input_ids [B, L], scores [B, V]) -> scores``.

        Synchronises only where :meth:`process` does (the prompt boundary comes from shapes).
        """
        boundary = self.__dict__.get("_host_boundary")
        if boundary is None:
            boundary = self.__dict__["_host_boundary"] = PromptBoundary()
        length = int(input_ids.shape[1])
        if boundary.starts_new_generation(length, input_ids):
            self.reset()
        ctx = BatchContext(input_ids=input_ids, prompt_length=boundary.observe(length))
        boundary.last_ids = input_ids
        return self.process(scores, ctx)

    def _forget_host(self) -> None:
        boundary = self.__dict__.get("_host_boundary")
        if boundary is not None:
            boundary.clear()

    def __repr__(self) -> str:
        return f"{self.name}()"


def callable_name(fn: Any) -> str:
    """A name for a user's function or callable object (its ``__name__``, else its class name)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def require_callable(fn: Any, adapter: str) -> None:
    """Raise ``TypeError`` naming ``adapter`` unless ``fn`` is callable."""
    if not callable(fn):
        raise TypeError(f"{adapter}: fn must be callable, got {type(fn).__name__}")


class FromTransformers(LogitsProcessor):
    """A transformers-convention processor ``fn(input_ids, scores) -> scores``.

    transformers processors may modify ``scores`` in place, so this adapter
    says it may (``inplace = True``).
    """

    inplace = True

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        require_callable(fn, "from_transformers")
        self.fn = fn

    @property
    def name(self) -> str:
        return callable_name(self.fn)

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """``fn(ctx.input_ids, logits)``; synchronises only if ``fn`` does."""
        return self.fn(ctx.input_ids, logits)

    def reset(self) -> None:
        reset = getattr(self.fn, "reset", None)
        if callable(reset):
            reset()

    def __repr__(self) -> str:
        """The wrapped processor and its plain settings (transformers' processors have no repr of their own)."""
        settings = []
        if type(self.fn).__repr__ is object.__repr__ and hasattr(self.fn, "__dict__"):
            settings = [
                f"{k}={v!r}"
                for k, v in vars(self.fn).items()
                if not k.startswith("_") and isinstance(v, (bool, int, float, str)) and len(repr(v)) <= 60
            ]
        return f"FromTransformers({self.name}" + (f"({', '.join(settings)})" if settings else "") + ")"


def as_processor(item: Any) -> LogitsProcessor:
    """A logitscope processor for ``item``.

    logitscope processors pass through. Any other callable is taken to be in
    the transformers convention (``LogitsProcessorList`` accepts the same);
    functions of other conventions must be wrapped explicitly with
    :func:`~processors.from_vllm`, :func:`~processors.from_dynamo` or
    :func:`~processors.from_trtllm`.
    """
    if isinstance(item, LogitsProcessor):
        return item
    if callable(item):
        return FromTransformers(item)
    raise TypeError(
        f"a logits processor must be a processors.LogitsProcessor or a callable "
        f"(input_ids, scores) -> scores, got {type(item).__name__}"
    )


class ProcessorList(LogitsProcessor):
    """Processors applied in order; checks each one's output.

    Accepts logitscope processors, transformers ``LogitsProcessor`` objects and
    plain callables in the transformers convention (see
    :func:`processors.as_processor`). A processor that returns the wrong shape,
    dtype or device, or raises, fails with an error that names it and its
    position.
    """

    def __init__(self, processors: Iterable[Any] = ()) -> None:
        self.processors: list[LogitsProcessor] = [as_processor(p) for p in processors]

    @property
    def inplace(self) -> bool:  # type: ignore[override]
        return any(p.inplace for p in self.processors)

    def append(self, processor: Any) -> None:
        self.processors.append(as_processor(processor))

    def __len__(self) -> int:
        return len(self.processors)

    def __iter__(self):
        return iter(self.processors)

    def __getitem__(self, index: int) -> LogitsProcessor:
        return self.processors[index]

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Each processor in order, its output checked; synchronises only where one of them does."""
        return self.apply(logits, ctx)

    def apply(
        self, logits: torch.Tensor, ctx: BatchContext, each: Callable[[int, torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """:meth:`process`, handing each processor's checked output to ``each(position, out)`` (a tracker records it).

        The checks read shapes, dtypes and devices only: no synchronisation of their own.
        """
        for position, processor in enumerate(self.processors):
            label = f"{position} ({processor.name})"
            try:
                out = processor.process(logits, ctx)
            except ProcessorError:
                raise
            except Exception as exc:
                raise ProcessorError(f"processor {label} raised {type(exc).__name__}: {exc}") from exc
            logits = check_logits(label, out, logits)
            if each is not None:
                each(position, logits)
        return logits

    def reset(self) -> None:
        for processor in self.processors:
            processor.reset()

    def on_generation_start(self, sampling: Sequence[Mapping[str, Any]]) -> None:
        for processor in self.processors:
            processor.on_generation_start(sampling)

    def on_generation_end(self, lengths: Sequence[int]) -> None:
        for processor in self.processors:
            processor.on_generation_end(lengths)

    def on_sampled(self, tokens: torch.Tensor, ctx: BatchContext) -> None:
        """Tell each processor the step's tokens (no synchronisation of its own)."""
        for processor in self.processors:
            processor.on_sampled(tokens, ctx)

    @property
    def wants_prefill_logits(self) -> bool:
        return any(p.wants_prefill_logits for p in self.processors)

    def on_prefill(self, logits: torch.Tensor, ctx: BatchContext) -> None:
        for processor in self.processors:
            if processor.wants_prefill_logits:
                processor.on_prefill(logits, ctx)

    def __repr__(self) -> str:
        return f"ProcessorList([{', '.join(repr(p) for p in self.processors)}])"
