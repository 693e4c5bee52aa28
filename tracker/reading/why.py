"""What each stage did at one step: which stage moved the chosen token and the model's favourite, and by how much.

:func:`why` answers for one step; :func:`step_probabilities` gives every stage's probabilities there. numpy and
pandas only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from tracker.format.stages import display_stages
from tracker.reading.selection import index_arg

__all__ = ["locate", "step_probabilities", "why"]


def locate(run: Any, position: int, *, sequence: int = 0, generation: int = -1, include_finished: bool = False):
    """The selection of one sequence and ``position``'s index in it.

    ValueError, naming the position and the recorded range, for a position that was not recorded or (without
    ``include_finished``) one past the sequence's end: the padding steps a host fed a row that had stopped.
    """
    position = index_arg("position", position)
    sel = run._select(generation, sequence, include_finished)
    steps = sel.steps.tolist()
    where = {int(s): i for i, s in enumerate(steps)}
    if position in where:
        return sel, where[position]
    shown = f"{steps[0]}..{steps[-1]}" if steps else "none"
    if not include_finished and position in run._select(generation, sequence, True).steps.tolist():
        raise ValueError(
            f"position={position} is past the end of sequence {sel.sequence} (generation {sel.generation}): "
            f"recorded positions are {shown}; include_finished=True shows the padding steps after its end"
        )
    raise ValueError(f"position={position} was not recorded; recorded positions are {shown}")


def _rows(run: Any, sel: Any, i: int, probs: bool) -> dict[str, np.ndarray]:
    """Every stage's probabilities (``probs``) or logits at row ``i`` of ``sel``, float64 ``[V]``: the values of
    ``get_probabilities``/``get_logits`` there, read from that row alone."""
    keys = {"natural": "unstructured", "constrained": "structured"}
    arrays = run._arrays_at(sel, np.array([i]), probs)
    return {s: np.asarray(arrays[keys.get(s, s)][0], dtype=np.float64) for s in run.metadata.stages}


def step_probabilities(
    run: Any, position: int, *, sequence: int = 0, generation: int = -1, include_finished: bool = False
) -> tuple[dict[str, np.ndarray], int, int]:
    """Every stage's probabilities at one step (float64 ``[V]``, NaN where top-k storage kept none),
    the chosen token (-1 when unknown) and the step's index in the sequence (see :func:`locate`)."""
    sel, i = locate(run, position, sequence=sequence, generation=generation, include_finished=include_finished)
    return _rows(run, sel, i, probs=True), int(sel.chosen[i]), i


def _rank(values: np.ndarray, token: int, storage: str, top_k: int) -> tuple[float, float, float, bool]:
    """``token``'s rank in one stored row (logits, NaN where not stored): ``(rank, low, high, logprob_exact)``.

    ``rank`` is exact or NaN; ``low..high`` bounds the exact rank (in top-k storage a token not stored is below the
    stage's k best; elsewhere a NaN entry of the row has no rank).
    """
    v = values[token]
    if storage == "topk":  # each stage's own top-k is stored: the rank is exact at or above its k-th value
        known = values[~np.isnan(values)]
        kth = np.partition(known, known.size - top_k)[known.size - top_k] if known.size >= top_k else -math.inf
        if v != v:  # not stored: below the stage's top k
            return math.nan, float((known > kth).sum()) if known.size else math.nan, float(values.size - 1), False
        greater = int((values > v).sum())
        if v >= kth:
            return float(greater), float(greater), float(greater), True
        return math.nan, float(greater), float(values.size - 1 - int((values < v).sum())), True
    if v != v:
        return math.nan, math.nan, math.nan, False
    greater = int((values > v).sum())
    if storage in ("float16", "bfloat16"):  # rounding keeps the order but may tie values that differed
        tied = int((values == v).sum()) - 1
        if tied and not math.isinf(v):
            return math.nan, float(greater), float(greater + tied), False
        return float(greater), float(greater), float(greater), False
    return float(greater), float(greater), float(greater), True


