"""Wrong input to SamplingParams and the Generator: clear errors naming the argument and value, before the model runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sampling import Generator, SamplingParams


@pytest.fixture
def forward_calls(tiny_model):
    """How many times the tiny model ran during the test."""
    calls = []
    handle = tiny_model.register_forward_pre_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


# ---------------------------------------------------------------- the model's context


def test_a_prompt_and_max_new_tokens_beyond_the_context_are_refused_before_the_model_runs(
    tiny_model, char_tokenizer, forward_calls
):
    gen = Generator(tiny_model, char_tokenizer)  # n_positions 128
    with pytest.raises(ValueError) as info:
        gen.generate(["ok", "a" * 100], SamplingParams(max_new_tokens=40, ignore_eos=True))
    message = str(info.value)
    assert "prompts[1] has 100 tokens" in message and "max_new_tokens=40" in message
    assert "context of 128 tokens (config.max_position_embeddings)" in message and "max_new_tokens <= 28" in message
    with pytest.raises(ValueError, match=r"prompts\[0\] has 130 tokens.*shorten the prompt to at most 127 tokens"):
        gen.check_inputs(["a" * 130], max_new_tokens=1)
    assert forward_calls == []
    # exactly the context fits
    out = gen.generate(["a" * 100], SamplingParams(max_new_tokens=28, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 28


def test_a_rotary_model_is_warned_not_refused_past_its_trained_length(char_tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
    )
    gen = Generator(LlamaForCausalLM(config).eval(), char_tokenizer)
    with pytest.warns(UserWarning, match=r"prompts\[0\] has 10 tokens .* context of 16 tokens .*rotary"):
        out = gen.generate(["a" * 10], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12  # positions past 16 still decode


def test_check_inputs_raises_what_generate_would(tiny_model, char_tokenizer, forward_calls):
    gen = Generator(tiny_model, char_tokenizer)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        gen.check_inputs(["a", ""])
    with pytest.raises(ValueError, match=r"top_p must be in \[0, 1\], got 1.5"):
        gen.check_inputs(["a"], top_p=1.5)
    gen.check_inputs(["a", "bc"], SamplingParams(max_new_tokens=5))
    assert forward_calls == []


# ---------------------------------------------------------------- types


@pytest.mark.parametrize("stop, shown", [(None, "None"), (123, "123"), (b"end", "b'end'"), ({"a": 1}, "{'a': 1}")])
def test_stop_of_the_wrong_type_names_it(stop, shown):
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=stop)
    assert str(info.value).startswith("stop must be a string or a list of strings") and shown in str(info.value)


def test_stop_accepts_a_string_or_a_list_of_strings():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(ValueError, match="stop must hold non-empty strings, got 3"):
        SamplingParams(stop=["a", 3])


def test_the_tokenizer_is_checked_when_the_generator_is_made(tiny_model):
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer .*got NoneType"):
        Generator(tiny_model, None)
    with pytest.raises(TypeError, match="tokenizer must be .*got str"):
        Generator(tiny_model, "gpt2")


def test_params_of_the_wrong_type_say_what_was_given(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    with pytest.raises(TypeError) as info:
        gen.generate(["Hi"], {"max_new_tokens": 3})
    message = str(info.value)
    assert message.startswith("params must be a SamplingParams")
    assert "got a dict {'max_new_tokens': 3}" in message and "SamplingParams(**d)" in message
    with pytest.raises(TypeError, match=r"params\[1\] must be a SamplingParams; got a dict \{'n': 2\}"):
        gen.generate(["Hi", "Ho"], [SamplingParams(), {"n": 2}])
    with pytest.raises(TypeError, match="params must be a SamplingParams .*got int 3"):
        gen.generate(["Hi"], 3)


def test_prompts_of_the_wrong_type_say_what_was_given(tiny_model, char_tokenizer):
    gen = Generator(tiny_model, char_tokenizer)
    with pytest.raises(
        TypeError, match="prompts must be a string, a list of token ids, or a list of those, got NoneType"
    ):
        gen.generate(None)
    with pytest.raises(TypeError, match="prompts must be .*got bytes b'Hi'"):
        gen.generate(b"Hi")
    with pytest.raises(TypeError, match="prompts must be .*got int 5"):
        gen.generate(5)
    # a bare string is one prompt
    out = gen.generate("Hi", max_new_tokens=3, ignore_eos=True)
    assert len(out) == 1 and out[0].prompt == "Hi" and len(out[0].outputs[0].token_ids) == 3


# ---------------------------------------------------------------- numpy scalars and bools


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers(tiny_model, char_tokenizer):
    params = SamplingParams(
        temperature=np.float32(0.5),
        top_k=np.int64(5),
        top_p=np.float64(0.9),
        min_p=np.float32(0.25),
        max_new_tokens=np.int32(4),
        seed=np.uint64(7),
        n=np.int16(2),
    )
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.5, 5, 0.9, 0.25)
    assert (params.max_new_tokens, params.seed, params.n) == (4, 7, 2)
    assert [type(v) for v in (params.temperature, params.top_k, params.top_p, params.seed, params.n)] == [
        float,
        int,
        float,
        int,
        int,
    ]
    json.dumps(params.to_dict())  # plain numbers: the run metadata stays JSON
    out = Generator(tiny_model, char_tokenizer).generate(["Hi"], params)
    assert [len(c.token_ids) <= 4 for c in out[0].outputs] == [True, True]
    # numpy values are validated like Python's
    with pytest.raises(ValueError, match=r"top_k must be an int >= 0 .*got 2.5"):
        SamplingParams(top_k=np.float64(2.5))
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1.0"):
        SamplingParams(temperature=np.float32(-1))
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        SamplingParams(top_k=True)


@pytest.mark.parametrize("name", ["ignore_eos", "joint_top_k_top_p"])
@pytest.mark.parametrize("value", ["yes", None, 1, np.bool_(True)])
def test_the_flags_must_be_bools(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    assert str(info.value) == f"{name} must be a bool, got {value!r}"


def test_the_flags_take_bools():
    assert SamplingParams(ignore_eos=True).ignore_eos is True
    assert SamplingParams(joint_top_k_top_p=False).joint_top_k_top_p is False
