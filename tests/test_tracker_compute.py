"""The read side's row maths (numpy) on small arrays, against float64 or whole-row references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tracker.reading import candidates, metrics, rows
from tracker.reading.block import Block

NEG_INF = float("-inf")


def _logsumexp64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = np.max(x, axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shift = np.where(np.isfinite(top), top, 0.0)
        return (np.log(np.exp(x - shift).sum(axis=1, keepdims=True)) + shift)[:, 0]


def _model_rows(rng: np.random.Generator, t: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((t, vocab)).astype(np.float32) * 2
    np.add.at(
        x, (np.repeat(np.arange(t), 6), rng.integers(0, vocab, t * 6)), rng.random(t * 6).astype(np.float32) * 6 + 8
    )
    return x


def test_logsumexp_rows_matches_float64_for_masks_biases_and_edge_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 50)).astype(np.float32) * 4
    x[0, ::2] = NEG_INF
    x[1, :] = NEG_INF  # nothing allowed
    x[2, 7] += 200.0  # one dominant token
    x[3, 3] = np.nan
    x[4, 9] = np.inf
    got = rows.logsumexp_rows(x)
    np.testing.assert_allclose(got.astype(np.float64), _logsumexp64(x), rtol=1e-6, atol=1e-5, equal_nan=True)
    assert got[1] == NEG_INF and np.isnan(got[3]) and got[4] == np.inf
    top = x.max(axis=1)
    np.testing.assert_array_equal(rows.logsumexp_rows(x, top), got)


def test_logsumexp_shared_equals_float64_for_masking_and_other_stages():
    """One exp pass for natural and the stages that only mask it; any other row still gets its exact value."""
    rng = np.random.default_rng(6)
    natural = (rng.standard_normal((9, 3000)) * 3).astype(np.float32)
    masking = np.where(rng.random((9, 3000)) < 0.7, NEG_INF, natural).astype(np.float32)
    masking[1] = NEG_INF  # nothing allowed
    masking[2] = NEG_INF
    masking[2, 5] = natural[2, 5] = natural[2].max() - 70.0  # only a token far below the model's best
    masking[3] = natural[3] + 0.5  # a bias, not a mask
    masking[4, 7] = np.nan  # a null row reads as NaN
    natural[5, :] = np.nan
    biased = natural * 0.5
    top = natural.max(axis=1)
    lse_n, (lse_m, lse_b) = rows.logsumexp_shared(
        natural, top, [masking, biased], [masking.max(axis=1), biased.max(axis=1)]
    )
    for got, x in ((lse_n, natural), (lse_m, masking), (lse_b, biased)):
        np.testing.assert_allclose(got.astype(np.float64), _logsumexp64(x), rtol=1e-6, atol=1e-5, equal_nan=True)
    assert lse_m[1] == NEG_INF and np.isnan(lse_m[4]) and np.isnan(lse_n[5])


def test_masked_keeps_allowed_natural_logits_and_masks_the_rest():
    rng = np.random.default_rng(3)
    natural = rng.standard_normal((4, 30)).astype(np.float32)
    constrained = np.where(rng.random((4, 30)) < 0.5, NEG_INF, natural + 1.0).astype(np.float32)
    np.testing.assert_array_equal(rows.masked(natural, constrained), np.where(constrained > NEG_INF, natural, NEG_INF))


def test_nonfinite_rows_flags_nan_and_plus_inf_but_not_masked_rows_in_every_stored_type():
    x = np.zeros((5, 10), dtype=np.float32)
    x[1, 4] = np.nan
    x[2, 0] = np.inf
    x[3, :] = NEG_INF  # nothing allowed: not a storage problem
    x[4, :5] = NEG_INF
    x[4, 9] = np.inf
    bfloat16_bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    for stored in (x, x.astype(np.float16), bfloat16_bits):
        assert rows.nonfinite_rows(stored).tolist() == [False, True, True, False, True]


def test_effective_reads_nan_as_masked_and_plus_inf_rows_as_one_hots():
    x = np.array([[1.0, np.nan, 2.0], [np.inf, 3.0, np.inf]], dtype=np.float32)
    np.testing.assert_array_equal(rows.effective(x), [[1.0, NEG_INF, 2.0], [0.0, NEG_INF, 0.0]])


def _reference_top(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-x.astype(np.float64), axis=1, kind="stable")[:, :k]  # ties: lower id first
    return np.take_along_axis(x, order, axis=1), order


def test_topk_rows_equals_a_stable_sort_on_peaked_flat_masked_and_tied_rows():
    rng = np.random.default_rng(4)
    peaked = _model_rows(rng, 5, 40000)
    masked = peaked.copy()
    masked[:, ::2] = NEG_INF
    flat = (rng.standard_normal((5, 40000)) * 1e-3).astype(np.float32)
    tied = np.round(peaked)  # many equal values at every rank
    few = np.full((5, 40000), NEG_INF, dtype=np.float32)
    few[:, :3] = 1.0  # fewer finite entries than k
    for x in (peaked, masked, flat, tied, few):
        for k in (1, 10, 50):
            values, ids = rows.topk_rows(x, k)
            want_values, want_ids = _reference_top(x, k)
            np.testing.assert_array_equal(values, want_values)
            np.testing.assert_array_equal(ids, want_ids)


def _reference_best(natural, constrained, ln, lc, k):
    """The k allowed tokens with the largest max(natural prob, constrained prob), in float64, ties by id."""
    with np.errstate(invalid="ignore", over="ignore"):
        score = np.maximum(
            np.exp(natural.astype(np.float64) - ln[:, None]), np.exp(constrained.astype(np.float64) - lc[:, None])
        )
    score = np.where((constrained > NEG_INF) & ~np.isnan(score), score, -1.0)
    order = np.argsort(-score, axis=1, kind="stable")[:, :k]
    count = (np.take_along_axis(score, order, axis=1) >= 0).sum(axis=1)
    return order, count


def test_best_allowed_tokens_rank_by_the_larger_probability_and_skip_masked():
    rng = np.random.default_rng(1)
    natural = (rng.standard_normal((5, 40)) * 3).astype(np.float32)
    constrained = np.where(rng.random((5, 40)) < 0.6, NEG_INF, natural).astype(np.float32)
    constrained[:, 5] += 2.0
    constrained[4, :] = NEG_INF
    constrained[4, 9] = 0.0  # one allowed token
    ln, lc = rows.logsumexp_rows(natural), rows.logsumexp_rows(constrained)
    found = candidates.top_candidates(natural, constrained, ln, lc, 6)
    ids, count, _, _ = candidates.best_candidates(found, ln, lc, 6)
    want_ids, want_count = _reference_best(natural, constrained, _logsumexp64(natural), _logsumexp64(constrained), 6)
    np.testing.assert_array_equal(count, want_count)
    for r in range(5):
        assert ids[r, : count[r]].tolist() == want_ids[r, : count[r]].tolist()


def test_grouped_searches_equal_whole_row_references_edge_rows_included():
    """Large rows take the group-maxima paths; they give what a whole-row float64 reference gives."""
    rng = np.random.default_rng(5)
    for vocab in (4096, 40000):  # 40000: columns past the last group, and groups past the last super group
        natural = _model_rows(rng, 8, vocab)
        halves = np.where(rng.random((8, vocab)) < 0.5, NEG_INF, natural).astype(np.float32)
        sparse = np.where(rng.random((8, vocab)) < 0.999, NEG_INF, natural).astype(np.float32)
        boosted = natural + np.where(rng.random((8, vocab)) < 0.01, 5.0, 0.0).astype(np.float32)
        edge = halves.copy()
        edge[0] = NEG_INF  # nothing allowed
        edge[1] = NEG_INF
        edge[1, :3] = 1.0  # fewer allowed than k
        edge[2, 7] = np.nan
        cases = [(natural, c) for c in (halves, sparse, boosted, natural / 50, edge, natural)]
        cases.append((np.asfortranarray(natural), np.asfortranarray(edge)))  # rows that are not contiguous
        for natural, constrained in cases:
            ln = rows.logsumexp_rows(natural)
            lc = rows.logsumexp_rows(np.where(np.isnan(constrained), NEG_INF, constrained).astype(np.float32))
            for k in (1, 10):
                found = candidates.top_candidates(natural, constrained, ln, lc, k)
                ids, count, _, _ = candidates.best_candidates(found, ln, lc, k)
                want_ids, want_count = _reference_best(natural, constrained, ln, lc, k)
                np.testing.assert_array_equal(count, want_count)
                for r in range(8):
                    assert ids[r, : count[r]].tolist() == want_ids[r, : count[r]].tolist()
            for min_value in (0.01, 1e-6):
                slack = np.float32(math.log(min_value) - 1e-4)
                got_rows, got_ids = candidates.entries_above(natural, constrained, ln + slack, lc + slack)
                above = (natural >= (ln + slack)[:, None]) | (constrained >= (lc + slack)[:, None])
                want_rows, want_ids = np.nonzero(above & ~np.isnan(natural) & ~np.isnan(constrained))
                np.testing.assert_array_equal(got_rows, want_rows)
                np.testing.assert_array_equal(got_ids, want_ids)


def test_step_metrics_match_float64_references_in_full_and_top_k_blocks():
    rng = np.random.default_rng(2)
    natural = (rng.standard_normal((4, 30)) * 2).astype(np.float32)
    constrained = np.where(rng.random((4, 30)) < 0.4, NEG_INF, natural + 0.5).astype(np.float32)
    chosen = np.array([0, 5, -1, 29])
    eos = [0, 1]
    ln, lc = _logsumexp64(natural), _logsumexp64(constrained)
    full = {"natural": Block(natural, ln.astype(np.float32)), "constrained": Block(constrained, lc.astype(np.float32))}
    got = metrics.step_metrics(full, chosen, eos)
    for name, x, lse in (("natural", natural, ln), ("constrained", constrained, lc)):
        p = np.exp(x.astype(np.float64) - lse[:, None])
        with np.errstate(invalid="ignore", divide="ignore"):
            entropy = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
        np.testing.assert_allclose(got[f"entropy_{name}"], entropy, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[f"p_eos_{name}"], p[:, eos].sum(axis=1), rtol=1e-6)
        for r in (0, 1, 3):
            assert math.isclose(got[f"p_chosen_{name}"][r], p[r, chosen[r]], rel_tol=1e-6, abs_tol=1e-12)
            assert got[f"rank_chosen_{name}"][r] == (x[r] > x[r, chosen[r]]).sum()
        assert np.isnan(got[f"p_chosen_{name}"][2]) and np.isnan(got[f"rank_chosen_{name}"][2])
    allowed = constrained > NEG_INF
    np.testing.assert_array_equal(got["allowed"], allowed.sum(axis=1))
    p_nat = np.exp(natural.astype(np.float64) - ln[:, None])
    np.testing.assert_allclose(got["removed_mass"], np.where(allowed, 0.0, p_nat).sum(axis=1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["margin"], natural.max(axis=1) - np.where(allowed, natural, NEG_INF).max(axis=1))
    # top-k storage of the same rows: the stored tokens answer what they can, the rest is NaN
    k = 5
    ids = np.argsort(-constrained, axis=1, kind="stable")[:, :k]
    topk = {
        "natural": Block(np.take_along_axis(natural, ids, 1), ln.astype(np.float32), ids, np.full(4, 30.0)),
        "constrained": Block(np.take_along_axis(constrained, ids, 1), lc.astype(np.float32), ids, allowed.sum(axis=1)),
    }
    sparse = metrics.step_metrics(topk, chosen, eos)
    assert np.isnan(sparse["entropy_natural"]).all() and np.isnan(sparse["removed_mass"]).all()
    np.testing.assert_array_equal(sparse["allowed"], allowed.sum(axis=1))
    for r in (0, 1, 3):
        stored = chosen[r] in ids[r].tolist()
        value = sparse["p_chosen_constrained"][r]
        assert math.isclose(value, got["p_chosen_constrained"][r], rel_tol=1e-6) if stored else np.isnan(value)


def test_step_metrics_without_a_constraint_remove_nothing():
    rng = np.random.default_rng(2)
    natural = rng.standard_normal((4, 30)).astype(np.float32)
    got = metrics.step_metrics({"natural": Block(natural, rows.logsumexp_rows(natural))}, np.array([0, 5, -1, 29]), [])
    assert (got["removed_mass"] == 0).all() and (got["margin"] == 0).all()
    assert got["allowed"].tolist() == [30] * 4 and np.isnan(got["p_eos_natural"]).all()


def test_map_blocks_keeps_order_and_raises_the_first_error():
    assert rows.map_blocks(lambda i: i * i, 7) == [i * i for i in range(7)]

    def fails(i: int) -> int:
        if i == 3:
            raise ValueError("block 3")
        return i

    with pytest.raises(ValueError, match="block 3"):
        rows.map_blocks(fails, 5)
