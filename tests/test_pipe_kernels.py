"""The kernels against straightforward versions: the radix crossing against a sort, top-k candidates, nth_equal, top-k."""

from __future__ import annotations

import pytest
import torch

from sampling.pipe import LogitsPipe, TensorType, TopK
from sampling.pipe import kernels as K


def _weights(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, -1)
    w[:, 100:140] = w[:, 7:8]  # ties
    w[:, 200:300] = 0.0  # removed tokens
    w[1] = 1.0 / vocab  # a uniform row: everything tied
    return w


def _crossing_by_sort(w: torch.Tensor, fraction: torch.Tensor, inclusive: bool) -> K.Crossing:
    """The crossing the straightforward way: sort each row, sum it up, search the target."""
    ordered = torch.sort(w, dim=-1, descending=True).values
    running = ordered.double().cumsum(-1)
    total = running[:, -1]
    target = fraction.double() * total
    at = torch.searchsorted(running, target[:, None], right=not inclusive).squeeze(1)
    at = torch.minimum(at, ((ordered > 0).sum(-1) - 1).clamp(min=0))  # no crossing (rounding): the last with mass
    value = ordered.gather(1, at[:, None]).squeeze(1)
    first = (ordered > value[:, None]).sum(-1)
    above = torch.where(first > 0, running.gather(1, (first - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    ties = (ordered == value[:, None]).sum(-1).clamp(min=1)
    return K.Crossing(value, above, ties, target, total)


@pytest.mark.parametrize(
    "how", [{}, {"sync_free": True}, {"pivot": True}], ids=["gathered bucket", "masked whole row", "pivot search"]
)
@pytest.mark.parametrize("inclusive", [True, False])
def test_radix_and_pivot_crossings_equal_the_sorting_crossing(inclusive, how):
    w = _weights(6, 5000, seed=0)
    fraction = torch.tensor([0.0, 0.3, 0.5, 0.9, 0.999, 1.0], dtype=torch.float64)
    assert w.shape[-1] >= K.SORT_BELOW
    radix = K.mass_crossing(w, fraction, inclusive=inclusive, **how)
    sort = _crossing_by_sort(w, fraction, inclusive)
    assert torch.equal(radix.value, sort.value)
    assert torch.equal(radix.ties, sort.ties)
    torch.testing.assert_close(radix.above, sort.above, atol=1e-6, rtol=0)
    torch.testing.assert_close(radix.total, sort.total, atol=1e-6, rtol=0)


def test_top_p_cut_and_sampling_match_a_sort_on_a_large_vocabulary():
    w = _weights(5, 4096, seed=1)
    u = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    order = torch.sort(w.double(), dim=-1, descending=True, stable=True)
    before = order.values.cumsum(-1) - order.values
    for top_p in (0.2, 0.75, 0.95):
        keep_sorted = before < top_p
        expected = torch.zeros_like(w, dtype=torch.bool).scatter_(1, order.indices, keep_sorted)
        cut = K.top_p_cut(w, top_p, torch.ones(5, dtype=torch.float64))
        assert torch.equal(K.cut_mask(w, cut) | (w == 0) & expected, expected)
        tokens, _, mass = K.sample_weights(w, u, cut)
        kept = torch.where(expected, w.double(), 0.0)
        sorted_kept = kept.gather(1, order.indices).cumsum(-1)
        position = torch.searchsorted(sorted_kept, (u * sorted_kept[:, -1])[:, None], right=True)
        assert torch.equal(tokens, order.indices.gather(1, position).squeeze(1))


def test_top_k_candidates_follow_the_order_with_lower_ids_first():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 6, (20, 300), generator=g).float()  # many ties
    for width in (1, 5, 37, 300):
        values, ids = K.top_k_candidates(x, width, float("-inf"))
        expected = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(values, expected.values[:, :width])
        assert torch.equal(ids, expected.indices[:, :width])


@pytest.mark.parametrize("scan", [False, True], ids=["blocks", "scan"])
def test_nth_equal_finds_the_nth_tied_token_by_id(scan):
    w = torch.zeros(3, 1000)
    w[0, [5, 300, 301, 999]] = 0.25
    w[1, 700] = 0.5
    w[2] = 0.001
    value = torch.tensor([0.25, 0.5, 0.001])

    def nth(n):
        if scan:
            return K.nth_equal_scan(w, value[:, None], torch.tensor(n)[:, None]).squeeze(1).tolist()
        return K.nth_equal(w, value, torch.tensor(n)).tolist()

    assert nth([0, 0, 0]) == [5, 700, 0]
    assert nth([2, 0, 999]) == [301, 700, 999]
    assert nth([3, 0, 256]) == [999, 700, 256]


@pytest.mark.parametrize("input_type", [TensorType.LOGITS, TensorType.PROBS])
def test_top_k_filter_keeps_exactly_k_with_lower_ids_among_ties_on_every_algorithm(input_type):
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 6, (30, 3000), generator=g).float()  # many ties at every boundary
    x[3] = float("-inf")
    x[3, [9, 40]] = 1.0  # fewer live tokens than k
    if input_type is TensorType.PROBS:
        x = torch.softmax(x, -1)
    k = torch.randint(1, 60, (30,), generator=g)
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    first_k = torch.arange(3000) < k[:, None]
    live = x > (float("-inf") if input_type is TensorType.LOGITS else 0.0)
    expected = torch.zeros_like(live).scatter_(1, order, first_k) & live
    for algorithm in ("cpu", "sort", "radix"):
        pipe = LogitsPipe([TopK(joint=input_type is TensorType.PROBS)], input_type=input_type, algorithm=algorithm)
        for bound in (None, 59):  # no bound: the whole row is the candidates on the sync-free algorithms
            kept = pipe(x, top_k=k, max_top_k=bound) > (float("-inf") if input_type is TensorType.LOGITS else 0.0)
            assert torch.equal(kept, expected), (algorithm, bound)
        kept = pipe(x, top_k=7) > (float("-inf") if input_type is TensorType.LOGITS else 0.0)
        assert torch.equal(kept, torch.zeros_like(live).scatter_(1, order[:, :7], True) & live), algorithm
