"""The sync-free algorithms ("sort", "radix", "pivot", what a GPU runs) against the CPU ones, on CPU tensors.

Forcing ``algorithm=`` runs a GPU's algorithms here. They must map every
uniform number to the same token as the CPU algorithms (which
``test_pipe_statistics`` checks against exact float64 probabilities), give
the same log-probabilities and the same "sampled" tap, sample the exact
distribution themselves, and read no tensor value on the host during a call.
"""

from __future__ import annotations

import pytest
import torch
from test_pipe_statistics import CASES, _assert_fits, _draw, _expected, _logits, _stages

from sampling.pipe import SAMPLED, LogitsPipe, MinP, PipeError, Sample, Softmax, Tap, Temperature, TopK, TopP
from sampling.pipe import kernels as K

SYNC_FREE = ("sort", "radix", "pivot")

PIPES = {
    "top_p": ([Temperature(), Softmax(), TopP(), Sample()], dict(temperature=0.7, top_p=0.9)),
    "top_k top_p": ([Temperature(), Softmax(), TopK(), TopP(), Sample()], dict(temperature=0.7, top_k=50, top_p=0.9)),
    "min_p": ([Temperature(), Softmax(), MinP(), Sample()], dict(temperature=0.7, min_p=0.05)),
    "temperature": ([Temperature(), Softmax(), Sample()], dict(temperature=1.3)),
    "min_p top_p": ([Temperature(), Softmax(), MinP(), TopP(), Sample()], dict(temperature=0.9, min_p=0.02, top_p=0.7)),
    "joint": ([Softmax(), TopK(joint=True), TopP(), Sample()], dict(top_k=20, top_p=0.5)),
    "logits top_k": ([TopK(), Sample()], dict(top_k=30)),
}


