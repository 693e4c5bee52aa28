"""Which tokens a query lists, found without ordering whole rows: the best allowed tokens of a block and
the entries above a threshold, in numpy.

Both searches use group maxima (:func:`tracker.reading.rows.group_max`, one folding
pass per stage, shared with the log-sum-exp pass when the caller has them):
groups whose maximum is below what a row needs are skipped whole. Rows the
grouped path cannot answer (NaN, too few finite entries, too many
candidates) take a whole-row pass; both give the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tracker.reading.rows import (
    GROUP,
    NEG_INF,
    at_kth_floor,
    compact,
    entries_at_least,
    group_max,
    groupable,
    masked,
    top_order,
    topk_rows,
    values_at,
)

__all__ = ["Candidates", "top_candidates", "best_candidates", "entries_above"]

_SLACK = 1e-3  # log-space margin for thresholds derived from float32 values (adds candidates, never drops one)
_DENSE_ROWS = 8  # rows per slice of the dense paths (their masked copy stays small)
_MAX_EXTRA = 1024  # natural candidates per row beyond which a row takes the dense path


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
    def join(parts: Sequence[Candidates], width: int = 0) -> Candidates:
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

    def take(self, rows: np.ndarray, other: Candidates) -> Candidates:
        """These candidates with ``rows`` replaced by ``other``'s rows (in order)."""
        both = Candidates.join([self, other])
        t = self.ids.shape[0]
        index = np.arange(t)
        index[rows] = t + np.arange(rows.size)
        return Candidates(both.ids[index], both.usable[index], both.natural[index], both.constrained[index])


def _gathered(ids: np.ndarray, usable: np.ndarray, natural: np.ndarray, constrained: np.ndarray) -> Candidates:
    return Candidates(
        ids, usable, np.take_along_axis(natural, ids, axis=1), np.take_along_axis(constrained, ids, axis=1)
    )


def top_candidates(
    natural: np.ndarray,
    constrained: np.ndarray,
    lse_natural: np.ndarray,
    lse_constrained: np.ndarray,
    k: int,
    gmax_natural: np.ndarray | None = None,
    gmax_constrained: np.ndarray | None = None,
) -> Candidates:
    """Candidates that hold each row's ``k`` best allowed tokens (by the larger probability).

    The answer lies in the constrained top-k plus the allowed tokens whose
    natural probability reaches the constrained ``k``-th best one (every
    other token scores below ``k`` tokens already listed). On large float32
    rows both sets come from group maxima (given, or one folding pass per
    stage); elsewhere, and for rows that pass cannot answer, from the
    constrained top-k and the natural top-k among allowed tokens.
    ``constrained is natural`` when there is no constraint.
    """
    k = min(int(k), natural.shape[1])
    if k >= 1 and groupable(constrained, k) and groupable(natural, k):
        found = _top_candidates_grouped(
            natural, constrained, lse_natural, lse_constrained, k, gmax_natural, gmax_constrained
        )
        if found is not None:
            return found
    return _top_candidates_dense(natural, constrained, k)


