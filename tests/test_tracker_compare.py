"""compare(run_a, run_b): divergence, distances against a float64 reference, storage modes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sampling import Generator, SamplingParams
from tracker import Run, add_tracking, compare
from tracker.reading.compare import distances


def _run(model, tok, seed, storage="float32", seeds=None):
    gen = add_tracking(Generator(model, tok), storage=storage)
    for s in seeds or [seed]:
        gen.generate("My dog", SamplingParams(temperature=1.0, seed=s, max_new_tokens=16, ignore_eos=True))
    return gen.logits_processor.run


def test_a_run_against_itself_has_no_divergence_and_zero_distances(tiny_model, char_tokenizer):
    run = _run(tiny_model, char_tokenizer, 0)
    result = compare(run, run)
    assert result.divergence is None and result.same and result.exact
    assert result.steps["same"].all() and len(result.steps) == 16
    for stage in ("natural", "sampled"):
        for name in ("tv", "kl", "js"):
            assert (result.steps[f"{name}_{stage}"] == 0).all(), (name, stage)
    assert result.tokens.empty
    assert run.diff(run).same


def test_two_seeds_diverge_where_the_chosen_tokens_first_differ(tiny_model, char_tokenizer):
    a, b = _run(tiny_model, char_tokenizer, 0), _run(tiny_model, char_tokenizer, 1)
    chosen_a, chosen_b = a.stats()["chosen_id"].to_numpy(), b.stats()["chosen_id"].to_numpy()
    expected = int(np.nonzero(chosen_a != chosen_b)[0][0])
    result = compare(a, b)
    assert result.divergence == expected
    assert f"at step {expected}" in result.summary()
    steps = result.steps
    # before the divergence both saw the same text: the natural distributions are equal
    assert (steps["tv_natural"][: expected + 1] < 1e-6).all()
    if expected + 1 < len(steps):
        assert steps["tv_natural"][expected + 1 :].max() > 0
    # the same two generations inside one run compare the same way
    both = _run(tiny_model, char_tokenizer, None, seeds=[0, 1])
    assert compare(both, both, generation_a=0, generation_b=1).divergence == expected


def test_distances_equal_a_float64_reference_on_random_rows():
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.full(50, 0.3), size=6)
    q = rng.dirichlet(np.full(50, 0.3), size=6)
    q[0, :5] = 0.0
    q[0] /= q[0].sum()
    tv, kl, js, exact = distances(p, q)
    m = (p + q) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        ref_kl = np.where(p > 0, p * np.log(p / q), 0.0).sum(axis=1)
        ref_js = 0.5 * np.where(p > 0, p * np.log(p / m), 0).sum(1) + 0.5 * np.where(q > 0, q * np.log(q / m), 0).sum(1)
    np.testing.assert_allclose(tv, 0.5 * np.abs(p - q).sum(axis=1), rtol=1e-12)
    assert math.isinf(kl[0]) and np.isinf(ref_kl[0])
    np.testing.assert_allclose(kl[1:], ref_kl[1:], rtol=1e-10)
    np.testing.assert_allclose(js, ref_js, rtol=1e-10)
    assert exact.all()


def test_topk_runs_whose_stored_tokens_do_not_overlap_get_bounds_that_say_they_differ(tmp_path):
    """Two peaked sequences with disjoint favourites: the bucket of 'the rest' alone reads both as all-bucket
    (distance ~0); the bounds must stay below the float64 truth and still say the rows are far apart."""
    from dashboard.synthetic import hand_made_run

    rng = np.random.default_rng()
    vocab, steps = 300, 6
    natural = rng.normal(size=(2, steps, vocab)).astype(np.float32)
    favourites = rng.permutation(vocab)[:10].reshape(2, 5)
    for s in range(2):
        natural[s][:, favourites[s]] += rng.uniform(6, 8, size=(steps, 5)).astype(np.float32)
    chosen = natural.argmax(-1)
    run = hand_made_run(natural, chosen, [f"t{i}" for i in range(vocab)], storage="topk", top_k=5)
    run = Run.load(run.to_parquet(tmp_path / "peaked.parquet"))
    got = compare(run, run, sequence_a=0, sequence_b=1, stages=["natural"]).steps
    x = natural.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a, b = p[0], p[1]
    m = (a + b) / 2
    true = {
        "tv": 0.5 * np.abs(a - b).sum(-1),
        "kl": (a * np.log(a / b)).sum(-1),
        "js": 0.5 * (a * np.log(a / m)).sum(-1) + 0.5 * (b * np.log(b / m)).sum(-1),
    }
    for name, exact in true.items():
        assert (got[f"{name}_natural"].to_numpy() <= exact + 1e-6).all(), name  # still lower bounds
    assert (got["tv_natural"].to_numpy() >= 0.5 * true["tv"]).all()  # and not ~0 where they differ most
    assert (got["js_natural"].to_numpy() > 0.1).all()


def test_topk_against_full_storage_gives_lower_bounds_and_says_so(tiny_model, char_tokenizer, tmp_path):
    full_a, full_b = _run(tiny_model, char_tokenizer, 0), _run(tiny_model, char_tokenizer, 1)
    topk_b = Run.load(_run_saved(tiny_model, char_tokenizer, tmp_path))
    exact = compare(full_a, full_b, stages=["natural"])
    approx = compare(full_a, topk_b, stages=["natural"])
    assert exact.exact and not approx.exact and "lower bounds" in approx.note
    assert approx.divergence == exact.divergence
    for name in ("tv", "js"):
        assert (approx.steps[f"{name}_natural"] <= exact.steps[f"{name}_natural"] + 1e-6).all()
    assert compare(topk_b, topk_b).same


def _run_saved(model, tok, tmp_path):
    gen = add_tracking(Generator(model, tok), storage="topk", top_k=8)
    gen.generate("My dog", SamplingParams(temperature=1.0, seed=1, max_new_tokens=16, ignore_eos=True))
    return gen.logits_processor.to_parquet(tmp_path / "topk.parquet")


def test_compare_rejects_bad_arguments(tiny_model, char_tokenizer):
    run = _run(tiny_model, char_tokenizer, 0)
    with pytest.raises(ValueError, match="top must be an int >= 1, got 0"):
        compare(run, run, top=0)
    with pytest.raises(ValueError, match=r"stages \['constrained'\] are not recorded by both runs"):
        compare(run, run, stages=["constrained"])


def test_dashboard_figures_from_comparison_and_processor_stages(tiny_model, char_tokenizer):
    from dashboard import charts
    from processors import LogitBiasLogitsProcessor, PenaltiesLogitsProcessor

    a, b = _run(tiny_model, char_tokenizer, 0), _run(tiny_model, char_tokenizer, 1)
    result = compare(a, b)
    fig = charts.distance_timeline(result.steps, result.stages, measure="tv", divergence=result.divergence)
    assert [t.name for t in fig.data] == [charts.STAGE_NAMES["natural"], charts.STAGE_NAMES["sampled"]]
    np.testing.assert_allclose(np.asarray(fig.data[0].y, dtype=float), result.steps["tv_natural"])
    assert charts.removed_by_processor(a.stats()) is None
    procs = [LogitBiasLogitsProcessor({7: float("-inf")}), PenaltiesLogitsProcessor(repetition_penalty=1.2)]
    gen = add_tracking(Generator(tiny_model, char_tokenizer, procs), processor_stages=True)
    gen.generate("My dog", SamplingParams(max_new_tokens=5))
    stats = gen.logits_processor.stats()
    fig = charts.removed_by_processor(stats)
    assert [t.name for t in fig.data] == ["after:logit_bias", "after:penalties"]
    np.testing.assert_allclose(np.asarray(fig.data[0].y, dtype=float), stats["removed_mass_after:logit_bias"])


def test_trackers_compare_as_the_runs_they_recorded_and_anything_else_is_named(tiny_model, char_tokenizer):
    trackers = []
    for seed in (0, 1):
        gen = add_tracking(Generator(tiny_model, char_tokenizer), prompt_logprobs=True)
        gen.generate("abc", SamplingParams(max_new_tokens=5, temperature=1.0, seed=seed))
        trackers.append(gen.logits_processor)
    a, b = trackers
    by_tracker = compare(a, b)
    by_run = compare(a.run, b.run)
    assert by_tracker.summary() == by_run.summary()
    assert by_tracker.steps.equals(by_run.steps)
    assert a.diff(b).summary() == by_run.summary()
    with pytest.raises(TypeError, match="run_b must be a tracker.Run or a LogitTrackingProcessor, got int"):
        compare(a, 3)
    assert a.stages == a.run.stages == ["natural", "sampled"]
    assert a.prompt_logprobs().equals(a.run.prompt_logprobs())


def _unfinished(seed: int, finish: bool, diverge_at: int | None = None):
    """A run of 4 steps (random logits); without ``finish`` its last chosen token is never known, as in a real
    engine's run that stops before the last token comes back. ``diverge_at``: that step chooses another token."""
    import torch

    from tracker import LogitTrackingProcessor

    tracker = LogitTrackingProcessor(None)
    ids, gen = torch.tensor([[1, 2, 3]]), torch.Generator().manual_seed(seed)
    for step in range(4):
        out = tracker(ids, torch.randn(1, 50, generator=gen))
        pick = out.argmax(1, keepdim=True) if step != diverge_at else out.argmin(1, keepdim=True)
        ids = torch.cat([ids, pick], 1)
    if finish:
        tracker.finish(ids)
    return tracker.run


def test_unknown_chosen_tokens_are_said_never_read_as_a_difference_nor_a_crash():
    known, unknown = _unfinished(3, True), _unfinished(3, False)
    for a, b, said in (
        (unknown, known, "A's token at step(s) [3] is not known"),
        (known, unknown, "B's token at step(s) [3] is not known"),
        (unknown, unknown, "A's token at step(s) [3] is not known; B's token at step(s) [3] is not known"),
    ):
        result = compare(a, b)
        assert result.divergence is None and result.same
        assert result.steps["same"].isna().tolist() == [False, False, False, True]
        assert result.summary() == f"the same tokens at every step both runs know (4 steps); {said}"
    early = compare(_unfinished(3, False, diverge_at=1), known)
    assert early.divergence == 1 and early.summary().startswith("the same first 1 tokens; at step 1 A chose <")
    assert early.summary().endswith("; A's token at step(s) [3] is not known")
    assert compare(known, known).summary() == "identical: 4 steps with the same tokens"
