"""The analysis maths as plain functions over blocks of rows ``[t, V]`` (float32 torch).

Every function works on whole blocks: no Python loop over the vocabulary or
over rows. "natural" rows are the logits before the wrapped processor,
"constrained" rows what it returned; a token is *allowed* when its
constrained logit is above ``-inf``. Probabilities are ``exp(logit - lse)``
with the row's log-sum-exp ``lse``, so nothing needs a full softmax.

The functions keep to the cheap kernels (add, min/max, exp, sum, top-k):
on CPU, selecting with a boolean mask (``where``, ``masked_fill``) and
``torch.logsumexp`` cost several times an ``exp`` pass, so masks are applied
arithmetically (see :func:`masked`). The passes over whole blocks run in
numpy: one thread, no parallel region to wait for on a busy machine, and an
``exp`` twice as fast as torch's here; torch does the top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = [
    "TopTokens",
    "logsumexp_rows",
    "masked",
    "top_allowed",
    "entries_above",
    "step_stats",
    "probs_at",
    "nonfinite_rows",
]

NEG_INF = float("-inf")
_FLOAT_MAX = torch.finfo(torch.float32).max
_EXP_FLOOR = -80.0  # exp(-80) ~ 1.8e-35: a normal float32, far below the rounding of a sum >= 1


@dataclass(frozen=True)
class TopTokens:
    """The best allowed tokens per row.

    Attributes:
        ids: ``[t, k]`` token ids, best first.
        count: ``[t]`` how many of the ``k`` are real (fewer when fewer are allowed).
    """

    ids: torch.Tensor
    count: torch.Tensor


def logsumexp_rows(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``[t]`` log-sum-exp of each row: ``-inf`` when nothing is allowed, NaN for a row holding NaN.

    ``scratch`` (float32, at least ``x``'s shape) holds the exponentials, so
    repeated calls touch no fresh memory. Shifted logits are clamped at -80
    before ``exp``: ``exp(-inf)`` takes a slow path (2.3x the time on this
    CPU), and terms below ``exp(-80)`` cannot change a float32 sum whose
    largest term is 1, so the result is the same to the bit.
    """
    rows = _np(x)
    terms = np.empty_like(rows) if scratch is None else _np(scratch)[: rows.shape[0]]
    shift = rows.max(axis=1, keepdims=True)
    nothing = shift[:, 0] == NEG_INF
    shift[~np.isfinite(shift)] = 0.0
    np.subtract(rows, shift, out=terms)
    np.maximum(terms, _EXP_FLOOR, out=terms)
    np.exp(terms, out=terms)
    lse = np.log(terms.sum(axis=1, dtype=np.float32)) + shift[:, 0]
    lse[nothing] = NEG_INF
    return torch.from_numpy(lse)


