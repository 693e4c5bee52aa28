"""The Generator: parity with model.generate, seeding, stopping, processors, bad input."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import LogitsProcessorList

from processors import BatchContext, LogitsProcessor, ProcessorError
from sampling import DeadRowError, Generator, SamplingParams
from sampling.generator import load_model

PROMPTS = ["Hello there", "ab", "The cat sat on"]


def _hf_inputs(tokenizer, prompts, pad=0):
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return input_ids, mask, width


def _trim(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_matches_model_generate_on_a_padded_batch(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    outputs = gen.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    input_ids, mask, width = _hf_inputs(char_tokenizer, PROMPTS)
    hf = tiny_model.generate(
        input_ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=0
    )
    for out, row in zip(outputs, hf[:, width:].tolist()):
        assert out.outputs[0].token_ids == _trim(row, 0)
    # distinct continuations, so parity is not trivially about one repeated token
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == len(PROMPTS)


def test_greedy_matches_model_generate_on_the_demo_model(demo):
    model, tokenizer = demo
    prompts = ['{"name": "', "Call ", "7 + 5 = ", "The weather in Lyon"]
    gen = Generator(model, tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = gen.generate(prompts, SamplingParams(max_new_tokens=30))
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecated == []  # the model is called with the names this transformers expects
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    hf = model.generate(**enc, do_sample=False, max_new_tokens=30, pad_token_id=tokenizer.pad_token_id)
    width = enc["input_ids"].shape[1]
    for out, row in zip(outputs, hf[:, width:].tolist()):
        assert out.outputs[0].token_ids == _trim(row, tokenizer.eos_token_id)


def test_raw_logprobs_are_the_models_and_processed_follow_the_processors(tiny_model, char_tokenizer):
    """raw_logprobs = log-softmax of model.generate's output_logits at the chosen token."""
    gen = Generator(tiny_model, char_tokenizer, logits_processor=[_Ban([ord("e"), ord("a")])])
    out = gen.generate(["Hello"], SamplingParams(max_new_tokens=8, ignore_eos=True)).pop().outputs[0]
    input_ids, mask, width = _hf_inputs(char_tokenizer, ["Hello"])
    hf = tiny_model.generate(
        input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=0,
        eos_token_id=None,
        logits_processor=LogitsProcessorList([_Ban([ord("e"), ord("a")])]),
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.token_ids == hf.sequences[0, width:].tolist()
    for step, token in enumerate(out.token_ids):
        raw = torch.log_softmax(hf.logits[step][0].double(), -1)[token].item()
        processed = torch.log_softmax(hf.scores[step][0].double(), -1)[token].item()
        assert out.raw_logprobs[step] == pytest.approx(raw, abs=1e-5)
        assert out.logprobs[step] == pytest.approx(processed, abs=1e-5)
        assert ord("e") not in out.token_ids and ord("a") not in out.token_ids


def test_a_seeded_request_is_the_same_alone_and_in_any_batch(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_new_tokens=20, ignore_eos=True)
    alone = gen.generate(["The cat"], mine)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.7, top_k=5, seed=1, max_new_tokens=5),
        mine,
        SamplingParams(max_new_tokens=30),
        SamplingParams(min_p=0.1, n=3, max_new_tokens=12),
    ]
    batched = gen.generate(["a much longer prompt here", "The cat", "x", "Hi"], others)
    assert batched[1].outputs[0].token_ids == alone
    # and again after reordering, with a different batch size
    again = gen.generate(["The cat", "zz"], [mine, SamplingParams(temperature=2.0, seed=9)])
    assert again[0].outputs[0].token_ids == alone


