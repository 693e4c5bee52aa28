"""Taps: every stage observable, the same tensors compiled or not, results unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pipe_reference import reference_probs

from sampling.pipe import (
    INPUT,
    SAMPLED,
    Greedy,
    LogitsPipe,
    MinP,
    PipeError,
    Sample,
    Softmax,
    Tap,
    Temperature,
    TensorType,
    TopK,
    TopP,
)

PARAMS = dict(temperature=0.8, min_p=0.02, top_k=12, top_p=0.7)


def _stages(top_k: bool = True):
    return [Temperature(), Softmax(), MinP(), *([TopK()] if top_k else []), TopP(), Sample()]


def _record(pipe: LogitsPipe) -> tuple[list[Tap], dict[str, list]]:
    seen: dict[str, list] = {stage: [] for stage in pipe.tap_stages}
    return [Tap(stage, seen[stage].append) for stage in pipe.tap_stages], seen


@pytest.mark.parametrize("top_k", [True, False])
def test_every_stage_is_observed_and_compiled_equals_uncompiled(top_k):
    x = torch.randn(32, 3000, generator=torch.Generator().manual_seed(0)) * 2
    u = torch.rand(32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    params = PARAMS if top_k else {k: v for k, v in PARAMS.items() if k != "top_k"}
    compiled = LogitsPipe(_stages(top_k))
    plain = LogitsPipe(_stages(top_k), compile=False)
    assert len(compiled.compiled_ops) == 1  # every stage but the input hides inside one fused op
    untapped = compiled(x, u=u, **params)
    results = {}
    for name, pipe in (("compiled", compiled), ("plain", plain)):
        taps, seen = _record(pipe)
        tokens = pipe(x, u=u, taps=taps, **params)
        assert torch.equal(tokens, untapped), f"{name}: taps changed the tokens"
        assert all(len(v) == 1 for v in seen.values()), {k: len(v) for k, v in seen.items()}
        results[name] = {stage: v[0] for stage, v in seen.items()}
    for stage in compiled.tap_stages:
        a, b = results["compiled"][stage], results["plain"][stage]
        assert a.type is b.type, stage
        assert torch.allclose(a.data.double(), b.data.double(), atol=1e-6), stage
    types = {stage: t.type for stage, t in results["compiled"].items()}
    assert types[INPUT] is types["temperature"] is TensorType.LOGITS
    assert types["softmax"] is types["top_p"] is types[SAMPLED] is TensorType.PROBS
    assert types["sample"] is TensorType.INDICES
    assert results["compiled"][INPUT].data is x  # handed over as is: no copy


def test_the_sampled_stage_is_the_exact_distribution_sampled_from():
    x = torch.randn(8, 400, generator=torch.Generator().manual_seed(2)) * 2
    expected = reference_probs(x, **PARAMS)
    for compiled in (True, False):
        seen = []
        LogitsPipe(_stages(), compile=compiled).sample(x, taps=[Tap(SAMPLED, seen.append)], **PARAMS)
        sampled = seen[0].data
        assert sampled.dtype == torch.float32 and sampled.shape == x.shape
        np.testing.assert_allclose(sampled.double().numpy(), expected, atol=1e-6)
        assert torch.equal(sampled == 0, torch.from_numpy(expected == 0))  # exactly 0 where removed
        np.testing.assert_allclose(sampled.sum(-1).numpy(), 1.0, atol=1e-5)


def test_greedy_sampled_stage_is_one_hot():
    x = torch.randn(4, 50)
    seen = []
    tokens = LogitsPipe([Greedy()])(x, taps=[Tap(SAMPLED, seen.append)])
    assert torch.equal(seen[0].data, torch.nn.functional.one_hot(tokens, 50).float())


def test_several_taps_on_one_stage_and_bad_taps():
    pipe = LogitsPipe([Softmax(), TopP(), Sample()])
    first, second = [], []
    pipe(torch.randn(2, 30), top_p=0.5, taps=[Tap("top_p", first.append), Tap("top_p", second.append)])
    assert len(first) == len(second) == 1 and first[0] is second[0]
    with pytest.raises(
        PipeError,
        match=r"taps\[0\]: unknown stage 'top_k'; this pipe has stages \['input', 'softmax', 'top_p', 'sample', 'sampled'\]",
    ):
        pipe(torch.randn(2, 30), top_p=0.5, taps=[Tap("top_k", print)])
    with pytest.raises(PipeError, match=r"taps\[0\]: fn must be callable, got int"):
        pipe(torch.randn(2, 30), top_p=0.5, taps=[Tap("top_p", 3)])
    with pytest.raises(PipeError, match=r"unknown stage 'sampled'"):
        LogitsPipe([Softmax(), TopP()])(torch.randn(2, 30), top_p=0.5, taps=[Tap(SAMPLED, print)])


@pytest.mark.parametrize("algorithm", ["cpu", "sort", "radix"])
def test_a_tap_on_the_sampled_stage_changes_no_token_and_sees_the_exact_distribution(algorithm):
    """On the whole-vocabulary path (no top-k, a vocabulary past the sorting cut-off) the distribution is built only
    for a tap: tapped and untapped calls agree, and what the tap sees is the float64 reference.

    (What skipping it saves, a [B, V] tensor per call, is printed by benchmarks/bench_sampling.py.)
    """
    x = torch.randn(16, 3000, generator=torch.Generator().manual_seed(5)) * 2
    u = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params = dict(temperature=0.9, min_p=0.01, top_p=0.8)
    pipe = LogitsPipe(_stages(top_k=False), algorithm=algorithm)
    untapped = pipe.sample(x, u=u, **params)
    seen = []
    tapped = pipe.sample(x, u=u, taps=[Tap(SAMPLED, seen.append)], **params)
    assert torch.equal(tapped.tokens, untapped.tokens) and torch.equal(tapped.logprobs, untapped.logprobs)
    expected = reference_probs(x, **params)
    np.testing.assert_allclose(seen[0].data.double().numpy(), expected, atol=1e-6)
    assert torch.equal(seen[0].data == 0, torch.from_numpy(expected == 0))
    chosen = np.log(expected[np.arange(16), tapped.tokens.numpy()])
    np.testing.assert_allclose(tapped.logprobs.double().numpy(), chosen, atol=1e-5)
