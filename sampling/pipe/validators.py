"""Checks, as plain functions: on a pipe's ops at construction, and on runtime parameters per call."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from sampling.pipe.types import CompileError, PipeError, TensorType

if TYPE_CHECKING:
    from sampling.pipe.op import Op

__all__ = [
    "ValidityCheck",
    "check_types",
    "check_single_softmax",
    "check_nothing_after_indices",
    "default_checks",
    "check_param",
    "PARAM_RULES",
]

ValidityCheck = Callable[[Sequence["Op"], TensorType], None]
"""``check(ops, input_type)`` raises :class:`CompileError` when the ops break a rule."""


def check_types(ops: Sequence["Op"], input_type: TensorType) -> None:
    """Each op must accept what the one before it gives (the first: the pipe's input type)."""
    current = input_type
    for i, op in enumerate(ops):
        if op.IN is not current:
            source = "the pipe's input" if i == 0 else f"op {i - 1} ({ops[i - 1].name})"
            raise CompileError(f"op {i} ({op.name}) takes {op.IN.name}, but {source} gives {current.name}")
        current = op.OUT


def check_single_softmax(ops: Sequence["Op"], input_type: TensorType) -> None:
    """At most one softmax, counting those inside fused ops."""
    from sampling.pipe.ops import SoftmaxOp

    where = [i for i, op in enumerate(ops) for part in op.parts if isinstance(part, SoftmaxOp)]
    if len(where) > 1:
        raise CompileError(f"a pipe may hold at most one Softmax, found {len(where)} (ops {where})")


def check_nothing_after_indices(ops: Sequence["Op"], input_type: TensorType) -> None:
    """Once a token is chosen (INDICES), nothing may follow."""
    for i, op in enumerate(ops[:-1]):
        if op.OUT is TensorType.INDICES:
            raise CompileError(
                f"op {i} ({op.name}) outputs INDICES, so it must be last; {len(ops) - i - 1} op(s) follow it"
            )


def default_checks() -> list[ValidityCheck]:
    return [check_types, check_single_softmax, check_nothing_after_indices]


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _unit(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1


PARAM_RULES: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    # name: (scalar rule, what is allowed, integer tensor)
    "temperature": (_positive_number, "a finite number > 0", False),
    "top_k": (_positive_int, "an int > 0", True),
    "top_p": (_unit, "a number in (0, 1]", False),
    "min_p": (_unit, "a number in (0, 1]", False),
}


def check_param(name: str, value: Any, batch: int | None = None) -> Any:
    """Validate one runtime parameter: a scalar by its rule, a tensor by shape and dtype.

    Tensors are not checked value by value (that would synchronise a GPU);
    a per-row tensor may hold the neutral value that turns the stage off for
    that row (top_k 0, top_p 1, min_p 0). Returns scalars unchanged and
    tensors flattened to ``[B]``.
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
