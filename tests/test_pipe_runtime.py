"""Calling a pipe: runtime parameters, randomness, dead rows, and which log-probability is which."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pipe_reference import reference_probs

from sampling.pipe import (
    DeadRowError,
    Greedy,
    LogitsPipe,
    MinP,
    PipeError,
    Sample,
    Softmax,
    Temperature,
    TensorType,
    TopK,
    TopP,
)

FULL = [Temperature(), Softmax(), MinP(), TopK(), TopP(), Sample()]


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def _u(n, seed=0):
    return torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("temperature", 0.0, r"temperature must be a finite number > 0, got 0.0"),
        ("temperature", float("nan"), r"temperature must be a finite number > 0, got nan"),
        ("temperature", True, r"temperature must be a finite number > 0, got True"),
        ("top_k", 0, r"top_k must be an int > 0, got 0"),
        ("top_k", 3.0, r"top_k must be an int > 0, got 3.0"),
        ("top_p", 0.0, r"top_p must be a number in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be a number in \(0, 1\], got 1.5"),
        ("min_p", -0.1, r"min_p must be a number in \(0, 1\], got -0.1"),
        ("top_k", torch.tensor([1.0, 2.0, 3.0]), r"top_k must be an integer tensor, got dtype torch.float32"),
        ("top_p", torch.tensor([1, 1, 1]), r"top_p must be a floating-point tensor, got dtype torch.int64"),
        ("top_p", torch.full((2,), 0.5), r"top_p must have one value per row \(3\), got 2"),
        ("temperature", torch.ones(3, 2), r"temperature must be a scalar or a \[batch\] tensor, got shape \(3, 2\)"),
    ],
)
def test_runtime_parameters_are_validated(name, value, message):
    pipe = LogitsPipe(FULL)
    params = dict(temperature=1.0, min_p=0.1, top_k=5, top_p=0.9)
    params[name] = value
    with pytest.raises(PipeError, match=message):
        pipe(torch.zeros(3, 10), **params)


def test_unknown_and_missing_parameters_and_bad_inputs():
    pipe = LogitsPipe([Softmax(), TopK(), Sample()])
    x = torch.zeros(2, 10)
    with pytest.raises(PipeError, match=r"unknown parameter 'top_q'; this pipe takes \['top_k'\]"):
        pipe(x, top_k=3, top_q=0.5)
    with pytest.raises(PipeError, match=r"stage 'top_k' \(ProbsTopKOp\) needs top_k: pass top_k= when calling"):
        LogitsPipe([Softmax(), TopK(), Sample()], compile=False)(x)
    with pytest.raises(PipeError, match=r"u must be a \[batch\] tensor of uniform numbers \(2,\), got \(3,\)"):
        pipe(x, top_k=3, u=torch.rand(3, dtype=torch.float64))
    with pytest.raises(PipeError, match=r"x must be \[batch, vocab\] with vocab > 0, got shape \(10,\)"):
        pipe(torch.zeros(10), top_k=3)
    with pytest.raises(PipeError, match="sample\\(\\) needs a pipe that ends in a sampler, this one ends in PROBS"):
        LogitsPipe([Softmax(), TopP()]).sample(x, top_p=0.5)


def test_processor_defaults_and_call_values():
    x = _rand(4000, 30)
    u = _u(4000)
    with_defaults = LogitsPipe([Temperature(0.5), Softmax(), TopK(3), Sample()])
    without = LogitsPipe([Temperature(), Softmax(), TopK(), Sample()])
    assert torch.equal(with_defaults(x, u=u), without(x, u=u, temperature=0.5, top_k=3))
    # a call value wins over the default
    assert torch.equal(with_defaults(x, u=u, top_k=1), x.argmax(-1))


def test_scalar_and_per_row_tensor_parameters_agree():
    x = _rand(300, 40)
    u = _u(300)
    pipe = LogitsPipe(FULL)
    scalars = pipe(x, u=u, temperature=0.7, min_p=0.05, top_k=9, top_p=0.8)
    tensors = pipe(
        x,
        u=u,
        temperature=torch.full((300,), 0.7),
        min_p=torch.full((300,), 0.05),
        top_k=torch.full((300,), 9),
        top_p=torch.full((300,), 0.8),
    )
    assert torch.equal(scalars, tensors)


def test_generator_makes_draws_repeatable():
    pipe = LogitsPipe([Softmax(), Sample()])
    x = _rand(50, 20)
    a = pipe(x, generator=torch.Generator().manual_seed(4))
    b = pipe(x, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- dead rows


PIPES = {
    "greedy": [Greedy()],
    "candidates": [Temperature(), Softmax(), TopK(), TopP(), Sample()],
    "vocabulary": [Temperature(), Softmax(), MinP(), TopP(), Sample()],
    "plain": [Softmax(), Sample()],
}


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("kind", list(PIPES))
def test_dead_rows_raise_naming_the_rows_or_are_flagged(kind, compiled):
    pipe = LogitsPipe(PIPES[kind], compile=compiled)
    params = {k: v for k, v in dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05).items() if k in pipe.param_names}
    x = _rand(5, 3000)
    x[1, 17] = float("nan")
    x[3] = float("-inf")
    u = _u(5)
    with pytest.raises(
        DeadRowError, match=r"cannot sample: rows \[1\] hold NaN logits; rows \[3\] have no allowed token"
    ):
        pipe(x, u=u, **params)
    out = pipe.sample(x, u=u, on_dead="flag", **params)
    assert out.valid.tolist() == [True, False, True, False, True]
    assert out.tokens[[1, 3]].tolist() == [-1, -1]
    assert torch.isnan(out.logprobs[[1, 3]]).all() and torch.isfinite(out.logprobs[[0, 2, 4]]).all()
    alive = x[[0, 2, 4]]
    assert out.tokens[[0, 2, 4]].tolist() == pipe(alive, u=u[[0, 2, 4]], **params).tolist()


def test_a_probs_row_of_zeros_is_dead():
    pipe = LogitsPipe([TopP(), Sample()])
    x = torch.softmax(_rand(3, 50), -1)
    x[2] = 0
    with pytest.raises(DeadRowError, match=r"rows \[2\] have no allowed token \(every probability is 0"):
        pipe(x, top_p=0.9)


def test_a_row_holding_plus_inf_among_finite_logits_is_named_for_it():
    x = _rand(3, 50)
    x[1, [7, 9]] = float("inf")
    with pytest.raises(DeadRowError, match=r"cannot sample: rows \[1\] hold \+inf logits \("):
        LogitsPipe([Temperature(), Softmax(), TopP(), Sample()])(x, u=_u(3), temperature=0.8, top_p=0.9)


def test_a_dead_row_from_a_per_row_temperature_of_zero_names_the_unchecked_tensor():
    pipe = LogitsPipe([Temperature(), Softmax(), TopK(), TopP(), Sample()])
    with pytest.raises(DeadRowError, match=r"rows \[0\] .*per-row tensors \['temperature'\] are not checked"):
        pipe(_rand(2, 50), u=_u(2), temperature=torch.tensor([0.0, 1.0]), top_k=2, top_p=0.5)


# ----------------------------------------------------------------------------- log-probabilities


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_k=8, top_p=0.8, min_p=0.02),
        dict(temperature=1.3, top_p=0.6, min_p=0.05),
        dict(temperature=0.5),
    ],
)
def test_processed_logprob_is_that_of_the_distribution_sampled_from(params, compiled):
    stages = [Temperature(), Softmax()]
    stages += [MinP()] if "min_p" in params else []
    stages += [TopK()] if "top_k" in params else []
    stages += [TopP()] if "top_p" in params else []
    pipe = LogitsPipe(stages + [Sample()], compile=compiled)
    x = _rand(64, 2500, seed=3)
    out = pipe.sample(x, u=_u(64), **params)
    expected = reference_probs(x, **params)
    chosen = expected[np.arange(64), out.tokens.numpy()]
    assert (chosen > 0).all()
    np.testing.assert_allclose(out.logprobs.numpy(), np.log(chosen), atol=2e-5)


def test_raw_logprobs_ranks_and_top_alternatives_are_of_the_input():
    pipe = LogitsPipe([Temperature(), Softmax(), TopK(), Sample()])
    x = _rand(16, 500, seed=8)
    out = pipe.sample(x, u=_u(16), temperature=0.5, top_k=5, top_logprobs=3)
    raw = torch.log_softmax(x.double(), -1)
    tokens = out.tokens
    np.testing.assert_allclose(out.raw.logprobs.numpy(), raw.gather(1, tokens[:, None]).squeeze(1).numpy(), atol=1e-5)
    expected_rank = (x > x.gather(1, tokens[:, None])).sum(-1) + 1
    assert torch.equal(out.raw.ranks, expected_rank)
    assert out.raw.ranks.max() <= 5  # top-k 5 samples only among the five best
    top_values, top_ids = raw.topk(3, dim=-1)
    assert torch.equal(out.raw.top_ids, top_ids)
    np.testing.assert_allclose(out.raw.top_logprobs.numpy(), top_values.numpy(), atol=1e-5)
    # processed >= raw here: temperature 0.5 and top-k sharpen the distribution
    assert (out.logprobs >= out.raw.logprobs - 1e-6).all()
    assert pipe.sample(x, u=_u(16), temperature=0.5, top_k=5).raw is None


def test_greedy_logprob_is_under_the_softmax_of_its_input():
    x = _rand(8, 100, seed=2)
    out = LogitsPipe([Greedy()]).sample(x)
    assert torch.equal(out.tokens, x.argmax(-1))
    np.testing.assert_allclose(out.logprobs.numpy(), torch.log_softmax(x, -1).max(-1).values.numpy(), atol=1e-6)
    probs = LogitsPipe([Greedy()], input_type=TensorType.PROBS).sample(torch.softmax(x, -1))
    np.testing.assert_allclose(probs.logprobs.numpy(), out.logprobs.numpy(), atol=1e-6)