def _batch(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits with ties at likely boundaries, a row of equal logits, and rows with -inf tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[:, 5:40] = x[:, 2:3]  # a block of ties near the top of some rows
    x[:, 100:110] = x[:, 100:101].clamp(min=x[:, :100].amax(-1, keepdim=True) - 1)  # ties around the top
    x[1] = 0.5  # 1001 equal tokens: no top-p boundary falls exactly on a token, where rounding would decide
    x[1, 1001:] = float("-inf")
    x[2, : vocab // 2] = float("-inf")
    return x


def _u(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("vocab", [300, 2500], ids=["sorting crossings", "whole-vocabulary crossings"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "plain ops"])
@pytest.mark.parametrize("name", list(PIPES))
def test_every_algorithm_draws_the_same_token_for_the_same_uniform(name, compiled, vocab):
    stages, params = PIPES[name]
    x = _batch(32, vocab, seed=vocab)
    u = _u(32)
    taps: dict[str, list] = {}
    results = {}
    for algorithm in ("cpu", *SYNC_FREE):
        seen = taps.setdefault(algorithm, [])
        pipe = LogitsPipe(stages, compile=compiled, algorithm=algorithm)
        results[algorithm] = pipe.sample(x, u=u, taps=[Tap(SAMPLED, lambda t, s=seen: s.append(t.data))], **params)
    cpu = results["cpu"]
    for algorithm in SYNC_FREE:
        out = results[algorithm]
        differ = int((out.tokens != cpu.tokens).sum())
        assert differ == 0, f"{name} {algorithm}: {differ} of 32 tokens differ from the CPU algorithm's"
        torch.testing.assert_close(out.logprobs, cpu.logprobs, atol=2e-5, rtol=0)
        torch.testing.assert_close(taps[algorithm][0], taps["cpu"][0], atol=1e-6, rtol=1e-5)


def test_per_row_parameters_with_a_host_bound_of_top_k():
    x = _batch(96, 2500, seed=7)
    g = torch.Generator().manual_seed(8)
    params = dict(
        temperature=torch.rand(96, generator=g) + 0.5,
        min_p=torch.rand(96, generator=g) * 0.05,
        top_k=torch.randint(0, 80, (96,), generator=g),  # 0: no top-k for that row
        top_p=torch.rand(96, generator=g) * 0.5 + 0.5,
    )
    stages = [Temperature(), Softmax(), MinP(), TopK(), TopP(), Sample()]
    u = _u(96, seed=9)
    cpu = LogitsPipe(stages, algorithm="cpu").sample(x, u=u, **params)
    for algorithm in SYNC_FREE:
        for bound in (None, 2500):  # no bound: the whole row is the candidates
            out = LogitsPipe(stages, algorithm=algorithm).sample(x, u=u, max_top_k=bound, **params)
            assert torch.equal(out.tokens, cpu.tokens), (algorithm, bound)
    bounded = dict(params, top_k=params["top_k"].clamp(min=1))
    cpu = LogitsPipe(stages, algorithm="cpu").sample(x, u=u, **bounded)
    out = LogitsPipe(stages, algorithm="sort").sample(x, u=u, max_top_k=79, **bounded)
    assert torch.equal(out.tokens, cpu.tokens)


def test_probs_input_counts_as_summing_to_one_on_every_algorithm():
    x = torch.softmax(_batch(32, 2100, seed=3).double(), -1).float() * 0.5  # rows sum to 0.5
    u = _u(32)
    pipe = {a: LogitsPipe([TopP(), Sample()], algorithm=a) for a in ("cpu", *SYNC_FREE)}
    for top_p in (0.3, 0.45, 0.9):
        expected = pipe["cpu"](x, u=u, top_p=top_p)
        for algorithm in SYNC_FREE:
            assert torch.equal(pipe[algorithm](x, u=u, top_p=top_p), expected), (algorithm, top_p)


@pytest.mark.parametrize("algorithm", ["cpu", *SYNC_FREE])
def test_top_p_on_logits_keeps_the_float64_prefix_on_a_large_flat_row(algorithm):
    # near-flat rows of 20,000 tokens: a float32 softmax sums to 1 - 1e-5 or so, enough to move a top-p cut by a
    # token when the cut is measured against 1 instead of the row's own total
    g = torch.Generator().manual_seed(5)
    pipe = LogitsPipe([Softmax(), TopP(), Sample()], algorithm=algorithm)
    checked = 0
    for _ in range(8):
        x = torch.randint(0, 2, (1, 20000), generator=g).float() * 1e-3
        p = torch.softmax(x[0].double(), -1)
        ordered = p[torch.sort(x[0], descending=True, stable=True).indices]
        before = ordered.cumsum(0) - ordered
        kept = int((before < 0.99).sum())
        if min(0.99 - before[kept - 1], before[kept] - 0.99) < 0.02 * ordered[kept - 1]:
            continue  # within rounding of a boundary: either side is right
        seen: list[torch.Tensor] = []
        pipe(x, u=_u(1), top_p=0.99, taps=[Tap(SAMPLED, lambda t, s=seen: s.append(t.data))])
        assert int((seen[0] > 0).sum()) == kept
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize("algorithm", SYNC_FREE)
@pytest.mark.parametrize(
    "case", ["top_p", "min_p", "temperature top_k top_p", "min_p top_p", "joint top_k top_p", "top_k at a tie"]
)
def test_sync_free_algorithms_sample_the_exact_distribution(case, algorithm):
    params = CASES[case]
    row = _logits(200, seed=200 + len(case))
    expected = _expected(row, params)
    pipe = LogitsPipe(_stages(params), algorithm=algorithm)
    _assert_fits(_draw(pipe, row, params, seed=1), expected, f"{case} {algorithm}")


@pytest.mark.parametrize("algorithm", SYNC_FREE)
def test_dead_rows_are_flagged_on_the_sync_free_algorithms(algorithm):
    x = _batch(6, 2100, seed=5)
    x[1, 17] = float("nan")
    x[3] = float("-inf")
    for name, (stages, params) in PIPES.items():
        out = LogitsPipe(stages, algorithm=algorithm).sample(x, u=_u(6), on_dead="flag", **params)
        assert out.valid.tolist() == [True, False, True, False, True, True], name
        assert out.tokens[[1, 3]].tolist() == [-1, -1], name


def test_bad_algorithm_and_bound_are_refused():
    with pytest.raises(
        PipeError, match=r"algorithm must be one of \['auto', 'cpu', 'sort', 'radix', 'pivot'\], got 'gpu'"
    ):
        LogitsPipe([Softmax(), Sample()], algorithm="gpu")
    pipe = LogitsPipe([Softmax(), TopK(), Sample()])
    with pytest.raises(PipeError, match=r"max_top_k must be an int >= 1 \(a bound of the per-row top_k\), got 0"):
        pipe(torch.zeros(2, 10), top_k=torch.tensor([1, 2]), max_top_k=0)
    with pytest.raises(PipeError, match=r"on_dead must be 'raise' or 'flag', got 'skip'"):
        pipe(torch.zeros(2, 10), top_k=3, on_dead="skip")


def test_auto_picks_the_cpu_algorithm_on_a_cpu_and_a_sort_elsewhere():
    assert K.resolve_algorithm("auto", torch.device("cpu")) == "cpu"
    assert K.resolve_algorithm("auto", torch.device("cuda", 0)) == "sort"  # the pivot search lost every GPU point
    assert K.resolve_algorithm("radix", torch.device("cpu")) == "radix"
    assert K.resolve_algorithm("pivot", torch.device("cuda", 0)) == "pivot"


# ----------------------------------------------------------------------------- no host reads

READS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts calls that read a tensor's values on the host (what synchronises a GPU)."""
    counts = {name: 0 for name in READS}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __name=name, __original=original, **kwargs):
            counts[__name] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    original_nonzero = torch.nonzero

    def nonzero(*args, **kwargs):
        counts["nonzero"] += 1
        return original_nonzero(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", nonzero)
    return counts


def test_sync_free_calls_read_no_tensor_value(host_reads):
    x = _batch(16, 2100, seed=11)
    u = _u(16)
    per_row = dict(temperature=torch.full((16,), 0.8), top_k=torch.arange(1, 17), top_p=torch.full((16,), 0.9))
    calls = 0
    for algorithm in SYNC_FREE:
        for compiled in (True, False):
            for stages, params in PIPES.values():
                pipe = LogitsPipe(stages, compile=compiled, algorithm=algorithm)
                pipe.sample(x, u=u, on_dead="flag", taps=[Tap(SAMPLED, lambda t: None)], **params)
                calls += 1
            full = LogitsPipe(
                [Temperature(), Softmax(), MinP(), TopK(), TopP(), Sample()], compile=compiled, algorithm=algorithm
            )
            full.sample(x, u=u, on_dead="flag", max_top_k=16, min_p=0.01, **per_row)
            calls += 1
    assert calls == 48
    assert sum(host_reads.values()) == 0, f"host reads in sync-free calls: {host_reads}"
    # the counter counts: the CPU algorithms read values (the top-k tie check at least)
    LogitsPipe([TopK(), Sample()], algorithm="cpu").sample(x, u=u, on_dead="flag", top_k=30)
    assert sum(host_reads.values()) > 0
