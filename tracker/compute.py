"""The analysis maths as plain functions over blocks of rows ``[t, V]`` (float32 torch).

Every function works on whole blocks: no Python loop over the vocabulary or
over rows. "natural" rows are the logits before the wrapped processor,
"constrained" rows what it returned; a token is *allowed* when its
constrained logit is above ``-inf``. Probabilities are ``exp(logit - lse)``
with the row's log-sum-exp ``lse``, so nothing needs a full softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["TopTokens", "logsumexp_rows", "lse_pair", "top_allowed", "entries_above", "step_stats", "probs_at"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TopTokens:
    """The best allowed tokens per row.

    Attributes:
        ids: ``[t, k]`` token ids, best first.
        count: ``[t]`` how many of the ``k`` are real (fewer when fewer are allowed).
    """

    ids: torch.Tensor
    count: torch.Tensor


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """``[t]`` log-sum-exp of each row (``-inf`` for a row with nothing allowed, NaN for NaN rows)."""
    return torch.logsumexp(x, dim=1)


def lse_pair(
    natural: torch.Tensor, constrained: torch.Tensor, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp of natural and constrained rows with one exponential pass where the constraint only masks.

    A constraint that only masks (constrained equals natural wherever it is
    above ``-inf``, the usual grammar case) keeps a subset of the natural
    terms: their sum comes from the same ``exp(natural - max)`` values. Rows
    where that does not hold, or where the allowed terms are too small to sum
    accurately in float32, are computed directly. ``scratch`` (at least the
    block's shape, float32) avoids a fresh temporary per call.
    """
    t = natural.shape[0]
    shift = natural.amax(dim=1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    terms = scratch[:t] if scratch is not None else torch.empty_like(natural)
    torch.sub(natural, shift, out=terms).exp_()
    lse_natural = terms.sum(dim=1).log_().add_(shift[:, 0])
    if constrained is natural:
        return lse_natural, lse_natural
    masked = constrained == NEG_INF
    pure = ((constrained == natural) | masked).all(dim=1)
    lse_constrained = terms.masked_fill_(masked, 0.0).sum(dim=1).log_().add_(shift[:, 0])
    redo = ~pure | (lse_constrained - shift[:, 0] < -60.0)
    if bool(redo.any()):
        rows = redo.nonzero()[:, 0]
        lse_constrained[rows] = torch.logsumexp(constrained[rows], dim=1)
    return lse_natural, lse_constrained


def probs_at(x: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Probabilities ``exp(x[ids] - lse)`` of the tokens ``ids [t, j]`` in each row."""
    return torch.exp(x.gather(1, ids) - lse[:, None])


def top_allowed(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    lse_natural: torch.Tensor,
    lse_constrained: torch.Tensor,
    k: int,
) -> TopTokens:
    """The ``k`` allowed tokens with the highest ``max(natural prob, constrained prob)``.

    Masked tokens (constrained logit ``-inf``) are never listed, so when
    fewer than ``k`` are allowed the list is shorter (``count``). The answer
    lies in the union of the constrained top-k and the natural top-k among
    allowed tokens, so only those ``2k`` candidates are scored.
    """
    k = min(int(k), natural.shape[1])
    allowed = constrained > NEG_INF
    _, con_ids = torch.topk(constrained, k, dim=1)
    _, nat_ids = torch.topk(torch.where(allowed, natural, NEG_INF), k, dim=1)
    candidates = torch.cat([con_ids, nat_ids], dim=1)
    score = torch.maximum(probs_at(natural, lse_natural, candidates), probs_at(constrained, lse_constrained, candidates))
    repeated = (nat_ids[:, :, None] == con_ids[:, None, :]).any(dim=2)
    usable = allowed.gather(1, candidates) & torch.cat([torch.ones_like(repeated), ~repeated], dim=1)
    score = torch.where(usable & ~torch.isnan(score), score, -1.0)
    best, order = torch.topk(score, k, dim=1)
    return TopTokens(candidates.gather(1, order), (best >= 0).sum(dim=1))


def entries_above(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    threshold_natural: torch.Tensor,
    threshold_constrained: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, ids)`` of every entry at or above its row's threshold in either stage, row-major."""
    mask = (natural >= threshold_natural[:, None]) | (constrained >= threshold_constrained[:, None])
    rows, ids = mask.nonzero(as_tuple=True)
    return rows, ids


def _entropy(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    logp = x - lse[:, None]
    p = torch.exp(logp)
    return -torch.where(p > 0, p * logp, 0.0).sum(dim=1)


def _chosen_prob_rank(x: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    known = chosen >= 0
    index = chosen.clamp(min=0)[:, None]
    value = x.gather(1, index)
    prob = torch.where(known, torch.exp(value[:, 0] - lse), math.nan)
    rank = torch.where(known, (x > value).sum(dim=1).double(), math.nan)
    return prob, rank


def step_stats(
    stages: dict[str, torch.Tensor],
    lses: dict[str, torch.Tensor],
    chosen: torch.Tensor,
    eos_ids: Sequence[int],
) -> dict[str, torch.Tensor]:
    """Per-row statistics of a block.

    ``stages`` maps a stage name to its rows (``natural`` first; without
    ``constrained`` every token counts as allowed). Returns, per stage,
    ``entropy_{stage}``, ``p_chosen_{stage}``, ``rank_chosen_{stage}`` (0 is
    the best token) and ``p_eos_{stage}``; and ``allowed`` (tokens left),
    ``removed_mass`` (natural probability of the tokens the constraint
    masked) and ``margin`` (the best token's natural log-probability minus the
    best allowed token's: 0 when the constraint let the model's favourite
    through, ``inf`` when it allowed nothing).
    """
    natural = stages["natural"]
    constrained = stages.get("constrained", natural)
    out: dict[str, torch.Tensor] = {}
    allowed = constrained > NEG_INF
    out["allowed"] = allowed.sum(dim=1)
    masked_natural = torch.where(allowed, natural, NEG_INF)
    kept = torch.logsumexp(masked_natural, dim=1)
    out["removed_mass"] = (1.0 - torch.exp(kept - lses["natural"])).clamp(0.0, 1.0)
    out["margin"] = natural.max(dim=1).values - masked_natural.max(dim=1).values
    eos = torch.as_tensor(list(eos_ids), dtype=torch.long)
    for name, x in stages.items():
        lse = lses[name]
        out[f"entropy_{name}"] = _entropy(x, lse)
        out[f"p_chosen_{name}"], out[f"rank_chosen_{name}"] = _chosen_prob_rank(x, lse, chosen)
        if eos.numel():
            ids = eos[None, :].expand(x.shape[0], -1)
            out[f"p_eos_{name}"] = probs_at(x, lse, ids).sum(dim=1)
        else:
            out[f"p_eos_{name}"] = torch.full((x.shape[0],), math.nan)
    return out
