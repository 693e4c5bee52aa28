"""Sampling frequencies against exact float64 probabilities, compiled and uncompiled.

Each case draws 12,000 seeded samples of one random logits row (with a block
of tied logits) in a single batched call, and runs a G-test against the
distribution that :func:`test_pipe_reference.reference_probs` computes in
float64. Tolerance: the test passes when the G-test p-value is >= 1e-4 (all
seeds fixed, so the outcome is deterministic; the measured G, degrees of
freedom and p-value are in the assertion message). A token of probability 0
must never be drawn. The compiled and uncompiled pipes must draw the same
token for the same uniform number (they implement one order and one CDF).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pipe_reference import goodness_of_fit, reference_probs

from sampling.pipe import LogitsPipe, MinP, Sample, Softmax, Temperature, TensorType, TopK, TopP

N = 12_000
MIN_PVALUE = 1e-4


def _logits(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2.0
    x[7:11] = x[3]  # a block of ties around a likely boundary
    return x


def _stages(params: dict) -> list:
    stages = [Temperature(), Softmax()]
    if "min_p" in params:
        stages.append(MinP())
    if "top_k" in params:
        stages.append(TopK(joint=params.get("joint", False)))
    if "top_p" in params:
        stages.append(TopP())
    return stages + [Sample()]


CASES = {
    "temperature": dict(temperature=0.6),
    "hot temperature": dict(temperature=1.7),
    "top_k": dict(temperature=1.0, top_k=7),
    "top_k at a tie": dict(temperature=1.0, top_k=9),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "temperature top_k top_p": dict(temperature=0.8, top_k=20, top_p=0.8),
    "min_p top_k top_p": dict(temperature=1.3, min_p=0.02, top_k=25, top_p=0.9),
    "min_p top_p": dict(temperature=0.9, min_p=0.05, top_p=0.6),
    "min_p top_k": dict(temperature=1.2, min_p=0.08, top_k=12),
    "joint top_k top_p": dict(temperature=1.0, top_k=10, top_p=0.6, joint=True),
}


def _draw(pipe: LogitsPipe, row: torch.Tensor, params: dict, seed: int) -> torch.Tensor:
    u = torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    call = {k: v for k, v in params.items() if k != "joint"}
    return pipe(row.expand(N, -1).contiguous(), u=u, **call)


def _assert_fits(tokens: torch.Tensor, expected: np.ndarray, what: str) -> None:
    drawn = tokens.numpy()
    impossible = np.flatnonzero(expected[drawn] == 0)
    assert impossible.size == 0, f"{what}: drew tokens of probability 0: {np.unique(drawn[impossible])[:10]}"
    g, pvalue, dof = goodness_of_fit(drawn, expected)
    assert pvalue >= MIN_PVALUE, f"{what}: G-test G={g:.1f}, dof={dof}, p={pvalue:.2e} < {MIN_PVALUE}"


def _expected(row, params: dict) -> object:
    """The exact float64 distribution a pipe with ``params`` samples from ``row``."""
    return reference_probs(
        row,
        temperature=params["temperature"],
        min_p=params.get("min_p"),
        top_k=params.get("top_k"),
        top_p=params.get("top_p"),
        joint=params.get("joint", False),
    )[0]


@pytest.mark.parametrize("vocab", [50, 200])
@pytest.mark.parametrize("case", list(CASES))
def test_samples_match_the_exact_distribution_compiled_and_not(case, vocab):
    params = CASES[case]
    row = _logits(vocab, seed=vocab + len(case))
    expected = _expected(row, params)
    compiled = LogitsPipe(_stages(params))
    plain = LogitsPipe(_stages(params), compile=False)
    a = _draw(compiled, row, params, seed=1)
    b = _draw(plain, row, params, seed=1)
    _assert_fits(a, expected, f"{case} compiled {compiled.compiled_ops[0].name}")
    _assert_fits(b, expected, f"{case} uncompiled")
    differ = int((a != b).sum())
    assert differ <= N // 1000, f"{case}: compiled and uncompiled differ on {differ} of {N} uniforms"


def test_probs_input_with_top_k_and_top_p():
    row = _logits(80, seed=5)
    probs = torch.softmax(row.double(), -1).float()
    pipe = LogitsPipe([TopK(), TopP(), Sample()], input_type=TensorType.PROBS)
    expected = reference_probs(probs.double(), top_k=15, top_p=0.75, from_probs=True)[0]
    _assert_fits(_draw(pipe, probs, dict(top_k=15, top_p=0.75), seed=2), expected, "PROBS top_k top_p")


def test_per_row_parameters_in_one_batch():
    """Eight settings, 4,000 rows each, one call with per-row tensors; neutral values switch stages off."""
    settings = [
        dict(temperature=0.5, min_p=0.0, top_k=0, top_p=1.0),
        dict(temperature=1.0, min_p=0.0, top_k=5, top_p=1.0),
        dict(temperature=1.0, min_p=0.0, top_k=0, top_p=0.5),
        dict(temperature=1.0, min_p=0.2, top_k=0, top_p=1.0),
        dict(temperature=1.5, min_p=0.01, top_k=30, top_p=0.9),
        dict(temperature=0.8, min_p=0.0, top_k=12, top_p=0.7),
        dict(temperature=2.0, min_p=0.05, top_k=0, top_p=0.8),
        dict(temperature=1.1, min_p=0.0, top_k=1, top_p=1.0),
    ]
    per = 4_000
    row = _logits(120, seed=11)
    batch = row.expand(per * len(settings), -1).contiguous()
    column = {
        name: torch.tensor(
            [s[name] for s in settings for _ in range(per)], dtype=torch.long if name == "top_k" else torch.float32
        )
        for name in ("temperature", "min_p", "top_k", "top_p")
    }
    u = torch.rand(len(batch), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    stages = [Temperature(), Softmax(), MinP(), TopK(), TopP(), Sample()]
    for compiled in (True, False):
        tokens = LogitsPipe(stages, compile=compiled)(batch, u=u, **column)
        for i, s in enumerate(settings):
            expected = reference_probs(
                row,
                temperature=s["temperature"],
                min_p=s["min_p"] or None,
                top_k=s["top_k"] or None,
                top_p=s["top_p"],
            )[0]
            _assert_fits(tokens[i * per : (i + 1) * per], expected, f"setting {i} {s} compiled={compiled}")
