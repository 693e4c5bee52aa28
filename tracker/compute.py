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
    "Candidates",
    "top_allowed",
    "top_candidates",
    "best_candidates",
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


_GROUP = 16  # entries per group: a row's columns j, j + G, ..., j + 15 G (G = V // 16 groups)
_GROUP_OFFSETS = np.arange(_GROUP, dtype=np.int64)
_GROUPED_MIN_VOCAB = 4096  # below this a whole-row pass is as cheap as the grouped one
_SLACK = 1e-3  # log-space margin for thresholds derived from float32 values (adds candidates, never drops one)


def _groupable(x: torch.Tensor, k: int = 1) -> bool:
    """Whether rows ``x`` take the grouped paths: float32 CPU rows of a large vocabulary."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] > 0
        and x.shape[1] >= _GROUPED_MIN_VOCAB
        and k <= x.shape[1] // (_GROUP * _GROUP)
    )


def group_max(rows: np.ndarray) -> np.ndarray:
    """``[t, G]`` maxima of each row's groups (group ``j``: columns ``j + G * r``, ``r < 16``; ``G = V // 16``).

    One read pass over the rows, as fast as a plain row maximum (sixteen
    contiguous slabs folded with ``maximum``); the columns past ``16 G`` belong
    to no group. A group holding NaN has a NaN maximum.
    """
    t, v = rows.shape
    groups = v // _GROUP
    return rows[:, : groups * _GROUP].reshape(t, _GROUP, groups).max(axis=1)


def entries_at_least(rows: np.ndarray, gmax: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row, column)`` of every entry ``>= threshold[row]``, row-major, reading only groups that reach it.

    ``gmax`` is :func:`group_max` of ``rows``. Groups whose maximum is below
    the threshold (or NaN) are skipped whole, so the cost is one compare over
    the group maxima plus sixteen entries per group that reaches it. Entries
    in a group with a NaN maximum are missed: callers check for NaN first.
    """
    t, v = rows.shape
    groups = gmax.shape[1]
    r, j = np.divmod(np.flatnonzero(gmax >= threshold[:, None]), groups)
    cols = (j[:, None] + groups * _GROUP_OFFSETS).ravel()
    owner = np.repeat(r, _GROUP)
    hit = rows[owner, cols] >= threshold[owner]
    owner, cols = owner[hit], cols[hit]
    if v > groups * _GROUP:  # the columns past the last group, compared directly
        tr, tc = np.nonzero(rows[:, groups * _GROUP :] >= threshold[:, None])
        owner, cols = np.concatenate([owner, tr]), np.concatenate([cols, tc + groups * _GROUP])
        order = np.argsort(owner * v + cols, kind="stable")
        return owner[order], cols[order]
    order = np.argsort(owner * v + cols, kind="stable")
    return owner[order], cols[order]


def _kth_floor(rows: np.ndarray, gmax: np.ndarray, k: int) -> np.ndarray:
    """``[t]`` a value at most each row's ``k``-th largest entry, at least as high as the ``k``-th group maximum
    of 256-column super groups (NaN or ``-inf`` where the row has no such floor).

    The maxima of disjoint sets of entries: their ``k``-th largest is at most
    the row's ``k``-th largest entry, so every one of the row's top ``k`` is at
    or above it.
    """
    t, v = rows.shape
    groups = gmax.shape[1]
    supers = groups // _GROUP
    parts = [gmax[:, : supers * _GROUP].reshape(t, _GROUP, supers).max(axis=1)]
    if groups > supers * _GROUP:
        parts.append(gmax[:, supers * _GROUP :])
    if v > groups * _GROUP:
        parts.append(rows[:, groups * _GROUP :])
    maxima = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    return -np.partition(-maxima, k - 1, axis=1)[:, k - 1]