def test_n_samples_differ_and_are_reproducible(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    params = SamplingParams(temperature=1.5, n=4, seed=7, max_new_tokens=15, ignore_eos=True)
    first = [c.token_ids for c in gen.generate(["Once"], params)[0].outputs]
    second = [c.token_ids for c in gen.generate(["Once"], params)[0].outputs]
    assert first == second
    assert len({tuple(t) for t in first}) > 1
    assert [c.index for c in gen.generate(["Once"], params)[0].outputs] == [0, 1, 2, 3]


def test_unseeded_requests_follow_torch_manual_seed(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    torch.manual_seed(5)
    a = gen.generate(["Hey"], params)[0].outputs[0].token_ids
    torch.manual_seed(5)
    assert gen.generate(["Hey"], params)[0].outputs[0].token_ids == a


class _Ban(LogitsProcessor):
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        out = logits.clone()
        out[:, self.ids] = float("-inf")
        return out


class _ForceAfter(LogitsProcessor):
    """Allow only ``token`` once ``after`` tokens were generated; records what it sees."""

    def __init__(self, token: int, after: int) -> None:
        self.token, self.after = token, after
        self.sampled: list[list[int]] = []

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        if ctx.num_generated < self.after:
            return logits
        out = torch.full_like(logits, float("-inf"))
        out[:, self.token] = 0.0
        return out

    def on_sampled(self, tokens: torch.Tensor, ctx: BatchContext) -> None:
        self.sampled.append(tokens.tolist())

    def reset(self) -> None:
        self.sampled = []


def test_stops_on_eos_length_and_stop_strings(tiny_model, char_tokenizer):
    force = _ForceAfter(token=0, after=3)
    gen = Generator(tiny_model, char_tokenizer, logits_processor=force)
    out = gen.generate(["Hi", "Hello"], SamplingParams(temperature=1.0, seed=3, max_new_tokens=10))
    for request in out:
        c = request.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None
        assert len(c.token_ids) == 4 and c.token_ids[-1] == 0
        assert "<eos>" not in c.text and len(c.text) == 3
    # the processor heard every step's tokens, the last one included
    assert [row[0] for row in force.sampled][-1] == 0 and len(force.sampled) == 4

    gen = Generator(tiny_model, char_tokenizer, logits_processor=_Ban([0]))
    c = gen.generate(["Hi"], SamplingParams(max_new_tokens=6))[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6

    # a stop string: force "xyz" token by token, stop at "yz"
    forced = [ord(ch) for ch in "abxyzq"]

    class Script(LogitsProcessor):
        def process(self, logits, ctx):
            out = torch.full_like(logits, float("-inf"))
            out[:, forced[min(ctx.num_generated, len(forced) - 1)]] = 0.0
            return out

    gen = Generator(tiny_model, char_tokenizer, logits_processor=[Script()])
    c = gen.generate(["Hi"], SamplingParams(temperature=1.0, max_new_tokens=20, stop=("yz", "zzz")))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "yz"
    assert c.text == "abx" and c.token_ids == forced[:5]


def test_rows_finish_independently_and_others_continue(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer, logits_processor=[_Ban([0])])
    out = gen.generate(["a", "b"], [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=9)])
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 9]


def test_transformers_and_callable_processors_in_the_generator(tiny_model, char_tokenizer):
    from transformers import NoBadWordsLogitsProcessor

    banned = [[ord("e")], [ord("t")]]
    gen = Generator(
        tiny_model,
        char_tokenizer,
        logits_processor=[NoBadWordsLogitsProcessor(banned, eos_token_id=0), lambda ids, s: s * 1.0],
    )
    out = gen.generate(["the tree"], SamplingParams(temperature=1.5, seed=0, max_new_tokens=40, ignore_eos=True))
    tokens = out[0].outputs[0].token_ids
    assert ord("e") not in tokens and ord("t") not in tokens


def test_logitscope_processor_inside_model_generate(tiny_model, char_tokenizer):
    input_ids, mask, _ = _hf_inputs(char_tokenizer, PROMPTS)
    hf = tiny_model.generate(
        input_ids,
        attention_mask=mask,
        do_sample=True,
        max_new_tokens=12,
        pad_token_id=0,
        eos_token_id=None,
        logits_processor=LogitsProcessorList([_Ban(list(range(1, 100)))]),
    )
    assert (hf[:, input_ids.shape[1] :] >= 100).all() | (hf[:, input_ids.shape[1] :] == 0).all()


def test_bad_input_gets_clear_errors(tiny_model, char_tokenizer, tmp_path):
    gen = Generator(tiny_model, char_tokenizer)
    with pytest.raises(ValueError, match=r"top_p must be in \[0, 1\], got 1.5"):
        gen.generate(["a"], top_p=1.5)
    with pytest.raises(ValueError, match="prompts must hold at least one prompt"):
        gen.generate([])
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        gen.generate(["a", ""])
    with pytest.raises(ValueError, match=r"prompts\[0\] holds token ids outside \[0, 128\)"):
        gen.generate([[1, 2, 500]])
    with pytest.raises(ValueError, match=r"one per prompt \(2\), got 3"):
        gen.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(TypeError, match="either params or keyword"):
        gen.generate(["a"], SamplingParams(), temperature=1.0)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        SamplingParams(top_k=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(FileNotFoundError, match="no model folder at"):
        load_model(tmp_path / "nowhere")

    def wrong_shape(ids, scores):
        return scores[:, :10]

    bad = Generator(tiny_model, char_tokenizer, logits_processor=[wrong_shape])
    with pytest.raises(ProcessorError, match=r"wrong_shape\) returned logits of shape \(1, 10\), expected \(1, 128\)"):
        bad.generate(["a"])

    dead = Generator(tiny_model, char_tokenizer, logits_processor=[_Ban(list(range(128)))])
    with pytest.raises(DeadRowError, match=r"rows \[0, 1\] have no allowed token"):
        dead.generate(["a", "b"], temperature=1.0)
    with pytest.raises(DeadRowError, match=r"rows \[0\] have no allowed token"):
        dead.generate(["a"])  # greedy too: never an arg-max over -inf


def test_greedy_rules(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    greedy = gen.generate(["Hello"], SamplingParams(max_new_tokens=10))[0].outputs[0].token_ids
    for params in (
        SamplingParams(temperature=0, top_p=0.5, seed=1, max_new_tokens=10),
        SamplingParams(top_k=1, temperature=3.0, seed=2, max_new_tokens=10),
        SamplingParams(top_p=0, temperature=3.0, seed=3, max_new_tokens=10),
    ):
        assert params.is_greedy
        assert gen.generate(["Hello"], params)[0].outputs[0].token_ids == greedy
    assert not SamplingParams(min_p=0.1).is_greedy


def test_logprobs_are_finite_and_consistent_with_sampling(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    c = gen.generate(["Hi"], SamplingParams(top_k=3, seed=4, max_new_tokens=10, ignore_eos=True))[0].outputs[0]
    assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs + c.raw_logprobs)
    # top-k renormalises over 3 tokens, so the chosen token is at least as likely as under the raw model
    assert all(p >= r - 1e-6 for p, r in zip(c.logprobs, c.raw_logprobs))
