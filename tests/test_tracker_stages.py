"""One stage per processor: names, values equal to calling the processors one by one, the "why" of a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from processors import BatchContext, LogitBiasLogitsProcessor, PenaltiesLogitsProcessor, ProcessorList
from sampling import Generator, SamplingParams
from tracker import LogitTrackingProcessor, Run, add_tracking

PROMPT = "abcab"


def _processors() -> ProcessorList:
    bias = LogitBiasLogitsProcessor({ord("a"): -3.0, ord("b"): 2.5, ord("q"): float("-inf")})
    return ProcessorList([bias, PenaltiesLogitsProcessor(repetition_penalty=1.8, frequency_penalty=0.4)])


def _generate(model, tok, storage="float32", **params):
    gen = add_tracking(Generator(model, tok, _processors()), storage=storage, processor_stages=True)
    gen.generate(PROMPT, SamplingParams(max_new_tokens=12, **params))
    return gen.logits_processor


def test_each_stage_equals_calling_the_processors_one_by_one(tiny_model, char_tokenizer):
    run = _generate(tiny_model, char_tokenizer, temperature=0.9, seed=3).run
    assert run.stages == ["natural", "after:logit_bias", "constrained", "sampled"]
    assert run.metadata.stage_aliases == {"after:penalties": "constrained"}
    logits = run.get_logits()
    chosen = run.stats()["chosen_id"].to_numpy()
    prompt = [ord(c) for c in PROMPT]
    first, second = _processors()
    for step in range(len(chosen)):
        ids = torch.tensor([prompt + [int(c) for c in chosen[:step]]])
        ctx = BatchContext(input_ids=ids, prompt_length=len(prompt))
        after_bias = first.process(torch.from_numpy(logits["unstructured"][step : step + 1]).clone(), ctx)
        after_both = second.process(after_bias.clone(), ctx)
        np.testing.assert_allclose(
            logits["after:logit_bias"][step], after_bias[0].numpy(), rtol=1e-6, err_msg=f"step {step}"
        )
        np.testing.assert_allclose(logits["structured"][step], after_both[0].numpy(), rtol=1e-6, err_msg=f"step {step}")


def test_topk_storage_keeps_each_stages_best_values(tiny_model, char_tokenizer):
    full = _generate(tiny_model, char_tokenizer, "float32", temperature=0.9, seed=3).run.get_logits()
    topk = _generate(tiny_model, char_tokenizer, "topk", temperature=0.9, seed=3).run.get_logits()
    for key in ("after:logit_bias", "structured"):
        stored = ~np.isnan(topk[key])
        assert (stored.sum(axis=1) == 20).all()
        np.testing.assert_allclose(topk[key][stored], full[key][stored], rtol=1e-6)
        best = np.sort(np.where(np.isneginf(full[key]), -np.inf, full[key]), axis=1)[:, -20:]
        np.testing.assert_allclose(np.sort(topk[key][stored].reshape(-1, 20), axis=1), best, rtol=1e-6)


@pytest.mark.parametrize("storage", ["topk", "bfloat16"])
def test_each_processors_removed_mass_is_exact_in_reduced_storage(tiny_model, char_tokenizer, storage):
    """The mass each processor removed comes from the statistics recorded with the whole rows."""
    full = _generate(tiny_model, char_tokenizer, "float32", temperature=0.9, seed=3).run.stats()
    small = _generate(tiny_model, char_tokenizer, storage, temperature=0.9, seed=3).run.stats()
    for column in ("removed_mass_after:logit_bias", "removed_mass_after:penalties"):
        np.testing.assert_allclose(small[column], full[column], rtol=1e-4, atol=1e-6, err_msg=column)
    assert (full["removed_mass_after:logit_bias"] > 0).all()


def test_stage_names_work_as_selectors_and_survive_parquet(tiny_model, char_tokenizer, tmp_path):
    tracker = _generate(tiny_model, char_tokenizer)
    run = Run.load(tracker.to_parquet(tmp_path / "run.parquet"))
    by_alias = run.to_dataframe(min_value=0.01, stage="after:penalties")
    by_name = run.to_dataframe(min_value=0.01)
    assert by_alias.equals(by_name)
    middle = run.to_dataframe(min_value=0.01, stage="after:logit_bias", token_ids=True)
    assert (middle.loc[middle["token_id"] == ord("q"), "constrained"] == 0).all()
    top = run.get_top_tokens(k=3, positions=0, stage="after:logit_bias")[0]["tokens"]
    assert all(t["token"] != "q" for t in top)
    with pytest.raises(ValueError, match="stage='after:nothing' was not recorded"):
        run.get_top_tokens(k=3, stage="after:nothing")
    stats = run.stats()
    assert {"entropy_after:logit_bias", "removed_mass_after:logit_bias", "removed_mass_after:penalties"} <= set(
        stats.columns
    )
    # the bias masks "q": its removed mass is the model's probability of "q"; penalties mask nothing
    p_q = run.get_probabilities()["unstructured"][:, ord("q")]
    np.testing.assert_allclose(stats["removed_mass_after:logit_bias"], p_q, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["removed_mass_after:penalties"], 0.0, atol=1e-6)


def test_why_names_the_stage_that_moved_each_token(tiny_model, char_tokenizer):
    tracker = _generate(tiny_model, char_tokenizer)
    run = tracker.run
    table = run.why(0)
    assert set(table["role"]) == {"chosen", "favourite"}
    assert list(table[table["role"] == "chosen"]["stage"]) == [
        "natural",
        "after:logit_bias",
        "after:penalties",
        "sampled",
    ]
    probs = run.get_probabilities()
    chosen = int(run.stats()["chosen_id"][0])
    rows = table[table["role"] == "chosen"].set_index("stage")
    np.testing.assert_allclose(
        rows.loc["after:logit_bias", "logprob"], np.log(probs["after:logit_bias"][0, chosen]), rtol=1e-5
    )
    expected = np.log(probs["after:logit_bias"][0, chosen]) - np.log(probs["unstructured"][0, chosen])
    np.testing.assert_allclose(rows.loc["after:logit_bias", "change"], expected, rtol=1e-4, atol=1e-6)
    changes = rows["change"].abs().fillna(-1)
    assert rows["decisive"].sum() == 1 and rows.loc[changes.idxmax(), "decisive"]


def test_processor_stages_accepts_transformers_lists_and_rejects_empty():
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

    tracker = LogitTrackingProcessor(
        LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.5)]),
        processor_stages=True,
    )
    assert tracker.recorder.stages == ["natural", "after:repetition_penalty", "constrained"]
    assert tracker.run.metadata.stage_aliases == {"after:temperature": "constrained"}
    with pytest.raises(ValueError, match="processor_stages=True needs at least one processor"):
        LogitTrackingProcessor(ProcessorList([]), processor_stages=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stages_and_prompt_on_cuda(tiny_model, char_tokenizer):
    import copy

    model = copy.deepcopy(tiny_model).cuda()
    gen = add_tracking(Generator(model, char_tokenizer, _processors()), processor_stages=True, prompt_logprobs=True)
    gen.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.9, seed=3))
    run = gen.logits_processor.run
    logits = run.get_logits()
    chosen = run.stats()["chosen_id"].to_numpy()
    prompt = [ord(c) for c in PROMPT]
    first, second = _processors()
    for step in range(len(chosen)):
        ctx = BatchContext(
            input_ids=torch.tensor([prompt + [int(c) for c in chosen[:step]]]), prompt_length=len(prompt)
        )
        after_bias = first.process(torch.from_numpy(logits["unstructured"][step : step + 1]).clone(), ctx)
        np.testing.assert_allclose(logits["after:logit_bias"][step], after_bias[0].numpy(), rtol=1e-6)
        np.testing.assert_allclose(logits["structured"][step], second.process(after_bias, ctx)[0].numpy(), rtol=1e-6)
    with torch.no_grad():
        direct = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0].double(), -1)
    expected = direct[:-1].gather(1, torch.tensor(prompt[1:], device="cuda")[:, None])[:, 0].cpu().numpy()
    np.testing.assert_allclose(run.prompt_logprobs()["logprob"][1:], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "topk"])
def test_the_chosen_tokens_statistics_are_those_of_each_stages_own_row(tiny_model, char_tokenizer, storage):
    """A later processor that writes into the row it is given (the penalties) must not change what an earlier
    stage recorded for the chosen token: its probability and rank there are those of the stage's stored row."""
    gen = add_tracking(
        Generator(tiny_model, char_tokenizer, _processors()),
        storage=storage,
        processor_stages=True,
        statistics="record",
    )
    gen.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.9, seed=3))
    recorded = gen.logits_processor.run.stats()
    reference = _generate(tiny_model, char_tokenizer, "float32", temperature=0.9, seed=3).run
    logits = reference.get_logits()
    chosen = recorded["chosen_id"].to_numpy()
    assert (chosen == reference.stats()["chosen_id"].to_numpy()).all()
    for stage, key in (
        ("natural", "unstructured"),
        ("after:logit_bias", "after:logit_bias"),
        ("constrained", "structured"),
    ):
        rows = logits[key].astype(np.float64)
        logp = rows - np.logaddexp.reduce(rows, axis=1, keepdims=True)
        at_chosen = logp[np.arange(len(chosen)), chosen]
        np.testing.assert_allclose(recorded[f"p_chosen_{stage}"], np.exp(at_chosen), rtol=1e-5, err_msg=stage)
        ranks = (rows > rows[np.arange(len(chosen)), chosen][:, None]).sum(axis=1)
        np.testing.assert_array_equal(recorded[f"rank_chosen_{stage}"], ranks, err_msg=stage)


