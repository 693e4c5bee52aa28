"""The attention mask the Generator passes (none, or a prepared 4-D one) keeps greedy parity with model.generate."""

from __future__ import annotations

import pytest
from test_tracker_support import byte_tokenizer, random_gpt2

from sampling import Generator, SamplingParams


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("prompts", [["the cat sat", "héllo wörld"], ["the cat", "a mat"]], ids=["padded", "unpadded"])
def test_greedy_parity_with_model_generate_for_each_attention_implementation(implementation, prompts):
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=11)
    model.set_attn_implementation(implementation)
    lengths = [len(tok(p)["input_ids"]) for p in prompts]
    assert (len(set(lengths)) > 1) == (prompts[0] == "the cat sat")  # the two cases are what they say
    outputs = Generator(model, tok).generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    enc = tok(prompts, return_tensors="pt", padding=True)
    hf = model.generate(**enc, do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=tok.pad_token_id)
    width = enc["input_ids"].shape[1]
    for out, row in zip(outputs, hf[:, width:].tolist()):
        assert out.outputs[0].token_ids == row
    # and the raw log-probabilities are finite log-probabilities
    for out in outputs:
        assert all(lp <= 0 and lp > -50 for lp in out.outputs[0].raw_logprobs)
