"""compare() against float64 references from the raw logits: top-k lower bounds, KL >= 0, stage aliases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sampling import Generator, SamplingParams
from tracker import add_tracking, compare

_KEYS = {"natural": "unstructured", "constrained": "structured"}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of raw logits ``[T, V]`` (``-inf`` stays ``-inf``)."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))


def _reference(logits_a: np.ndarray, logits_b: np.ndarray) -> dict[str, np.ndarray]:
    """TV, KL(a‖b) and JS per row, in float64 from the raw logits of whole rows."""
    la, lb = _log_softmax(logits_a), _log_softmax(logits_b)
    p, q = np.exp(la), np.exp(lb)
    lm = np.logaddexp(la, lb) - np.log(2.0)
    with np.errstate(invalid="ignore"):
        kl = np.where(p > 0, p * (la - lb), 0.0).sum(axis=1)
        js = 0.5 * np.where(p > 0, p * (la - lm), 0.0).sum(axis=1) + 0.5 * np.where(q > 0, q * (lb - lm), 0.0).sum(1)
    return {"tv": 0.5 * np.abs(p - q).sum(axis=1), "kl": kl, "js": js}


def _record(model, tok, prompts, params, **options):
    gen = add_tracking(Generator(model, tok), **options)
    for p in params:
        gen.generate(list(prompts), p)
    return gen.logits_processor.run


def _assert_matches(values: np.ndarray, reference: np.ndarray, what: str) -> None:
    assert (np.isinf(values) == np.isinf(reference)).all(), what
    finite = np.isfinite(reference)
    np.testing.assert_allclose(values[finite], reference[finite], rtol=1e-4, atol=2e-6, err_msg=what)


def test_topk_distances_are_finite_lower_bounds_of_the_float32_ones(demo):
    model, tok = demo
    rng = np.random.default_rng(4021)
    prompts = ['{"name": "Ada Lovelace", "city": "Oslo"}\n{"name": "', "Once upon a time", "1, 2, 3,", "Hi "]
    temperatures = [0.2, 0.3, 1.0, 2.0, *rng.uniform(0.2, 2.0, size=2).round(3)]
    params = [
        SamplingParams(
            temperature=float(t),
            seed=int(rng.integers(1 << 30)),
            top_p=0.9 if i == 4 else 1.0,  # one with rows masked outside the top-p set
            max_new_tokens=8,
            ignore_eos=True,
        )
        for i, t in enumerate(temperatures)
    ]
    full = _record(model, tok, prompts, params, storage="float32")
    topk = _record(model, tok, prompts, params, storage="topk", top_k=8)
    rows = peaked = 0
    for (ga, gb), seq in itertools.product(itertools.permutations(range(len(params)), 2), range(len(prompts))):
        exact = compare(full, full, generation_a=ga, generation_b=gb, sequence_a=seq)
        bound = compare(topk, topk, generation_a=ga, generation_b=gb, sequence_a=seq)
        assert exact.exact and not bound.exact
        assert bound.steps[["chosen_a", "chosen_b"]].equals(exact.steps[["chosen_a", "chosen_b"]])
        for stage in ("natural", "sampled"):
            la = full.get_logits(generation=ga, sequence=seq)[_KEYS.get(stage, stage)]
            lb = full.get_logits(generation=gb, sequence=seq)[_KEYS.get(stage, stage)]
            n = len(exact.steps)
            ref = _reference(la[:n], lb[:n])
            peaked += int((np.exp(_log_softmax(lb[:n])).max(axis=1) > 1 - 1e-7).sum())
            for name in ("tv", "kl", "js"):
                what = f"{name}_{stage} generations {ga}->{gb} sequence {seq}"
                seen, low = exact.steps[f"{name}_{stage}"].to_numpy(), bound.steps[f"{name}_{stage}"].to_numpy()
                _assert_matches(seen, ref[name], what)
                assert (low >= 0).all(), what
                assert np.isfinite(low[np.isfinite(seen)]).all(), what
                # up to float32 rounding: the same run's values (measured 7e-7), the float64 reference (2.4e-6)
                assert (low <= seen + 2e-6 + 1e-6 * seen).all(), (what, (low - seen).max())
                assert (low <= ref[name] + 5e-6 + 1e-6 * ref[name]).all(), (what, (low - ref[name]).max())
            rows += n
    assert rows > 1000 and peaked > 50  # the sweep holds rows where B keeps nearly all its mass in its top-k


def test_kl_is_never_negative_where_two_runs_nearly_agree(demo):
    model, tok = demo
    params = [SamplingParams(temperature=1.0, seed=3, max_new_tokens=16, ignore_eos=True)]
    alone = _record(model, tok, ["Hi there, my name is"], params)
    batched = _record(model, tok, ["Hi there, my name is", "The weather today in the north is"], params)
    result = compare(alone, batched)
    assert result.divergence is None
    for stage in ("natural", "sampled"):
        ref = _reference(alone.get_logits()[_KEYS.get(stage, stage)], batched.get_logits()[_KEYS.get(stage, stage)])
        for name in ("kl", "js"):
            values = result.steps[f"{name}_{stage}"].to_numpy()
            assert (values >= 0).all(), (name, stage, values.min())
            np.testing.assert_allclose(values, ref[name], atol=2e-6)


def test_stages_accept_the_alias_of_the_last_processor_stage(demo):
    from processors import PenaltiesLogitsProcessor, RegexLogitsProcessor

    model, tok = demo
    runs = []
    for seed in (0, 1):
        procs = [
            RegexLogitsProcessor(r"\(\d{3}\) \d{3}-\d{4}\.", tok),
            PenaltiesLogitsProcessor(repetition_penalty=1.3),
        ]
        gen = add_tracking(Generator(model, tok, procs), processor_stages=True)
        gen.generate(["Call Maria at "], SamplingParams(temperature=1.5, seed=seed, max_new_tokens=10))
        runs.append(gen.logits_processor.run)
    a, b = runs
    assert a.metadata.stage_aliases == {"after:penalties": "constrained"}
    result = compare(a, b, stages=["after:penalties", "after:regex"])
    assert result.stages == ["after:penalties", "after:regex"]
    n = len(result.steps)
    by_name = compare(a, b, stages=["constrained"])
    for stage, key in (("after:penalties", "structured"), ("after:regex", "after:regex")):
        ref = _reference(a.get_logits()[key][:n], b.get_logits()[key][:n])
        for name in ("tv", "kl", "js"):
            _assert_matches(result.steps[f"{name}_{stage}"].to_numpy(), ref[name], f"{name}_{stage}")
    np.testing.assert_array_equal(result.steps["tv_after:penalties"], by_name.steps["tv_constrained"])
    assert set(result.tokens["stage"]) <= {"after:penalties", "after:regex"}
    assert not result.tokens[result.tokens["stage"] == "after:penalties"].empty
    with pytest.raises(ValueError, match=r"stages \['after:nothing'\] are not recorded by both runs.*after:penalties"):
        compare(a, b, stages=["after:nothing"])
