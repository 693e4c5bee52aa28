"""What flows through a pipe and what comes out: tagged tensors, taps, results, errors, and the op.

Every tensor between two ops is tagged with what it holds, so that the pipe
can check at construction that each op receives what it accepts.

A tap is a ``(stage, fn)`` pair; ``fn(tensor)`` is called with the
:class:`TaggedTensor` that the stage produced, on the device where it lives,
with no copy and no synchronisation. ``fn`` must not modify the tensor.
Stage names of a pipe: ``"input"`` (what the pipe was given), one per
processor (``"temperature"``, ``"softmax"``, ``"top_k"``, ``"top_p"``,
``"min_p"``, ``"sample"``, ``"greedy"``, or the processor's ``name=``; a
repeated name gets ``_2``, ``_3``), and, in a pipe that samples,
``"sampled"``: the distribution actually sampled from, always **PROBS**,
float32 ``[B, V]``, each row summing to 1, exactly 0 for tokens removed by
top-k, top-p or min-p (a one-hot row for greedy). It is built only when a
tap asks for it. A tap on a stage that fusion folded into a later op makes
that call run the plain ops, which give every stage (and the same tokens).
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from sampling.pipe.kernels import Param


class TensorType(enum.Enum):
    """What a ``[B, V]`` (or ``[B]``) tensor in a pipe holds."""

    LOGITS = "logits"  # float [B, V]; -inf for removed tokens
    PROBS = "probs"  # float [B, V]; >= 0, zero for removed tokens
    INDICES = "indices"  # int64 [B]: one token id per row

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class TaggedTensor:
    """A tensor and the :class:`TensorType` it holds."""

    data: torch.Tensor
    type: TensorType

    @classmethod
    def logits(cls, data: torch.Tensor) -> TaggedTensor:
        return cls(data, TensorType.LOGITS)

    @classmethod
    def probs(cls, data: torch.Tensor) -> TaggedTensor:
        return cls(data, TensorType.PROBS)

    @classmethod
    def indices(cls, data: torch.Tensor) -> TaggedTensor:
        return cls(data, TensorType.INDICES)

    def __repr__(self) -> str:
        return f"TaggedTensor({self.type}, shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


TapFn = Callable[[TaggedTensor], None]
INPUT = "input"
SAMPLED = "sampled"


class Tap(NamedTuple):
    """Call ``fn`` with the tensor of ``stage`` (see the module docstring for stage names)."""

    stage: str
    fn: TapFn


@dataclass(frozen=True, slots=True)
class RawLogprobs:
    """Log-probabilities under the **raw** distribution: the pipe's input, before any of its stages.

    Attributes:
        logprobs: ``float32 [B]``, the chosen token's raw log-probability.
        ranks: ``int64 [B]``, the chosen token's rank in the raw distribution,
            1-based: 1 + the number of tokens with a strictly larger value.
        top_ids: ``int64 [B, n]``, the ``n`` most likely raw tokens (most likely first).
        top_logprobs: ``float32 [B, n]``, their raw log-probabilities.
    """

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One sampled token per row.

    Attributes:
        tokens: ``int64 [B]``; -1 in a dead row (only with ``on_dead="flag"``).
        logprobs: ``float32 [B]``, the **processed** log-probability: of the
            chosen token in the distribution it was sampled from (after every
            stage of the pipe; for ``Greedy``, under the greedy stage's
            input). NaN in a dead row.
        valid: ``bool [B]``; False where the row had nothing to sample.
        raw: log-probabilities before the pipe's stages, when asked for.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    valid: torch.Tensor
    raw: RawLogprobs | None = None


class PipeError(ValueError):
    """A pipe cannot be built, or a call to it got arguments it cannot use."""


class LegalizationError(PipeError):
    """A processor cannot run on the tensor type it would receive."""


class CompileError(PipeError):
    """A list of ops breaks a type or validity rule."""


class DeadRowError(RuntimeError):
    """A row has no token left to sample (every logit -inf, or a stage removed all) or holds NaN."""


# --------------------------------------------------------------------------- the op and what one call's ops share


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
