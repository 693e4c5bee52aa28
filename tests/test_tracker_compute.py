"""The analysis maths on small tensors, against float64 references."""

from __future__ import annotations

import math

import numpy as np
import torch

from tracker import compute

NEG_INF = float("-inf")


def test_logsumexp_rows_matches_torch_for_masks_biases_and_edge_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=gen) * 4
    x[0, ::2] = NEG_INF
    x[1, :] = NEG_INF  # nothing allowed
    x[2, 7] += 200.0  # one dominant token
    x[3, 3] = float("nan")
    x[4, 9] = float("inf")
    got = compute.logsumexp_rows(x, torch.empty(8, 50))
    ref = torch.logsumexp(x.double(), 1)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-5, equal_nan=True)
    assert got[1] == NEG_INF and torch.isnan(got[3]) and got[4] == float("inf")


def test_masked_keeps_allowed_natural_logits_and_masks_the_rest():
    gen = torch.Generator().manual_seed(3)
    natural = torch.randn(4, 30, generator=gen)
    constrained = (natural + 1.0).masked_fill(torch.rand(4, 30, generator=gen) < 0.5, NEG_INF)
    expected = torch.where(constrained > NEG_INF, natural, NEG_INF)
    assert torch.equal(compute.masked(natural, constrained), expected)


def test_top_allowed_ranks_by_the_larger_probability_and_skips_masked():
    gen = torch.Generator().manual_seed(1)
    natural = torch.randn(5, 40, generator=gen) * 3
    constrained = natural.masked_fill(torch.rand(5, 40, generator=gen) < 0.6, NEG_INF)
    constrained[:, 5] += 2.0
    constrained[4, :] = NEG_INF
    constrained[4, 9] = 0.0  # one allowed token
    ln, lc = torch.logsumexp(natural, 1), torch.logsumexp(constrained, 1)
    top = compute.top_allowed(natural, constrained, ln, lc, 6)
    pn, pc = natural.double().softmax(1), constrained.double().softmax(1)
    score = torch.where(torch.isfinite(constrained), torch.maximum(pn, pc), -1.0)
    for r in range(5):
        n = int(top.count[r])
        assert n == min(6, int(torch.isfinite(constrained[r]).sum()))
        assert top.ids[r, :n].tolist() == torch.argsort(score[r], descending=True)[:n].tolist()


def test_step_stats_without_a_constraint_remove_nothing():
    gen = torch.Generator().manual_seed(2)
    natural = torch.randn(4, 30, generator=gen)
    lse = torch.logsumexp(natural, 1)
    chosen = torch.tensor([0, 5, -1, 29])
    stats = compute.step_stats({"natural": natural}, {"natural": lse}, chosen, [0, 1])
    assert stats["removed_mass"].abs().max() < 1e-6 and (stats["margin"] == 0).all()
    assert stats["allowed"].tolist() == [30] * 4
    assert torch.isnan(stats["p_chosen_natural"][2]) and torch.isnan(stats["rank_chosen_natural"][2])
    torch.testing.assert_close(stats["p_eos_natural"], natural.softmax(1)[:, :2].sum(1))


def test_nonfinite_rows_flags_nan_and_plus_inf_but_not_masked_rows():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.zeros(5, 10, dtype=dtype)
        x[1, 4] = float("nan")
        x[2, 0] = float("inf")
        x[3, :] = NEG_INF  # nothing allowed: not a storage problem
        x[4, :5] = NEG_INF
        x[4, 9] = float("inf")  # +inf beside -inf: the sum is NaN, the exact check decides
        assert compute.nonfinite_rows(x).tolist() == [False, True, True, False, True]


def test_topk_rows_equals_torch_topk_on_peaked_flat_and_masked_rows():
    from tracker.compute import topk_rows

    gen = torch.Generator().manual_seed(4)
    peaked = torch.randn(5, 40000, generator=gen) * 2
    peaked.scatter_add_(1, torch.randint(0, 40000, (5, 6), generator=gen), torch.rand(5, 6, generator=gen) * 6 + 8)
    masked = peaked.clone()
    masked[:, ::2] = float("-inf")
    flat = torch.randn(5, 40000, generator=gen) * 1e-3
    for rows in (peaked, masked, flat):
        for k in (1, 10, 50):
            got, want = topk_rows(rows, k), torch.topk(rows, k, dim=1)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _rows_like_a_model(gen: torch.Generator, t: int, vocab: int) -> torch.Tensor:
    x = torch.randn(t, vocab, generator=gen) * 2
    x.scatter_add_(1, torch.randint(0, vocab, (t, 6), generator=gen), torch.rand(t, 6, generator=gen) * 6 + 8)
    return x


def test_grouped_top_allowed_and_entries_equal_the_whole_row_passes():
    """Large rows take the group-maxima paths; they give what the whole-row passes give, edge rows included."""
    gen = torch.Generator().manual_seed(5)
    for vocab in (4096, 40000):  # 40000: columns past the last group, and groups past the last super group
        natural = _rows_like_a_model(gen, 8, vocab)
        halves = natural.masked_fill(torch.rand(8, vocab, generator=gen) < 0.5, NEG_INF)
        sparse = natural.masked_fill(torch.rand(8, vocab, generator=gen) < 0.999, NEG_INF)
        boosted = natural + torch.where(torch.rand(8, vocab, generator=gen) < 0.01, 5.0, 0.0)
        edge = halves.clone()
        edge[0] = NEG_INF  # nothing allowed
        edge[1] = NEG_INF
        edge[1, :3] = 1.0  # fewer allowed than k
        edge[2, 7] = float("nan")
        for constrained in (halves, sparse, boosted, natural / 50, edge, natural):
            ln = torch.logsumexp(natural, 1)
            lc = torch.logsumexp(torch.nan_to_num(constrained, nan=NEG_INF), 1)
            for k in (1, 10):
                got = compute.top_allowed(natural, constrained, ln, lc, k)
                dense = compute._top_candidates_dense(natural, constrained, ln, lc, k)
                want = compute.best_candidates(dense, ln, lc, k)[0]
                assert torch.equal(got.count, want.count)
                for r in range(8):
                    n = int(want.count[r])
                    assert got.ids[r, :n].tolist() == want.ids[r, :n].tolist()
            for min_value in (0.01, 1e-6):
                slack = math.log(min_value) - 1e-4
                rows, ids = compute.entries_above(natural, constrained, ln + slack, lc + slack)
                margin = np.maximum(natural.numpy() - (ln + slack).numpy()[:, None],
                                    constrained.numpy() - (lc + slack).numpy()[:, None])
                want_rows, want_ids = np.nonzero(margin >= 0)
                assert np.array_equal(rows.numpy(), want_rows) and np.array_equal(ids.numpy(), want_ids)