def _at_kth_floor(a: np.ndarray, gmax: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(answered, owner, cols)``: the rows the grouped path can answer (no NaN, a finite k-th floor) and
    the entries of those rows at or above their floor; None when they are not a small part of the rows."""
    t, v = a.shape
    floor = _kth_floor(a, gmax, k)
    answered = np.isfinite(floor) & ~np.isnan(gmax).any(axis=1)
    if v > gmax.shape[1] * _GROUP:
        answered &= ~np.isnan(a[:, gmax.shape[1] * _GROUP :]).any(axis=1)
    owner, cols = entries_at_least(a, gmax, np.where(answered, floor, np.inf).astype(np.float32))
    if owner.size > t * (v // 8):
        return None
    return answered, owner, cols

def _compact(owner: np.ndarray, cols: np.ndarray, values: np.ndarray, t: int, fill: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Variable-length runs per row (row-major ``owner``) packed into ``[t, width]`` values, ids and a validity mask."""
    counts = np.bincount(owner, minlength=t)
    width = int(counts.max()) if counts.size else 0
    starts = np.cumsum(counts) - counts
    pos = np.arange(owner.size) - np.repeat(starts, counts)
    packed = np.full((t, width), fill, dtype=np.float32)
    ids = np.zeros((t, width), dtype=np.int64)
    valid = np.zeros((t, width), dtype=bool)
    packed[owner, pos] = values
    ids[owner, pos] = cols
    valid[owner, pos] = True
    return packed, ids, valid


def _packed(a: np.ndarray, owner: np.ndarray, cols: np.ndarray, t: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The entries ``a[owner, cols]`` as ``[t, >= k]`` rows of values (padded with -inf) and their column ids."""
    values, ids, _ = _compact(owner, cols, a[owner, cols], t, NEG_INF)
    if values.shape[1] < k:
        values = np.pad(values, ((0, 0), (0, k - values.shape[1])), constant_values=NEG_INF)
        ids = np.pad(ids, ((0, 0), (0, k - ids.shape[1])))
    return values, ids


def _topk_grouped(a: np.ndarray, gmax: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray] | None:
    """Top-``k`` values and ids of float32 rows from the entries at or above :func:`_kth_floor`.

    Returns ``(values, ids, answered)``; rows not answered (NaN, fewer than
    ``k`` finite entries) hold junk. None when the candidates are not a small
    part of the rows (a whole-row ``topk`` is then as cheap).
    """
    t, _ = a.shape
    found = _at_kth_floor(a, gmax, k)
    if found is None:
        return None
    answered, owner, cols = found
    values, ids = _packed(a, owner, cols, t, k)
    best, where = torch.topk(torch.from_numpy(values), k, dim=1)
    return best, torch.from_numpy(ids).gather(1, where), answered


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=1)`` for float32 CPU rows, selecting among a few candidates per row.

    The ``k``-th largest maximum of disjoint groups of entries is at most the
    row's ``k``-th largest entry, so the entries at or above it include the
    row's top ``k``: one folding pass (:func:`group_max`) finds the groups
    that hold them, and ``topk`` runs on those entries only (in column order,
    as on the whole row). Rows with NaN or fewer than ``k`` finite entries
    take ``torch.topk`` on their own. Same values and ids, many times faster
    at 128k tokens than sorting out the top of each row.
    """
    if not _groupable(x, k):
        return torch.topk(x, k, dim=1)
    a = _np(x)
    found = _topk_grouped(a, group_max(a), k)
    if found is None:
        return torch.topk(x, k, dim=1)
    best, ids, answered = found
    if not answered.all():
        rest = torch.from_numpy(np.nonzero(~answered)[0])
        best[rest], ids[rest] = torch.topk(x[rest], k, dim=1)
    return best, ids


@dataclass(frozen=True)
class Candidates:
    """Tokens that may be among a block's best allowed tokens, with both stages' logits at them.

    Attributes:
        ids: ``[t, j]`` token ids.
        usable: ``[t, j]`` whether an entry counts (padding and repeats do not).
        natural: ``[t, j]`` float32 natural logits at ``ids``.
        constrained: ``[t, j]`` float32 constrained logits at ``ids``.
    """

    ids: np.ndarray
    usable: np.ndarray
    natural: np.ndarray
    constrained: np.ndarray

    @staticmethod
    def join(parts: Sequence["Candidates"], width: int = 0) -> "Candidates":
        """Rows of ``parts`` one after another, padded with unusable entries to a common width (at least ``width``)."""
        width = max([width, *(p.ids.shape[1] for p in parts)])

        def pad(x: np.ndarray, fill: object) -> np.ndarray:
            return np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=fill) if x.shape[1] < width else x

        return Candidates(
            np.concatenate([pad(p.ids, 0) for p in parts]),
            np.concatenate([pad(p.usable, False) for p in parts]),
            np.concatenate([pad(p.natural, NEG_INF) for p in parts]),
            np.concatenate([pad(p.constrained, NEG_INF) for p in parts]),
        )

    def take(self, rows: np.ndarray, other: "Candidates") -> "Candidates":
        """These candidates with ``rows`` replaced by ``other``'s rows (in order)."""
        both = Candidates.join([self, other])
        t = self.ids.shape[0]
        index = np.arange(t)
        index[rows] = t + np.arange(rows.size)
        return Candidates(both.ids[index], both.usable[index], both.natural[index], both.constrained[index])


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
    fewer than ``k`` are allowed the list is shorter (``count``). See
    :func:`top_candidates` (``scratch`` as there) and :func:`best_candidates`.
    """
    k = min(int(k), natural.shape[1])
    candidates = top_candidates(natural, constrained, lse_natural, lse_constrained, k, scratch)
    return best_candidates(candidates, lse_natural, lse_constrained, k)[0]


def top_candidates(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    lse_natural: torch.Tensor,
    lse_constrained: torch.Tensor,
    k: int,
    scratch: torch.Tensor | None = None,
) -> Candidates:
    """Candidates that hold each row's ``k`` best allowed tokens (by the larger probability).

    The answer lies in the constrained top-k plus the allowed tokens whose
    natural probability reaches the constrained ``k``-th best one (every
    other token scores below ``k`` tokens already listed). On large float32
    CPU rows both sets come from group maxima (one folding pass per stage,
    see :func:`group_max`); elsewhere, and for rows that pass cannot answer,
    from the constrained top-k and the natural top-k among allowed tokens
    (``scratch`` as for :func:`masked`). numpy only: the scoring runs once
    per query in :func:`best_candidates`.
    """
    k = min(int(k), natural.shape[1])
    if _groupable(constrained, k) and _groupable(natural, k):
        found = _top_candidates_grouped(natural, constrained, lse_natural, lse_constrained, k)
        if found is not None:
            return found
    return _top_candidates_dense(natural, constrained, lse_natural, lse_constrained, k, scratch)


def best_candidates(
    candidates: Candidates, lse_natural: torch.Tensor, lse_constrained: torch.Tensor, k: int
) -> tuple[TopTokens, torch.Tensor, torch.Tensor]:
    """The ``k`` best usable, allowed candidates per row, with their natural and constrained logits."""
    ids = torch.from_numpy(candidates.ids)
    nat, con = torch.from_numpy(candidates.natural), torch.from_numpy(candidates.constrained)
    if ids.shape[1] < k:
        candidates = Candidates.join([candidates], k)
        ids = torch.from_numpy(candidates.ids)
        nat, con = torch.from_numpy(candidates.natural), torch.from_numpy(candidates.constrained)
    score = torch.maximum(torch.exp(nat - lse_natural[:, None]), torch.exp(con - lse_constrained[:, None]))
    usable = torch.from_numpy(candidates.usable) & (con > NEG_INF)
    score = torch.where(usable & ~torch.isnan(score), score, -1.0)
    best, order = torch.topk(score, k, dim=1)
    return TopTokens(ids.gather(1, order), (best >= 0).sum(dim=1)), nat.gather(1, order), con.gather(1, order)


def _gathered(ids: np.ndarray, usable: np.ndarray, natural: torch.Tensor, constrained: torch.Tensor) -> Candidates:
    return Candidates(
        ids,
        usable,
        np.take_along_axis(_np(natural), ids, axis=1),
        np.take_along_axis(_np(constrained), ids, axis=1),
    )


def _top_candidates_dense(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    lse_natural: torch.Tensor,
    lse_constrained: torch.Tensor,
    k: int,
    scratch: torch.Tensor | None = None,
) -> Candidates:
    """:func:`top_candidates` from the constrained top-k and the natural top-k among allowed tokens.

    Works in slices of at most ``scratch``'s rows (:data:`_DENSE_ROWS` without
    it), so that its masked copy of the natural rows stays small.
    """
    per = _DENSE_ROWS if scratch is None else scratch.shape[0]
    if natural.shape[0] > per:
        same = constrained is natural
        return Candidates.join([
            _top_candidates_dense(natural[a : a + per], natural[a : a + per] if same else constrained[a : a + per],
                                  lse_natural[a : a + per], lse_constrained[a : a + per], k, scratch)
            for a in range(0, natural.shape[0], per)
        ])
    _, con_ids = topk_rows(constrained, k)
    if constrained is natural:
        return _gathered(con_ids.numpy(), np.ones(con_ids.shape, dtype=bool), natural, constrained)
    _, nat_ids = topk_rows(masked(natural, constrained, scratch), k)
    repeated = (nat_ids[:, :, None] == con_ids[:, None, :]).any(dim=2)
    usable = torch.cat([torch.ones_like(repeated), ~repeated], dim=1)
    return _gathered(torch.cat([con_ids, nat_ids], dim=1).numpy(), usable.numpy(), natural, constrained)


_DENSE_ROWS = 8  # rows per slice of the dense paths when no scratch bounds them
_MAX_EXTRA = 1024  # natural candidates per row beyond which a row takes the dense path


def _top_candidates_grouped(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    lse_natural: torch.Tensor,
    lse_constrained: torch.Tensor,
    k: int,
) -> Candidates | None:
    """:func:`top_candidates` from group maxima; rows it cannot answer go to the dense path."""
    a_c = _np(constrained)
    t, v = a_c.shape
    gmax_c = group_max(a_c)
    found = _at_kth_floor(a_c, gmax_c, k)
    if found is None:
        return None
    answered, owner, cols = found
    # The constrained k-th best of each row, and every candidate reaching it (ties included).
    packed, _ = _packed(a_c, owner, cols, t, k)
    kth = -np.partition(-packed, k - 1, axis=1)[:, k - 1]
    keep = a_c[owner, cols] >= kth[owner]
    owner, cols = owner[keep], cols[keep]
    if constrained is not natural:
        a_n = _np(natural)
        # An allowed token outside the constrained top-k can only be listed if its natural
        # probability reaches the constrained k-th best probability: natural logit >= this.
        ln = lse_natural.detach().double().numpy()
        gap = kth.astype(np.float64) - lse_constrained.detach().double().numpy()
        with np.errstate(invalid="ignore"):
            threshold = ln + gap
            threshold -= _SLACK * (1.0 + np.abs(ln) + np.abs(gap))
        gmax_n = group_max(a_n)
        answered &= np.isfinite(threshold) & ~np.isnan(gmax_n).any(axis=1)
        threshold = np.where(answered, threshold, np.inf).astype(np.float32)
        extra_owner, extra_cols = entries_at_least(a_n, gmax_n, threshold)
        new = (a_c[extra_owner, extra_cols] > NEG_INF) & ~np.isin(extra_owner * v + extra_cols, owner * v + cols)
        extra_owner, extra_cols = extra_owner[new], extra_cols[new]
        values = a_n[extra_owner, extra_cols]
        order = np.lexsort((extra_cols, -values, extra_owner))  # best natural first, as a top-k lists them
        extra_owner, extra_cols = extra_owner[order], extra_cols[order]
        answered &= np.bincount(extra_owner, minlength=t) <= _MAX_EXTRA
        together = np.argsort(np.concatenate([owner, extra_owner]), kind="stable")  # per row: constrained, then extras
        owner = np.concatenate([owner, extra_owner])[together]
        cols = np.concatenate([cols, extra_cols])[together]
    keep = answered[owner]
    owner, cols = owner[keep], cols[keep]
    _, ids, usable = _compact(owner, cols, np.zeros(owner.size, dtype=np.float32), t, 0.0)
    found = _gathered(ids, usable, natural, constrained)
    if answered.all():
        return found
    rest = np.nonzero(~answered)[0]
    index = torch.from_numpy(rest)
    same = constrained is natural
    dense = _top_candidates_dense(natural[index], natural[index] if same else constrained[index],
                                  lse_natural[index], lse_constrained[index], k)
    return found.take(rest, dense)


def entries_above(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    threshold_natural: torch.Tensor,
    threshold_constrained: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, ids)`` of every entry at or above its row's threshold in either stage, row-major.

    An entry holding NaN in either stage is never listed. On large float32
    CPU rows with finite thresholds the entries come from group maxima (one
    folding pass per stage, see :func:`group_max`); otherwise from one
    compare pass over the rows.
    """
    if _groupable(natural) and _groupable(constrained):
        tn, tc = _np(threshold_natural), _np(threshold_constrained)
        if np.isfinite(tn).all() and np.isfinite(tc).all():
            found = _entries_above_grouped(_np(natural), _np(constrained), tn, tc, constrained is natural)
            if found is not None:
                return found
    return _entries_above_dense(natural, constrained, threshold_natural, threshold_constrained, scratch)