def masked(natural: torch.Tensor, constrained: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``natural`` where the token is allowed, ``-inf`` where ``constrained`` masked it.

    ``constrained - max(constrained, -FLT_MAX)`` is 0 for an allowed token
    and ``-inf`` for a masked one: three cheap passes instead of a boolean
    select. ``out`` (float32, the rows' shape or larger) avoids allocating.
    """
    con = _np(constrained)
    result = np.empty_like(con) if out is None else _np(out)[: con.shape[0]]
    np.maximum(con, -_FLOAT_MAX, out=result)
    np.subtract(con, result, out=result)
    np.add(result, _np(natural), out=result)
    return torch.from_numpy(result)


def _np(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU float32 tensor (no copy)."""
    return x.detach().numpy()


def probs_at(x: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Probabilities ``exp(x[ids] - lse)`` of the tokens ``ids [t, j]`` in each row."""
    return torch.exp(x.gather(1, ids) - lse[:, None])


_TOPK_STRIDE = 16  # every 16th entry samples a row for its top-k threshold


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=1)`` for float32 CPU rows, selecting among a few candidates per row.

    The ``k``-th largest of every 16th entry is at most the row's ``k``-th
    largest, so the entries at or above it include the row's top ``k``: one
    compare pass finds them, and ``topk`` runs on those only (the whole rows
    when they are not a small part of them). Same values and ids, several
    times faster at 128k tokens than sorting out the top of each row.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[1] < 64 * k or x.shape[0] == 0:
        return torch.topk(x, k, dim=1)
    a = _np(x)
    sample = a[:, ::_TOPK_STRIDE]
    floor = -np.partition(-sample, k - 1, axis=1)[:, k - 1]
    if not np.isfinite(floor).all():
        return torch.topk(x, k, dim=1)
    mask = a >= floor[:, None]
    counts = np.count_nonzero(mask, axis=1)
    width = int(counts.max())
    if width > a.shape[1] // 8:
        return torch.topk(x, k, dim=1)
    rows, cols = np.nonzero(mask)
    starts = np.cumsum(counts) - counts
    pos = np.arange(rows.size) - np.repeat(starts, counts)
    values = np.full((a.shape[0], width), NEG_INF, dtype=np.float32)
    ids = np.zeros((a.shape[0], width), dtype=np.int64)
    values[rows, pos] = a[rows, cols]
    ids[rows, pos] = cols
    best, where = torch.topk(torch.from_numpy(values), k, dim=1)
    return best, torch.from_numpy(ids).gather(1, where)


def top_allowed(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    lse_natural: torch.Tensor,
    lse_constrained: torch.Tensor,
    k: int,
    scratch: torch.Tensor | None = None,
) -> TopTokens:
    """The ``k`` allowed tokens with the highest ``max(natural prob, constrained prob)``.

    Masked tokens (constrained logit ``-inf``) are never listed, so when
    fewer than ``k`` are allowed the list is shorter (``count``). The answer
    lies in the union of the constrained top-k and the natural top-k among
    allowed tokens, so only those ``2k`` candidates are scored. ``scratch``
    as for :func:`masked`.
    """
    k = min(int(k), natural.shape[1])
    _, con_ids = topk_rows(constrained, k)
    if constrained is natural:
        nat_ids = con_ids
    else:
        _, nat_ids = topk_rows(masked(natural, constrained, scratch), k)
    candidates = torch.cat([con_ids, nat_ids], dim=1)
    score = torch.maximum(probs_at(natural, lse_natural, candidates), probs_at(constrained, lse_constrained, candidates))
    repeated = (nat_ids[:, :, None] == con_ids[:, None, :]).any(dim=2)
    usable = (constrained.gather(1, candidates) > NEG_INF) & torch.cat([torch.ones_like(repeated), ~repeated], dim=1)
    score = torch.where(usable & ~torch.isnan(score), score, -1.0)
    best, order = torch.topk(score, k, dim=1)
    return TopTokens(candidates.gather(1, order), (best >= 0).sum(dim=1))


def entries_above(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    threshold_natural: torch.Tensor,
    threshold_constrained: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, ids)`` of every entry at or above its row's threshold in either stage, row-major."""
    nat, con = _np(natural), _np(constrained)
    margin = np.empty_like(nat) if scratch is None else _np(scratch)[: nat.shape[0]]
    np.subtract(nat, _np(threshold_natural)[:, None], out=margin)
    np.maximum(margin, con - _np(threshold_constrained)[:, None], out=margin)
    rows, ids = np.nonzero(margin >= 0)
    return torch.from_numpy(rows), torch.from_numpy(ids)


def _entropy(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # Clamped at -80: a masked token then weighs exp(-80) * 80 ~ 1e-33 instead of 0 * -inf (NaN).
    logp = (x - lse[:, None]).clamp_(min=_EXP_FLOOR)
    return -(torch.exp(logp) * logp).sum(dim=1)


def _chosen_prob_rank(x: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    known = chosen >= 0
    value = x.gather(1, chosen.clamp(min=0)[:, None])
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
    out["allowed"] = (constrained > NEG_INF).sum(dim=1)
    kept = masked(natural, constrained)
    out["removed_mass"] = (1.0 - torch.exp(logsumexp_rows(kept) - lses["natural"])).clamp(0.0, 1.0)
    out["margin"] = natural.amax(dim=1) - kept.amax(dim=1)
    eos = torch.as_tensor(list(eos_ids), dtype=torch.long)
    for name, x in stages.items():
        lse = lses[name]
        out[f"entropy_{name}"] = _entropy(x, lse)
        out[f"p_chosen_{name}"], out[f"rank_chosen_{name}"] = _chosen_prob_rank(x, lse, chosen)
        if eos.numel():
            out[f"p_eos_{name}"] = probs_at(x, lse, eos[None, :].expand(x.shape[0], -1)).sum(dim=1)
        else:
            out[f"p_eos_{name}"] = torch.full((x.shape[0],), math.nan)
    return out


def nonfinite_rows(values: torch.Tensor) -> torch.Tensor:
    """``[t]`` bool: rows holding NaN or +inf, from one summing pass plus exact checks where needed.

    A row's float32 sum is NaN or +inf exactly when the row holds NaN or +inf
    (or +inf beside -inf, or it overflows): only those rows are checked value
    by value. ``-inf`` alone (masked tokens) is normal.
    """
    out = torch.zeros(values.shape[0], dtype=torch.bool)
    if values.shape[0] == 0:
        return out
    sums = values.sum(dim=1, dtype=torch.float32)
    rows = (torch.isnan(sums) | (sums == float("inf"))).nonzero()[:, 0]
    if rows.numel():
        sub = values[rows]
        out[rows] = (torch.isnan(sub) | torch.isposinf(sub)).any(dim=1)
    return out


# ---------------------------------------------------------------- record-time statistics (any device)

#: Order of the values :func:`row_stats` packs per row (the schema's statistics columns up to the margin).
ROW_STATS = ("lse", "allowed", "max", "entropy", "nan", "p_eos", "removed_mass", "margin")
#: Order of the values :func:`chosen_stats` packs per row.
CHOSEN_STATS = ("chosen_logit", "p_chosen", "rank_chosen")


def probability(logit: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``exp(logit - lse)`` with the record's rules: NaN entries weigh 0, a ``+inf`` row is a one-hot.

    ``lse`` and ``allowed`` broadcast against ``logit`` (a ``+inf`` row has
    ``lse = +inf`` and ``allowed`` = its count of ``+inf`` tokens).
    """
    p = torch.exp(logit - lse)
    one_hot = (logit == math.inf).to(p.dtype) / allowed.clamp(min=1).to(p.dtype)
    p = torch.where(lse == math.inf, one_hot, p)
    return torch.nan_to_num(p, nan=0.0)


def row_stats(x: torch.Tensor, eos: torch.Tensor | None, natural: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 8]`` float32 statistics of rows ``x [B, V]`` on their device, in :data:`ROW_STATS` order.

    NaN entries are left out of the distribution (and counted); a row with
    ``+inf`` is a one-hot on its ``+inf`` tokens. ``eos`` (int64 ids on the
    same device) gives ``p_eos`` (NaN without). With ``natural`` (the rows
    before the processor), ``removed_mass`` and ``margin`` say what ``x``
    masked of them; without, they are NaN. Whole-row kernels only: no host
    read, no synchronisation.
    """
    if x.device.type == "cpu":
        return _row_stats_cpu(x, eos, natural)
    return _row_stats_general(x, eos, natural)


def _row_stats_general(x: torch.Tensor, eos: torch.Tensor | None, natural: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`row_stats` with torch kernels, for any device and any row."""
    x = x.float()
    isnan = torch.isnan(x)
    nan = isnan.sum(dim=1, dtype=torch.float32)
    xs = x.masked_fill(isnan, NEG_INF)
    top = xs.amax(dim=1)
    posinf = top == math.inf
    shift = torch.where(torch.isfinite(top), top, 0.0)
    z = (xs - shift[:, None]).clamp_(min=_EXP_FLOOR)
    e = torch.exp(z)
    total = e.sum(dim=1)
    log_total = torch.log(total)
    entropy = log_total - (e * z).sum(dim=1) / total
    count_inf = torch.isposinf(xs).sum(dim=1, dtype=torch.float32)
    allowed = torch.where(posinf, count_inf, (xs > NEG_INF).sum(dim=1, dtype=torch.float32))
    nothing = top == NEG_INF
    lse = torch.where(nothing, NEG_INF, torch.where(posinf, math.inf, shift + log_total))
    entropy = torch.where(nothing, math.nan, torch.where(posinf, torch.log(count_inf.clamp(min=1)), entropy))
    if eos is not None and eos.numel():
        p_eos = probability(xs.index_select(1, eos), lse[:, None], allowed[:, None]).sum(dim=1)
    else:
        p_eos = torch.full_like(lse, math.nan)
    if natural is not None:
        removed, margin = pair_stats(natural, xs)
    else:
        removed = margin = torch.full_like(lse, math.nan)
    return torch.stack([lse, allowed, top, entropy, nan, p_eos, removed, margin], dim=1)


def _row_stats_cpu(x: torch.Tensor, eos: torch.Tensor | None, natural: torch.Tensor | None) -> torch.Tensor:
    """:func:`row_stats` on the CPU: numpy passes (one thread, a fast ``exp``) for rows without NaN or
    ``+inf`` (a row's sum tells), the general kernels for the others."""
    rows = x.detach().float().numpy()
    sums = rows.sum(axis=1)
    plain = np.isfinite(sums) | (sums == NEG_INF)
    if not plain.all():
        out = torch.empty(rows.shape[0], len(ROW_STATS))
        special = torch.from_numpy(np.nonzero(~plain)[0])
        out[special] = _row_stats_general(x[special], eos, None if natural is None else natural[special])
        if plain.any():
            keep = torch.from_numpy(np.nonzero(plain)[0])
            out[keep] = _row_stats_cpu(x[keep], eos, None if natural is None else natural[keep])
        return out
    top = rows.max(axis=1)
    nothing = top == NEG_INF
    shift = np.where(nothing, 0.0, top).astype(np.float32)
    z = rows - shift[:, None]
    np.maximum(z, _EXP_FLOOR, out=z)
    e = np.exp(z)
    total = e.sum(axis=1, dtype=np.float32)
    log_total = np.log(total)
    entropy = log_total - np.einsum("ij,ij->i", e, z) / total
    allowed = rows.shape[1] - np.count_nonzero(rows == NEG_INF, axis=1)
    lse = np.where(nothing, NEG_INF, shift + log_total)
    entropy = np.where(nothing, np.nan, entropy)
    if eos is not None and eos.numel():
        p_eos = np.exp(rows[:, eos.numpy()] - lse[:, None]).sum(axis=1)
    else:
        p_eos = np.full(rows.shape[0], np.nan)
    if natural is not None:
        removed, margin = _pair_stats_cpu(natural, x)
    else:
        removed = margin = np.full(rows.shape[0], np.nan)
    nan = np.zeros(rows.shape[0])
    packed = np.stack([lse, allowed, top, entropy, nan, p_eos, removed, margin], axis=1).astype(np.float32)
    return torch.from_numpy(packed)


def _pair_stats_cpu(natural: torch.Tensor, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pair_stats` in numpy passes when the natural rows hold no NaN or ``+inf``."""
    nat = natural.detach().float()
    sums = nat.numpy().sum(axis=1)
    if not (np.isfinite(sums) | (sums == NEG_INF)).all():
        removed, margin = pair_stats(natural, x)
        return removed.numpy(), margin.numpy()
    kept = masked(nat, x.detach().float())
    lse_nat, lse_kept = logsumexp_rows(nat).numpy(), logsumexp_rows(kept).numpy()
    removed = np.nan_to_num(np.clip(1.0 - np.exp(lse_kept - lse_nat), 0.0, 1.0), nan=0.0)
    margin = nat.numpy().max(axis=1) - kept.numpy().max(axis=1)
    return removed, margin


def pair_stats(natural: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(removed_mass, margin)`` of a stage ``x`` against ``natural`` (both ``[B, V]``, any device).

    ``removed_mass``: natural probability of the tokens ``x`` masked (``-inf``
    or NaN); ``margin``: the best natural logit minus the best natural logit
    ``x`` still allows (``inf`` when it allows nothing).
    """
    nat = natural.float()
    nat = nat.masked_fill(torch.isnan(nat), NEG_INF)
    kept = nat.masked_fill(~(x > NEG_INF), NEG_INF)
    lse_nat, lse_kept = torch.logsumexp(nat, dim=1), torch.logsumexp(kept, dim=1)
    removed = (1.0 - torch.exp(lse_kept - lse_nat)).clamp_(0.0, 1.0)
    margin = nat.amax(dim=1) - kept.amax(dim=1)
    return torch.nan_to_num(removed, nan=0.0), margin


def chosen_stats(x: torch.Tensor, chosen: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """``[B, 3]`` float32: the chosen token's logit, probability and rank (0 = best) in rows ``x``.

    ``stats`` are the rows' :func:`row_stats`; ``chosen`` holds one id per
    row (out-of-range ids give NaN). Same device as ``x``, no synchronisation.
    """
    vocab = x.shape[1]
    ids = chosen.reshape(-1, 1).to(device=x.device, dtype=torch.int64)
    valid = (ids[:, 0] >= 0) & (ids[:, 0] < vocab)
    value = x.gather(1, ids.clamp(0, vocab - 1))
    if x.device.type == "cpu":  # a numpy count: torch's sum of a boolean row is slow on the CPU
        rows = x.detach().numpy() if x.dtype in (torch.float32, torch.float16) else x.detach().float().numpy()
        bound = value.detach().to(torch.float32).numpy().astype(rows.dtype)
        rank = torch.from_numpy(np.count_nonzero(rows > bound, axis=1).astype(np.float32))
    else:
        rank = (x > value).sum(dim=1, dtype=torch.float32)
    logit = value[:, 0].float()
    logit = logit.masked_fill(torch.isnan(logit), NEG_INF)
    prob = probability(logit, stats[:, 0], stats[:, 1])
    out = torch.stack([logit, prob, rank], dim=1)
    return out.masked_fill(~valid[:, None], math.nan)


def effective(x: torch.Tensor) -> torch.Tensor:
    """Rows as the record reads them: NaN as ``-inf``; a row holding ``+inf`` as 0 there and ``-inf`` elsewhere."""
    x = x.float().masked_fill(torch.isnan(x), NEG_INF)
    posinf = torch.isposinf(x)
    rows = posinf.any(dim=1, keepdim=True)
    return torch.where(rows, torch.where(posinf, 0.0, NEG_INF), x)