def test_a_host_writing_into_the_returned_logits_does_not_change_what_was_recorded(tiny_model, char_tokenizer):
    """``model.generate`` with a processor after the tracker that modifies the scores in place."""
    from transformers import LogitsProcessorList

    def halve_in_place(input_ids, scores):
        return scores.mul_(0.5)

    tracker = LogitTrackingProcessor(tokenizer=char_tokenizer, statistics="record")
    torch.manual_seed(0)
    tiny_model.generate(
        torch.tensor([[ord(c) for c in PROMPT]]),
        logits_processor=LogitsProcessorList([tracker, halve_in_place]),
        do_sample=True,
        max_new_tokens=8,
        pad_token_id=0,
    )
    stats, rows = tracker.stats(), tracker.get_logits()["unstructured"].astype(np.float64)
    known = (
        stats["chosen_id"].notna().to_numpy()
    )  # the last step's token reaches the tracker only with stopping_criteria
    chosen = stats["chosen_id"].to_numpy(dtype=np.int64, na_value=0)[known]
    logp = rows[known] - np.logaddexp.reduce(rows[known], axis=1, keepdims=True)
    assert known.sum() >= 7
    expected = np.exp(logp[np.arange(len(chosen)), chosen])
    np.testing.assert_allclose(stats["p_chosen_natural"].to_numpy()[known], expected, rtol=1e-5)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "topk"])
