"""Compiling a pipe's ops: validity checks, then fusion rules that do a window of ops in one.

A rule is ``(pattern, guard, build, prio)``: ``pattern`` is a tuple of op
classes (or tuples of classes; the filters are all a :class:`~sampling.pipe.ops.FilterOp`,
told apart by ``kind``) matched by ``isinstance`` against a window of
consecutive ops, ``guard(window)`` says whether fusing keeps the semantics,
``build(window)`` returns the fused op. :func:`fuse` tries rules highest
``prio`` first at each position, and after a fusion steps the window back by
one, so fused ops fuse again (a cascade):

    Temperature, Softmax, TopK, TopP, Sample
    -> TemperatureSoftmax, TopK, TopP, Sample          (temperature_softmax)
    -> TemperatureSoftmax, TopK, FusedTopPSample       (filter_into_sample)
    -> TemperatureSoftmax, FusedTopKTopPSample         (filter_into_sample)
    -> FusedTemperatureSoftmaxTopKTopPSample           (softmax_into_sample)

The last op never computes a softmax over the vocabulary: it selects the
top-k candidates from the logits and does the rest on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from sampling.pipe.ops import FilterOp, SampleOp, SoftmaxOp, TemperatureOp, TemperatureSoftmaxOp, fusable
from sampling.pipe.types import CompileError, Op, TensorType

ValidityCheck = Callable[[Sequence[Op], TensorType], None]
"""``check(ops, input_type)`` raises :class:`CompileError` when the ops break a rule."""


class FusionRule(NamedTuple):
    """Replace a window of ops matching ``pattern`` (and ``guard``) by ``build(window)``."""

    pattern: tuple[type | tuple[type, ...], ...]
    guard: Callable[[Sequence[Op]], bool]
    build: Callable[[Sequence[Op]], Op]
    prio: int = 0
    name: str = ""


def _filter_guard(window: Sequence[Op]) -> bool:
    """A filter joins the sampler after it if both see the same tensor type and the joined chain runs exactly."""
    f, sampler = window
    return f.IN is sampler.IN and fusable((f, *sampler.filters))


def _build_filter(window: Sequence[Op]) -> Op:
    f, sampler = window  # top-k on logits commutes with the sampler's temperature
    return SampleOp(f.IN, parts=window, filters=(f, *sampler.filters), temperature=sampler.temperature)


def _build_softmax(window: Sequence[Op]) -> Op:
    softmax, sampler = window
    temperature = softmax.parts[0] if isinstance(softmax, TemperatureSoftmaxOp) else None
    return SampleOp(TensorType.LOGITS, parts=window, filters=sampler.filters, temperature=temperature)


def default_rules() -> list[FusionRule]:
    """The rules every pipe starts with (a user's rules are added to these)."""
    return [
        FusionRule((TemperatureOp, SoftmaxOp), lambda w: True, TemperatureSoftmaxOp, 50, "temperature_softmax"),
        FusionRule((FilterOp, SampleOp), _filter_guard, _build_filter, 20, "filter_into_sample"),
        FusionRule(
            ((SoftmaxOp, TemperatureSoftmaxOp), SampleOp),
            lambda w: w[1].IN is TensorType.PROBS,
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


DEFAULT_CHECKS: tuple[ValidityCheck, ...] = (check_types, check_single_softmax, check_nothing_after_indices)
