"""Statistics of each recorded row, computed on the row's device as it is recorded (torch, any device).

Per stage and row the recorder keeps a few values beside (or instead of) the
row itself, so that every storage mode answers the per-step statistics
exactly: :func:`row_stats` (log-sum-exp, allowed count, maximum, entropy, NaN
count, EOS probability, and against the natural row the removed mass and
margin), :func:`chosen_stats` once the chosen token is known (its logit,
probability and rank), and :func:`summarise_topk` for top-k storage. A
half-precision row is stored minus its largest logit (:func:`offset_rows`)
with the log-sum-exp of its rounded values (:func:`stored_lse`), which its
probabilities are read with; its statistics are the full row's.

These run once per recorded stage and step. None of them synchronises with
the device: whole-row kernels whose small results are copied to the host
with the rows (on a CPU, numpy passes on the row itself). The read side
(:mod:`tracker.reading.block`, :mod:`tracker.reading.analysis`) reads the packed values
by the names in :data:`ROW_STATS` and :data:`CHOSEN_STATS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tracker.reading.rows import (
    EXP_FLOOR,
    GROUP,
    NEG_INF,
    exp_floor,
    group_max,
    logsumexp_rows,
    masked,
    probabilities,
)

try:
    from tracker.recording import _rowstats
except ImportError:  # built without a C compiler: numpy passes (the same statistics within float32 rounding)
    _rowstats = None

__all__ = ["CHOSEN_STATS", "ROW_STATS", "chosen_stats", "offset_rows", "pair_stats", "probability", "row_stats"]
__all__ += ["stored_lse"]
__all__ += ["eos_on", "group_maxima", "stage_stats", "summarise_topk"]

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
    """:func:`row_stats` on the CPU, on one thread, for rows without NaN or ``+inf``: two passes a row in
    the ``_rowstats`` extension, else numpy passes; the general kernels for the other rows."""
    rows = x.detach().float().numpy()
    fused = _fused_row_stats(rows)
    if fused is not None:
        top, lse, entropy, allowed, plain = fused
    else:
        top = rows.max(axis=1)  # NaN where a row holds NaN, +inf where it holds +inf: both special
        plain = np.isfinite(top) | (top == NEG_INF)
    if not plain.all():
        out = torch.empty(rows.shape[0], len(ROW_STATS))
        special = torch.from_numpy(np.nonzero(~plain)[0])
        out[special] = _row_stats_general(x[special], eos, None if natural is None else natural[special])
        if plain.any():
            keep = torch.from_numpy(np.nonzero(plain)[0])
            out[keep] = _row_stats_cpu(x[keep], eos, None if natural is None else natural[keep])
        return out
    if fused is None:
        nothing = top == NEG_INF
        shift = np.where(nothing, 0.0, top).astype(np.float32)
        z = rows - shift[:, None]
        np.maximum(z, exp_floor(z.shape[1]), out=z)
        e = np.exp(z)
        total = e.sum(axis=1, dtype=np.float32)
        log_total = np.log(total)
        entropy = log_total - np.einsum("ij,ij->i", e, z) / total
        allowed = rows.shape[1] - np.count_nonzero(rows == NEG_INF, axis=1)
        lse = np.where(nothing, NEG_INF, shift + log_total)
        entropy = np.where(nothing, np.nan, entropy)
    if eos is not None and eos.numel():
        p_eos = probabilities(rows[:, eos.numpy()], lse[:, None]).sum(axis=1)  # a masked EOS weighs 0
    else:
        p_eos = np.full(rows.shape[0], np.nan)
    if natural is not None:
        removed, margin = _pair_stats_cpu(natural, x)
    else:
        removed = margin = np.full(rows.shape[0], np.nan)
    nan = np.zeros(rows.shape[0])
    packed = np.stack([lse, allowed, top, entropy, nan, p_eos, removed, margin], axis=1).astype(np.float32)
    return torch.from_numpy(packed)


def _fused_row_stats(
    rows: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(max, lse, entropy, allowed, plain)`` of float32 ``rows [B, V]`` from the ``_rowstats`` extension
    (two passes a row, on this thread); None where it was not built. ``plain`` is False for a row holding
    NaN or ``+inf``, whose other values are then unset. Does not synchronise (host arrays)."""
    if _rowstats is None or rows.ndim != 2 or rows.shape[1] == 0:
        return None
    out = np.empty((rows.shape[0], 5), dtype=np.float32)
    _rowstats.row_stats(np.ascontiguousarray(rows), out)
    return out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, 4] == 0


