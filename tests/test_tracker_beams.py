"""Beam search is refused with a message that says so, instead of rows that are not sequences; outputs that
are not the tracked generation's are refused; a call on the last output extends its generation."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from tracker import LogitTrackingProcessor

BEAMS = r"beam search \(num_beams > 1\) is not tracked.*num_beams=1"


def beam_search(demo, tracker, device="cpu", **options):
    model, tokenizer = demo
    enc = tokenizer(["Call ", "The cat sat"], return_tensors="pt", padding=True, padding_side="left").to(device)
    return model.to(device).generate(
        **enc,
        logits_processor=LogitsProcessorList([tracker]),
        num_beams=3,
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=tokenizer.eos_token_id,
        **options,
    )


@pytest.mark.parametrize(
    "options",
    [
        {"return_dict_in_generate": True},
        {"return_dict_in_generate": False},
        {"num_return_sequences": 3},  # as many rows out as were tracked: no shape tells
        {"num_return_sequences": 3, "output_scores": True, "return_dict_in_generate": True},
    ],
)
def test_beam_search_is_refused_with_a_message_that_says_so(demo, options):
    tracker = LogitTrackingProcessor(tokenizer=demo[1])
    with pytest.raises(ValueError, match=BEAMS):
        tracker.finish(beam_search(demo, tracker, **options))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_beam_search_on_an_accelerator_is_refused_by_finish(demo):
    tracker = LogitTrackingProcessor(tokenizer=demo[1])
    try:
        out = beam_search(demo, tracker, device="cuda", num_return_sequences=3)  # columns not read per step
        with pytest.raises(ValueError, match=BEAMS):
            tracker.finish(out)
    finally:
        demo[0].to("cpu")


@pytest.fixture
def accelerator_rules(monkeypatch):
    """The transformers host's rules for tensors on an accelerator (no value read per step: steps follow on by
    shape, a reorder is a flag on the device, read once) applied to the demo model on the CPU."""
    import processors.protocol as protocol
    import tracker.recording.hosts as hosts

    monkeypatch.setattr(protocol, "free_to_read", lambda *tensors: False)
    monkeypatch.setattr(hosts, "free_to_read", lambda *tensors: False)


def test_under_accelerator_rules_beam_search_is_refused_by_finish(demo, accelerator_rules):
    tracker = LogitTrackingProcessor(tokenizer=demo[1])
    out = beam_search(demo, tracker, num_return_sequences=3)  # no step refused: nothing read per step
    with pytest.raises(ValueError, match=BEAMS):
        tracker.finish(out)


def test_under_accelerator_rules_beam_search_without_finish_is_said_when_the_next_generation_starts(
    demo, accelerator_rules
):
    tokenizer = demo[1]
    tracker = LogitTrackingProcessor(tokenizer=tokenizer)
    beam_search(demo, tracker)
    with pytest.warns(RuntimeWarning, match=r"generation 0: .*not sequences.*" + BEAMS):
        greedy(demo, tracker, tokenizer(["The weather in Lyon is"], return_tensors="pt").input_ids)


def test_under_accelerator_rules_sampled_and_greedy_runs_read_as_they_were_generated(demo, accelerator_rules):
    import warnings

    model, tokenizer = demo
    tracker = LogitTrackingProcessor(tokenizer=tokenizer)
    enc = tokenizer(["Call ", "The cat sat"], return_tensors="pt", padding=True, padding_side="left")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.manual_seed(0)
        sampled = model.generate(
            **enc,
            logits_processor=LogitsProcessorList([tracker]),
            do_sample=True,
            num_return_sequences=2,
            max_new_tokens=8,
            pad_token_id=tokenizer.eos_token_id,
        )
        tracker.finish(sampled)
        prompt = tokenizer(["Bob is"], return_tensors="pt").input_ids
        out = greedy(demo, tracker, prompt)
        tracker.finish(out)
    run = tracker.run
    width = enc["input_ids"].shape[1]
    texts = [tokenizer.decode(row[width:], skip_special_tokens=True) for row in sampled]
    assert [run.sequence(generation=0, sequence=i) for i in range(4)] == texts
    assert run.sequence(generation=1, sequence=0) == tokenizer.decode(out[0, prompt.shape[1] :])


def test_sampling_several_sequences_per_prompt_is_still_tracked(demo):
    model, tokenizer = demo
    tracker = LogitTrackingProcessor(tokenizer=tokenizer)
    enc = tokenizer(["Call "], return_tensors="pt")
    out = model.generate(
        **enc,
        logits_processor=LogitsProcessorList([tracker]),
        do_sample=True,
        num_return_sequences=2,
        max_new_tokens=5,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id,
    )
    run = tracker.finish(out)
    texts = [tokenizer.decode(row[enc["input_ids"].shape[1] :]) for row in out.sequences]
    assert [run.sequence(sequence=i) for i in range(2)] == texts


def greedy(demo, tracker, ids, tokens=4):
    model, tokenizer = demo
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        logits_processor=LogitsProcessorList([tracker]),
        do_sample=False,
        max_new_tokens=tokens,
        pad_token_id=tokenizer.eos_token_id,
    )


def test_finish_refuses_the_output_of_another_generation(demo):
    tokenizer = demo[1]
    prompt = tokenizer(["Call "], return_tensors="pt").input_ids
    other_prompt = prompt.clone()
    other_prompt[0, 0] = tokenizer(["Bob"]).input_ids[0][0]
    tracker = LogitTrackingProcessor(tokenizer=tokenizer)
    greedy(demo, tracker, prompt)
    other = greedy(demo, LogitTrackingProcessor(tokenizer=tokenizer), other_prompt)
    assert other.shape[1] == prompt.shape[1] + 4  # the same shape: only the tokens tell
    with pytest.raises(ValueError, match="do not extend the input of the generation's last step"):
        tracker.finish(other)


def test_a_call_on_the_last_output_extends_that_generation_unless_finish_came_between(demo):
    tokenizer = demo[1]
    prompt = tokenizer(["Call "], return_tensors="pt").input_ids
    joined = LogitTrackingProcessor(tokenizer=tokenizer)
    out = greedy(demo, joined, prompt)
    out = greedy(demo, joined, out)  # no finish between: the same token stream, one generation
    joined.finish(out)
    assert len(joined.run.metadata.generations) == 1
    assert joined.run.sequence(sequence=0) == tokenizer.decode(out[0, prompt.shape[1] :])

    apart = LogitTrackingProcessor(tokenizer=tokenizer)
    first = greedy(demo, apart, prompt)
    apart.finish(first)
    second = greedy(demo, apart, first)
    apart.finish(second)
    run = apart.run
    assert len(run.metadata.generations) == 2
    assert run.metadata.generations[1]["prompt_ids"] == [first[0].tolist()]
    assert run.sequence(generation=1, sequence=0) == tokenizer.decode(second[0, first.shape[1] :])
