"""Beam search is refused with a message that says so, instead of a misleading shape error."""

from __future__ import annotations

import pytest
from transformers import LogitsProcessorList

from tracker import LogitTrackingProcessor


@pytest.mark.parametrize("as_dict", [True, False])
def test_finish_after_beam_search_says_beams_are_not_tracked(demo, as_dict):
    model, tokenizer = demo
    tracker = LogitTrackingProcessor(tokenizer=tokenizer)
    enc = tokenizer(["Call "], return_tensors="pt")
    out = model.generate(
        **enc,
        logits_processor=LogitsProcessorList([tracker]),
        num_beams=2,
        do_sample=False,
        max_new_tokens=5,
        return_dict_in_generate=as_dict,
        pad_token_id=tokenizer.eos_token_id,
    )
    with pytest.raises(ValueError, match=r"beam search \(num_beams > 1\) is not tracked.*num_beams=1"):
        tracker.finish(out)


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
