"""A straightforward float64 reference for the sampling semantics, and the goodness-of-fit test.

The reference sorts each row (stable, so equal probabilities keep the lower
id first) and applies each rule literally; the pipe's tests compare against
it. The tests in this file check the reference itself on hand-computed cases.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy import stats


def _order(p: np.ndarray) -> np.ndarray:
    """Token ids by descending probability, lower id first among equals."""
    return np.argsort(-p, axis=-1, kind="stable")


def _renormalise(p: np.ndarray) -> np.ndarray:
    return p / p.sum(-1, keepdims=True)


def reference_probs(
    logits: np.ndarray | torch.Tensor,
    *,
    temperature: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] | None = None,
    top_k: int | Sequence[int] | None = None,
    top_p: float | Sequence[float] | None = None,
    joint: bool = False,
    order: Sequence[str] = ("min_p", "top_k", "top_p"),
    from_probs: bool = False,
) -> np.ndarray:
    """The distribution sampled from, float64 ``[B, V]``, by the documented rules.

    Parameters are scalars or one value per row; ``order`` is the order of
    the filters (the documented one by default); ``joint`` skips the
    renormalisation after top-k.
    """
    x = np.asarray(logits, dtype=np.float64)
    x = x[None] if x.ndim == 1 else x
    rows, vocab = x.shape

    def per_row(v):
        return np.broadcast_to(np.asarray(v, dtype=np.float64), (rows,))[:, None]

    if from_probs:
        p = _renormalise(x)
    else:
        z = x / per_row(temperature)
        p = np.exp(z - z.max(-1, keepdims=True))
        p = _renormalise(p)
    for stage in order:
        order_ids = _order(p)
        sorted_p = np.take_along_axis(p, order_ids, -1)
        if stage == "min_p" and min_p is not None:
            keep = p >= per_row(min_p) * p.max(-1, keepdims=True)
            p = _renormalise(np.where(keep, p, 0.0))
        elif stage == "top_k" and top_k is not None:
            k = per_row(top_k)
            k = np.where(k > 0, k, vocab)
            keep_sorted = np.arange(vocab)[None] < k
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order_ids, keep_sorted, -1)
            p = np.where(keep, p, 0.0)
            p = p if joint else _renormalise(p)
        elif stage == "top_p" and top_p is not None:
            before = np.cumsum(sorted_p, -1) - sorted_p
            keep_sorted = before < per_row(top_p)
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order_ids, keep_sorted, -1)
            p = _renormalise(np.where(keep, p, 0.0))
    return _renormalise(p)


def goodness_of_fit(samples: np.ndarray, probs: np.ndarray) -> tuple[float, float, int]:
    """G-test of token ``samples`` against ``probs`` (one row): ``(G, p-value, degrees of freedom)``.

    Tokens with an expected count below 5 are pooled into one bin. A sample
    of a token with probability 0 is never pooled: the caller asserts that
    none happened.
    """
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(obs) < 2:
        return 0.0, 1.0, 0
    g, pvalue = stats.power_divergence(obs, exp, lambda_="log-likelihood")
    return float(g), float(pvalue), len(obs) - 1


# ----------------------------------------------------------------------------- the reference itself


def test_reference_top_k_keeps_lower_ids_among_ties():
    p = reference_probs(np.log([0.1, 0.3, 0.3, 0.3]), top_k=2)
    np.testing.assert_allclose(p, [[0, 0.5, 0.5, 0]])


def test_reference_top_p_boundary_drops_a_token_whose_preceding_mass_equals_top_p():
    probs = np.array([0.5, 0.25, 0.125, 0.125])
    np.testing.assert_allclose(reference_probs(probs, top_p=0.75, from_probs=True), [[2 / 3, 1 / 3, 0, 0]])
    np.testing.assert_allclose(reference_probs(probs, top_p=0.76, from_probs=True), [[4 / 7, 2 / 7, 1 / 7, 0]])


def test_reference_renormalises_after_top_k_unless_joint():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    # renormalised top-2 is [4/7, 3/7]: mass before token 1 is 4/7 >= 0.5, so it goes
    np.testing.assert_allclose(reference_probs(probs, top_k=2, top_p=0.5, from_probs=True), [[1, 0, 0, 0]])
    # joint: mass before token 1 is 0.4 < 0.5 (against the whole distribution), so it stays
    np.testing.assert_allclose(
        reference_probs(probs, top_k=2, top_p=0.5, joint=True, from_probs=True), [[4 / 7, 3 / 7, 0, 0]]
    )


def test_reference_min_p_keeps_the_boundary():
    probs = np.array([0.5, 0.25, 0.125, 0.125])
    np.testing.assert_allclose(reference_probs(probs, min_p=0.25, from_probs=True), [probs])
    np.testing.assert_allclose(reference_probs(probs, min_p=0.5, from_probs=True), [[2 / 3, 1 / 3, 0, 0]])


def test_goodness_of_fit_accepts_a_fair_sample_and_rejects_a_biased_one():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    fair = rng.choice(4, size=20_000, p=probs)
    biased = rng.choice(4, size=20_000, p=[0.48, 0.32, 0.15, 0.05])
    assert goodness_of_fit(fair, probs)[1] > 1e-3
    assert goodness_of_fit(biased, probs)[1] < 1e-4


@pytest.mark.parametrize("order", [("min_p", "top_k", "top_p"), ("top_k", "min_p", "top_p")])
def test_reference_min_p_and_top_k_commute(order):
    logits = np.random.default_rng(1).normal(size=(3, 40)) * 2
    a = reference_probs(logits, temperature=0.8, min_p=0.05, top_k=10, top_p=0.8)
    b = reference_probs(logits, temperature=0.8, min_p=0.05, top_k=10, top_p=0.8, order=order)
    np.testing.assert_allclose(a, b)
