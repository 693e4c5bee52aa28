"""Statistics of each recorded row, computed on the row's device as it is recorded (torch, any device).

Per stage and row the recorder keeps a few values beside (or instead of) the
row itself, so that every storage mode answers the per-step statistics
exactly: :func:`row_stats` (log-sum-exp, allowed count, maximum, entropy, NaN
count, EOS probability, and against the natural row the removed mass and
margin), :func:`chosen_stats` once the chosen token is known (its logit,
probability and rank), and :func:`top_k` for top-k storage. A
half-precision row is stored minus its largest logit (:func:`offset_rows`)
with the log-sum-exp of its rounded values (:func:`stored_lse`), which its
probabilities are read with; its statistics are the full row's.

These run once per recorded stage and step, over the batch's rows at once. None
of them synchronises with an accelerator: batched kernels whose small results
are copied to the host with the rows (on a GPU with Triton, one kernel each:
:mod:`.stats_triton`; on a CPU, the ``_rowstats`` extension's two passes a row,
where it is built; elsewhere torch's kernels, the reference both are tested against). The read side
(:mod:`tracker.reading.block`, :mod:`tracker.reading.analysis`) reads the packed values
by the names in :data:`ROW_STATS` and :data:`CHOSEN_STATS`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tracker.reading.rows import EXP_FLOOR, NEG_INF

try:
    from tracker.recording import _rowstats
except ImportError:  # built without a C compiler: torch's kernels (the same statistics within float32 rounding)
    _rowstats = None

# torch's CPU exp and log (MKL VML) may give values 6e-5 off on their first call in a process when two threads
# share it (pytorch/pytorch#188792, torch 2.13: torch.exp of 4 x 5,000 floats off in 5 fresh processes of 40,
# in none after this import; exact from the second call on): called once here, so that no recorded statistic
# is the first call's.
for _op in (torch.exp, torch.log):
    _op(torch.zeros(1 << 16))

__all__ = ["CHOSEN_STATS", "ROW_STATS", "chosen_stats", "eos_on", "offset_rows", "pair_stats", "probability"]
__all__ += ["half_rows", "row_stats", "stored_lse", "top_k"]

#: Order of the values :func:`row_stats` packs per row (the schema's statistics columns up to the margin).
ROW_STATS = ("lse", "allowed", "max", "entropy", "nan", "p_eos", "removed_mass", "margin")
#: Order of the values :func:`chosen_stats` packs per row.
CHOSEN_STATS = ("chosen_logit", "p_chosen", "rank_chosen")


def eos_on(cache: dict[Any, torch.Tensor], ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor | None:
    """The EOS ``ids`` inside the vocabulary, on ``device``: copied there once and kept in ``cache``
    (a host-to-device copy; no synchronisation). None without EOS ids."""
    if not ids:
        return None
    key = (device, tuple(ids), vocab)
    eos = cache.get(key)
    if eos is None:
        eos = cache[key] = torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.int64).to(device)
    return eos


def _kernels(x: torch.Tensor) -> Any:
    """:mod:`.stats_triton` where its kernels run on ``x`` (a GPU with Triton; imported on first use), else None."""
    if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    from tracker.recording import stats_triton

    return stats_triton if stats_triton.kernel_ready(x) else None


def probability(logit: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``exp(logit - lse)`` with the record's rules: NaN entries weigh 0, a ``+inf`` row is a one-hot.

    ``lse`` and ``allowed`` broadcast against ``logit`` (a ``+inf`` row has
    ``lse = +inf`` and ``allowed`` = its count of ``+inf`` tokens). Kernels
    on the inputs' device; no synchronisation.
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
    if (kernels := _kernels(x)) is not None and (found := kernels.row_stats(x, eos, natural)) is not None:
        return found
    if x.device.type == "cpu" and _rowstats is not None and x.shape[1]:
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
    z = (xs - shift[:, None]).clamp_(min=EXP_FLOOR)
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
    """:func:`row_stats` of CPU rows through the ``_rowstats`` extension (two passes a row, on one thread, and
    the statistics packed in place: torch's CPU kernels cost a pass per statistic, and a dispatch per small
    operation); rows holding NaN or ``+inf`` take the general kernels."""
    rows = np.ascontiguousarray(x.detach().float().numpy())
    packed = np.empty((rows.shape[0], len(ROW_STATS)), dtype=np.float32)
    ids = np.ascontiguousarray(eos.numpy().reshape(1, -1)) if eos is not None and eos.numel() else None
    if _rowstats.row_stats(rows, ids, packed):  # rows holding NaN or +inf (a count: numpy's any() cost 10 µs)
        special = (packed[:, 4] != 0) | (packed[:, 2] == math.inf)
        out = torch.from_numpy(packed)
        some = torch.from_numpy(np.flatnonzero(special))
        out[some] = _row_stats_general(x[some], eos, None if natural is None else natural[some])
        if natural is not None and not special.all():
            keep = torch.from_numpy(np.flatnonzero(~special))
            out[keep] = _row_stats_cpu(x[keep], eos, natural[keep])
        return out
    if natural is not None:
        nat = np.ascontiguousarray(natural.detach().float().numpy())
        pair = np.empty((nat.shape[0], 3), dtype=np.float32)
        _rowstats.pair_stats(nat, rows, pair)
        if pair[:, 2].any():  # a natural row holding NaN or +inf
            removed, margin = pair_stats(natural, x)
            packed[:, 6], packed[:, 7] = removed.numpy(), margin.numpy()
        else:
            packed[:, 6:8] = pair[:, :2]
    return torch.from_numpy(packed)


def pair_stats(natural: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(removed_mass, margin)`` of a stage ``x`` against ``natural`` (both ``[B, V]``, any device).

    ``removed_mass``: natural probability of the tokens ``x`` masked (``-inf``
    or NaN), summed over those tokens (not 1 minus what is kept, which
    rounds a mass below 1e-7 to 0); ``margin``: the best natural logit minus
    the best natural logit ``x`` still allows (``inf`` when it allows
    nothing). A natural row holding ``+inf`` counts as a one-hot on its
    ``+inf`` tokens. Whole-row kernels on the rows' device; no synchronisation.
    """
    nat = natural.float()
    nat = nat.masked_fill(torch.isnan(nat), NEG_INF)
    posinf = torch.isposinf(nat)  # a natural row holding +inf is a one-hot on its +inf tokens
    nat = torch.where(posinf.any(dim=1, keepdim=True), torch.where(posinf, 0.0, NEG_INF), nat)
    allowed = x > NEG_INF
    kept, gone = nat.masked_fill(~allowed, NEG_INF), nat.masked_fill(allowed, NEG_INF)
    removed = torch.exp(torch.logsumexp(gone, dim=1) - torch.logsumexp(nat, dim=1)).clamp_(0.0, 1.0)
    margin = nat.amax(dim=1) - kept.amax(dim=1)
    return torch.nan_to_num(removed, nan=0.0), margin


