"""The sampling maths, as plain functions over batches of rows.

All functions work on whole ``[B, V]`` tensors with per-row parameters given
as Python scalars or ``[B]`` tensors; none loops over rows or tokens.

**The order.** Tokens are ranked by descending weight (logit or probability),
ties broken by lower token id. Every filter keeps a prefix of that order:

- top-k keeps exactly ``k`` tokens: the first ``k`` of the order (so among
  tokens tied at the boundary, the lower ids are kept);
- top-p keeps token ``t`` iff the mass of the tokens strictly before ``t`` is
  ``< top_p`` (the smallest prefix whose mass is ``>= top_p``);
- min-p keeps every token with ``p >= min_p * max(p)`` (ties all kept).

A token is drawn by inverting the CDF **in that order** at the row's uniform
number ``u``: the token ``t`` with ``before(t) <= u * M < before(t) + p(t)``,
``M`` the mass kept. So every path (fused or not, partial selection or not)
maps the same ``u`` to the same token, up to float rounding at a boundary.

**Algorithms** (:data:`Algorithm`; compared in ``docs/sampling-algorithms.md``).
``"cpu"`` reads the device where that is cheapest on a CPU: the radix select
of :func:`mass_crossing` (three histograms of mass over the float bits, no
sort) gathers one bucket's tokens with ``nonzero``, :func:`top_k_candidates`
checks for ties across its boundary, and a per-row top-k tensor is read for
its largest value. ``"sort"`` and ``"radix"`` are sync-free (no ``nonzero``,
``item``, ``bool(tensor)`` or data-dependent shape): top-k takes
:func:`sync_free_candidates` and finds the sampled id afterwards with
:func:`nth_equal_scan`; without a top-k ``"sort"`` sorts the row,
``"radix"`` histograms the whole row under a mask and ``"pivot"`` bisects
on the weight (:mod:`sampling.pipe.pivot`: 31 masked sums per row, no sort).

**Synchronisation.** A function here does not synchronise unless its
docstring says so; those that take ``sync_free`` then do not.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

import sampling.pipe.pivot as P

Param = float | int | torch.Tensor
"""A runtime parameter: one value for every row, or a ``[B]`` tensor."""

Algorithm = Literal["auto", "cpu", "sort", "radix", "pivot"]
"""How a pipe finds cuts and samples (see the module docstring); ``"auto"`` picks by device and batch size."""

ALGORITHMS: tuple[str, ...] = ("auto", "cpu", "sort", "radix", "pivot")


def resolve_algorithm(algorithm: str, device: torch.device) -> str:
    """The algorithm that runs on ``device``: ``"auto"`` picks ``"cpu"`` on a CPU, ``"sort"`` elsewhere.

    It never picks ``"pivot"``: on an H200 (``docs/performance.md``, the
    GPU proof) one sort beat the pivot search's Triton kernel at every point of the grid, 1 to 256 rows of
    32k and 128k tokens (top-p at 32 x 128k: 0.82 ms against 6.6 ms).
    """
    if algorithm != "auto":
        return algorithm
    return "cpu" if device.type == "cpu" else "sort"


_LEVELS = ((20, 11), (10, 10), (0, 10))  # (shift, width) of the three radix levels over 31 bits
_BLOCK = 256  # block length for locating the n-th equal token without a full cumsum
_TINY = 1e-300  # below any float32 mass: "at least one bucket with mass"
SORT_BELOW = 2048
"""Vocabularies smaller than this are sampled from the sorted row (histograms of 2048 buckets would cost more)."""


class Crossing(NamedTuple):
    """Where the running mass (in the order of the module docstring) crosses a target.

    ``value`` is the weight of the token at the crossing, ``above`` the mass of
    all tokens with a larger weight, ``ties`` how many tokens have weight
    ``value``, ``target`` the target mass and ``total`` the total mass of the
    row (both in the units of the weights given).
    """

    value: torch.Tensor  # float32 [B]
    above: torch.Tensor  # float64 [B]
    ties: torch.Tensor  # int64 [B]
    target: torch.Tensor  # float64 [B]
    total: torch.Tensor  # float64 [B]


class Cut(NamedTuple):
    """A prefix of the order: tokens with weight > ``value``, then the first ``count`` (by id) equal to it.

    ``mass`` is the prefix's mass in the units of the weights; NaN means "the
    whole row of (possibly masked) weights", to be read off the next histogram.
    """

    value: torch.Tensor  # float32 [B]
    count: torch.Tensor  # int64 [B]
    mass: torch.Tensor  # float64 [B]


def as_column(value: Param, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | float | int:
    """A per-row parameter shaped ``[B, 1]`` to broadcast against ``[B, V]``; scalars stay scalars."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=dtype or like.dtype).reshape(-1, 1)
    return value


