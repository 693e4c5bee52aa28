"""The op (one step of a compiled pipe), what the ops of one call share, and the parameters' rules."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from sampling.pipe.kernels import Param
from sampling.pipe.types import PipeError, TaggedTensor, TapFn, TensorType

__all__ = ["Op", "Runtime", "PARAM_RULES", "check_param"]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


PARAM_RULES: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    # name: (scalar rule, what is allowed, integer tensor)
    "temperature": (lambda v: _number(v) and math.isfinite(v) and v > 0, "a finite number > 0", False),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "an int > 0", True),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]", False),
    "min_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]", False),
}


def check_param(name: str, value: Any, batch: int | None = None) -> Any:
    """Validate one runtime parameter: a scalar by its rule, a tensor by shape and dtype.

    Tensors are not checked value by value (that would synchronise a GPU);
    a per-row tensor may hold the neutral value that turns the stage off for
    that row (top_k 0, top_p 1, min_p 0). Returns scalars unchanged and
    tensors flattened to ``[B]``. Does not synchronise.
    """
    if name not in PARAM_RULES:
        raise PipeError(f"unknown parameter {name!r}; known parameters: {sorted(PARAM_RULES)}")
    rule, allowed, integer = PARAM_RULES[name]
    if isinstance(value, torch.Tensor):
        if value.ndim > 2 or (value.ndim == 2 and value.shape[1] != 1):
            raise PipeError(f"{name} must be a scalar or a [batch] tensor, got shape {tuple(value.shape)}")
        if batch is not None and value.numel() not in (1, batch):
            raise PipeError(f"{name} must have one value per row ({batch}), got {value.numel()}")
        if integer and (value.is_floating_point() or value.dtype == torch.bool or value.is_complex()):
            raise PipeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if not integer and not value.is_floating_point():
            raise PipeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
        return value.reshape(-1)
    if not rule(value):
        raise PipeError(f"{name} must be {allowed}, got {value!r}")
    return value


@dataclass
class Runtime:
    """What the ops of one call share.

    ``params`` are the call's validated keyword parameters; an op falls back
    to the defaults of its processor. ``u`` holds one uniform number in
    [0, 1) per row (float64), drawn from ``generator`` when not given. The
    sampling op fills ``logprobs`` (log-probability of each chosen token in
    the distribution sampled from) and ``valid`` (False for a dead row).
    ``algorithm`` is the resolved algorithm (never ``"auto"``, see
    :mod:`sampling.pipe.kernels`); ``max_top_k`` a host-side bound of a
    per-row top-k.
    """

    batch: int
    device: torch.device
    params: Mapping[str, Param] = field(default_factory=dict)
    u: torch.Tensor | None = None
    generator: torch.Generator | None = None
    taps: Mapping[str, tuple[TapFn, ...]] = field(default_factory=dict)
    flag_dead: bool = False
    algorithm: str = "cpu"
    max_top_k: int | None = None
    logprobs: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    def param(self, op: Op, name: str) -> Param:
        """The value of ``name`` for ``op``: the call's, else the processor's default."""
        value = self.params.get(name)
        if value is None:
            value = op.defaults.get(name)
        if value is None:
            raise PipeError(
                f"stage {op.stage!r} ({op.name}) needs {name}: pass {name}= when calling "
                f"the pipe, or give it to the processor"
            )
        return value

    def uniforms(self) -> torch.Tensor:
        """One uniform number in [0, 1) per row, float64 (drawn once per call). Does not synchronise."""
        if self.u is None:
            self.u = torch.rand(self.batch, dtype=torch.float64, device=self.device, generator=self.generator)
        return self.u

    @property
    def sync_free(self) -> bool:
        """Whether the ops must not read the device (every algorithm but ``"cpu"``)."""
        return self.algorithm != "cpu"

    def wants(self, stage: str) -> bool:
        return stage in self.taps

    def emit(self, stage: str, tensor: TaggedTensor) -> None:
        for fn in self.taps.get(stage, ()):
            fn(tensor)


class Op(abc.ABC):
    """A step that maps a tagged tensor of type ``IN`` to one of type ``OUT``.

    ``stage`` names the processor the op came from (taps use it);
    ``defaults`` hold the processor's parameter values; ``ends_stage`` is
    True for the last op of its processor, whose output is the stage's
    output. A fused op lists the ops it replaces in ``parts``.
    Subclasses implement :meth:`__call__` and must not modify ``x.data``.
    """

    IN: TensorType  # a class attribute; fused and user ops may set it per instance
    OUT: TensorType
    PARAMS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, stage: str = "", ends_stage: bool = True, **defaults: Any) -> None:
        self.stage = stage
        self.ends_stage = ends_stage
        self.defaults = {k: v for k, v in defaults.items() if v is not None}

    @abc.abstractmethod
    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor: ...

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def parts(self) -> tuple[Op, ...]:
        return (self,)

    def __repr__(self) -> str:
        return f"{self.name}(stage={self.stage!r})"
