"""One recorded stage per processor of a :class:`~processors.ProcessorList`.

With ``LogitTrackingProcessor(ProcessorList([a, b, c]), processor_stages=True)``
the tracker records the logits after each processor: ``natural``,
``after:a``, ``after:b`` and, for the last one, the stage it already keeps as
``constrained`` (``after:c`` is another name for it, kept in the run's
``stage_aliases``). So a list of ``n`` processors costs ``n - 1`` more stages
per step: ``4 V`` bytes each in float32 storage, ``2 V`` in float16 or
bfloat16, ``12 k + 8`` in top-k storage.

:func:`why` answers, for one step, which stage moved the chosen token and
the model's favourite, and by how much. The read side (:func:`resolve_stage`,
:func:`display_stages`, :func:`step_probabilities`, :func:`why`) needs only
numpy and pandas: torch and the processors are imported by the recording
helpers when they are called.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tracker.selection import index_arg

if TYPE_CHECKING:  # the recording helpers take processors and tensors; the read side needs neither
    import torch

    from processors.protocol import BatchContext, LogitsProcessor, ProcessorList

__all__ = ["stage_names", "apply_recording", "resolve_stage", "why"]

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


def resolve_stage(stages: Sequence[str], aliases: dict[str, str], stage: str) -> str:
    """The recorded stage that ``stage`` names (itself, or what its alias points to)."""
    if not isinstance(stage, str):
        raise TypeError(f"stage must be a string, got {type(stage).__name__}")
    if stage in stages:
        return stage
    if stage in aliases and aliases[stage] in stages:
        return aliases[stage]
    known = list(stages) + [a for a in aliases if aliases[a] in stages]
    raise ValueError(f"stage={stage!r} was not recorded; recorded stages: {known}")


def display_stages(stages: Sequence[str], aliases: dict[str, str]) -> list[str]:
    """The stage names a user sees, in order: the last processor's name in place of ``constrained``."""
    back = {v: k for k, v in aliases.items()}
    return [back.get(s, s) for s in stages]


def step_probabilities(
    run: Any, position: int, *, sequence: int = 0, generation: int = -1
) -> tuple[dict[str, np.ndarray], int, int]:
    """Every stage's probabilities at one step (float64 ``[V]``, NaN where top-k storage kept none),
    the chosen token (-1 when unknown) and the step's index in the sequence."""
    probs = run.get_probabilities(sequence=sequence, generation=generation, include_finished=True)
    sel = run._select(generation, sequence, True)
    where = {int(s): i for i, s in enumerate(sel.steps.tolist())}
    position = index_arg("position", position)
    if position not in where:
        raise ValueError(f"position={position} was not recorded; recorded positions are 0..{sel.length - 1}")
    i = where[position]
    keys = {"natural": "unstructured", "constrained": "structured"}
    rows = {s: np.asarray(probs[keys.get(s, s)][i], dtype=np.float64) for s in run.metadata.stages}
    return rows, int(sel.chosen[i]), i


def why(run: Any, position: int, *, sequence: int = 0, generation: int = -1) -> pd.DataFrame:
    """What each stage did to the chosen token and to the model's favourite at one step.

    One row per (token, stage), tokens ``"chosen"`` and ``"favourite"`` (the
    natural stage's best token), stages in pipeline order under their display
    names. Columns: ``role, token_id, token, stage, logprob, rank`` (0 = the
    stage's best), ``change`` (logprob minus the previous stage's; NaN at
    ``natural``) and ``decisive`` (True on the stage with the largest
    ``|change|`` for that token, none when nothing changed). In top-k
    storage a token outside a stage's stored top-k has NaN values there.
    """
    by_stage, chosen, _ = step_probabilities(run, position, sequence=sequence, generation=generation)
    stages = list(by_stage)
    names = display_stages(stages, run.metadata.stage_aliases)
    rows = np.stack(list(by_stage.values()))  # [S, V]
    natural = rows[0]
    favourite = int(np.nanargmax(natural))
    tokens = [("chosen", chosen)] if chosen >= 0 else []
    tokens.append(("favourite", favourite))
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(rows)
        steps = np.diff(logp, axis=0)  # -inf minus -inf (masked twice) is NaN: no change known
    ranks = (rows[:, None, :] > rows[:, [t for _, t in tokens]][:, :, None]).sum(axis=2)  # [S, tokens]
    out = []
    for j, (role, token) in enumerate(tokens):
        values = logp[:, token]
        change = np.concatenate([[math.nan], steps[:, token]])
        finite = np.where(np.isnan(change), -1.0, np.abs(np.nan_to_num(change, nan=0.0, posinf=np.inf, neginf=np.inf)))
        decisive = int(np.argmax(finite)) if finite.max() > 0 else -1
        known = ~np.isnan(values)
        for s, name in enumerate(names):
            out.append(
                {
                    "role": role,
                    "token_id": token,
                    "token": run.vocab.display[token],
                    "stage": name,
                    "logprob": values[s],
                    "rank": float(ranks[s, j]) if known[s] else math.nan,
                    "change": change[s],
                    "decisive": s == decisive,
                }
            )
    return pd.DataFrame(out)


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