# --------------------------------------------------------------------------- top-k


def top_k_candidates(x: torch.Tensor, width: int, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``width`` tokens of the order, as ``(values, ids)`` sorted by (value desc, id asc).

    ``x`` holds logits (``floor=-inf``) or probabilities (``floor=0``). Uses
    ``torch.topk`` (a partial selection); only rows where tokens of positive
    mass tie across the boundary are re-selected with a stable sort, so the
    lower ids win as the tie rule says. NaN ranks first (``torch.topk``'s
    rule), so a row holding NaN is caught downstream as a dead row.
    Synchronises: reads whether values tie.
    """
    vocab = x.shape[-1]
    if width >= vocab:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    values, ids = torch.topk(x, width + 1, dim=-1)
    if not bool((values.diff(dim=-1) == 0).any()):  # no ties at all: the common case, one check
        return values[:, :width], ids[:, :width]
    boundary = (values[:, width - 1] == values[:, width]) & (values[:, width - 1] > floor)
    if bool(boundary.any()):
        rows = boundary.nonzero().squeeze(1)
        exact_values, exact_ids = torch.sort(x.index_select(0, rows), dim=-1, descending=True, stable=True)
        values = values.index_copy(0, rows, exact_values[:, : width + 1])
        ids = ids.index_copy(0, rows, exact_ids[:, : width + 1])
    values, ids = values[:, :width], ids[:, :width]
    ids, order = ids.sort(dim=-1)  # order ties inside the candidates by id
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    return values, ids


def top_k_column(
    k: Param, batch: int, vocab: int, device: torch.device, bound: int | None = None, sync_free: bool = False
) -> tuple[int, torch.Tensor | None]:
    """``(width, k)``: how many candidates to select, and per-row ``k`` as ``[B, 1]`` (0 means all) if a tensor.

    For a tensor ``k`` the width is ``bound`` when given (a host-side upper
    bound of the tensor's values; larger values are cut to it, unchecked);
    else the tensor's largest value, read from the device, or the whole
    vocabulary when ``sync_free`` (no read). Synchronises only then.
    """
    if isinstance(k, torch.Tensor):
        column = k.to(device=device, dtype=torch.long).reshape(-1, 1).expand(batch, 1)
        column = torch.where(column > 0, column, vocab).clamp(max=vocab)
        if bound is not None:
            width = min(bound, vocab)
            return width, column.clamp(max=width)
        return (vocab if sync_free else int(column.max())), column
    return (min(int(k), vocab) if k > 0 else vocab), None


def sync_free_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The first ``width`` values of the order without reading the device: ``(values, ids, exact)``.

    ``values`` are exact; ``ids`` follow the tie rule only when ``exact``
    (the whole row, sorted stably). Otherwise they come from ``torch.topk``,
    which may return any of tied tokens: resolve a chosen position with
    :func:`nth_equal_scan`.
    """
    if width >= x.shape[-1]:
        values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return values, ids, True
    values, ids = torch.topk(x, width, dim=-1)
    return values, ids, False


def nth_equal_scan(x: torch.Tensor, value: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the id of the ``n``-th (0-based, by id) token of each row equal to ``value`` (``[B, 1]``).

    One scan over the row (fewer kernels than :func:`nth_equal`'s blocks); no
    sync. A row without such a token gets the last id (its row is dead).
    """
    running = (x == value).cumsum(-1, dtype=torch.int32)
    at = torch.searchsorted(running, n.to(torch.int32), right=True)
    return at.clamp_(max=x.shape[-1] - 1)


# --------------------------------------------------------------------------- radix select on mass


class Radix(NamedTuple):
    """What every mass crossing over one weights tensor shares: bucket keys and float64 masses."""

    keys: torch.Tensor  # int64 [B, V]: the top 11 bits of each weight (ordered like the weights)
    masses: torch.Tensor  # float64 [B, V]: the weights, summed in float64 (float32 sums drift by 1e-4)


def radix(w: torch.Tensor) -> Radix:
    """The shared part of the crossings over ``w`` (non-negative float32 ``[B, V]``), computed once.

    Keys are int64 because ``scatter_add_`` converts any other index type on
    every call.
    """
    bits = w.contiguous().view(torch.int32)
    keys = ((bits >> _LEVELS[0][0]) & ((1 << _LEVELS[0][1]) - 1)).long()
    return Radix(keys, w.double())


def _top_down(hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buckets from the highest value down, and their running mass (index ``i`` is bucket ``size - 1 - i``)."""
    top_down = hist.flip(-1)
    return top_down, top_down.cumsum(-1)


def _select(
    top_down: torch.Tensor, running: torch.Tensor, above: torch.Tensor, target: torch.Tensor, inclusive: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bucket where the mass, summed from the top bucket down, crosses ``target``.

    Returns ``(bucket, mass above it, mass in it)``. The chosen bucket always
    holds mass: a target of 0 takes the highest bucket with mass, and when
    rounding leaves no crossing, the lowest bucket with mass.
    """
    need = (target - above)[:, None].clamp(min=_TINY if inclusive else 0.0)
    i = torch.searchsorted(running, need, right=not inclusive)
    i = torch.minimum(i, running.argmax(-1, keepdim=True))  # argmax: where the running mass stops growing
    in_bucket = top_down.gather(1, i)
    new_above = above + (running.gather(1, i) - in_bucket).squeeze(1)
    return (top_down.shape[-1] - 1 - i).squeeze(1), new_above, in_bucket.squeeze(1)


def mass_crossing(
    w: torch.Tensor,
    fraction: torch.Tensor | float,
    of_mass: torch.Tensor | None = None,
    *,
    inclusive: bool,
    shared: Radix | None = None,
    sync_free: bool = False,
    pivot: bool = False,
) -> Crossing:
    """Find the token at which the running mass of ``w`` crosses ``fraction * of_mass``.

    ``w``: float32 ``[B, V]`` non-negative weights (need not sum to 1).
    ``of_mass``: ``[B]`` float64; NaN or ``None`` means the row's total.
    ``inclusive=True`` finds the last token of the smallest prefix with mass
    ``>= target`` (top-p); ``inclusive=False`` the token ``t`` with
    ``before(t) <= target < before(t) + w(t)`` (sampling). ``shared`` may
    pass :func:`radix` of ``w`` when it is reused.

    The first level histograms every token by its top 11 bits; the next two
    see only the tokens of the chosen bucket (gathered with one ``nonzero``,
    which synchronises a GPU once), so their cost does not grow with ``V``.
    With ``sync_free`` they histogram the whole row under a mask instead (no
    sync, same result). With ``pivot`` the bisection of :mod:`sampling.pipe.pivot`
    finds it instead (no histogram, no sync, same result). Synchronises
    unless ``sync_free`` or ``pivot``.
    """
    if pivot:
        total = w.sum(-1, dtype=torch.float64)
        target, need = P.targets(total, fraction, of_mass, inclusive)
        value, above, ties = P.pivot_crossing(w, need, inclusive)
        return Crossing(value, above, ties, target, total)
    batch = w.shape[0]
    shared = radix(w) if shared is None else shared
    keys, masses = shared
    (_, width), *inner_levels = _LEVELS
    hist = masses.new_zeros(batch, 1 << width).scatter_add_(1, keys, masses)
    top_down, running = _top_down(hist)
    total = running[:, -1]  # summed as the crossing sums it, so fraction 1 keeps every token
    mass = total if of_mass is None else torch.where(torch.isnan(of_mass), total, of_mass)
    target = (fraction.double() if isinstance(fraction, torch.Tensor) else fraction) * mass
    above = torch.zeros_like(total)
    prefix, above, in_bucket = _select(top_down, running, above, target, inclusive)
    if sync_free:
        bits = w.contiguous().view(torch.int32) & 0x7FFFFFFF
        for shift, width in inner_levels:
            size = 1 << width
            inside = (bits >> (shift + width)) == prefix.to(torch.int32)[:, None]
            slot = ((bits >> shift) & (size - 1)).long()
            hist = masses.new_zeros(batch, size).scatter_add_(1, slot, torch.where(inside, masses, 0.0))
            bucket, above, in_bucket = _select(*_top_down(hist), above, target, inclusive)
            prefix = (prefix << width) | bucket
        return _crossing_at(prefix, above, in_bucket, target, total)
    rows, cols = (keys == prefix.to(keys.dtype)[:, None]).nonzero(as_tuple=True)
    sub_w = masses[rows, cols]
    sub_bits = (w[rows, cols].view(torch.int32) & 0x7FFFFFFF).long()
    for shift, width in inner_levels:
        size = 1 << width
        inside = (sub_bits >> (shift + width)) == prefix[rows]
        slot = rows * size + ((sub_bits >> shift) & (size - 1))
        hist = masses.new_zeros(batch * size).index_add_(0, slot, torch.where(inside, sub_w, 0.0))
        bucket, above, in_bucket = _select(*_top_down(hist.view(batch, size)), above, target, inclusive)
        prefix = (prefix << width) | bucket
    return _crossing_at(prefix, above, in_bucket, target, total)


def _crossing_at(
    prefix: torch.Tensor, above: torch.Tensor, in_bucket: torch.Tensor, target: torch.Tensor, total: torch.Tensor
) -> Crossing:
    """The crossing once the radix select has found all 31 bits of the value."""
    value = prefix.to(torch.int32).view(torch.float32)
    safe = torch.where(value > 0, value, torch.ones_like(value)).double()
    ties = torch.round(in_bucket / safe).long().clamp_(min=1)
    return Crossing(value, above, ties, target, total)


def top_p_cut(
    w: torch.Tensor,
    top_p: Param,
    of_mass: torch.Tensor | None = None,
    shared: Radix | None = None,
    sync_free: bool = False,
    pivot: bool = False,
) -> Cut:
    """The top-p prefix of ``w`` (renormalised to ``of_mass``): keep ``t`` iff mass before ``t`` < top_p * mass.

    Synchronises as :func:`mass_crossing` does (not with ``sync_free``).
    """
    fraction = top_p.to(w.device, torch.float64).reshape(-1) if isinstance(top_p, torch.Tensor) else top_p
    c = mass_crossing(w, fraction, of_mass, inclusive=True, shared=shared, sync_free=sync_free, pivot=pivot)
    safe = torch.where(c.value > 0, c.value, torch.ones_like(c.value)).double()
    count = torch.ceil((c.target - c.above) / safe).clamp_(min=1)
    count = torch.minimum(count, c.ties.double()).long()
    return Cut(c.value, count, c.above + count.double() * c.value.double())


def shorter(a: Cut, b: Cut) -> Cut:
    """Per row, the shorter of two prefixes of the same order."""
    take_a = (a.value > b.value) | ((a.value == b.value) & (a.count < b.count))
    mass_a = torch.where(torch.isnan(a.mass), b.mass, a.mass)  # a whole-row cut never shortens
    return Cut(
        torch.where(take_a, a.value, b.value),
        torch.where(take_a, a.count, b.count),
        torch.where(take_a, mass_a, b.mass),
    )


def nth_equal(w: torch.Tensor, value: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Per row, the id of the ``n``-th (0-based, by id) token whose weight equals ``value``.

    Counts equal tokens in blocks of 256, then scans one block: no cumsum over
    the whole vocabulary, no sync.
    """
    batch, vocab = w.shape
    size = min(_BLOCK, vocab)
    equal = w == value[:, None]
    blocks = -(-vocab // size)
    if blocks * size != vocab:
        equal = torch.nn.functional.pad(equal, (0, blocks * size - vocab))
    equal = equal.view(batch, blocks, size)
    counts = equal.sum(-1, dtype=torch.int32).long()
    running = counts.cumsum(-1)
    block = torch.searchsorted(running, n[:, None], right=True).clamp_(max=blocks - 1)
    before = running.gather(1, block) - counts.gather(1, block)
    inner = equal.gather(1, block[:, :, None].expand(batch, 1, size)).squeeze(1).cumsum(-1)
    offset = torch.searchsorted(inner, n[:, None] - before, right=True).clamp_(max=size - 1)
    return (block * size + offset).squeeze(1)


def cut_mask(w: torch.Tensor, cut: Cut) -> torch.Tensor:
    """``bool [B, V]``: the tokens of ``w`` inside ``cut`` (with positive weight). No sync."""
    value = cut.value[:, None]
    equal = w == value
    rank = equal.cumsum(-1, dtype=torch.int32)
    return (w > 0) & ((w > value) | (equal & (rank <= cut.count[:, None])))


def sample_weights(
    w: torch.Tensor,
    u: torch.Tensor,
    cut: Cut | None = None,
    shared: Radix | None = None,
    sync_free: bool = False,
    pivot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row from weights ``w`` restricted to ``cut``, by the CDF in the order.

    Returns ``(tokens, log-probability in the renormalised distribution,
    mass sampled from)``. The mass is NaN or 0 for a dead row (its token is
    then meaningless; the caller flags it). Synchronises as :func:`mass_crossing`
    does (not with ``sync_free``).
    """
    of_mass = None if cut is None else cut.mass
    c = mass_crossing(w, u, of_mass, inclusive=False, shared=shared, sync_free=sync_free, pivot=pivot)
    safe = torch.where(c.value > 0, c.value, torch.ones_like(c.value)).double()
    n = torch.floor((c.target - c.above) / safe).clamp_(min=0)
    n = torch.minimum(n, (c.ties - 1).double()).long()
    value = c.value
    if cut is not None:
        outside = (value < cut.value) | ((value == cut.value) & (n >= cut.count))
        value = torch.where(outside, cut.value, value)
        n = torch.where(outside, cut.count - 1, n)
    sync_free = sync_free or pivot
    tokens = nth_equal_scan(w, value[:, None], n[:, None]).squeeze(1) if sync_free else nth_equal(w, value, n)
    mass = c.total if cut is None else torch.where(torch.isnan(cut.mass), c.total, cut.mass)
    mass = torch.where(torch.isfinite(c.total), mass, c.total)  # NaN anywhere in the row: dead
    logprobs = torch.log(value.double() / mass)
    return tokens, logprobs, mass


# --------------------------------------------------------------------------- candidates


def candidate_masses(values: torch.Tensor, temperature: Param | None, from_logits: bool) -> torch.Tensor:
    """float64 masses of sorted candidates: their softmax (with temperature) for logits, the values for probs."""
    if not from_logits:
        return values.double()
    if temperature is not None:
        values = values / as_column(temperature, values)
    return torch.softmax(values, dim=-1, dtype=torch.float64)


Length = int | torch.Tensor
"""How many sorted candidates a row keeps: one int for all rows, or ``int64 [B, 1]``."""


def prefix_mass(running: torch.Tensor, length: Length) -> torch.Tensor:
    """``[B, 1]``: the mass of the first ``length`` candidates, from their cumulative sum."""
    if isinstance(length, int):
        return running[:, length - 1 : length]
    return running.gather(1, length - 1)


def shorten(length: Length, kept: torch.Tensor | int) -> Length:
    """The shorter of two prefix lengths, and never below 1 (a NaN row counts 0 kept)."""
    if isinstance(kept, int):
        return min(length, kept) if isinstance(length, int) else length.clamp(max=kept)
    if isinstance(length, int):
        return kept.clamp_(1, length)
    return torch.minimum(length, kept).clamp_(min=1)


def min_p_length(masses: torch.Tensor, min_p: Param) -> torch.Tensor:
    """``[B, 1]``: how many sorted candidates have ``mass >= min_p * max``."""
    return (masses >= as_column(min_p, masses) * masses[:, :1]).sum(-1, keepdim=True)


def top_p_length(masses: torch.Tensor, running: torch.Tensor, top_p: Param, total: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: how many sorted candidates have a mass strictly before them ``< top_p * total``.

    ``total`` is ``[B, 1]``. The mass before candidate ``i`` is the running
    sum up to ``i - 1``, so the count is one more than the number of running
    sums below the target: a binary search, not a pass over the candidates.
    At least 1 (the first has nothing before it); a row of NaN is dead
    whatever it gets.
    """
    target = (as_column(top_p, masses) * total).to(running.dtype)
    return torch.searchsorted(running, target.contiguous()) + 1


def sample_prefix(
    masses: torch.Tensor, running: torch.Tensor, length: Length, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw a position in the first ``length`` sorted candidates by the CDF in their order.

    ``u`` is ``[B, 1]``. Returns ``(positions, log-probabilities, mass sampled
    from)``, each ``[B, 1]``; the mass is NaN or 0 for a dead row.
    """
    mass = prefix_mass(running, length)
    pos = torch.searchsorted(running, u * mass, right=True)
    pos = pos.clamp_(max=length - 1) if isinstance(length, int) else torch.minimum(pos, length - 1)
    return pos, torch.log(masses.gather(1, pos) / mass), mass
