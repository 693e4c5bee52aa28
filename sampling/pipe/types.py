"""What flows through a pipe and what comes out: tagged tensors, taps, results and errors.

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

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["TensorType", "TaggedTensor", "Tap", "TapFn", "INPUT", "SAMPLED", "SampleResult", "RawLogprobs"]
__all__ += ["PipeError", "LegalizationError", "CompileError", "DeadRowError"]


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
