"""The tracker records exactly what ``model.generate`` computed: the main "done when" of issue 5.

transformers applies user processors after its built-in ones and before its
sampling warpers, so ``output_logits`` (unprocessed) must equal the recorded
natural logits and ``output_scores`` (processed) the constrained logits when
no warper runs; with warpers (top-k 50 by default when sampling) the scores
are what the warpers made, and only the natural side can match.
"""

from __future__ import annotations

import pytest
import torch
from test_tracker_support import byte_tokenizer, random_gpt2
from transformers import LogitsProcessorList, NoBadWordsLogitsProcessor, StoppingCriteriaList

from tracker import LogitTrackingProcessor, Run

PROMPTS = ["the cat", "héllo wörld and then", "2"]


def _generate(model, tok, tracker, *, do_sample, last_token="stopping", **kwargs):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    extra = {}
    if last_token == "stopping":
        extra["stopping_criteria"] = StoppingCriteriaList([tracker.stopping_criteria()])
    torch.manual_seed(7)
    out = model.generate(
        **enc,
        logits_processor=LogitsProcessorList([tracker]),
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
        do_sample=do_sample,
        max_new_tokens=10,
        pad_token_id=tok.pad_token_id,
        **extra,
        **kwargs,
    )
    if last_token == "finish":
        tracker.finish(out)
    return enc, out


def _masking_processor(tok):
    banned = [[tok.convert_tokens_to_ids(t)] for t in ("Ġthe", "a", "t", "Ġ")]
    return NoBadWordsLogitsProcessor(banned, eos_token_id=tok.eos_token_id)


def _assert_matches(tracker_or_run, enc, out, *, scores_equal=True):
    prompt = enc["input_ids"].shape[1]
    steps = len(out.logits)
    for s in range(len(PROMPTS)):
        arrays = tracker_or_run.get_logits(sequence=s, include_finished=True)
        natural = torch.stack([step[s] for step in out.logits])
        constrained = torch.stack([step[s] for step in out.scores])
        assert arrays["unstructured"].shape == (steps, natural.shape[1])
        assert torch.equal(torch.from_numpy(arrays["unstructured"]), natural), f"natural logits differ, row {s}"
        if scores_equal:
            assert torch.equal(torch.from_numpy(arrays["structured"]), constrained), f"constrained differ, row {s}"
        chosen = tracker_or_run.stats(sequence=s, include_finished=True)["chosen_id"].tolist()
        assert chosen == out.sequences[s, prompt:].tolist(), f"chosen tokens differ, row {s}"


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("last_token", ["stopping", "finish"])
def test_recorded_logits_equal_generate_outputs(do_sample, last_token):
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=1)
    tracker = LogitTrackingProcessor(_masking_processor(tok), tokenizer=tok)
    # top_k=None: no warper after the user processor, so output_scores is what the tracker returned.
    enc, out = _generate(model, tok, tracker, do_sample=do_sample, last_token=last_token, top_k=None)
    assert (torch.stack(out.scores) == float("-inf")).any(), "the processor should mask something"
    _assert_matches(tracker, enc, out)
    assert len(tracker.generations()) == 1


def test_an_in_place_processor_leaves_generates_raw_logits_as_the_model_gave_them():
    """The tracker hands a processor that writes into its input a copy: ``output_logits`` stay raw."""
    from processors import LogitBiasLogitsProcessor

    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=4)
    banned = {tok.convert_tokens_to_ids(t): float("-inf") for t in ("a", "t", "Ġ")}
    tracker = LogitTrackingProcessor(LogitBiasLogitsProcessor(banned), tokenizer=tok)
    enc, out = _generate(model, tok, tracker, do_sample=True, top_k=None)
    raw = torch.stack(out.logits)
    assert torch.isfinite(raw).all(), "the model's raw logits were written into"
    assert (torch.stack(out.scores)[..., list(banned)] == float("-inf")).all()
    _assert_matches(tracker, enc, out)


def test_saved_run_matches_generate_outputs_without_model_or_tokenizer(tmp_path):
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=2)
    tracker = LogitTrackingProcessor(_masking_processor(tok), tokenizer=tok)
    enc, out = _generate(model, tok, tracker, do_sample=True, top_k=None)
    path = tracker.to_parquet(tmp_path / "run.parquet")
    del tracker
    run = Run.load(path)
    _assert_matches(run, enc, out)
    prompt = enc["input_ids"].shape[1]
    for s in range(len(PROMPTS)):
        ids = out.sequences[s, prompt:].tolist()
        if tok.eos_token_id in ids:  # the sequence ends at its end-of-sequence token
            ids = ids[: ids.index(tok.eos_token_id) + 1]
        assert run.sequence(sequence=s) == tok.decode(ids)


def test_with_sampling_warpers_only_natural_logits_can_match():
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=3)
    tracker = LogitTrackingProcessor(_masking_processor(tok), tokenizer=tok)
    enc, out = _generate(model, tok, tracker, do_sample=True, top_k=5)
    _assert_matches(tracker, enc, out, scores_equal=False)
    recorded = torch.from_numpy(tracker.get_logits(include_finished=True)["structured"])
    scores = torch.stack([step[0] for step in out.scores])
    # top-k 5 ran after the tracker: at most 5 finite scores per step, many more recorded.
    assert int(torch.isfinite(scores).sum(dim=1).max()) <= 5
    assert int(torch.isfinite(recorded).sum(dim=1).min()) > 5


def test_two_generations_are_kept_apart():
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=4)
    tracker = LogitTrackingProcessor(_masking_processor(tok), tokenizer=tok)
    _generate(model, tok, tracker, do_sample=False)
    enc, out = _generate(model, tok, tracker, do_sample=True, top_k=None)
    assert tracker.generations() == [0, 1]
    _assert_matches(tracker, enc, out)  # defaults select the latest generation


@pytest.mark.skipif(
    not __import__("logitscope.demo_model", fromlist=["DEMO_MODEL_PATH"])
    .DEMO_MODEL_PATH.joinpath("config.json")
    .is_file(),
    reason="demo model files not built yet",
)
def test_fidelity_on_the_demo_model():
    from logitscope.demo_model import load_demo_model

    model, tok = load_demo_model()
    banned = [[i] for i in range(10, 200)]
    tracker = LogitTrackingProcessor(NoBadWordsLogitsProcessor(banned, eos_token_id=tok.eos_token_id), tokenizer=tok)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    enc = tok(['{"name": "', "Call ", "2 + 2 = 4 and 3"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(
        **enc,
        logits_processor=LogitsProcessorList([tracker]),
        stopping_criteria=StoppingCriteriaList([tracker.stopping_criteria()]),
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
        do_sample=True,
        top_k=None,
        max_new_tokens=12,
        pad_token_id=tok.pad_token_id,
    )
    prompt = enc["input_ids"].shape[1]
    for s in range(3):
        arrays = tracker.get_logits(sequence=s, include_finished=True)
        assert torch.equal(torch.from_numpy(arrays["unstructured"]), torch.stack([x[s] for x in out.logits]))
        assert torch.equal(torch.from_numpy(arrays["structured"]), torch.stack([x[s] for x in out.scores]))
        chosen = tracker.stats(sequence=s, include_finished=True)["chosen_id"].tolist()
        assert chosen == out.sequences[s, prompt:].tolist()