def _pair_stats_cpu(natural: torch.Tensor, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pair_stats` on one thread when the natural rows hold no NaN or ``+inf`` (and ``x`` no NaN):
    two passes a row pair in the ``_rowstats`` extension, else numpy passes."""
    nat = natural.detach().float().numpy()
    if _rowstats is not None and nat.ndim == 2 and nat.shape[1]:
        out = np.empty((nat.shape[0], 3), dtype=np.float32)
        _rowstats.pair_stats(np.ascontiguousarray(nat), np.ascontiguousarray(x.detach().float().numpy()), out)
        if not out[:, 2].any():
            return out[:, 0], out[:, 1]
    with np.errstate(invalid="ignore", over="ignore"):
        sums = nat.sum(axis=1)
    if not (np.isfinite(sums) | (sums == NEG_INF)).all():
        removed, margin = pair_stats(natural, x)
        return removed.numpy(), margin.numpy()
    kept = masked(nat, x.detach().float().numpy())  # natural where x allows the token, -inf where it masked it
    gone = np.where(kept == NEG_INF, nat, NEG_INF)  # natural where x masked the token: summed directly, not 1 - kept
    with np.errstate(invalid="ignore"):  # a natural row with nothing allowed: -inf - -inf, as pair_stats gives
        removed = np.clip(np.exp(logsumexp_rows(gone) - logsumexp_rows(nat)), 0.0, 1.0)
        margin = nat.max(axis=1) - kept.max(axis=1)
    return np.nan_to_num(removed, nan=0.0), margin


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
    range) it is ``exact``. ``nan_free``: the rows hold no NaN (known on the host: two passes fewer, the
    same values). Kernels on the rows' device; no synchronisation.
    """
    rounded = kept.to(device=exact.device, dtype=torch.float32)
    if rounded.device.type == "cpu":  # on one thread: the extension's two passes, else numpy's
        values = rounded.numpy()
        if not nan_free:
            values = np.where(np.isnan(values), NEG_INF, values)
        fused = _fused_row_stats(values)
        if fused is not None and fused[4].all():
            lse = torch.from_numpy(fused[1].copy())
        else:
            lse = torch.from_numpy(logsumexp_rows(values))
    else:
        if not nan_free:
            rounded = rounded.masked_fill(torch.isnan(rounded), NEG_INF)
        lse = torch.logsumexp(rounded, dim=1)
    return torch.where(torch.isfinite(lse) & torch.isfinite(exact), lse, exact)


def offset_rows(
    x: torch.Tensor, eos: torch.Tensor | None, natural: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stats, offset)``: :func:`row_stats` of rows ``x`` and the offset half-precision storage subtracts
    from each row before rounding: its largest logit (0 where that is not finite). Stored as ``x - offset``,
    the best logits lie near 0, where float16 and bfloat16 are finest; the run's ``{stage}_max`` column
    gives the offset back (:data:`tracker.format.schema.FIELD_OFFSET`). No synchronisation."""
    stats = row_stats(x, eos, natural)
    top = stats[:, 2]
    return stats, torch.where(torch.isfinite(top), top, torch.zeros_like(top))


def stage_stats(
    x: torch.Tensor,
    eos: torch.Tensor | None,
    natural: torch.Tensor | None,
    kept: torch.Tensor | None,
    stats: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stats, stored)``: :func:`row_stats` of rows ``x`` (or ``stats``, already computed), and the values
    stored beside them: the same, but for rows kept in half precision (``kept``, the converted rows, stored
    minus ``offset`` when given) their own log-sum-exp (:func:`stored_lse`). No synchronisation."""
    stats = row_stats(x, eos, natural) if stats is None else stats
    if kept is None:
        return stats, stats
    stored = stats.clone()
    nan_free = stats.device.type == "cpu" and not bool(stats[:, 4].any())  # a host value only on the CPU
    if offset is None:
        stored[:, 0] = stored_lse(kept, stats[:, 0], nan_free)
    else:
        offset = offset.to(stats.device)
        stored[:, 0] = stored_lse(kept, stats[:, 0] - offset, nan_free) + offset
    return stats, stored


def chosen_stats(x: torch.Tensor, chosen: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """``[B, 3]`` float32: the chosen token's logit, probability and rank (0 = best) in rows ``x``.

    ``stats`` are the rows' :func:`row_stats`; ``chosen`` holds one id per
    row (out-of-range ids give NaN). Same device as ``x``, no synchronisation.
    """
    if x.device.type == "cpu" and stats.device.type == "cpu" and chosen.device.type == "cpu":
        return _chosen_stats_cpu(x, chosen, stats)
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


def _chosen_stats_cpu(x: torch.Tensor, chosen: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """:func:`chosen_stats` of CPU rows in a few numpy operations on one thread (the torch spelling costs
    a dispatch per small operation, more than the row's one counting pass at 32k tokens)."""
    rows = x.detach().numpy() if x.dtype in (torch.float32, torch.float16) else x.detach().float().numpy()
    ids = chosen.detach().reshape(-1).to(torch.int64).numpy()
    packed = stats.detach().numpy()
    b, vocab = rows.shape
    valid = (ids >= 0) & (ids < vocab)
    value = rows[np.arange(b), np.clip(ids, 0, vocab - 1)].astype(np.float32)
    value[np.isnan(value)] = NEG_INF  # a NaN entry weighs 0: it ranks after every allowed token
    rank = np.count_nonzero(rows > value.astype(rows.dtype)[:, None], axis=1).astype(np.float32)
    lse, allowed = packed[:, 0], packed[:, 1]
    one_hot = lse == math.inf  # a row holding +inf: a one-hot on its +inf tokens, every other token after them
    rank = np.where(one_hot, np.where(value == math.inf, 0.0, allowed), rank)
    with np.errstate(invalid="ignore", over="ignore"):
        prob = np.exp(value - lse)
        prob = np.where(one_hot, (value == math.inf) / np.maximum(allowed, 1), prob)
    out = np.stack([value, np.nan_to_num(prob, nan=0.0), rank], axis=1).astype(np.float32)
    out[~valid] = math.nan
    return torch.from_numpy(out)


def summarise_topk(x: torch.Tensor, k: int, natural: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Top-k storage of rows ``x [B, V]`` on their device: the ``k`` largest logits and their ids.

    NaN entries are never selected (they count as ``-inf``). ``natural`` (the
    rows before the processor) gives the natural logits at the same ids, so a
    constrained top-k row still knows what the model wanted. No synchronisation.
    """
    x = x.float()
    x = x.masked_fill(torch.isnan(x), float("-inf"))
    values, ids = torch.topk(x, k, dim=1)
    out = {"ids": ids.to(torch.int32), "logits": values}
    if natural is not None:
        out["natural"] = natural.float().gather(1, ids)
    return out


def group_maxima(x: torch.Tensor) -> torch.Tensor:
    """``[B, V // 16]`` group maxima of rows ``x`` on their device, as :func:`tracker.reading.rows.group_max`
    folds them (a group holding NaN has a NaN maximum). Kernels only: no host read, no synchronisation."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(group_max(x.numpy()))  # numpy's fold of contiguous slabs beats torch's here
    b, v = x.shape
    groups = v // GROUP
    return x[:, : groups * GROUP].reshape(b, GROUP, groups).amax(dim=1)
