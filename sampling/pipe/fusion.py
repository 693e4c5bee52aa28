"""Compiling a pipe's ops: validity checks, then fusion rules that do a window of ops in one.

A rule is ``(pattern, guard, build, prio)``: ``pattern`` is a tuple of op
classes (or tuples of classes) matched by ``isinstance`` against a window of
consecutive ops, ``guard(window)`` says whether fusing keeps the semantics,
``build(window)`` returns the fused op. :func:`fuse` tries rules highest
``prio`` first at each position, and after a fusion steps the window back by
one, so fused ops fuse again (a cascade):

    Temperature, Softmax, TopK, TopP, Sample
    -> TemperatureSoftmax, TopK, TopP, Sample          (temperature_softmax)
    -> TemperatureSoftmax, TopK, FusedTopPSample       (filter_sample)
    -> TemperatureSoftmax, FusedTopKTopPSample         (filter_into_sample)
    -> FusedTemperatureSoftmaxTopKTopPSample           (softmax_into_sample)

The last op never computes a softmax over the vocabulary: it selects the
top-k candidates from the logits and does the rest on them. A check is
``check(ops, input_type)`` and raises :class:`CompileError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from sampling.pipe.chain import Filter, fusable
from sampling.pipe.op import Op
from sampling.pipe.ops import (
    FusedSampleOp,
    LogitsSampleOp,
    LogitsTopKOp,
    ProbsFilterOp,
    ProbsSampleOp,
    SoftmaxOp,
    TemperatureOp,
    TemperatureSoftmaxOp,
)
from sampling.pipe.types import CompileError, TensorType

__all__ = ["FusionRule", "default_rules", "fuse", "compile_ops", "ValidityCheck", "default_checks"]
__all__ += ["check_types", "check_single_softmax", "check_nothing_after_indices"]

ValidityCheck = Callable[[Sequence[Op], TensorType], None]
"""``check(ops, input_type)`` raises :class:`CompileError` when the ops break a rule."""


class FusionRule(NamedTuple):
    """Replace a window of ops matching ``pattern`` (and ``guard``) by ``build(window)``."""

    pattern: tuple[type | tuple[type, ...], ...]
    guard: Callable[[Sequence[Op]], bool]
    build: Callable[[Sequence[Op]], Op]
    prio: int = 0
    name: str = ""


def _filters(op: Op) -> tuple[Filter, ...]:
    """The filter chain an op stands for (a plain filter: itself; a fused sampler: its chain)."""
    if isinstance(op, ProbsFilterOp):
        return (op.filter,)
    if isinstance(op, LogitsTopKOp):
        return (Filter("top_k", op),)
    return op.filters if isinstance(op, FusedSampleOp) else ()


def _filter_guard(window: Sequence[Op]) -> bool:
    """A filter joins a sampler on the same tensor type if the joined chain runs exactly."""
    f, sampler = window
    if isinstance(sampler, FusedSampleOp) and sampler.from_logits != isinstance(f, LogitsTopKOp):
        return False
    return fusable(_filters(f) + _filters(sampler))


def _build_filter(window: Sequence[Op]) -> Op:
    f, sampler = window
    temperature = sampler.temperature if isinstance(sampler, FusedSampleOp) else None  # top-k commutes with it
    return FusedSampleOp(window, _filters(f) + _filters(sampler), isinstance(f, LogitsTopKOp), temperature)


def _softmax_guard(window: Sequence[Op]) -> bool:
    sampler = window[1]
    return not isinstance(sampler, FusedSampleOp) or not sampler.from_logits


def _build_softmax(window: Sequence[Op]) -> Op:
    softmax, sampler = window
    temperature = softmax.parts[0] if isinstance(softmax, TemperatureSoftmaxOp) else None
    return FusedSampleOp(window, _filters(sampler), from_logits=True, temperature=temperature)


def default_rules() -> list[FusionRule]:
    """The rules every pipe starts with (a user's rules are added to these)."""
    samplers = (FusedSampleOp, ProbsSampleOp, LogitsSampleOp)
    return [
        FusionRule((TemperatureOp, SoftmaxOp), lambda w: True, TemperatureSoftmaxOp, 50, "temperature_softmax"),
        FusionRule(((ProbsFilterOp, LogitsTopKOp), samplers), _filter_guard, _build_filter, 20, "filter_into_sample"),
        FusionRule(
            ((SoftmaxOp, TemperatureSoftmaxOp), (FusedSampleOp, ProbsSampleOp)),
            _softmax_guard,
            _build_softmax,
            10,
            "softmax_into_sample",
        ),
    ]


def fuse(ops: Sequence[Op], rules: Sequence[FusionRule]) -> list[Op]:
    """Apply ``rules`` (highest ``prio`` first) left to right, stepping back one op after each fusion."""
    ordered = sorted(rules, key=lambda r: -r.prio)
    out = list(ops)
    i = 0
    while i < len(out):
        for rule in ordered:
            window = out[i : i + len(rule.pattern)]
            matches = len(window) == len(rule.pattern) and all(map(isinstance, window, rule.pattern))
            if matches and rule.guard(window):
                out[i : i + len(window)] = [rule.build(window)]
                i = max(i - 1, 0)
                break
        else:
            i += 1
    return out


def check_types(ops: Sequence[Op], input_type: TensorType) -> None:
    """Each op must accept what the one before it gives (the first: the pipe's input type)."""
    current = input_type
    for i, op in enumerate(ops):
        if op.IN is not current:
            source = "the pipe's input" if i == 0 else f"op {i - 1} ({ops[i - 1].name})"
            raise CompileError(f"op {i} ({op.name}) takes {op.IN.name}, but {source} gives {current.name}")
        current = op.OUT


def check_single_softmax(ops: Sequence[Op], input_type: TensorType) -> None:
    """At most one softmax, counting those inside fused ops."""
    where = [i for i, op in enumerate(ops) for part in op.parts if isinstance(part, SoftmaxOp)]
    if len(where) > 1:
        raise CompileError(f"a pipe may hold at most one Softmax, found {len(where)} (ops {where})")


def check_nothing_after_indices(ops: Sequence[Op], input_type: TensorType) -> None:
    """Once a token is chosen (INDICES), nothing may follow."""
    for i, op in enumerate(ops[:-1]):
        if op.OUT is TensorType.INDICES:
            raise CompileError(
                f"op {i} ({op.name}) outputs INDICES, so it must be last; {len(ops) - i - 1} op(s) follow it"
            )


def default_checks() -> list[ValidityCheck]:
    return [check_types, check_single_softmax, check_nothing_after_indices]


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
