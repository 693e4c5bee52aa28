"""Taps: observers that see a stage's tensor without changing the result.

A tap is a ``(stage, fn)`` pair; ``fn(tensor)`` is called with the
:class:`~sampling.pipe.types.TaggedTensor` that the stage produced, on the
device where it lives, with no copy and no synchronisation. ``fn`` must not
modify the tensor; copying it (e.g. a non-blocking copy to pinned memory) is
the observer's business.

Stage names of a pipe: ``"input"`` (what the pipe was given), one per
processor (``"temperature"``, ``"softmax"``, ``"top_k"``, ``"top_p"``,
``"min_p"``, ``"sample"``, ``"greedy"``, or the processor's ``name=``; a
repeated name gets ``_2``, ``_3``), and, in a pipe that samples,
``"sampled"``: the distribution actually sampled from, always **PROBS**,
float32 ``[B, V]``, each row summing to 1, exactly 0 for tokens removed by
top-k, top-p or min-p (a one-hot row for greedy). It is built only when a
tap asks for it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, NamedTuple

from sampling.pipe.types import PipeError, TaggedTensor

__all__ = ["Tap", "TapFn", "SAMPLED", "INPUT", "group_taps"]

TapFn = Callable[[TaggedTensor], None]

INPUT = "input"
SAMPLED = "sampled"


class Tap(NamedTuple):
    """Call ``fn`` with the tensor of ``stage`` (see the module docstring for stage names)."""

    stage: str
    fn: TapFn


def group_taps(taps: Iterable[Tap] | None, allowed: Iterable[str]) -> Mapping[str, tuple[TapFn, ...]]:
    """Taps grouped by stage; an unknown stage or a non-callable is an error naming what is allowed."""
    if not taps:
        return {}
    allowed = tuple(allowed)
    grouped: dict[str, list[TapFn]] = {}
    for i, tap in enumerate(taps):
        if not isinstance(tap, tuple) or len(tap) != 2:
            raise PipeError(f"taps[{i}] must be a Tap(stage, fn), got {tap!r}")
        stage, fn = tap
        if stage not in allowed:
            raise PipeError(f"taps[{i}]: unknown stage {stage!r}; this pipe has stages {list(allowed)}")
        if not callable(fn):
            raise PipeError(f"taps[{i}]: fn must be callable, got {type(fn).__name__}")
        grouped.setdefault(stage, []).append(fn)
    return {stage: tuple(fns) for stage, fns in grouped.items()}