def _entries_above_dense(
    natural: torch.Tensor,
    constrained: torch.Tensor,
    threshold_natural: torch.Tensor,
    threshold_constrained: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`entries_above` by one compare pass, in slices of at most ``scratch``'s rows (the margins' copy)."""
    per = _DENSE_ROWS if scratch is None else scratch.shape[0]
    if natural.shape[0] > per:
        rows_parts, ids_parts = [], []
        for a in range(0, natural.shape[0], per):
            r, i = _entries_above_dense(natural[a : a + per], constrained[a : a + per], threshold_natural[a : a + per],
                                 threshold_constrained[a : a + per], scratch)
            rows_parts.append(r + a)
            ids_parts.append(i)
        return torch.cat(rows_parts), torch.cat(ids_parts)
    nat, con = _np(natural), _np(constrained)
    margin = np.empty_like(nat) if scratch is None else _np(scratch)[: nat.shape[0]]
    np.subtract(nat, _np(threshold_natural)[:, None], out=margin)
    np.maximum(margin, con - _np(threshold_constrained)[:, None], out=margin)
    rows, ids = np.nonzero(margin >= 0)
    return torch.from_numpy(rows), torch.from_numpy(ids)


def _entries_above_grouped(
    nat: np.ndarray, con: np.ndarray, tn: np.ndarray, tc: np.ndarray, same: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`entries_above` through group maxima; None when the thresholds reach too many groups."""
    t, v = nat.shape
    gn = group_max(nat)
    gc = gn if same else group_max(con)
    # Entries in a group whose maximum is NaN would not be looked at: such blocks take the compare pass.
    if np.isnan(gn).any() or np.isnan(gc).any():
        return None
    tail = gn.shape[1] * _GROUP
    if v > tail and (np.isnan(nat[:, tail:]).any() or np.isnan(con[:, tail:]).any()):
        return None
    reached = np.count_nonzero(gn >= tn[:, None]) + np.count_nonzero(gc >= tc[:, None])
    if reached > t * gn.shape[1] // 8:
        return None
    rn, cn = entries_at_least(nat, gn, tn)
    rc, cc = entries_at_least(con, gc, tc)
    key = np.union1d(rn * v + cn, rc * v + cc)  # sorted: row-major
    return torch.from_numpy(key // v), torch.from_numpy(key % v)


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


def effective(x: torch.Tensor) -> torch.Tensor:
    """Rows as the record reads them: NaN as ``-inf``; a row holding ``+inf`` as 0 there and ``-inf`` elsewhere."""
    x = x.float().masked_fill(torch.isnan(x), NEG_INF)
    posinf = torch.isposinf(x)
    rows = posinf.any(dim=1, keepdim=True)
    return torch.where(rows, torch.where(posinf, 0.0, NEG_INF), x)
