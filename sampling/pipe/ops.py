"""The ops a pipe runs: what each processor legalizes into, and the fused ops the fusion rules build.

Every filter and sampler here runs the one filter chain of
:mod:`~sampling.pipe.chain`: a filter (:class:`FilterOp`) is a chain of one
whose kept tokens it materialises; a sampler (:class:`SampleOp`) is a chain of
none until the fusion rules fold the softmax and filters before it into it.
The other ops are a line of PyTorch each. Every sampler fills
``Runtime.logprobs`` and ``Runtime.valid`` (and, when dead rows are flagged
rather than raised, gives them token -1), and builds the ``"sampled"`` tap
tensor only when a tap asks for it. An op's ``name`` (shown by the pipe's
repr) says what it does on which tensor type, e.g. ``ProbsTopPOp``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

import sampling.pipe.kernels as K
from sampling.pipe.chain import Chain, Filter, fusable, report_draw
from sampling.pipe.op import Op, Runtime
from sampling.pipe.types import SAMPLED, PipeError, TaggedTensor, TensorType

__all__ = ["TemperatureOp", "SoftmaxOp", "TemperatureSoftmaxOp", "FilterOp", "SampleOp", "GreedyOp", "FunctionOp"]

LOGITS, PROBS, INDICES = TensorType.LOGITS, TensorType.PROBS, TensorType.INDICES


def _typed(name: str, input_type: TensorType) -> str:
    return ("Logits" if input_type is LOGITS else "Probs") + name


# --------------------------------------------------------------------------- logits and softmax


class TemperatureOp(Op):
    """``logits / temperature``. Does not synchronise."""

    IN, OUT, PARAMS = LOGITS, LOGITS, ("temperature",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return TaggedTensor.logits(x.data / K.as_column(rt.param(self, "temperature"), x.data))


class SoftmaxOp(Op):
    """Logits to probabilities (float32). Does not synchronise."""

    IN, OUT = LOGITS, PROBS

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return TaggedTensor.probs(torch.softmax(x.data.float(), dim=-1))


class _FusedOp(Op):
    """An op standing for several: it keeps them as ``parts`` (for taps and the repr)."""

    def __init__(self, parts: Sequence[Op]) -> None:
        flat = tuple(p for op in parts for p in op.parts)
        super().__init__(stage=flat[-1].stage, ends_stage=flat[-1].ends_stage)
        self._parts = flat

    @property
    def parts(self) -> tuple[Op, ...]:
        return self._parts

    @property
    def name(self) -> str:
        words = (p.name.removesuffix("Op").removeprefix("Probs").removeprefix("Logits") for p in self.parts)
        return "Fused" + "".join(words) + "Op"


class TemperatureSoftmaxOp(_FusedOp):
    """``softmax(logits / temperature)`` in one op. Does not synchronise."""

    IN, OUT, PARAMS = LOGITS, PROBS, ("temperature",)

    @property
    def name(self) -> str:
        return "TemperatureSoftmaxOp"

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        t = rt.param(self.parts[0], "temperature")
        return TaggedTensor.probs(torch.softmax(x.data.float() / K.as_column(t, x.data), dim=-1))


# --------------------------------------------------------------------------- filters and samplers


class FilterOp(Op):
    """Top-k, top-p or min-p (``kind``): the tokens its chain of one keeps, on ``input_type``.

    On LOGITS (top-k only) the others become -inf; on PROBS they become 0 and
    the rest is renormalised unless ``renormalize`` is off (the joint
    filter's top-k). Synchronises as :class:`Chain` does (only under the
    ``"cpu"`` algorithm).
    """

    def __init__(
        self,
        kind: Literal["top_k", "top_p", "min_p"],
        input_type: TensorType,
        stage: str = "",
        ends_stage: bool = True,
        *,
        renormalize: bool = True,
        **defaults: Any,
    ) -> None:
        super().__init__(stage, ends_stage, **defaults)
        self.kind, self.renormalize, self.PARAMS = kind, renormalize, (kind,)
        self.IN = self.OUT = input_type

    @property
    def filter(self) -> Filter:
        return Filter(self.kind, self, self.renormalize)

    @property
    def name(self) -> str:
        word = {"top_k": "TopK", "top_p": "TopP", "min_p": "MinP"}[self.kind]
        return _typed(("" if self.renormalize else "Joint") + word + "Op", self.IN)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        keep = Chain(x.data, rt, [self.filter], from_logits=self.IN is LOGITS).keep()
        if self.IN is LOGITS:
            return TaggedTensor.logits(x.data.masked_fill(~keep, float("-inf")))
        kept = torch.where(keep, x.data, 0.0)
        return TaggedTensor.probs(kept / kept.sum(-1, keepdim=True) if self.renormalize else kept)


class SampleOp(_FusedOp):
    """Softmax (with temperature) if given LOGITS, a chain of filters, then one draw per row by the CDF in the order.

    A ``Sample`` processor legalizes into a sampler with no filters; the
    fusion rules build samplers that replace the ops before them (kept as
    ``parts``): ``filters`` describe the chain in order, and ``temperature``
    is the op holding the temperature default, if any. Synchronises as
    :class:`Chain` does.
    """

    OUT = INDICES

    def __init__(
        self,
        input_type: TensorType,
        stage: str = "",
        *,
        parts: Sequence[Op] = (),
        filters: Sequence[Filter] = (),
        temperature: Op | None = None,
    ) -> None:
        if parts:
            super().__init__(parts)
        else:
            Op.__init__(self, stage)
            self._parts = (self,)
        if not fusable(filters):
            raise PipeError(f"a sampler cannot run the filter chain {[f.kind for f in filters]} exactly")
        self.IN, self.filters, self.temperature = input_type, tuple(filters), temperature

    @property
    def name(self) -> str:
        return _typed("SampleOp", self.IN) if self._parts == (self,) else super().name

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return Chain(x.data, rt, self.filters, self.IN is LOGITS, self.temperature).sample()


class GreedyOp(Op):
    """The arg-max (lowest id among ties); its log-probability under ``softmax(logits)``, or renormalised probabilities.

    Does not synchronise.
    """

    OUT = INDICES

    def __init__(self, input_type: TensorType, stage: str = "") -> None:
        super().__init__(stage)
        self.IN = input_type

    @property
    def name(self) -> str:
        return _typed("GreedyOp", self.IN)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        w = x.data.float()
        best, tokens = w.max(dim=-1)  # first maximum: the lowest id among ties
        if self.IN is LOGITS:
            logprobs = best.double() - torch.logsumexp(w, dim=-1).double()
        else:
            logprobs = torch.log(best.double()) - torch.log(w.sum(-1).double())
        if rt.wants(SAMPLED):
            one_hot = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            rt.emit(SAMPLED, TaggedTensor.probs(one_hot.scatter_(1, tokens[:, None], 1.0)))
        return report_draw(rt, tokens, logprobs, torch.isfinite(logprobs) & torch.isfinite(best))


class FunctionOp(Op):
    """A user's function ``fn(tensor) -> tensor`` from one tensor type to another (synchronises if ``fn`` does)."""

    def __init__(
        self, fn: Callable[[torch.Tensor], torch.Tensor], accepts: TensorType, returns: TensorType, stage: str = ""
    ) -> None:
        super().__init__(stage)
        self.fn, self.IN, self.OUT = fn, accepts, returns

    @property
    def name(self) -> str:
        return f"FunctionOp[{getattr(self.fn, '__name__', type(self.fn).__name__)}]"

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        y = self.fn(x.data)
        expected = x.data.shape[:1] if self.OUT is INDICES else x.data.shape
        if not isinstance(y, torch.Tensor) or y.shape != expected:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise PipeError(
                f"stage {self.stage!r}: the function must return a tensor of shape {tuple(expected)}, got {got}"
            )
        return TaggedTensor(y, self.OUT)
