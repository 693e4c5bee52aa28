"""The per-step metrics, written once over :class:`~tracker.reading.block.Block` rows (numpy).

Entropy, the chosen token's probability and rank, the end-of-sequence
probability, the allowed count, the natural mass a constraint removed and
the margin between the model's best token and the best allowed one. The
tracker's :meth:`~tracker.reading.analysis.Analysis.stats` and the dashboard's step
summary both call these. What a storage cannot tell (entropy of a top-k
row, a chosen token outside the stored ``k``) is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tracker.reading.block import Block
from tracker.reading.rows import NEG_INF, exp_floor, logsumexp_rows, masked, probabilities

__all__ = ["entropy", "chosen", "p_eos", "allowed", "removed_mass", "margin", "step_metrics"]


def entropy(block: Block) -> np.ndarray:
    """``[t]`` entropy in nats (NaN in top-k storage, where the row is not known)."""
    if not block.full:
        return np.full(block.rows, math.nan)
    # Clamped at -80: a masked token then weighs exp(-80) * 80 ~ 1e-33 instead of 0 * -inf (NaN).
    with np.errstate(invalid="ignore"):  # a row with nothing allowed: -inf - -inf, its entropy NaN
        logp = block.values - block.lse[:, None]
    np.maximum(logp, exp_floor(logp.shape[1]), out=logp)
    return -np.einsum("ij,ij->i", np.exp(logp), logp).astype(np.float64)


def chosen(block: Block, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(probability, rank)`` of the token ``ids[t]`` in each row (rank 0: the best; NaN when the id is
    unknown (-1) or not stored)."""
    known = ids >= 0
    value = block.at(np.maximum(ids, 0)[:, None].astype(np.int64))
    stored = ~np.isnan(block.values)
    with np.errstate(invalid="ignore"):
        rank = ((block.values > value) & stored).sum(axis=1).astype(np.float64)
        prob = probabilities(value[:, 0], block.lse).astype(np.float64)  # float32, as the record computes it
    ok = known & ~np.isnan(value[:, 0])
    return np.where(ok, prob, math.nan), np.where(ok, rank, math.nan)


def p_eos(block: Block, eos_ids: Sequence[int]) -> np.ndarray:
    """``[t]`` probability of end-of-sequence (NaN without an eos id, or when top-k storage kept none)."""
    if not len(eos_ids):
        return np.full(block.rows, math.nan)
    eos = np.broadcast_to(np.asarray(list(eos_ids), dtype=np.int64), (block.rows, len(eos_ids)))
    probs = probabilities(block.at(eos), block.lse[:, None])
    found = ~np.isnan(probs).all(axis=1)
    return np.where(found, np.nansum(probs, axis=1, dtype=np.float32), math.nan).astype(np.float64)


def allowed(block: Block) -> np.ndarray:
    """``[t]`` tokens with a logit above ``-inf``."""
    if block.allowed is not None:
        return np.asarray(block.allowed, dtype=np.float64)
    return np.count_nonzero(block.values > NEG_INF, axis=1).astype(np.float64)


def _kept(natural: Block, constrained: Block) -> np.ndarray | None:
    return masked(natural.values, constrained.values) if natural.full and constrained.full else None


def removed_mass(natural: Block, constrained: Block, kept: np.ndarray | None = None) -> np.ndarray:
    """``[t]`` natural probability of the tokens ``constrained`` masked (NaN unless both rows are stored whole)."""
    kept = _kept(natural, constrained) if kept is None else kept
    if kept is None:
        return np.full(natural.rows, math.nan)
    gone = np.where(kept == NEG_INF, natural.values, NEG_INF)  # summed directly: 1 - kept loses a small mass
    with np.errstate(invalid="ignore"):  # a row with nothing allowed: -inf - -inf
        return np.clip(np.exp(logsumexp_rows(gone) - natural.lse).astype(np.float64), 0.0, 1.0)


def margin(natural: Block, constrained: Block, kept: np.ndarray | None = None) -> np.ndarray:
    """``[t]`` the best natural logit minus the best natural logit ``constrained`` allows (0 when the model's
    favourite is allowed, ``inf`` when nothing is; NaN unless both rows are stored whole)."""
    kept = _kept(natural, constrained) if kept is None else kept
    if kept is None:
        return np.full(natural.rows, math.nan)
    return (natural.values.max(axis=1) - kept.max(axis=1)).astype(np.float64)


def step_metrics(blocks: dict[str, Block], chosen_ids: np.ndarray, eos_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-row metrics of a block of steps, as the columns of ``stats``.

    ``blocks`` maps a stage name to its rows (``natural`` first; without
    ``constrained`` every token counts as allowed and nothing is removed).
    Returns, per stage, ``entropy_{stage}``, ``p_chosen_{stage}``,
    ``rank_chosen_{stage}``, ``p_eos_{stage}``; then ``allowed``,
    ``removed_mass`` and ``margin`` (float64).
    """
    natural = blocks["natural"]
    out: dict[str, np.ndarray] = {}
    for name, block in blocks.items():
        out[f"entropy_{name}"] = entropy(block)
        out[f"p_chosen_{name}"], out[f"rank_chosen_{name}"] = chosen(block, chosen_ids)
        out[f"p_eos_{name}"] = p_eos(block, eos_ids)
    constrained = blocks.get("constrained")
    if constrained is None:
        out["allowed"] = allowed(natural)
        out["removed_mass"] = out["margin"] = np.zeros(natural.rows)
    else:
        kept = _kept(natural, constrained)
        out["allowed"] = allowed(constrained)
        out["removed_mass"] = removed_mass(natural, constrained, kept)
        out["margin"] = margin(natural, constrained, kept)
    return out
