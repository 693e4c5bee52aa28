"""The Generator samples through the pipe: its taps see what each step sampled from, and change nothing."""

from __future__ import annotations

import math

import torch

from sampling import Generator, SamplingParams


def test_sample_taps_see_each_step_and_agree_with_the_logprobs(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    params = [
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=1, max_new_tokens=6, ignore_eos=True),
        SamplingParams(max_new_tokens=6, ignore_eos=True),
    ]
    plain = gen.generate(["Hello", "ab"], params)
    seen: list[torch.Tensor] = []
    gen.sample_taps.append(lambda probs: seen.append(probs.clone()))
    tapped = gen.generate(["Hello", "ab"], params)
    assert [o.outputs[0].token_ids for o in tapped] == [o.outputs[0].token_ids for o in plain]
    assert len(seen) == 6 and all(s.shape == (2, 128) for s in seen)
    sampled, greedy = tapped[0].outputs[0], tapped[1].outputs[0]
    for step, probs in enumerate(seen):
        assert math.isclose(probs[0].sum().item(), 1.0, abs_tol=1e-5)
        assert 1 <= int((probs[0] > 0).sum()) <= 6  # top-k 6 leaves at most six tokens
        assert math.isclose(math.log(probs[0, sampled.token_ids[step]].item()), sampled.logprobs[step], abs_tol=1e-5)
        assert probs[1, greedy.token_ids[step]].item() == 1.0  # greedy: one-hot


def test_greedy_stays_the_arg_max_of_the_processed_logits(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    ids = torch.tensor([char_tokenizer("The cat")["input_ids"]])
    out = gen.generate(["The cat"], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    expected = tiny_model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    assert out == expected[0, ids.shape[1] :].tolist()