def test_two_processors_of_one_kind_each_get_a_stage(tiny_model, char_tokenizer, storage, tmp_path):
    """``after:logit_bias`` begins ``after:logit_bias_2``: each stage still reads its own columns."""
    biases = [LogitBiasLogitsProcessor({ord("b"): 2.0}), LogitBiasLogitsProcessor({ord("c"): 3.0})]
    gen = add_tracking(
        Generator(
            tiny_model, char_tokenizer, ProcessorList([*biases, PenaltiesLogitsProcessor(repetition_penalty=1.5)])
        ),
        storage=storage,
        processor_stages=True,
    )
    gen.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.9, seed=1))
    gen.logits_processor.to_parquet(tmp_path / "run.parquet")
    run = Run.load(tmp_path / "run.parquet")
    assert run.stages == ["natural", "after:logit_bias", "after:logit_bias_2", "constrained", "sampled"]
    logits = run.get_logits()
    stats = run.stats()
    for stage, token in (("after:logit_bias", "b"), ("after:logit_bias_2", "c")):
        rows = logits[stage]
        before = logits["unstructured" if stage == "after:logit_bias" else "after:logit_bias"]
        kept = ~np.isnan(rows[:, ord(token)]) & ~np.isnan(before[:, ord(token)])
        bias = 2.0 if token == "b" else 3.0
        np.testing.assert_allclose(rows[kept, ord(token)] - before[kept, ord(token)], bias, atol=0.05)
        assert stats[f"p_chosen_{stage}"].notna().all()
