"""The ops a pipe runs: what each processor legalizes into, and the fused ops the fusion rules build.

Every filter and sampler here runs the one filter chain of
:mod:`~sampling.pipe.chain`; the other ops are a line of PyTorch each.
Every sampler fills ``Runtime.logprobs`` and ``Runtime.valid`` (and, when
dead rows are flagged rather than raised, gives them token -1), and builds
the ``"sampled"`` tap tensor only when a tap asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

import sampling.pipe.kernels as K
from sampling.pipe.chain import Chain, Filter, fusable, report_draw
from sampling.pipe.op import Op, Runtime
from sampling.pipe.types import SAMPLED, PipeError, TaggedTensor, TensorType

__all__ = ["TemperatureOp", "SoftmaxOp", "TemperatureSoftmaxOp", "LogitsTopKOp", "ProbsFilterOp", "ProbsTopKOp"]
__all__ += ["ProbsTopPOp", "ProbsMinPOp", "LogitsSampleOp", "ProbsSampleOp", "LogitsGreedyOp", "ProbsGreedyOp"]
__all__ += ["FunctionOp", "FusedSampleOp"]

LOGITS, PROBS, INDICES = TensorType.LOGITS, TensorType.PROBS, TensorType.INDICES


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


class LogitsTopKOp(Op):
    """Keep exactly ``top_k`` logits per row (ties: lower id), the rest -inf. Synchronises as :class:`Chain`."""

    IN, OUT, PARAMS = LOGITS, LOGITS, ("top_k",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        keep = Chain(x.data, rt, [Filter("top_k", self)], from_logits=True).keep()
        return TaggedTensor.logits(x.data.masked_fill(~keep, float("-inf")))


class ProbsFilterOp(Op):
    """A filter on probabilities: the tokens its chain of one keeps, renormalised unless ``renormalize`` is off.

    Synchronises as :class:`Chain` does (only under the ``"cpu"`` algorithm).
    """

    IN, OUT = PROBS, PROBS
    KIND: Literal["top_k", "top_p", "min_p"]
    renormalize = True

    @property
    def filter(self) -> Filter:
        return Filter(self.KIND, self, self.renormalize)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        kept = torch.where(Chain(x.data, rt, [self.filter], from_logits=False).keep(), x.data, 0.0)
        return TaggedTensor.probs(kept / kept.sum(-1, keepdim=True) if self.renormalize else kept)


class ProbsTopKOp(ProbsFilterOp):
    """Keep exactly ``top_k`` tokens (ties: lower id); renormalise unless it is the joint filter's top-k."""

    KIND, PARAMS = "top_k", ("top_k",)

    def __init__(self, stage: str = "", ends_stage: bool = True, *, renormalize: bool = True, **defaults) -> None:
        super().__init__(stage, ends_stage, **defaults)
        self.renormalize = renormalize

    @property
    def name(self) -> str:
        return "ProbsTopKOp" if self.renormalize else "ProbsJointTopKOp"


class ProbsTopPOp(ProbsFilterOp):
    """Keep the top-p prefix (mass strictly before a token < top_p; PROBS count as summing to 1); renormalise."""

    KIND, PARAMS = "top_p", ("top_p",)


class ProbsMinPOp(ProbsFilterOp):
    """Keep tokens with ``p >= min_p * max(p)``; renormalise."""

    KIND, PARAMS = "min_p", ("min_p",)


class ProbsSampleOp(Op):
    """Draw a token per row from probabilities (renormalised), by the CDF in the order. Synchronises as :class:`Chain`."""

    IN, OUT = PROBS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return Chain(x.data, rt, [], from_logits=False).sample()


class LogitsSampleOp(Op):
    """Draw a token per row from ``softmax(logits)``, by the CDF in the order. Synchronises as :class:`Chain`."""

    IN, OUT = LOGITS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return Chain(x.data, rt, [], from_logits=True).sample()


class FusedSampleOp(_FusedOp):
    """Softmax (with temperature) if given logits, a chain of filters, then sampling, in one op.

    ``filters`` describe the chain in order; ``from_logits`` says whether the
    input is LOGITS (the softmax is part of the op) and ``temperature`` is the
    op holding the temperature default, if any. Synchronises as :class:`Chain` does.
    """

    OUT = INDICES

    def __init__(
        self, parts: Sequence[Op], filters: Sequence[Filter], from_logits: bool, temperature: Op | None = None
    ) -> None:
        super().__init__(parts)
        if not fusable(filters):
            raise PipeError(f"FusedSampleOp cannot run the filter chain {[f.kind for f in filters]} exactly")
        self.filters, self.from_logits, self.temperature = tuple(filters), from_logits, temperature
        self.IN = LOGITS if from_logits else PROBS

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return Chain(x.data, rt, self.filters, self.from_logits, self.temperature).sample()


def _greedy(x: torch.Tensor, log_total: torch.Tensor, rt: Runtime, log: bool) -> TaggedTensor:
    best, tokens = x.max(dim=-1)  # first maximum: the lowest id among ties
    logprobs = (torch.log(best.double()) if log else best.double()) - log_total
    if rt.wants(SAMPLED):
        one_hot = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        rt.emit(SAMPLED, TaggedTensor.probs(one_hot.scatter_(1, tokens[:, None], 1.0)))
    return report_draw(rt, tokens, logprobs, torch.isfinite(logprobs) & torch.isfinite(best))


class LogitsGreedyOp(Op):
    """The arg-max (lowest id among ties); its log-probability under ``softmax(logits)``. Does not synchronise."""

    IN, OUT = LOGITS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        logits = x.data.float()
        return _greedy(logits, torch.logsumexp(logits, dim=-1).double(), rt, log=False)


class ProbsGreedyOp(Op):
    """The arg-max (lowest id among ties); its probability renormalised. Does not synchronise."""

    IN, OUT = PROBS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        p = x.data.float()
        return _greedy(p, torch.log(p.sum(-1).double()), rt, log=True)


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
