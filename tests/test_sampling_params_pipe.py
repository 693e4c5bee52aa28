"""SamplingParams turned into a pipe: greedy rules, the documented stage order, the joint option."""

from __future__ import annotations

import pytest
import torch
from test_pipe_reference import goodness_of_fit, reference_probs

from sampling import SamplingParams


@pytest.mark.parametrize(
    "params, stages",
    [
        (SamplingParams(), ["Greedy"]),
        (SamplingParams(temperature=0, top_k=5), ["Greedy"]),
        (SamplingParams(top_k=1, temperature=2.0), ["Greedy"]),
        (SamplingParams(top_p=0, min_p=0.3), ["Greedy"]),
        (SamplingParams(temperature=0.7), ["Temperature(0.7)", "Softmax", "Sample"]),
        (SamplingParams(min_p=0.1), ["Temperature(1.0)", "Softmax", "MinP(0.1)", "Sample"]),
        (
            SamplingParams(top_k=50, top_p=0.9, min_p=0.05),
            ["Temperature(1.0)", "Softmax", "MinP(0.05)", "TopK(50)", "TopP(0.9)", "Sample"],
        ),
        (
            SamplingParams(top_k=50, top_p=0.9, joint_top_k_top_p=True),
            ["Temperature(1.0)", "Softmax", "TopK(50, joint=True)", "TopP(0.9)", "Sample"],
        ),
        # the joint filter needs both top-k and top-p
        (SamplingParams(top_k=50, joint_top_k_top_p=True), ["Temperature(1.0)", "Softmax", "TopK(50)", "Sample"]),
        (SamplingParams(top_p=1.0, temperature=0.9), ["Temperature(0.9)", "Softmax", "Sample"]),
    ],
)
def test_to_pipe_builds_the_stages_that_are_on(params, stages):
    pipe = params.to_pipe()
    assert [repr(p) for p in pipe.processors] == stages
    assert pipe.compiled_ops is not None


def test_to_pipe_samples_the_documented_distribution():
    params = SamplingParams(temperature=0.8, min_p=0.03, top_k=20, top_p=0.85)
    row = torch.randn(120, generator=torch.Generator().manual_seed(0)) * 2
    n = 12_000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tokens = params.to_pipe()(row.expand(n, -1).contiguous(), u=u).numpy()
    expected = reference_probs(row, temperature=0.8, min_p=0.03, top_k=20, top_p=0.85)[0]
    assert (expected[tokens] > 0).all()
    g, pvalue, dof = goodness_of_fit(tokens, expected)
    assert pvalue >= 1e-4, f"G-test G={g:.1f}, dof={dof}, p={pvalue:.2e}"


def test_greedy_pipe_is_the_arg_max():
    x = torch.randn(32, 500)
    assert torch.equal(SamplingParams(top_k=1).to_pipe()(x), x.argmax(-1))


def test_joint_option_is_validated_and_recorded():
    with pytest.raises(ValueError, match="joint_top_k_top_p must be a bool, got 1"):
        SamplingParams(joint_top_k_top_p=1)
    assert SamplingParams(top_k=5, joint_top_k_top_p=True).to_dict()["joint_top_k_top_p"] is True
    assert SamplingParams().to_dict()["joint_top_k_top_p"] is False
    assert SamplingParams(top_k=5, top_p=0.5, joint_top_k_top_p=True).active == (False, True, True, True)
    assert SamplingParams(top_k=1, joint_top_k_top_p=True).active == (False, False, False, False)


def test_joint_and_renormalised_filters_differ():
    """probs [0.4, 0.3, 0.2, 0.1], top-k 2, top-p 0.5: renormalised keeps one token, joint keeps two."""
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(2000, -1).contiguous()
    u = torch.rand(2000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    renorm = SamplingParams(temperature=1.0, top_k=2, top_p=0.5).to_pipe()(x, u=u)
    joint = SamplingParams(temperature=1.0, top_k=2, top_p=0.5, joint_top_k_top_p=True).to_pipe()(x, u=u)
    assert set(renorm.tolist()) == {0}
    assert set(joint.tolist()) == {0, 1}
    assert abs(float((joint == 1).double().mean()) - 3 / 7) < 0.04
