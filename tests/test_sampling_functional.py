"""functional.sample: greedy rules, mixed batches through grouped pipes, batch independence, taps, dead rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pipe_reference import goodness_of_fit, reference_probs

from sampling import DeadRowError, SamplingParams
from sampling.functional import RowParams, row_keys, sample, uniforms

GREEDY = [
    SamplingParams(),  # all unset
    SamplingParams(temperature=0, top_p=0.5, top_k=40),
    SamplingParams(top_k=1, temperature=3.0),
    SamplingParams(top_p=0, temperature=3.0, min_p=0.2),
]


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _u(rows: int, seed: int = 0, step: int = 0) -> torch.Tensor:
    keys = row_keys(torch.full((rows,), seed), torch.arange(rows))
    return uniforms(keys, step)


@pytest.mark.parametrize("params", GREEDY, ids=["unset", "temperature 0", "top_k 1", "top_p 0"])
def test_greedy_rules_take_the_arg_max_with_lowest_id_among_ties(params):
    assert params.is_greedy
    x = _logits(64, 300, seed=1)
    x[:8, 10] = x[:8, 20] = x[:8].max(-1).values + 1.0  # tied maxima: id 10 wins
    out = sample(x, RowParams.build([params] * 64, "cpu"), _u(64))
    assert torch.equal(out.tokens, x.argmax(-1))
    assert (out.tokens[:8] == 10).all()
    np.testing.assert_allclose(out.logprobs.numpy(), torch.log_softmax(x, -1).max(-1).values.numpy(), atol=1e-6)


def test_rows_are_grouped_by_the_stages_they_need():
    params = [
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.5),
        SamplingParams(top_p=0.8),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, joint_top_k_top_p=True),
    ]
    groups = RowParams.build(params, "cpu").plan()
    by_rows = {tuple(g.rows.tolist()): g for g in groups}
    assert sorted(by_rows) == [(0, 2), (1, 4), (3,), (5,)]
    assert by_rows[(1, 4)].key[0]  # greedy
    assert by_rows[(0, 2)].params["top_k"].tolist() == [50, 20]  # differing values: a per-row tensor
    assert by_rows[(3,)].params == {"temperature": 1.0, "top_p": 0.8}  # one value: a scalar
    assert "TopK(joint=True)" in repr(by_rows[(5,)].pipe)  # the joint filter's row has a pipe of its own


def test_a_mixed_batch_samples_each_row_from_its_own_distribution():
    settings = [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.9),
        SamplingParams(temperature=1.5),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.1, temperature=1.2),
        SamplingParams(temperature=0.9, top_k=15, top_p=0.5, joint_top_k_top_p=True),
        SamplingParams(temperature=1.1, top_k=12, min_p=0.05, top_p=0.85),
    ]
    per = 3_000
    row = _logits(1, 150, seed=4)[0]
    params = [s for s in settings for _ in range(per)]
    x = row.expand(len(params), -1).contiguous()
    tokens = sample(x, RowParams.build(params, "cpu"), _u(len(params), seed=9)).tokens.numpy()
    for i, s in enumerate(settings):
        t, k, p, m = s.effective
        expected = reference_probs(
            row, temperature=t, top_k=k or None, top_p=p, min_p=m or None, joint=s.joint_top_k_top_p
        )[0]
        drawn = tokens[i * per : (i + 1) * per]
        assert (expected[drawn] > 0).all(), f"{s}: drew a token of probability 0"
        g, pvalue, dof = goodness_of_fit(drawn, expected)
        assert pvalue >= 1e-4, f"{s}: G-test G={g:.1f}, dof={dof}, p={pvalue:.2e}"


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    others = [SamplingParams(top_k=5), SamplingParams(), SamplingParams(min_p=0.2, temperature=2.0)]
    x = _logits(4, 500, seed=5)
    u = _u(4, seed=12)
    alone = sample(x[1:2], RowParams.build([mine], "cpu"), u[1:2])
    batch = sample(x, RowParams.build([others[0], mine, others[1], others[2]], "cpu"), u)
    assert batch.tokens[1] == alone.tokens[0]
    assert batch.logprobs[1] == alone.logprobs[0]


@pytest.mark.parametrize("algorithm", ["cpu", "sort", "radix"])
@pytest.mark.parametrize("top_k", [None, 50])
@pytest.mark.parametrize(("tied", "top_p"), [(10, 0.3), (10, 0.7), (5, 0.6), (20, 0.1)])
def test_a_top_p_cut_between_ties_is_the_same_alone_and_beside_other_top_p(algorithm, top_k, tied, top_p):
    # `tied` equal tokens and top_p a multiple of their mass: a cut on a float boundary, which must land on the
    # same side whether the row's top_p reaches the pipe alone (a scalar) or beside other rows' values (a column)
    x = torch.full((1, 3000), float("-inf"))
    x[0, :tied] = 0.0
    x[0, tied : tied + 200] = -40.0  # a tail far below, so that the whole-vocabulary path sees many weights
    mine = SamplingParams(top_p=top_p, top_k=top_k, seed=1)
    other = SamplingParams(top_p=0.95, top_k=top_k, seed=2)
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(tied))
    runs = []
    for params, logits in (([mine], x), ([mine, other], torch.cat([x, _logits(1, 3000, seed=9)]))):
        seen: list[torch.Tensor] = []
        built = RowParams.build(params, "cpu")
        sample(logits, built, _u(len(params)), taps=[seen.append], algorithm=algorithm)
        tokens = [int(sample(logits, built, u[i : i + len(params)], algorithm=algorithm).tokens[0]) for i in range(32)]
        runs.append((seen[0][0], tokens))
    (alone, alone_tokens), (beside, beside_tokens) = runs
    assert torch.equal(alone, beside)
    assert alone_tokens == beside_tokens
    assert int((alone > 0).sum()) in (round(top_p * tied), round(top_p * tied) + 1)  # either side of the boundary


def test_each_row_of_a_batch_samples_as_its_own_params_pipe():
    """Grouping rows by the stages they need gives each row the token and log-probability of its own to_pipe()."""
    params = [
        SamplingParams(top_k=3),
        SamplingParams(),
        SamplingParams(top_p=0.5),
        SamplingParams(top_k=7, temperature=0.8),
        SamplingParams(min_p=0.1, top_p=0.9),
        SamplingParams(temperature=0.9, top_k=15, top_p=0.5, joint_top_k_top_p=True),
    ]
    x = _logits(len(params), 80, seed=6)
    u = _u(len(params))
    out = sample(x, RowParams.build(params, "cpu"), u)
    for i, p in enumerate(params):
        alone = p.to_pipe().sample(x[i : i + 1], u=u[i : i + 1])
        assert out.tokens[i] == alone.tokens[0], p
        assert out.logprobs[i] == alone.logprobs[0], p


def test_taps_see_the_distribution_each_row_was_sampled_from():
    params = [SamplingParams(temperature=0.5, top_k=4), SamplingParams(), SamplingParams(top_p=0.7, temperature=1.3)]
    x = _logits(3, 2500, seed=7)
    seen: list[torch.Tensor] = []
    out = sample(x, RowParams.build(params, "cpu"), _u(3), taps=[seen.append])
    assert len(seen) == 1
    dist = seen[0]
    assert dist.shape == x.shape and dist.dtype == torch.float32
    np.testing.assert_allclose(dist.sum(-1).numpy(), 1.0, atol=1e-5)
    assert torch.equal(dist[1], torch.nn.functional.one_hot(out.tokens[1], 2500).float())  # greedy: one-hot
    assert int((dist[0] > 0).sum()) == 4
    np.testing.assert_allclose(dist[0].double().numpy(), reference_probs(x[0], temperature=0.5, top_k=4)[0], atol=1e-6)
    np.testing.assert_allclose(
        dist[2].double().numpy(), reference_probs(x[2], temperature=1.3, top_p=0.7)[0], atol=1e-6
    )
    chosen = torch.log(dist.gather(1, out.tokens[:, None])).squeeze(1)
    np.testing.assert_allclose(out.logprobs[[0, 2]].numpy(), chosen[[0, 2]].numpy(), atol=1e-5)
    # a greedy row reports its token's log-probability under the softmax of the logits (Completion.logprobs)
    np.testing.assert_allclose(out.logprobs[1].item(), torch.log_softmax(x[1], -1).max().item(), atol=1e-6)
    again = sample(x, RowParams.build(params, "cpu"), _u(3))
    assert torch.equal(again.tokens, out.tokens)  # the tap changed nothing


def test_dead_rows_are_named_by_their_batch_index():
    params = [
        SamplingParams(top_k=3),
        SamplingParams(),
        SamplingParams(top_p=0.5),
        SamplingParams(top_k=3),
        SamplingParams(),
    ]
    x = _logits(5, 60, seed=8)
    x[3] = float("-inf")
    x[4, 5] = float("nan")
    with pytest.raises(
        DeadRowError, match=r"cannot sample: rows \[4\] hold NaN logits; rows \[3\] have no allowed token"
    ):
        sample(x, RowParams.build(params, "cpu"), _u(5))


def test_bad_arguments():
    x = _logits(2, 10, seed=0)
    rp = RowParams.build([SamplingParams()] * 2, "cpu")
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\], got shape \(10,\)"):
        sample(x[0], rp, _u(2))
    with pytest.raises(ValueError, match="params has 2 rows, logits has 1"):
        sample(x[:1], rp, _u(1))
    with pytest.raises(ValueError, match=r"u must hold one uniform number per row, shape \(2,\), got \(3,\)"):
        sample(x, rp, _u(3))
    with pytest.raises(TypeError, match=r"taps\[0\] must be callable"):
        sample(x, rp, _u(2), taps=["sampled"])
