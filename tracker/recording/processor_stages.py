"""One recorded stage per processor of a :class:`~processors.ProcessorList`.

With ``LogitTrackingProcessor(ProcessorList([a, b, c]), processor_stages=True)``
the tracker records the logits after each processor: ``natural``,
``after:a``, ``after:b`` and, for the last one, the stage it already keeps as
``constrained`` (``after:c`` is another name for it, kept in the run's
``stage_aliases``). So a list of ``n`` processors costs ``n - 1`` more stages
per step: ``4 V`` bytes each in float32 storage, ``2 V`` in float16 or
bfloat16, ``12 k + 8`` in top-k storage. The read side of stages (names and
aliases) is :mod:`tracker.format.stages`; what each stage did at a step, :mod:`tracker.reading.why`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from processors.protocol import BatchContext, LogitsProcessor, ProcessorList

__all__ = ["stage_names", "apply_recording", "per_processor"]

_SUFFIXES = ("logitsprocessor", "logitswarper", "processor")


def _short(name: str) -> str:
    """``RepetitionPenaltyLogitsProcessor`` -> ``repetition_penalty``."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    snake = re.sub(r"[^a-z0-9_]+", "_", snake).strip("_")
    for suffix in ("_logits_processor", "_logits_warper", "_processor"):
        if snake.endswith(suffix) and len(snake) > len(suffix):
            return snake[: -len(suffix)]
    return snake or "processor"


def stage_names(processors: ProcessorList) -> list[str]:
    """``after:<name>`` for each processor, in order; repeated names get ``_2``, ``_3``, ..."""
    names: list[str] = []
    for processor in processors:
        base = f"after:{_short(processor.name)}"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


def apply_recording(
    processors: ProcessorList,
    logits: torch.Tensor,
    ctx: BatchContext,
    record: Callable[[int, torch.Tensor], None],
) -> torch.Tensor:
    """Apply the processors in order as :meth:`ProcessorList.process` does, handing each output to ``record``.

    ``record(i, out)`` is called after processor ``i`` for every processor
    but the last (the caller records the final output as ``constrained``).
    It does not synchronise: recording is the recorder's copy.
    """
    last = len(processors) - 1

    def each(position: int, out: torch.Tensor) -> None:
        if position < last:
            record(position, out)

    return processors.apply(logits, ctx, each)


def per_processor(processor: Any) -> tuple[LogitsProcessor, list[str]]:
    """``processor`` as a logitscope processor and its stage names (one per processor it holds).

    A Python list, a transformers ``LogitsProcessorList`` (a list) or a
    :class:`~processors.ProcessorList` gives one name per item; any other
    processor gives one name.
    """
    from processors.protocol import ProcessorList

    if isinstance(processor, (list, tuple)) and not isinstance(processor, ProcessorList):
        processor = ProcessorList(processor)
    if isinstance(processor, ProcessorList):
        if len(processor) == 0:
            raise ValueError("processor_stages=True needs at least one processor; the ProcessorList given is empty")
        return processor, stage_names(processor)
    single = ProcessorList([processor])  # converts any convention the list accepts
    return single[0], stage_names(single)
