"""Row maths of the read side, in numpy: log-sum-exp, masks, non-finite rows, group maxima, top-k.

Every function works on whole blocks of rows ``[t, V]`` (float32 unless
said): no Python loop over the vocabulary or over rows. A token is
*allowed* when its logit is above ``-inf``; probabilities are
``exp(logit - lse)`` with the row's log-sum-exp ``lse``, so nothing needs a
full softmax. The passes keep to cheap ufuncs (subtract, maximum, exp, sum):
masks are applied arithmetically (see :func:`masked`), and a row's maximum
tells whether it holds NaN or ``+inf`` (``np.max`` propagates NaN), so the
exact checks run on those rows only.

:func:`map_blocks` runs per-block work on a small thread pool: numpy
releases the GIL inside its ufunc loops, so blocks of one query proceed in
parallel without copies.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

__all__ = [
    "NEG_INF",
    "as_float32",
    "exp_floor",
    "logsumexp_rows",
    "probabilities",
    "logsumexp_shared",
    "masked",
    "nonfinite_rows",
    "effective",
    "group_max",
    "row_max",
    "entries_at_least",
    "topk_rows",
    "map_blocks",
]

NEG_INF = float("-inf")
FLOAT_MAX = float(np.finfo(np.float32).max)
EXP_FLOOR = -80.0  # exp(-80) ~ 1.8e-35: a normal float32, far below the rounding of a sum >= 1
GROUP = 16  # entries per group: a row's columns j, j + G, ..., j + 15 G (G = V // 16 groups)
GROUP_OFFSETS = np.arange(GROUP, dtype=np.int64)
GROUPED_MIN_VOCAB = 4096  # below this a whole-row pass is as cheap as the grouped one
_LSE_ROWS = 2  # rows per log-sum-exp slice: its scratch (1 MiB at 128k tokens) stays in cache

T = TypeVar("T")


def as_float32(rows: np.ndarray) -> np.ndarray:
    """Rows as float32: float32 as they are (no copy); float16 converted; uint16 read as bfloat16 bits."""
    if rows.dtype == np.float32:
        return rows
    if rows.dtype == np.uint16:  # bfloat16 is the high half of a float32
        return (rows.astype(np.uint32) << 16).view(np.float32)
    return rows.astype(np.float32)


@functools.lru_cache(maxsize=4)
def exp_floor(vocab: int) -> np.ndarray:
    """A read-only ``[1, vocab]`` row of float32 :data:`EXP_FLOOR`, to clamp rows with
    ``np.maximum(x, floor, out=x)``: against an array operand numpy's float32 ``maximum`` runs about
    three times as fast as against a scalar."""
    row = np.full((1, vocab), EXP_FLOOR, dtype=np.float32)
    row.flags.writeable = False
    return row


def probabilities(logits: np.ndarray, lse: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``exp(logits - lse)`` (``lse`` broadcast), with the record's rule for a masked token: 0, even in a row
    with nothing allowed (log-sum-exp ``-inf``, where the difference is NaN). NaN (a value not stored)
    stays NaN. ``out`` may be ``logits`` itself (computed in place).
    """
    masked = logits == NEG_INF
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(logits - lse, out=out)
    p[masked] = 0.0
    return p


def logsumexp_rows(x: np.ndarray, shift: np.ndarray | None = None) -> np.ndarray:
    """``[t]`` float32 log-sum-exp of each row: ``-inf`` when nothing is allowed, NaN for a row holding NaN.

    ``shift`` is the rows' maximum when the caller has it (:func:`row_max`).
    Shifted logits are clamped at -80 before ``exp``: ``exp(-inf)`` takes a
    slow path, and terms below ``exp(-80)`` cannot change a float32 sum whose
    largest term is 1, so the result is the same to the bit. Works in slices
    of two rows, whose scratch stays in cache.
    """
    t = x.shape[0]
    top = x.max(axis=1) if shift is None else shift
    out = np.empty(t, dtype=np.float32)
    if t == 0:
        return out
    nothing = top == NEG_INF
    offset = np.where(np.isfinite(top), top, 0.0).astype(np.float32)
    per = min(t, _LSE_ROWS)
    scratch = np.empty((per, x.shape[1]), dtype=np.float32)
    floor = exp_floor(x.shape[1])
    for a in range(0, t, per):
        rows = x[a : a + per]
        terms = scratch[: rows.shape[0]]
        np.subtract(rows, offset[a : a + per, None], out=terms)
        np.maximum(terms, floor, out=terms)
        np.exp(terms, out=terms)
        out[a : a + per] = terms.sum(axis=1, dtype=np.float32)
    with np.errstate(divide="ignore"):
        np.log(out, out=out)
    out += offset
    out[nothing] = NEG_INF
    return out