def stored_lse(kept: torch.Tensor, exact: torch.Tensor, nan_free: bool = False) -> torch.Tensor:
    """``[B]`` log-sum-exp of rows as stored (``kept``: float16 or bfloat16), NaN entries left out.

    It normalises the probabilities a query reads off the stored rows, so that
    they sum to 1 (with the full row's ``exact`` log-sum-exp, a rounded-up
    best logit would read as a probability above 1). Where it or ``exact`` is
    not finite (nothing allowed, a ``+inf`` row, a logit past float16's
    range) it is ``exact``. ``nan_free``: the rows hold no NaN (two passes fewer, the
    same values). Kernels on the rows' device; no synchronisation.
    """
    rounded = kept.to(device=exact.device, dtype=torch.float32)
    if not nan_free:
        rounded = rounded.masked_fill(torch.isnan(rounded), NEG_INF)
    lse = torch.logsumexp(rounded, dim=1)
    return torch.where(torch.isfinite(lse) & torch.isfinite(exact), lse, exact)


def half_rows(x: torch.Tensor, stats: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> tuple:
    """``(kept, stored)``: rows ``x`` minus ``offset`` (:func:`offset_rows`) rounded to ``dtype`` (float16 or
    bfloat16), and their statistics ``stats`` with the log-sum-exp of the rounded rows (:func:`stored_lse`).

    CPU rows without NaN or ``+inf`` take one call of the extension (the rounding, torch's to nearest even
    bit for bit, and the sum in one pass: a float16 store of 64 rows of 1,079 logits took 445 µs through
    torch's conversion and a second statistics pass, 218 µs so); other rows, torch's kernels on their device.
    No synchronisation with an accelerator (host values are read only for CPU rows).
    """
    if x.device.type == "cpu" and _rowstats is not None and x.shape[1] and dtype in _HALF_KINDS:
        found, off = stats.numpy(), offset.numpy()
        rows = np.ascontiguousarray(x.detach().float().numpy())
        kept = torch.empty(rows.shape, dtype=dtype)
        lse = np.empty((rows.shape[0], 1), dtype=np.float32)
        odd = _rowstats.half_rows(rows, off.reshape(-1, 1), kept.view(torch.int16).numpy(), lse, _HALF_KINDS[dtype])
        if not odd:  # rows holding NaN or +inf take the general kernels
            exact, lse = found[:, 0] - off, lse[:, 0]
            stored = found.copy()
            stored[:, 0] = np.where(np.isfinite(lse) & np.isfinite(exact), lse, exact) + off
            return kept, torch.from_numpy(stored)
    if (kernels := _kernels(x)) is not None and (rounded := kernels.half_rows(x, stats, offset, dtype)) is not None:
        return rounded
    exact = stats[:, 0] - offset
    kept = (x.float() - offset[:, None]).to(dtype)
    stored = stats.clone()
    nan_free = stats.device.type == "cpu" and not bool(stats[:, 4].any())  # a host value only on the CPU
    stored[:, 0] = stored_lse(kept, exact, nan_free) + offset
    return kept, stored


#: The extension's rounding of each half-precision type (float16 where the CPU converts it: F16C).
_HALF_KINDS = {torch.bfloat16: 1, **({torch.float16: 0} if getattr(_rowstats, "FLOAT16", 0) else {})}


def offset_rows(
    x: torch.Tensor, eos: torch.Tensor | None, natural: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stats, offset)``: :func:`row_stats` of rows ``x`` and the offset half-precision storage subtracts
    from each row before rounding: its largest logit (0 where that is not finite). Stored as ``x - offset``,
    the best logits lie near 0, where float16 and bfloat16 are finest; the run's ``{stage}_max`` column
    gives the offset back (:data:`tracker.format.schema.FIELD_OFFSET`). No synchronisation."""
    stats = row_stats(x, eos, natural)
    if stats.device.type == "cpu":  # numpy: a dispatch per small operation fewer
        top = stats[:, 2].numpy()
        return stats, torch.from_numpy(np.where(np.isfinite(top), top, np.float32(0)))
    top = stats[:, 2]
    return stats, torch.where(torch.isfinite(top), top, torch.zeros_like(top))


def chosen_stats(
    x: torch.Tensor, chosen: torch.Tensor, stats: torch.Tensor, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, 3]`` float32: the chosen token's logit, probability and rank (0 = best) in rows ``x``.

    ``stats`` are the rows' :func:`row_stats`; ``chosen`` holds one id per
    row (out-of-range ids give NaN). ``kept``: the rows' largest values, largest first (top-k storage's): where
    the chosen token's value is at least the last of them, its rank is counted among them, not over the row
    (no entry outside them is larger). Same device as ``x``, no synchronisation.
    """
    cpu = x.device.type == "cpu" and stats.device.type == "cpu" and chosen.device.type == "cpu"
    if (kernels := _kernels(x)) is not None and (found := kernels.chosen_stats(x, chosen, stats)) is not None:
        return found
    if cpu and _rowstats is not None and x.shape[1]:
        return _chosen_stats_cpu(x, chosen, stats, kept)
    return _chosen_stats_general(x, chosen, stats)


def _chosen_stats_general(x: torch.Tensor, chosen: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """:func:`chosen_stats` with torch kernels, for any device."""
    vocab = x.shape[1]
    ids = chosen.reshape(-1, 1).to(device=x.device, dtype=torch.int64)
    valid = (ids[:, 0] >= 0) & (ids[:, 0] < vocab)
    value = x.gather(1, ids.clamp(0, vocab - 1))
    value = value.masked_fill(torch.isnan(value), NEG_INF)  # a NaN entry weighs 0: it ranks after every allowed token
    rank = (x > value).sum(dim=1, dtype=torch.float32)
    # in a row holding +inf (a one-hot on its +inf tokens) every other token ranks after those
    one_hot = stats[:, 0] == math.inf
    rank = torch.where(one_hot, torch.where(value[:, 0] == math.inf, 0.0, stats[:, 1]), rank.to(stats.device))
    logit = value[:, 0].float()
    prob = probability(logit, stats[:, 0], stats[:, 1])
    out = torch.stack([logit, prob, rank], dim=1)
    return out.masked_fill(~valid[:, None], math.nan)


def _chosen_stats_cpu(
    x: torch.Tensor, chosen: torch.Tensor, stats: torch.Tensor, kept: torch.Tensor | None
) -> torch.Tensor:
    """:func:`chosen_stats` of CPU rows in one call of the extension (a counting pass where the rank is not
    found among ``kept``): in an engine's step the torch or numpy spelling cost a dispatch per small operation,
    more than the whole row's pass at 1k tokens."""
    rows = np.ascontiguousarray(x.detach().float().numpy())
    ids = np.ascontiguousarray(chosen.detach().reshape(-1, 1).to(torch.int64).numpy())
    top = None
    if kept is not None and kept.shape[0] == rows.shape[0] and kept.shape[1]:
        top = np.ascontiguousarray(kept.detach().float().numpy())
    out = np.empty((rows.shape[0], 3), dtype=np.float32)
    _rowstats.chosen_stats(rows, ids, np.ascontiguousarray(stats.detach().float().numpy()), top, out)
    return torch.from_numpy(out)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)``: the ``k`` largest entries of each row of ``x [n, V]`` (float32, int64), NaN never chosen.

    On a CPU the ``_rowstats`` extension keeps each row's best ``k`` in a sorted buffer in one pass after a
    pass for a floor (ties: the lower id first); elsewhere (and without the extension) ``torch.topk`` of the
    row with NaN as ``-inf``. The values are exact; among tied values the ids kept may differ from
    ``torch.topk``'s. Kernels on the rows' device; on a CPU it reads host values (no device to wait for).
    """
    x = x.float()
    n = x.shape[0]
    if x.device.type == "cpu" and _rowstats is not None and n:
        values, ids = np.empty((n, k), dtype=np.float32), np.empty((n, k), dtype=np.int64)
        _rowstats.top_k(np.ascontiguousarray(x.numpy()), values, ids)
        return torch.from_numpy(values), torch.from_numpy(ids)
    return _top_k_general(x, k)


def _top_k_general(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k` by ``torch.topk`` over whole rows, NaN as ``-inf``. Kernels only: no synchronisation."""
    values, ids = torch.topk(x.masked_fill(torch.isnan(x), NEG_INF), k, dim=1)
    return values, ids
