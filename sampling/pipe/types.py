"""Tensor types that flow through a pipe, and the pipe's errors.

Every tensor between two ops is tagged with what it holds, so that the pipe
can check at construction that each op receives what it accepts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "TensorType",
    "TaggedTensor",
    "PipeError",
    "LegalizationError",
    "CompileError",
    "DeadRowError",
]


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
    def logits(cls, data: torch.Tensor) -> "TaggedTensor":
        return cls(data, TensorType.LOGITS)

    @classmethod
    def probs(cls, data: torch.Tensor) -> "TaggedTensor":
        return cls(data, TensorType.PROBS)

    @classmethod
    def indices(cls, data: torch.Tensor) -> "TaggedTensor":
        return cls(data, TensorType.INDICES)

    def __repr__(self) -> str:
        return f"TaggedTensor({self.type}, shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


class PipeError(ValueError):
    """A pipe cannot be built, or a call to it got arguments it cannot use."""


class LegalizationError(PipeError):
    """A processor cannot run on the tensor type it would receive."""


class CompileError(PipeError):
    """A list of ops breaks a type or validity rule."""


class DeadRowError(RuntimeError):
    """A row has no token left to sample (every logit -inf, or a stage removed all) or holds NaN."""