def _finish_lse(sums: np.ndarray, offset: np.ndarray, top: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        out = np.log(sums) + offset
    out[top == NEG_INF] = NEG_INF
    return out.astype(np.float32)


def logsumexp_shared(
    natural: np.ndarray, top: np.ndarray, others: list[np.ndarray], tops: list[np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """:func:`logsumexp_rows` of ``natural`` and of each of ``others`` (same shape; ``top``/``tops`` the rows'
    maxima), with one ``exp`` pass instead of one per stage where it can.

    A stage that only masks the natural row (each entry equal to the natural
    one or ``-inf``: what a constraint does) has as its sum the natural
    exponentials of the tokens it allows; those rows take that sum (equal
    to the direct one within float32 rounding), the others their own pass.
    A row whose best allowed token is far below the natural best (more than
    40 nats, where the -80 clamp could matter) also takes its own pass.
    """
    t, v = natural.shape
    offset = np.where(np.isfinite(top), top, 0.0).astype(np.float32)
    sums = np.empty(t, dtype=np.float32)
    other_sums = [np.empty(t, dtype=np.float32) for _ in others]
    same = [np.empty(t, dtype=bool) for _ in others]
    per = max(1, min(t, _LSE_ROWS))
    terms, kept = np.empty((per, v), dtype=np.float32), np.empty((per, v), dtype=np.float32)
    allowed, differ = np.empty((per, v), dtype=bool), np.empty((per, v), dtype=bool)
    floor = exp_floor(v)
    for a in range(0, t, per):
        rows = natural[a : a + per]
        k = rows.shape[0]
        e, w, m, d = terms[:k], kept[:k], allowed[:k], differ[:k]
        np.subtract(rows, offset[a : a + per, None], out=e)
        np.maximum(e, floor, out=e)
        np.exp(e, out=e)
        sums[a : a + per] = e.sum(axis=1, dtype=np.float32)
        for j, other in enumerate(others):
            o = other[a : a + per]
            np.greater(o, NEG_INF, out=m)
            np.not_equal(o, rows, out=d)
            np.logical_and(d, m, out=d)
            same[j][a : a + per] = ~d.any(axis=1)
            np.multiply(e, m, out=w)
            other_sums[j][a : a + per] = w.sum(axis=1, dtype=np.float32)
    results = []
    for j, other in enumerate(others):
        top_o = tops[j]
        with np.errstate(invalid="ignore"):
            ok = same[j] & np.isfinite(top) & ((top_o - offset > -40.0) | (top_o == NEG_INF))
        lse = _finish_lse(other_sums[j], offset, top_o)
        if not ok.all():
            rest = np.nonzero(~ok)[0]
            lse[rest] = logsumexp_rows(other[rest], top_o[rest])
        results.append(lse)
    return _finish_lse(sums, offset, top), results


def masked(natural: np.ndarray, constrained: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``natural`` where the token is allowed, ``-inf`` where ``constrained`` masked it.

    ``constrained - max(constrained, -FLT_MAX)`` is 0 for an allowed token
    and ``-inf`` for a masked one: three cheap passes instead of a boolean
    select. ``out`` (float32, the rows' shape or larger) avoids allocating.
    """
    result = np.empty(constrained.shape, dtype=np.float32) if out is None else out[: constrained.shape[0]]
    np.maximum(constrained, -FLOAT_MAX, out=result)
    np.subtract(constrained, result, out=result)
    np.add(result, natural, out=result)
    return result


def row_max(rows: np.ndarray, gmax: np.ndarray | None = None) -> np.ndarray:
    """``[t]`` each row's maximum (NaN when it holds NaN), from its :func:`group_max` when given."""
    if gmax is None or gmax.shape[1] == 0:
        return rows.max(axis=1) if rows.shape[1] else np.full(rows.shape[0], NEG_INF, dtype=np.float32)
    top = gmax.max(axis=1)
    tail = gmax.shape[1] * GROUP
    if rows.shape[1] > tail:
        top = np.maximum(top, rows[:, tail:].max(axis=1))
    return top


def nonfinite_rows(values: np.ndarray, top: np.ndarray | None = None) -> np.ndarray:
    """``[t]`` bool: rows holding NaN or ``+inf`` (``-inf`` alone, a masked token, is normal).

    A row's maximum is NaN or ``+inf`` exactly then, so one maximum pass
    (none when ``top``, the rows' maxima, is given) decides.
    """
    if values.shape[0] == 0 or values.shape[1] == 0:
        return np.zeros(values.shape[0], dtype=bool)
    top = as_float32(values).max(axis=1) if top is None else top
    return np.isnan(top) | (top == np.inf)


def effective(x: np.ndarray) -> np.ndarray:
    """Rows as the record reads them (a copy): NaN as ``-inf``; a row holding ``+inf`` as 0 there and ``-inf`` elsewhere."""
    x = np.where(np.isnan(x), np.float32(NEG_INF), x).astype(np.float32)
    posinf = x == np.inf
    rows = posinf.any(axis=1, keepdims=True)
    return np.where(rows, np.where(posinf, np.float32(0.0), np.float32(NEG_INF)), x)


def groupable(x: np.ndarray, k: int = 1) -> bool:
    """Whether rows ``x`` take the grouped paths: float32 rows of a large vocabulary."""
    return (
        x.dtype == np.float32
        and x.ndim == 2
        and x.shape[0] > 0
        and x.shape[1] >= GROUPED_MIN_VOCAB
        and k <= x.shape[1] // (GROUP * GROUP)
    )


def group_max(rows: np.ndarray) -> np.ndarray:
    """``[t, G]`` maxima of each row's groups (group ``j``: columns ``j + G * r``, ``r < 16``; ``G = V // 16``).

    One read pass over the rows, as fast as a plain row maximum (sixteen
    contiguous slabs folded with ``maximum``); the columns past ``16 G`` belong
    to no group. A group holding NaN has a NaN maximum.
    """
    t, v = rows.shape
    groups = v // GROUP
    return rows[:, : groups * GROUP].reshape(t, GROUP, groups).max(axis=1)


def values_at(rows: np.ndarray, owner: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``rows[owner, cols]``, gathered from the flat rows where they are contiguous (about twice as fast)."""
    if rows.flags.c_contiguous:
        return rows.reshape(-1)[owner * rows.shape[1] + cols]
    return rows[owner, cols]


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
    # each reached group's entries as flat indices (row * v + column): one gather from the flat rows, as
    # values_at does (spelt out here: the indices are built once and sort into row-major order as they are)
    at = (r * v + j)[:, None] + groups * GROUP_OFFSETS
    flat = rows.reshape(-1) if rows.flags.c_contiguous else None
    values = flat[at] if flat is not None else rows[r[:, None], at - (r * v)[:, None]]  # the same entries
    at = at[values >= threshold[r][:, None]]
    if v > groups * GROUP:  # the columns past the last group, compared directly
        tr, tc = np.nonzero(rows[:, groups * GROUP :] >= threshold[:, None])
        at = np.concatenate([at, tr * v + tc + groups * GROUP])
    at.sort()
    return at // v, at % v


def kth_floor(rows: np.ndarray, gmax: np.ndarray, k: int) -> np.ndarray:
    """``[t]`` a value at most each row's ``k``-th largest entry: the ``k``-th largest maximum of 256-column
    super groups (NaN or ``-inf`` where the row has no such floor).

    The maxima of disjoint sets of entries: their ``k``-th largest is at most
    the row's ``k``-th largest entry, so every one of the row's top ``k`` is at
    or above it.
    """
    t, v = rows.shape
    groups = gmax.shape[1]
    supers = groups // GROUP
    parts = [gmax[:, : supers * GROUP].reshape(t, GROUP, supers).max(axis=1)]
    if groups > supers * GROUP:
        parts.append(gmax[:, supers * GROUP :])
    if v > groups * GROUP:
        parts.append(rows[:, groups * GROUP :])
    maxima = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    return -np.partition(-maxima, k - 1, axis=1)[:, k - 1]


def at_kth_floor(a: np.ndarray, gmax: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(answered, owner, cols)``: the rows the grouped path can answer (no NaN, a finite k-th floor) and
    the entries of those rows at or above their floor; None when they are not a small part of the rows."""
    t, v = a.shape
    floor = kth_floor(a, gmax, k)
    answered = np.isfinite(floor) & ~np.isnan(gmax).any(axis=1)
    if v > gmax.shape[1] * GROUP:
        answered &= ~np.isnan(a[:, gmax.shape[1] * GROUP :]).any(axis=1)
    owner, cols = entries_at_least(a, gmax, np.where(answered, floor, np.inf).astype(np.float32))
    if owner.size > t * (v // 8):
        return None
    return answered, owner, cols


def compact(
    owner: np.ndarray, cols: np.ndarray, values: np.ndarray, t: int, fill: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def top_order(values: np.ndarray, k: int) -> np.ndarray:
    """``[t, k]`` column indices of each row's ``k`` largest values, best first (ties: lower column first;
    NaN counts as smallest)."""
    k = min(k, values.shape[1])
    if k == 0:
        return np.zeros((values.shape[0], 0), dtype=np.int64)
    key = np.where(np.isnan(values), -np.inf, values)
    if k < values.shape[1]:
        part = np.argpartition(-key, k - 1, axis=1)[:, :k]
        # the k-th value may tie with columns left out: take every column reaching it, in column order
        kth = np.take_along_axis(key, part, axis=1).min(axis=1)
        reach = key >= kth[:, None]
        if int(reach.sum(axis=1).max()) > k:
            cols = np.argsort(~reach, axis=1, kind="stable")[:, : int(reach.sum(axis=1).max())]
            part = cols
        part = np.sort(part, axis=1)
    else:
        part = np.broadcast_to(np.arange(values.shape[1]), values.shape)
    sub = np.take_along_axis(key, part, axis=1)
    order = np.argsort(-sub, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(part, order, axis=1)


def topk_rows(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values, ids)`` of each row's ``k`` largest entries, best first (ties: lower id first).

    On large float32 rows the ``k``-th largest maximum of disjoint groups of
    entries bounds the row's ``k``-th largest entry from below, so one
    folding pass (:func:`group_max`) finds the few entries that can be in the
    top ``k`` and only those are ordered. Rows with NaN or fewer than ``k``
    finite entries are ordered whole.
    """
    k = min(int(k), x.shape[1])
    if groupable(x, k):
        found = at_kth_floor(x, group_max(x), k)
        if found is not None:
            answered, owner, cols = found
            values, ids, _ = compact(owner, cols, x[owner, cols], x.shape[0], NEG_INF)
            if values.shape[1] < k:
                values = np.pad(values, ((0, 0), (0, k - values.shape[1])), constant_values=NEG_INF)
                ids = np.pad(ids, ((0, 0), (0, k - ids.shape[1])))
            order = top_order(values, k)
            ids = np.take_along_axis(ids, order, axis=1)
            if not answered.all():
                rest = np.nonzero(~answered)[0]
                ids[rest] = top_order(x[rest], k)
            return np.take_along_axis(x, ids, axis=1), ids
    ids = top_order(x, k)
    return np.take_along_axis(x, ids, axis=1), ids


_POOL: ThreadPoolExecutor | None = None
#: Threads a query reads blocks on: the passes are memory-bound, so more cores add little speed and
#: one block (about 16 MiB per stage) of memory each.
MAX_WORKERS = 4


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(
            max_workers=max(1, min(MAX_WORKERS, os.cpu_count() or 1)), thread_name_prefix="logitscope-rows"
        )
    return _POOL


def map_blocks(work: Callable[[int], T], count: int) -> list[T]:
    """``[work(0), ..., work(count - 1)]``, run on a small thread pool (a worker per core, at most four) when there are
    several; the first error is raised. Each call should hold at most one block of rows beyond its input."""
    if count <= 1 or (os.cpu_count() or 1) == 1:
        return [work(i) for i in range(count)]
    return list(_pool().map(work, range(count)))
