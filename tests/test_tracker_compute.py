"""The analysis maths on small tensors, against float64 references."""

from __future__ import annotations

import torch

from tracker import compute

NEG_INF = float("-inf")


def test_lse_pair_matches_logsumexp_for_masks_biases_and_edge_rows():
    gen = torch.Generator().manual_seed(0)
    natural = torch.randn(7, 50, generator=gen) * 4
    constrained = natural.clone()
    constrained[0, ::2] = NEG_INF  # a pure mask: shares the exponential pass
    constrained[1, :] += 0.5  # a bias everywhere: computed directly
    constrained[2, :] = NEG_INF  # nothing allowed
    natural[3, 7] += 200.0  # the only high token is masked: allowed terms underflow
    constrained[3] = natural[3]
    constrained[3, 7] = NEG_INF
    natural[4, 3] = float("nan")  # NaN natural, replaced by the processor
    constrained[4] = torch.nan_to_num(natural[4], nan=0.0)
    constrained[5, 10:] = NEG_INF
    lse_n, lse_c = compute.lse_pair(natural, constrained, torch.empty(8, 50))
    ref_n = torch.logsumexp(natural.double(), 1)
    ref_c = torch.logsumexp(constrained.double(), 1)
    torch.testing.assert_close(lse_n[[0, 1, 2, 3, 5, 6]].double(), ref_n[[0, 1, 2, 3, 5, 6]], rtol=1e-6, atol=1e-5)
    assert torch.isnan(lse_n[4])
    torch.testing.assert_close(lse_c.double(), ref_c, rtol=1e-6, atol=1e-5)
    assert lse_c[2] == NEG_INF


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
