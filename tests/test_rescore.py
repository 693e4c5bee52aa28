"""Re-scoring a recorded run with another model or precision, and the statistics of the pair (issue 33)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from logitscope.cli import main
from logitscope.demo_model import DEMO_MODEL_PATH
from sampling import Generator
from tracker import LogitTrackingProcessor, Run, compare_runs

PROMPTS = ["Alice is", "The phone number of Bob is", "7 +"]


@pytest.fixture(scope="module")
def recorded(demo):
    """A run of the demo model (float32, CPU) with prompt log-probabilities, three prompts of different lengths."""
    model, tok = demo
    tracker = LogitTrackingProcessor(None, tokenizer=tok, storage="float32", prompt_logprobs=True)
    Generator(model, tok, logits_processor=tracker).generate(PROMPTS, max_new_tokens=10, temperature=1.0, seed=5)
    return tracker.run


def _chosen(run, s, include_finished=False):
    return run._select(-1, s, include_finished).chosen.tolist()


def _logits(run, s):
    return run.get_logits(sequence=s)["unstructured"]


def _kl64(run_a, run_b, s):
    """KL(A‖B) per step, recomputed in float64 with torch from the stored logits."""
    a = torch.from_numpy(_logits(run_a, s)).double().log_softmax(-1)
    b = torch.from_numpy(_logits(run_b, s)).double().log_softmax(-1)
    return (a.exp() * (a - b)).sum(-1).numpy()


def test_stepwise_with_the_recording_model_is_bit_for_bit(recorded, demo):
    model, tok = demo
    again = recorded.rescore(model, tok, method="stepwise")
    for s in range(len(PROMPTS)):
        assert np.array_equal(_logits(again, s), _logits(recorded, s))
        a, b = recorded.prompt_logprobs(sequence=s), again.prompt_logprobs(sequence=s)
        assert a["token_id"].tolist() == b["token_id"].tolist()
        assert np.array_equal(a["logprob"].to_numpy(), b["logprob"].to_numpy(), equal_nan=True)
        assert _chosen(again, s, True) == _chosen(recorded, s, True)
    stats = compare_runs(recorded, again)
    assert (stats.steps["kl_natural"] == 0.0).all()
    assert stats.totals["kl"]["natural"]["max"] == 0.0
    assert stats.totals["top1_agreement"] == 1.0 and stats.totals["perplexity_ratio"] == 1.0
    extra = again.metadata.extra
    assert extra["rescored_from"]["run_id"] == recorded.run_id
    assert extra["rescore"]["dtype"] == "float32" and extra["rescore"]["method"] == "stepwise"
    assert [g["prompt_ids"] for g in again.metadata.generations] == [
        g["prompt_ids"] for g in recorded.metadata.generations
    ]


def test_forward_is_one_pass_and_agrees_to_rounding(recorded, demo):
    model, tok = demo
    again = recorded.rescore(model, tok)  # one forward pass over each whole sequence
    for s in range(len(PROMPTS)):
        assert np.abs(_logits(again, s) - _logits(recorded, s)).max() < 1e-3
    assert compare_runs(recorded, again).totals["kl"]["natural"]["max"] < 1e-8


def test_forward_values_are_the_models_over_the_recorded_tokens(recorded, demo):
    """The rescored rows are what a plain forward pass of the model (in bfloat16) over the left-padded prompts
    and the recorded tokens gives, bit for bit."""
    model, tok = demo
    again = recorded.rescore(model, tok, dtype=torch.bfloat16)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    prompts = recorded.metadata.generations[0]["prompt_ids"]
    chosen = [_chosen(recorded, s, True) for s in range(len(prompts))]
    width, steps = max(map(len, prompts)), len(chosen[0])
    ids = torch.zeros(len(prompts), width + steps - 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for s, prompt in enumerate(prompts):
        ids[s, width - len(prompt) : width] = torch.tensor(prompt)
        ids[s, width:] = torch.tensor(chosen[s][:-1])
        mask[s, width - len(prompt) :] = 1
    with torch.inference_mode():
        logits = bf16(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    for s in range(len(prompts)):
        got = again.get_logits(sequence=s, include_finished=True)["unstructured"]
        assert np.array_equal(got, logits[s, width - 1 :].float().numpy())
        assert not np.array_equal(got, recorded.get_logits(sequence=s, include_finished=True)["unstructured"])


def test_bfloat16_gives_a_small_kl_and_perturbed_weights_a_larger_one(recorded, demo):
    model, tok = demo
    bf16 = recorded.rescore(model, tok, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.float32  # the given model is left as it was
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    perturbed = recorded.rescore(noisy, tok)
    small, large = compare_runs(recorded, bf16), compare_runs(recorded, perturbed)
    for stats, other in ((small, bf16), (large, perturbed)):
        reference = np.concatenate([_kl64(recorded, other, s) for s in range(len(PROMPTS))])
        np.testing.assert_allclose(
            stats.steps["kl_natural"].to_numpy(), reference, rtol=1e-9, atol=1e-12
        )  # float64 rounding of a sum of V terms
    assert 0 < small.totals["kl"]["natural"]["mean"] < 1e-2
    assert large.totals["kl"]["natural"]["mean"] > 10 * small.totals["kl"]["natural"]["mean"]
    kl = small.steps["kl_natural"].to_numpy()
    t = small.totals["kl"]["natural"]
    assert t["median"] == np.median(kl) and t["max"] == kl.max() and t["p99"] == np.quantile(kl, 0.99)


def test_token_statistics_and_logprob_gaps(recorded, demo):
    model, tok = demo
    bf16 = recorded.rescore(model, tok, dtype="bfloat16")
    stats = compare_runs(recorded, bf16)
    steps = stats.steps
    for s in range(len(PROMPTS)):
        rows = steps[steps["sequence"] == s]
        chosen = _chosen(recorded, s)
        for run, column in ((recorded, "logprob_a"), (bf16, "logprob_b")):
            lp = torch.from_numpy(_logits(run, s)).double().log_softmax(-1)
            np.testing.assert_allclose(rows[column], lp[np.arange(len(chosen)), chosen].numpy(), rtol=1e-9, atol=1e-12)
        top_a, top_b = _logits(recorded, s).argmax(1), _logits(bf16, s).argmax(1)
        assert rows["top1_same"].tolist() == (top_a == top_b).tolist()
    dp = steps["p_b"] - steps["p_a"]
    assert stats.totals["dp_mean"] == pytest.approx(dp.mean(), rel=1e-12)
    assert stats.totals["dp_rms"] == pytest.approx(np.sqrt((dp**2).mean()), rel=1e-12)
    ppl = np.exp(-steps["logprob_a"].mean()), np.exp(-steps["logprob_b"].mean())
    assert stats.totals["perplexity_a"] == pytest.approx(ppl[0], rel=1e-12)
    assert stats.totals["perplexity_ratio"] == pytest.approx(ppl[1] / ppl[0], rel=1e-12)
    gaps = stats.logprob_gaps()
    assert len(gaps) == len(steps)
    assert (np.diff(gaps["gap"].abs().to_numpy()) <= 0).all()
    assert np.allclose(gaps["gap"], gaps["logprob_b"] - gaps["logprob_a"])
    assert "KL p99.9 (natural)" in stats.summary()


def test_topk_storage_gives_stated_lower_bounds(recorded, demo):
    model, tok = demo
    full = compare_runs(recorded, recorded.rescore(model, tok, dtype="bfloat16"))
    topk = compare_runs(recorded, recorded.rescore(model, tok, dtype="bfloat16", storage="topk", top_k=8))
    assert not topk.exact and "lower bounds" in topk.note and "lower bounds" in topk.summary()
    assert (topk.steps["kl_natural"].to_numpy() <= full.steps["kl_natural"].to_numpy() + 1e-7).all()
    # the chosen token's probability is recorded from the whole row: perplexities are exact
    assert topk.totals["perplexity_b"] == pytest.approx(full.totals["perplexity_b"], rel=1e-5)
    assert topk.totals["top1_agreement"] == full.totals["top1_agreement"]


def test_mismatched_vocabulary_is_refused(recorded):
    from test_tracker_support import random_gpt2

    with pytest.raises(ValueError, match=r"128 entries.*1079 tokens"):
        recorded.rescore(random_gpt2(128, seed=0))


def test_a_run_longer_than_the_context_window_is_refused(recorded, demo):
    model, tok = demo
    short = copy.deepcopy(model)
    short.config.n_positions = 12
    with pytest.raises(ValueError, match=r"context window holds 12"):
        recorded.rescore(short, tok)


def test_bounded_memory_and_small_batches_give_the_same_rows(recorded, demo, tmp_path):
    model, tok = demo
    whole = recorded.rescore(model, tok)
    pieces = recorded.rescore(model, tok, batch_size=1, window_bytes=3 * 1079 * 4 * 4, memory_limit=1 << 16)
    for s in range(len(PROMPTS)):
        np.testing.assert_allclose(_logits(pieces, s), _logits(whole, s), atol=1e-4)
    path = pieces.to_dataset(tmp_path)
    back = Run.load(tmp_path, run_id=pieces.run_id)
    assert path.is_file() and back.metadata.extra["rescored_from"]["run_id"] == recorded.run_id
    assert np.array_equal(_logits(back, 1), _logits(pieces, 1))


def test_cli_round_trip(tmp_path, capsys):
    run, out = tmp_path / "r.parquet", tmp_path / "b.parquet"
    argv = ["run", "--prompt", "Alice is", "--prompt", "7 +", "--max-new-tokens", "6", "--temperature", "1"]
    assert main([*argv, "--seed", "2", "--out", str(run)]) == 0
    rescore = ["rescore", str(run), "--model", str(DEMO_MODEL_PATH), "--method", "stepwise", "--out", str(out)]
    assert main(rescore) == 0
    with pytest.raises(SystemExit) as refused:
        main(rescore)
    assert refused.value.code == 2 and "--force" in capsys.readouterr().err
    assert main([*rescore, "--force"]) == 0
    capsys.readouterr()
    assert main(["compare", str(run), str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["sequences"] == 2 and stats["kl"]["natural"]["max"] == 0.0 and stats["perplexity_ratio"] == 1.0
    assert main(["compare", str(run), str(out)]) == 0
    assert "top-1 agreement" in capsys.readouterr().out


def test_dashboard_says_where_a_rescored_run_came_from_and_sums_the_pair_up(recorded, demo, tmp_path):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from dashboard.paths import APP

    model, tok = demo
    recorded.to_parquet(tmp_path / "a.parquet")
    recorded.rescore(model, tok, dtype="bfloat16", name="demo-bf16").to_parquet(tmp_path / "b.parquet")
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.session_state["root"] = str(tmp_path)
    at.run()
    at = at.sidebar.selectbox(key="run").set_value(str(tmp_path / "b.parquet")).run()
    said = " ".join(i.value for i in at.info).replace("\\", "")
    assert f"Rescored from run {recorded.run_id}" in said and "demo-bf16 in bfloat16" in said
    at.sidebar.selectbox(key="run_b").set_value(str(tmp_path / "a.parquet")).run()
    at.switch_page("app_pages/compare.py").run()
    at.button(key="compare_run_statistics").click().run()
    assert not at.exception
    frames = [d.value for d in at.dataframe if "statistic" in getattr(d.value, "columns", [])]
    values = dict(zip(frames[0]["statistic"], frames[0]["value"]))
    assert values["sequences"] == len(PROMPTS) and 0 < values["KL mean (natural)"] < 1e-2


def test_a_tokenizer_whose_tokens_differ_is_refused(recorded, demo, capsys):
    from processors.vocab import Vocabulary

    model, tok = demo
    pieces = list(recorded.vocab.pieces)
    pieces[7] = b"not the same token"
    other = Run(recorded._record_batches(), recorded.metadata, Vocabulary.from_parts(pieces))
    with pytest.raises(ValueError, match=r"token 7 is .* but the run's token 7 is b'not the same token'"):
        other.rescore(model, tok)
    recorded.rescore(model, tok, progress=True)  # the bar, asked for
    assert "rescoring" in capsys.readouterr().err


def test_every_stage_both_runs_recorded_is_compared(demo):
    from processors import LogitBiasLogitsProcessor

    model, tok = demo
    runs = []
    for banned in ((5, 6), (5, 6, 7, 8, 9, 10)):
        tracker = LogitTrackingProcessor(LogitBiasLogitsProcessor({i: float("-inf") for i in banned}), tokenizer=tok)
        Generator(model, tok, logits_processor=tracker).generate(["Alice is"], max_new_tokens=5, seed=1)
        runs.append(tracker.run)
    stats = compare_runs(runs[1], runs[0])  # A bans more tokens than B
    assert stats.stages == ["natural", "constrained"]
    np.testing.assert_allclose(stats.steps["kl_natural"], _kl64(runs[1], runs[0], 0), rtol=1e-9, atol=1e-12)
    a = torch.from_numpy(runs[1].get_logits()["structured"]).double().log_softmax(-1)
    b = torch.from_numpy(runs[0].get_logits()["structured"]).double().log_softmax(-1)
    kl = torch.where(a.exp() > 0, a.exp() * (a - b), 0.0).sum(-1).numpy()
    assert np.isfinite(kl).all() and (kl > 0).all()
    np.testing.assert_allclose(stats.steps["kl_constrained"], kl, rtol=1e-9, atol=1e-12)
    # the other way, B bans tokens A allows: KL(A‖B) is infinite, and said so
    assert compare_runs(runs[0], runs[1]).totals["kl"]["constrained"] == {
        k: float("inf") for k in ("mean", "median", "p90", "p99", "p99.9", "max")
    }
    rescored = compare_runs(runs[0], runs[0].rescore(model, tok, method="stepwise"))
    assert rescored.stages == ["natural"] and rescored.totals["kl"]["natural"]["max"] == 0.0


def test_rescore_takes_the_demo_model_by_name_and_names_it_so_in_the_run(recorded, tmp_path, capsys):
    run = tmp_path / "r.parquet"
    recorded.to_parquet(run)
    with pytest.raises(SystemExit):
        main(["rescore", str(run), "--out", str(tmp_path / "b.parquet")])
    assert capsys.readouterr().err == (
        "logitscope rescore: error: argument --model: give the model to rescore with: a local model folder, "
        "or demo (the shipped demo model)\n"
    )
    for model in ("demo", str(DEMO_MODEL_PATH)):
        assert main(["rescore", str(run), "--model", model, "--out", str(tmp_path / "b.parquet"), "--force"]) == 0
        assert Run.load(tmp_path / "b.parquet").metadata.model == "logitscope demo model"


def test_compare_of_runs_that_chose_other_tokens_says_so_and_what_still_compares(capsys):
    from pathlib import Path

    samples = Path(__file__).resolve().parent.parent / "sample_runs"
    a, b = str(samples / "json_record.parquet"), str(samples / "regex_phone.parquet")
    assert main(["compare", a, b, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    run_a, run_b = Run.load(a), Run.load(b)
    chosen_a, chosen_b = _chosen(run_a, 0), _chosen(run_b, 0)
    n = min(len(chosen_a), len(chosen_b))
    differ = [i for i in range(n) if chosen_a[i] != chosen_b[i]]
    assert stats["tokens_differ"] == len(differ) > 0 and stats["same_context"]["steps"] == differ[0] + 1
    kl = compare_runs(run_a, run_b).steps["kl_natural"].to_numpy()[: differ[0] + 1]
    assert stats["same_context"]["kl_mean"] == pytest.approx(kl.mean(), rel=1e-12)
    assert main(["compare", a, b]) == 0
    note = capsys.readouterr().out.strip().splitlines()[-1]
    assert note.startswith(f"note: the runs chose different tokens at {len(differ)} of {n} steps: ")
    assert f"Still comparable: perplexity A, and the {differ[0] + 1} step(s) up to each sequence's first" in note
    assert main(["compare", a, a]) == 0
    assert "different tokens" not in capsys.readouterr().out
