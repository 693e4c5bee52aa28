"""Compile a list of ops: run the validity checks, then apply fusion rules."""

from __future__ import annotations

from typing import Sequence

from sampling.pipe.fusion import FusionRule
from sampling.pipe.op import Op
from sampling.pipe.types import CompileError, TensorType
from sampling.pipe.validators import ValidityCheck, check_types

__all__ = ["compile_ops", "fuse"]


def _matches(window: Sequence[Op], pattern: tuple) -> bool:
    return len(window) == len(pattern) and all(isinstance(op, kind) for op, kind in zip(window, pattern))


def fuse(ops: Sequence[Op], rules: Sequence[FusionRule]) -> list[Op]:
    """Apply ``rules`` (highest ``prio`` first) left to right, stepping back one op after each fusion."""
    ordered = sorted(rules, key=lambda r: -r.prio)
    out = list(ops)
    i = 0
    while i < len(out):
        for rule in ordered:
            window = out[i : i + len(rule.pattern)]
            if _matches(window, rule.pattern) and rule.guard(window):
                out[i : i + len(window)] = [rule.build(window)]
                i = max(i - 1, 0)
                break
        else:
            i += 1
    return out


def compile_ops(
    ops: Sequence[Op], input_type: TensorType, rules: Sequence[FusionRule], checks: Sequence[ValidityCheck]
) -> list[Op]:
    """Check ``ops`` with every check, fuse them, and check that the fusion kept the types."""
    if not ops:
        raise CompileError("cannot compile an empty list of ops")
    for check in checks:
        check(ops, input_type)
    fused = fuse(ops, rules)
    try:
        check_types(fused, input_type)
    except CompileError as e:
        raise CompileError(f"a fusion rule broke the chain of types: {e}") from e
    return fused
