"""The processors a pipe is written with; each legalizes into ops for the tensor type it receives.

>>> LogitsPipe([Temperature(0.7), Softmax(), TopK(50), TopP(0.9), Sample()])

A processor may carry default values for its parameters; a value passed when
the pipe is called wins. ``TopK`` and ``Sample`` accept LOGITS or PROBS,
``Temperature`` and ``Softmax`` only LOGITS, ``TopP`` and ``MinP`` only PROBS.
A user's own step subclasses :class:`Stage` (or wraps a function with
:class:`Apply`).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch

import sampling.pipe.ops as O
from sampling.pipe.types import LegalizationError, Op, TensorType, check_param

LOGITS, PROBS, INDICES = TensorType.LOGITS, TensorType.PROBS, TensorType.INDICES


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).lower()


class Stage(abc.ABC):
    """A step of a pipe. Subclasses set ``ACCEPTS`` and implement :meth:`ops_for`.

    ``name`` names the stage for taps (default: the class name in snake case,
    ``TopK`` -> ``"top_k"``). The repr shows the class and the values given.
    """

    ACCEPTS: ClassVar[tuple[TensorType, ...]]
    PARAM: ClassVar[str | None] = None  # the runtime parameter this processor may carry a default of

    def __init__(self, value: Any = None, *, name: str | None = None) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        self.name = name
        if self.PARAM is not None:
            setattr(self, self.PARAM, None if value is None else check_param(self.PARAM, value))

    @property
    def default_name(self) -> str:
        return self.name or _snake(type(self).__name__)

    @abc.abstractmethod
    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        """The ops that do this step on a tensor of ``input_type``."""

    def legalize(self, input_type: TensorType, stage: str) -> list[Op]:
        """The ops for ``input_type``; raises :class:`LegalizationError` if the type is not accepted."""
        if input_type not in self.ACCEPTS:
            accepted = " or ".join(t.name for t in self.ACCEPTS)
            raise LegalizationError(f"{type(self).__name__} can only be applied to {accepted}, got {input_type.name}")
        ops = self.ops_for(input_type, stage)
        for op in ops:
            op.ends_stage = op is ops[-1]
        return ops

    def _defaults(self) -> dict[str, Any]:
        return {} if self.PARAM is None else {self.PARAM: getattr(self, self.PARAM)}

    def _repr_args(self) -> list[str]:
        args = [repr(v) for v in self._defaults().values() if v is not None]
        return args + ([f"name={self.name!r}"] if self.name else [])

    def __repr__(self) -> str:
        args = self._repr_args()
        return type(self).__name__ + (f"({', '.join(args)})" if args else "")


class Temperature(Stage):
    """Divide logits by ``temperature`` (> 0; greedy decoding is :class:`Greedy`)."""

    ACCEPTS, PARAM = (LOGITS,), "temperature"

    def __init__(self, temperature: float | None = None, *, name: str | None = None) -> None:
        super().__init__(temperature, name=name)

    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        return [O.TemperatureOp(stage, **self._defaults())]


class Softmax(Stage):
    """Logits to probabilities. At most one per pipe."""

    ACCEPTS = (LOGITS,)

    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        return [O.SoftmaxOp(stage)]


class _Filter(Stage):
    """A filter processor: top-k, top-p or min-p by its ``PARAM``; all legalize into one :class:`~sampling.pipe.ops.FilterOp`."""

    joint = False

    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        kind: Any = self.PARAM  # "top_k", "top_p" or "min_p"
        return [O.FilterOp(kind, input_type, stage, renormalize=not self.joint, **self._defaults())]


class TopK(_Filter):
    """Keep exactly ``top_k`` tokens (ties: lower id); on PROBS, renormalise.

    ``joint=True`` is the joint top-k/top-p filter (FlashInfer's
    ``joint_topk_topp``): no renormalisation after top-k, so a following
    :class:`TopP` counts mass against the whole distribution. It samples a
    different distribution from the default (renormalise, then top-p).
    """

    ACCEPTS, PARAM = (LOGITS, PROBS), "top_k"

    def __init__(self, top_k: int | None = None, *, joint: bool = False, name: str | None = None) -> None:
        if not isinstance(joint, bool):
            raise ValueError(f"joint must be a bool, got {joint!r}")
        super().__init__(top_k, name=name)
        self.joint = joint

    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        if input_type is LOGITS and self.joint:
            raise LegalizationError("TopK(joint=True) needs PROBS (put a Softmax before it), got LOGITS")
        return super().ops_for(input_type, stage)

    def _repr_args(self) -> list[str]:
        return super()._repr_args() + (["joint=True"] if self.joint else [])


class TopP(_Filter):
    """Keep the smallest prefix of most probable tokens whose mass is ``>= top_p``; renormalise."""

    ACCEPTS, PARAM = (PROBS,), "top_p"

    def __init__(self, top_p: float | None = None, *, name: str | None = None) -> None:
        super().__init__(top_p, name=name)


class MinP(_Filter):
    """Keep tokens with ``p >= min_p * max(p)``; renormalise."""

    ACCEPTS, PARAM = (PROBS,), "min_p"

    def __init__(self, min_p: float | None = None, *, name: str | None = None) -> None:
        super().__init__(min_p, name=name)


class Sample(Stage):
    """Draw one token per row (INDICES) by inverting the CDF in the order at the row's uniform number."""

    ACCEPTS = (LOGITS, PROBS)

    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        return [O.SampleOp(input_type, stage)]


class Greedy(Stage):
    """Take the arg-max of each row (lowest id among ties)."""

    ACCEPTS = (LOGITS, PROBS)

    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        return [O.GreedyOp(input_type, stage)]


class Apply(Stage):
    """A user's function as a step: ``fn(tensor [B, V]) -> tensor``, from ``accepts`` to ``returns``.

    ``returns`` defaults to ``accepts``; INDICES means the function picks one
    token per row (``[B]``).
    """

    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        accepts: TensorType = LOGITS,
        returns: TensorType | None = None,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        for arg, value in (("accepts", accepts), ("returns", returns)):
            if value is not None and not isinstance(value, TensorType):
                raise TypeError(f"{arg} must be a TensorType, got {value!r}")
        super().__init__(name=name or _snake(getattr(fn, "__name__", "apply")).strip("_<>") or "apply")
        self.fn, self.accepts, self.returns = fn, accepts, returns or accepts

    @property
    def ACCEPTS(self) -> tuple[TensorType, ...]:  # type: ignore[override]
        return (self.accepts,)

    def ops_for(self, input_type: TensorType, stage: str) -> list[Op]:
        return [O.FunctionOp(self.fn, self.accepts, self.returns, stage)]

    def __repr__(self) -> str:
        return f"Apply[{getattr(self.fn, '__name__', type(self.fn).__name__)}]"