def why(
    run: Any, position: int, *, sequence: int = 0, generation: int = -1, include_finished: bool = False
) -> pd.DataFrame:
    """What each stage did to the chosen token and to the model's favourite at one step.

    One row per (token, stage), tokens ``"chosen"`` and ``"favourite"`` (the
    natural stage's best token in the stored row), stages in pipeline order
    under their display names. Columns: ``role, token_id, token, stage,
    logprob``, ``rank`` (0 = the stage's best: the number of tokens with a
    higher logit; NaN where it is not known exactly), ``rank_min`` and
    ``rank_max`` (bounds on the exact rank; NaN when nothing is known),
    ``logprob_exact`` (False where ``logprob`` comes from a half-precision row
    and is only as close as its rounding, or is unknown), ``change`` (logprob
    minus the previous stage's; NaN at ``natural``) and ``decisive`` (True on
    the stage with the largest ``|change|`` for that token, none when nothing
    changed).

    What is exact: the chosen token's log-probability and rank come from the
    statistics recorded with the whole rows (the ``p_chosen_*`` and
    ``rank_chosen_*`` columns of :meth:`stats`), exact in every storage mode,
    where the run has them. Everything else comes from the stored rows: exact
    in float32 storage; in top-k storage exact for a stored token at or above
    the stage's k-th best value, while for a token further down only a lower
    bound on its rank is known (``rank`` NaN) and a token not stored has NaN
    values; in float16 or bfloat16 storage the log-probability is within the
    rounding, and where rounding gave the token's logit the same value as other
    tokens' the rank is only bounded (``rank`` NaN, ``rank_min..rank_max``).
    The favourite is the stored natural row's best token: in half precision,
    when rounding tied it with others it is the first of them (its natural
    ``rank`` is then NaN and ``rank_max`` says how many tied).

    A position past the sequence's end (the padding a host fed a row that had
    stopped) raises ValueError unless ``include_finished`` is True.
    """
    sel, i = locate(run, position, sequence=sequence, generation=generation, include_finished=include_finished)
    stages = list(run.metadata.stages)
    names = display_stages(stages, run.metadata.stage_aliases)
    probs = np.stack(list(_rows(run, sel, i, probs=True).values()))  # [S, V]
    logits = np.stack(list(_rows(run, sel, i, probs=False).values()))
    chosen = int(sel.chosen[i])
    step = sel.subset(np.array([i]))  # its statistics columns, read from its batch alone
    recorded = chosen >= 0 and run._has_stats(step)
    favourite = int(np.nanargmax(probs[0]))
    tokens = [("chosen", chosen)] if chosen >= 0 else []
    tokens.append(("favourite", favourite))
    storage, top_k = run.metadata.storage, int(run.metadata.top_k or 0)
    out = []
    for role, token in tokens:
        facts = [_rank(logits[s], token, storage, top_k) for s in range(len(stages))]
        with np.errstate(divide="ignore"):
            values = np.log(probs[:, token])
        for s, stage in enumerate(stages if recorded and token == chosen else []):
            p, r = run._column(f"{stage}_p_chosen", step)[0], run._column(f"{stage}_rank_chosen", step)[0]
            if p == p and r == r:  # the statistics recorded with the whole row
                with np.errstate(divide="ignore"):
                    values[s] = np.log(p)
                facts[s] = (float(r), float(r), float(r), True)
        with np.errstate(invalid="ignore"):
            change = np.concatenate([[math.nan], np.diff(values)])  # -inf minus -inf (masked twice) is NaN
        finite = np.where(np.isnan(change), -1.0, np.abs(np.nan_to_num(change, nan=0.0, posinf=np.inf, neginf=np.inf)))
        decisive = int(np.argmax(finite)) if finite.max() > 0 else -1
        for s, name in enumerate(names):
            rank, low, high, exact = facts[s]
            out.append(
                {
                    "role": role,
                    "token_id": token,
                    "token": run.vocab.display[token],
                    "stage": name,
                    "logprob": values[s],
                    "rank": rank,
                    "rank_min": low,
                    "rank_max": high,
                    "logprob_exact": exact and not math.isnan(values[s]),
                    "change": change[s],
                    "decisive": s == decisive,
                }
            )
    return pd.DataFrame(out)
