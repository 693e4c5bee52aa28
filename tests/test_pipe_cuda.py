"""The pipe on CUDA (skipped without it): exact distributions at a real vocabulary, no host sync, CPU parity.

Sized to run in well under a minute on an H100 (the whole CUDA set, ``pytest
-m cuda``, must finish in 3). Statistics at the vocabulary of Llama 3
(128,256 tokens): ``ROWS`` rows of random logits (standard normal times 4, so
the mass sits on tens of tokens, with ties) are each drawn ``DRAWS`` times,
not by looping over steps but by repeating each row ``CHUNK`` times per call
with one independent uniform per copy (the Generator's counter-based
streams), so one setting costs a few calls. The total variation between the
frequencies and the float64 reference distribution
(``test_pipe_reference.reference_probs``) is compared with the total
variation of as many draws from the reference itself (``torch.multinomial``
in float64), which is what sampling noise alone gives. At these sizes the
mean over the rows has a standard deviation of about 0.0015 under the
reference itself (simulated: means 0.015-0.027 with a cut, 0.19 without),
so the margin (25% plus 0.005, 0.008-0.012 with a cut) is five or more
standard deviations of the difference wide; a cut off by one token moves a
row's total variation by that token's probability. No token of probability
0 may ever be drawn; both measured values are in the message.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pipe_pivot import dyadic_rows
from test_pipe_reference import reference_probs

from sampling.functional import RowParams, row_keys, sample, uniforms
from sampling.params import SamplingParams
from sampling.pipe import SAMPLED, LogitsPipe, MinP, Sample, Softmax, Tap, Temperature, TopK, TopP
from sampling.pipe import pivot as P

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 128_256
ROWS, DRAWS, CHUNK = 8, 4_000, 500  # each row copied 500 times per call: 8 calls of 4,000 rows (2 GB of logits)
STATISTICAL = ("sort", "pivot")  # what "auto" picks on a GPU; "radix" is checked for parity below and on CPU
ALGORITHMS = ("sort", "radix", "pivot")
SETTINGS = {
    "top_p": dict(temperature=0.7, top_p=0.9),
    "top_k top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "min_p": dict(temperature=0.7, min_p=0.05),
    "temperature": dict(temperature=1.0),
    "joint top_k top_p": dict(temperature=1.0, top_k=40, top_p=0.6, joint=True),
}


def _stages(params: dict) -> list:
    stages = [Temperature(), Softmax()]
    stages += [MinP()] if "min_p" in params else []
    stages += [TopK(joint=params.get("joint", False))] if "top_k" in params else []
    stages += [TopP()] if "top_p" in params else []
    return stages + [Sample()]


def _call(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "joint"}


def _logits(batch: int, seed: int) -> torch.Tensor:
    x = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    x[:, 1000:1004] = x[:, 7:8]  # ties
    return x


_REFERENCE: dict[tuple[str, int], np.ndarray] = {}


def _reference(setting: str, batch: int) -> np.ndarray:
    key = (setting, batch)
    if key not in _REFERENCE:
        p = SETTINGS[setting]
        _REFERENCE[key] = reference_probs(
            _logits(batch, seed=batch),
            temperature=p["temperature"],
            min_p=p.get("min_p"),
            top_k=p.get("top_k"),
            top_p=p.get("top_p"),
            joint=p.get("joint", False),
        )
    return _REFERENCE[key]


def _total_variation(counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (counts / counts.sum(-1, keepdim=True) - probs).abs().sum(-1)


@pytest.mark.parametrize("algorithm", STATISTICAL)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_cuda_samples_match_the_float64_reference(setting, algorithm):
    params = SETTINGS[setting]
    expected = torch.from_numpy(_reference(setting, ROWS)).cuda()
    x = _logits(ROWS, seed=ROWS).cuda()
    pipe = LogitsPipe(_stages(params), algorithm=algorithm)
    counts = torch.zeros(ROWS, VOCAB, dtype=torch.float64, device="cuda")
    valid = torch.ones((), dtype=torch.bool, device="cuda")
    copies = torch.arange(ROWS, device="cuda").repeat_interleave(CHUNK)  # which row each copy is
    repeated = x.index_select(0, copies)
    ones = torch.ones(ROWS * CHUNK, dtype=torch.float64, device="cuda")
    for call in range(DRAWS // CHUNK):
        keys = row_keys(torch.full_like(copies, 1234), torch.arange(ROWS * CHUNK, device="cuda"))
        out = pipe.sample(repeated, u=uniforms(keys, call), on_dead="flag", **_call(params))
        valid &= out.valid.all()
        counts.view(-1).index_add_(0, copies * VOCAB + out.tokens.clamp(min=0), ones)
    assert bool(valid), f"{setting} {algorithm}: live rows flagged dead"
    impossible = int(((expected == 0) & (counts > 0)).sum())
    assert impossible == 0, f"{setting} {algorithm}: {impossible} tokens of probability 0 were drawn"
    null = torch.multinomial(expected, DRAWS, replacement=True, generator=torch.Generator("cuda").manual_seed(5))
    null_counts = torch.zeros_like(counts).scatter_add_(1, null, torch.ones_like(null, dtype=torch.float64))
    tv = float(_total_variation(counts, expected).mean())
    tv_null = float(_total_variation(null_counts, expected).mean())
    assert tv <= 1.25 * tv_null + 0.005, (
        f"{setting} {algorithm}: mean total variation {tv:.4f} over {DRAWS} draws per row, "
        f"sampling noise alone gives {tv_null:.4f}"
    )


def test_pivot_search_on_cuda_matches_the_pytorch_version_and_the_cpu():
    """The Triton kernel (when triton is there) and the PyTorch bisection agree on CUDA and with the CPU."""
    g = torch.Generator().manual_seed(6)
    rows = torch.cat([dyadic_rows(vocab=VOCAB), torch.softmax(_logits(8, seed=6), -1)])
    for inclusive in (True, False):
        need = torch.rand(rows.shape[0], dtype=torch.float64, generator=g)
        cpu = P.pivot_crossing_torch(rows, need, inclusive)
        for use_triton in (False, True) if P._triton_ready(rows.cuda()) else (False,):
            got = P.pivot_crossing(rows.cuda(), need.cuda(), inclusive, use_triton=use_triton)
            assert torch.equal(got[0].cpu(), cpu[0]), f"values differ (triton={use_triton}, inclusive={inclusive})"
            assert torch.equal(got[2].cpu(), cpu[2]), f"ties differ (triton={use_triton}, inclusive={inclusive})"
            torch.testing.assert_close(got[1].cpu(), cpu[1], rtol=1e-12, atol=0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cpu_and_cuda_draw_the_same_tokens_for_the_same_uniforms(algorithm):
    x = _logits(256, seed=3)
    u = uniforms(row_keys(torch.full((256,), 9), torch.arange(256)), 0)
    for setting, params in SETTINGS.items():
        cpu = LogitsPipe(_stages(params)).sample(x, u=u, **_call(params))
        gpu = LogitsPipe(_stages(params), algorithm=algorithm).sample(x.cuda(), u=u.cuda(), **_call(params))
        differ = int((gpu.tokens.cpu() != cpu.tokens).sum())
        assert differ <= 2, f"{setting} {algorithm}: {differ} of 256 tokens differ between CPU and CUDA"


def test_pipe_calls_do_not_synchronise_the_device():
    batch = 64
    x = _logits(batch, seed=4).cuda()
    u = uniforms(row_keys(torch.full((batch,), 1, device="cuda"), torch.arange(batch, device="cuda")), 0)
    per_row = dict(
        temperature=torch.linspace(0.5, 1.5, batch, device="cuda"),
        min_p=torch.full((batch,), 0.01, device="cuda"),
        top_k=torch.arange(1, batch + 1, device="cuda"),
        top_p=torch.linspace(0.5, 1.0, batch, device="cuda"),
    )
    calls = []
    for algorithm in ALGORITHMS:
        for compiled in (True, False):
            for params in SETTINGS.values():
                pipe = LogitsPipe(_stages(params), compile=compiled, algorithm=algorithm)
                kwargs = _call(params)
                calls.append(lambda p=pipe, c=kwargs: p.sample(x, u=u, on_dead="flag", **c))
                calls.append(
                    lambda p=pipe, c=kwargs: p.sample(x, u=u, on_dead="flag", taps=[Tap(SAMPLED, lambda t: None)], **c)
                )
            full = LogitsPipe(_stages(dict(min_p=1, top_k=1, top_p=1)), compile=compiled, algorithm=algorithm)
            calls.append(lambda p=full: p.sample(x, u=u, on_dead="flag", max_top_k=batch, **per_row))
    four = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)]
    four += [SamplingParams(top_k=20, top_p=0.8), SamplingParams(top_k=27, top_p=0.8)]  # a per-row top_k
    rows = RowParams.build(four * (batch // 4), "cuda")
    calls.append(lambda: sample(x, rows, u, on_dead="flag", taps=[lambda p: None]))
    w, need = torch.softmax(x, -1), u.double()
    calls += [lambda inc=inc: P.pivot_crossing(w, need, inc, use_triton=False) for inc in (True, False)]
    for call in calls:  # warm-up: allocations, plans
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, call in enumerate(calls):
            try:
                call()
            except Exception as e:  # the pipe wraps an op's error in a PipeError
                raise AssertionError(f"call {i} synchronised the device: {e}") from e
    finally:
        torch.cuda.set_sync_debug_mode("default")