def best_candidates(
    candidates: Candidates, lse_natural: np.ndarray, lse_constrained: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, count, natural, constrained)``: the ``k`` best usable, allowed candidates per row by the larger
    of the two probabilities (ties: earlier candidate first), how many are real, and both logits at them."""
    if candidates.ids.shape[1] < k:
        candidates = Candidates.join([candidates], k)
    nat, con = candidates.natural, candidates.constrained
    with np.errstate(invalid="ignore", over="ignore"):
        score = np.maximum(np.exp(nat - lse_natural[:, None]), np.exp(con - lse_constrained[:, None]))
    usable = candidates.usable & (con > NEG_INF) & ~np.isnan(score)
    score = np.where(usable, score, -1.0)
    order = top_order(score, k)
    best = np.take_along_axis(score, order, axis=1)
    pick = lambda x: np.take_along_axis(x, order, axis=1)  # noqa: E731
    return pick(candidates.ids), (best >= 0).sum(axis=1), pick(nat), pick(con)


def _top_candidates_dense(natural: np.ndarray, constrained: np.ndarray, k: int) -> Candidates:
    """:func:`top_candidates` from the constrained top-k and the natural top-k among allowed tokens, in slices
    of a few rows (the masked copy of the natural rows stays small)."""
    t = natural.shape[0]
    if t > _DENSE_ROWS:
        same = constrained is natural
        return Candidates.join(
            [
                _top_candidates_dense(
                    natural[a : a + _DENSE_ROWS],
                    natural[a : a + _DENSE_ROWS] if same else constrained[a : a + _DENSE_ROWS],
                    k,
                )
                for a in range(0, t, _DENSE_ROWS)
            ]
        )
    _, con_ids = topk_rows(constrained, k)
    if constrained is natural:
        return _gathered(con_ids, np.ones(con_ids.shape, dtype=bool), natural, constrained)
    _, nat_ids = topk_rows(masked(natural, constrained), k)
    repeated = (nat_ids[:, :, None] == con_ids[:, None, :]).any(axis=2)
    usable = np.concatenate([np.ones_like(repeated), ~repeated], axis=1)
    return _gathered(np.concatenate([con_ids, nat_ids], axis=1), usable, natural, constrained)


def _top_candidates_grouped(
    natural: np.ndarray,
    constrained: np.ndarray,
    lse_natural: np.ndarray,
    lse_constrained: np.ndarray,
    k: int,
    gmax_n: np.ndarray | None,
    gmax_c: np.ndarray | None,
) -> Candidates | None:
    """:func:`top_candidates` from group maxima; rows it cannot answer go to the dense path."""
    a_c = constrained
    t, v = a_c.shape
    gmax_c = group_max(a_c) if gmax_c is None else gmax_c
    found = at_kth_floor(a_c, gmax_c, k)
    if found is None:
        return None
    answered, owner, cols = found
    # The constrained k-th best of each row, and every candidate reaching it (ties included).
    found_values = values_at(a_c, owner, cols)
    packed, _, _ = compact(owner, cols, found_values, t, NEG_INF)
    if packed.shape[1] < k:
        packed = np.pad(packed, ((0, 0), (0, k - packed.shape[1])), constant_values=NEG_INF)
    kth = -np.partition(-packed, k - 1, axis=1)[:, k - 1]
    keep = found_values >= kth[owner]
    owner, cols = owner[keep], cols[keep]
    if constrained is not natural:
        a_n = natural
        # An allowed token outside the constrained top-k can only be listed if its natural
        # probability reaches the constrained k-th best probability: natural logit >= this.
        ln = lse_natural.astype(np.float64)
        with np.errstate(invalid="ignore"):
            gap = kth.astype(np.float64) - lse_constrained.astype(np.float64)
            threshold = ln + gap
            threshold -= _SLACK * (1.0 + np.abs(ln) + np.abs(gap))
        gmax_n = group_max(a_n) if gmax_n is None else gmax_n
        answered &= np.isfinite(threshold) & ~np.isnan(gmax_n).any(axis=1)
        threshold = np.where(answered, threshold, np.inf).astype(np.float32)
        extra_owner, extra_cols = entries_at_least(a_n, gmax_n, threshold)
        # listed already exactly when the constrained value reaches the k-th best (every such entry was kept above)
        at = values_at(a_c, extra_owner, extra_cols)
        new = (at > NEG_INF) & (at < kth[extra_owner])
        extra_owner, extra_cols = extra_owner[new], extra_cols[new]
        values = values_at(a_n, extra_owner, extra_cols)
        order = np.lexsort((extra_cols, -values, extra_owner))  # best natural first, as a top-k lists them
        extra_owner, extra_cols = extra_owner[order], extra_cols[order]
        answered &= np.bincount(extra_owner, minlength=t) <= _MAX_EXTRA
        together = np.argsort(np.concatenate([owner, extra_owner]), kind="stable")  # per row: constrained, then extras
        owner = np.concatenate([owner, extra_owner])[together]
        cols = np.concatenate([cols, extra_cols])[together]
    keep = answered[owner]
    owner, cols = owner[keep], cols[keep]
    _, ids, usable = compact(owner, cols, np.zeros(owner.size, dtype=np.float32), t, 0.0)
    found = _gathered(ids, usable, natural, constrained)
    if answered.all():
        return found
    rest = np.nonzero(~answered)[0]
    same = constrained is natural
    dense = _top_candidates_dense(natural[rest], natural[rest] if same else constrained[rest], k)
    return found.take(rest, dense)


def entries_above(
    natural: np.ndarray,
    constrained: np.ndarray,
    threshold_natural: np.ndarray,
    threshold_constrained: np.ndarray,
    gmax_natural: np.ndarray | None = None,
    gmax_constrained: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, ids)`` of every entry at or above its row's threshold in either stage, row-major.

    An entry holding NaN in either stage is never listed. On large float32
    rows with finite thresholds the entries come from group maxima (given,
    or one folding pass per stage); otherwise from one compare pass.
    """
    tn, tc = threshold_natural, threshold_constrained
    if groupable(natural) and groupable(constrained) and np.isfinite(tn).all() and np.isfinite(tc).all():
        found = _entries_above_grouped(
            natural, constrained, tn, tc, constrained is natural, gmax_natural, gmax_constrained
        )
        if found is not None:
            return found
    rows_parts, ids_parts = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for a in range(0, natural.shape[0], _DENSE_ROWS):
        s = slice(a, a + _DENSE_ROWS)
        n, c = natural[s], constrained[s]
        # two comparisons, not one on a difference: -inf - (-inf) is NaN, which would drop masked
        # tokens under a threshold of -inf (a min_value of 0)
        above = ((n >= tn[s, None]) | (c >= tc[s, None])) & ~np.isnan(n) & ~np.isnan(c)
        rows, ids = np.nonzero(above)
        rows_parts.append(rows + a)
        ids_parts.append(ids)
    return np.concatenate(rows_parts), np.concatenate(ids_parts)


def _entries_above_grouped(
    nat: np.ndarray,
    con: np.ndarray,
    tn: np.ndarray,
    tc: np.ndarray,
    same: bool,
    gn: np.ndarray | None,
    gc: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`entries_above` through group maxima; None when the thresholds reach too many groups."""
    t, v = nat.shape
    gn = group_max(nat) if gn is None else gn
    gc = gn if same else (group_max(con) if gc is None else gc)
    # Entries in a group whose maximum is NaN would not be looked at: such blocks take the compare pass.
    if np.isnan(gn).any() or np.isnan(gc).any():
        return None
    tail = gn.shape[1] * GROUP
    if v > tail and (np.isnan(nat[:, tail:]).any() or np.isnan(con[:, tail:]).any()):
        return None
    reached = np.count_nonzero(gn >= tn[:, None]) + np.count_nonzero(gc >= tc[:, None])
    if reached > t * gn.shape[1] // 8:
        return None
    rn, cn = entries_at_least(nat, gn, tn.astype(np.float32))
    rc, cc = entries_at_least(con, gc, tc.astype(np.float32))
    key = np.union1d(rn * v + cn, rc * v + cc)  # sorted: row-major
    return key // v, key % v
