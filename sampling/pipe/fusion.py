"""Fusion rules: a window of ops that one op can do faster, with the same result.

A rule is ``(pattern, guard, build, prio)``: ``pattern`` is a tuple of op
classes (or tuples of classes) matched by ``isinstance`` against a window of
consecutive ops, ``guard(window)`` says whether fusing keeps the semantics,
``build(window)`` returns the fused op. The compiler tries rules highest
``prio`` first at each position, and after a fusion steps the window back by
one, so fused ops fuse again (a cascade):

    Temperature, Softmax, TopK, TopP, Sample
    -> TemperatureSoftmax, TopK, TopP, Sample          (temperature_softmax)
    -> TemperatureSoftmax, TopK, FusedTopPSample       (filter_sample)
    -> TemperatureSoftmax, FusedTopKTopPSample         (filter_into_sample)
    -> FusedTemperatureSoftmaxTopKTopPSample           (softmax_into_sample)

The last op never computes a softmax over the vocabulary: it selects the
top-k candidates from the logits and does the rest on them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from sampling.pipe.op import Op
from sampling.pipe.ops import (
    FusedSampleOp,
    LogitsSampleOp,
    LogitsTopKOp,
    ProbsFilterOp,
    ProbsSampleOp,
    ProbsTopKOp,
    ProbsTopPOp,
    SoftmaxOp,
    TemperatureOp,
    TemperatureSoftmaxOp,
    Filter,
    fusable,
)

__all__ = ["FusionRule", "default_rules"]


class FusionRule(NamedTuple):
    """Replace a window of ops matching ``pattern`` (and ``guard``) by ``build(window)``."""

    pattern: tuple[type | tuple[type, ...], ...]
    guard: Callable[[Sequence[Op]], bool]
    build: Callable[[Sequence[Op]], Op]
    prio: int = 0
    name: str = ""


def _always(window: Sequence[Op]) -> bool:
    return True


def _joint_guard(window: Sequence[Op]) -> bool:
    top_k = window[0]
    return isinstance(top_k, ProbsTopKOp) and not top_k.renormalize


def _build_joint(window: Sequence[Op]) -> Op:
    top_k, top_p, _ = window
    assert isinstance(top_k, ProbsFilterOp) and isinstance(top_p, ProbsFilterOp)
    return FusedSampleOp(window, [top_k.filter, top_p.filter], from_logits=False)


def _filter_sample_guard(window: Sequence[Op]) -> bool:
    f = window[0]
    return isinstance(f, ProbsFilterOp) and fusable([f.filter])


def _build_filter_sample(window: Sequence[Op]) -> Op:
    f = window[0]
    assert isinstance(f, ProbsFilterOp)
    return FusedSampleOp(window, [f.filter], from_logits=False)


def _build_logits_top_k_sample(window: Sequence[Op]) -> Op:
    return FusedSampleOp(window, [Filter("top_k", window[0])], from_logits=True)


def _into_sample_guard(window: Sequence[Op]) -> bool:
    f, fused = window
    return (
        isinstance(f, ProbsFilterOp)
        and isinstance(fused, FusedSampleOp)
        and not fused.from_logits
        and fusable([f.filter, *fused.filters])
    )


def _build_into_sample(window: Sequence[Op]) -> Op:
    f, fused = window
    assert isinstance(f, ProbsFilterOp) and isinstance(fused, FusedSampleOp)
    return FusedSampleOp(window, [f.filter, *fused.filters], from_logits=False)


def _softmax_guard(window: Sequence[Op]) -> bool:
    sampler = window[1]
    return not isinstance(sampler, FusedSampleOp) or not sampler.from_logits


def _build_softmax_into_sample(window: Sequence[Op]) -> Op:
    softmax, sampler = window
    filters = sampler.filters if isinstance(sampler, FusedSampleOp) else ()
    temperature = softmax.parts[0] if isinstance(softmax, TemperatureSoftmaxOp) else None
    return FusedSampleOp(window, filters, from_logits=True, temperature=temperature)


def default_rules() -> list[FusionRule]:
    """The rules every pipe starts with (a user's rules are added to these)."""
    return [
        FusionRule((ProbsTopKOp, ProbsTopPOp, ProbsSampleOp), _joint_guard, _build_joint, 100, "joint_top_k_top_p"),
        FusionRule((TemperatureOp, SoftmaxOp), _always, TemperatureSoftmaxOp, 50, "temperature_softmax"),
        FusionRule((ProbsFilterOp, ProbsSampleOp), _filter_sample_guard, _build_filter_sample, 20, "filter_sample"),
        FusionRule((LogitsTopKOp, LogitsSampleOp), _always, _build_logits_top_k_sample, 20, "logits_top_k_sample"),
        FusionRule((ProbsFilterOp, FusedSampleOp), _into_sample_guard, _build_into_sample, 10, "filter_into_sample"),
        FusionRule(
            ((SoftmaxOp, TemperatureSoftmaxOp), (FusedSampleOp, ProbsSampleOp)),
            _softmax_guard,
            _build_softmax_into_sample,
            10,
            "softmax_into_sample",
        ),
    ]
