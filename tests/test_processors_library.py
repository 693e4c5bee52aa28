"""Bias, forced text, temperature, min new tokens, allowed ids and penalties: deterministic checks on small tensors."""

from __future__ import annotations

import pytest
import torch

from processors import (
    AllowedTokenIdsLogitsProcessor,
    BatchContext,
    ForcedTextLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinNewTokensLogitsProcessor,
    PenaltiesLogitsProcessor,
    TemperatureLogitsProcessor,
)

EOT = "<|endoftext|>"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    lines = ["Hello world! Paris is big.", "Call Maria Moreau at (555) 123-4567.", "12 + 7 = 19"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=300, min_frequency=2, special_tokens=[EOT], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT, pad_token=EOT)


def ctx_of(rows: list[list[int]], prompt_length: int, attention_mask=None) -> BatchContext:
    return BatchContext(input_ids=torch.tensor(rows), prompt_length=prompt_length, attention_mask=attention_mask)


# --------------------------------------------------------------- temperature


@pytest.mark.parametrize("dtype", DTYPES)
def test_temperature_divides_in_place_and_keeps_the_dtype(dtype):
    logits = torch.tensor([[2.0, -4.0, float("-inf")]], dtype=dtype)
    out = TemperatureLogitsProcessor(0.5).process(logits, ctx_of([[1]], 1))
    assert out is logits and out.dtype == dtype
    assert out.tolist() == [[4.0, -8.0, float("-inf")]]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "hot", True, None])
def test_temperature_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0, got"):
        TemperatureLogitsProcessor(bad)


# --------------------------------------------------------------- min new tokens


def test_min_new_tokens_bans_eos_until_enough_tokens():
    proc = MinNewTokensLogitsProcessor(2, eos_token_id=[0, 3])
    logits = torch.zeros(2, 5)
    for generated, banned in [(0, True), (1, True), (2, False), (3, False)]:
        rows = [[9] * (4 + generated), [8] * (4 + generated)]
        out = proc.process(logits.clone(), ctx_of(rows, 4))
        assert bool(torch.isinf(out[:, [0, 3]]).all()) is banned
        assert torch.isfinite(out[:, [1, 2, 4]]).all()


def test_min_new_tokens_rejects_bad_values():
    with pytest.raises(ValueError, match="min_new_tokens must be an int >= 0, got -1"):
        MinNewTokensLogitsProcessor(-1, 0)
    with pytest.raises(ValueError, match=r"eos_token_id\[0\] must be a token id \(an int\), got 'eos'"):
        MinNewTokensLogitsProcessor(1, "eos")
    with pytest.raises(ValueError, match="token id 9 is outside the vocabulary of these logits"):
        MinNewTokensLogitsProcessor(1, 9).process(torch.zeros(1, 5), ctx_of([[1]], 1))


# --------------------------------------------------------------- allowed ids


@pytest.mark.parametrize("dtype", DTYPES)
def test_allowed_token_ids_keep_only_those(dtype):
    logits = torch.randn(3, 10).to(dtype)
    out = AllowedTokenIdsLogitsProcessor([2, 7, 7]).process(logits.clone(), ctx_of([[1]] * 3, 1))
    assert out.dtype == dtype
    assert torch.isfinite(out).nonzero()[:, 1].tolist() == [2, 7] * 3
    assert torch.equal(out[:, [2, 7]], logits[:, [2, 7]])


def test_allowed_token_ids_reject_bad_ids():
    with pytest.raises(ValueError, match=r"token_ids\[1\] must be a token id in \[0, 10\), got 10"):
        AllowedTokenIdsLogitsProcessor([1, 10], vocab_size=10)
    with pytest.raises(ValueError, match=r"token_ids\[0\] must be a token id >= 0, got -3"):
        AllowedTokenIdsLogitsProcessor([-3])
    with pytest.raises(ValueError, match="token_ids must hold at least one token id"):
        AllowedTokenIdsLogitsProcessor([])
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1, got True"):
        AllowedTokenIdsLogitsProcessor([0], vocab_size=True)
    with pytest.raises(ValueError, match=r"token id 12 is outside the vocabulary of these logits \(width 10\)"):
        AllowedTokenIdsLogitsProcessor([12]).process(torch.zeros(1, 10), ctx_of([[1]], 1))


# --------------------------------------------------------------- logit bias


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_adds_to_listed_tokens(tok, dtype):
    (paris,) = tok("Hello Paris", add_special_tokens=False)["input_ids"][-1:]
    assert tok.decode([paris]) == " Paris"
    proc = LogitBiasLogitsProcessor({3: 2.0, 5: float("-inf"), " Paris": -1.5}, tok)
    logits = torch.zeros(2, len(tok), dtype=dtype)
    out = proc.process(logits, ctx_of([[1], [2]], 1))
    assert out is logits and out.dtype == dtype
    expected = torch.zeros(len(tok))
    expected[3], expected[5], expected[paris] = 2.0, float("-inf"), -1.5
    assert torch.equal(out.float(), expected.expand(2, -1))


def test_bias_of_a_multi_token_string_is_refused_with_its_tokens(tok):
    text = " Moreau at"
    pieces = tok(text, add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1, "the test needs a string of several tokens"
    with pytest.raises(
        ValueError, match=rf"bias key ' Moreau at' is no single token in context: .* {len(pieces)} tokens"
    ):
        LogitBiasLogitsProcessor({text: 4.0}, tok)


def test_bias_entries_on_the_same_token_add_up(tok):
    token = tok("Hello Paris", add_special_tokens=False)["input_ids"][-1]
    proc = LogitBiasLogitsProcessor({" Paris": 1.0, token: 0.5}, tok)
    assert proc.bias == {token: 1.5}


@pytest.mark.parametrize(
    "bias, message",
    [
        ({3: "high"}, r"bias\[3\] must be a finite number or -inf, got 'high'"),
        ({3: float("nan")}, r"bias\[3\] must be a finite number .*got nan"),
        ({3: True}, r"bias\[3\] must be a finite number"),
        ({5000: 1.0}, r"bias key 5000 must be a token id in \[0, 300\), got 5000"),
        ({-1: 1.0}, r"bias key -1 must be a token id in \[0, 300\), got -1"),
        ({2.5: 1.0}, r"bias key 2\.5 must be a token id \(an int\)"),
        ({}, "bias must hold at least one entry"),
    ],
)
def test_bias_rejects_bad_input(tok, bias, message):
    with pytest.raises(ValueError, match=message):
        LogitBiasLogitsProcessor(bias, tok)


def test_bias_without_tokenizer_checks_ids_against_the_logits():
    with pytest.raises(ValueError, match="pass tokenizer= to tokenise it"):
        LogitBiasLogitsProcessor({"Paris": 1.0})
    proc = LogitBiasLogitsProcessor({40: 1.0})
    with pytest.raises(ValueError, match=r"token id 40 is outside the vocabulary of these logits \(width 32\)"):
        proc.process(torch.zeros(1, 32), ctx_of([[1]], 1))


# --------------------------------------------------------------- forced text


def test_forced_text_forces_each_token_then_eos(tok):
    proc = ForcedTextLogitsProcessor("Hello world!", tok)
    tokens = tok("Hello world!", add_special_tokens=False)["input_ids"]
    generated: list[int] = []
    for _ in range(len(tokens) + 2):
        logits = torch.randn(2, len(tok))
        out = proc.process(logits.clone(), ctx_of([[7] + generated] * 2, 1))
        choice = out.argmax(-1)
        assert torch.isfinite(out).sum(-1).tolist() == [1, 1]
        assert choice[0] == choice[1]
        assert out[0, choice[0]] == logits[0, choice[0]], "the forced token keeps its natural logit"
        generated.append(int(choice[0]))
    assert generated[: len(tokens)] == tokens
    assert generated[len(tokens) :] == [tok.eos_token_id] * 2
    assert tok.decode(generated, skip_special_tokens=True) == "Hello world!"


@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_text_after_a_ban_still_allows_the_forced_token(tok, dtype):
    proc = ForcedTextLogitsProcessor("Hello", tok)
    first = tok("Hello", add_special_tokens=False)["input_ids"][0]
    logits = torch.zeros(1, len(tok), dtype=dtype)
    logits[0, first] = float("-inf")
    out = proc.process(logits, ctx_of([[7]], 1))
    assert out.dtype == dtype and out[0, first] == 0 and torch.isfinite(out).sum() == 1


def test_forced_text_rejects_bad_input(tok):
    with pytest.raises(ValueError, match="text must be a non-empty string, got ''"):
        ForcedTextLogitsProcessor("", tok)
    with pytest.raises(ValueError, match=r"eos_token_id\[0\] must be a token id >= 0, got -2"):
        ForcedTextLogitsProcessor("Hello", tok, eos_token_id=-2)
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer .* got NoneType"):
        ForcedTextLogitsProcessor("Hello", None)  # not "the tokenizer has no end-of-sequence token"


@pytest.mark.parametrize("eos", [{7}, torch.tensor([7]), torch.tensor(7)])
def test_forced_text_takes_eos_ids_as_transformers_does(tok, eos):
    forced = ForcedTextLogitsProcessor("Hello", tok, eos_token_id=eos)
    after = len(forced.token_ids)
    logits = forced.process(torch.randn(1, len(tok)), ctx_of([[1] + [2] * after], 1))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [7]


# --------------------------------------------------------------- penalties


@pytest.mark.parametrize("dtype", DTYPES)
def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits(dtype):
    logits = torch.tensor([[2.0, -2.0, 2.0, 2.0, 2.0]], dtype=dtype)
    # prompt [pad=4, 0, 1], generated [1]; the padding column is not a token of the prompt
    ctx = ctx_of([[4, 0, 1, 1]], 3, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    out = PenaltiesLogitsProcessor(repetition_penalty=2.0).process(logits, ctx)
    assert out.dtype == dtype
    assert out.float().tolist() == [[1.0, -4.0, 2.0, 2.0, 2.0]]


def test_repetition_penalty_leaves_a_row_of_padding_only_alone():
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(3)) + 2.0
    ctx = ctx_of([[5, 5, 5], [5, 1, 2]], 3, attention_mask=torch.tensor([[0, 0, 0], [0, 1, 1]]))
    out = PenaltiesLogitsProcessor(repetition_penalty=2.0).process(logits.clone(), ctx)
    assert torch.equal(out[0], logits[0])
    want = logits[1].clone()
    want[[1, 2]] = torch.where(want[[1, 2]] > 0, want[[1, 2]] / 2, want[[1, 2]] * 2)
    torch.testing.assert_close(out[1], want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(2, 6)
    ctx = ctx_of([[5, 5, 2, 2, 3], [5, 5, 1, 4, 4]], 2)
    out = PenaltiesLogitsProcessor(presence_penalty=0.5, frequency_penalty=0.25).process(logits, ctx)
    assert out.tolist() == [[0, 0, -1.0, -0.75, 0, 0], [0, -0.75, 0, 0, -1.0, 0]]


def test_penalties_make_repeats_lose_the_argmax():
    """Constant logits, a penalty, then argmax: the repeated token is no longer chosen."""
    logits = torch.full((1, 4), 1.0)
    logits[0, 2] = 1.2
    ctx = ctx_of([[0, 2, 2]], 1)
    assert PenaltiesLogitsProcessor(repetition_penalty=1.5).process(logits.clone(), ctx).argmax() != 2
    assert PenaltiesLogitsProcessor(frequency_penalty=0.2).process(logits.clone(), ctx).argmax() != 2
    assert PenaltiesLogitsProcessor(presence_penalty=0.3).process(logits.clone(), ctx).argmax() != 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repetition_penalty": 0}, r"repetition_penalty must be a finite number > 0, got 0"),
        ({"presence_penalty": 3}, r"presence_penalty must be a finite number in \[-2, 2\], got 3"),
        ({"frequency_penalty": "x"}, r"frequency_penalty must be a finite number in \[-2, 2\], got 'x'"),
    ],
)
def test_penalties_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PenaltiesLogitsProcessor(**kwargs)


def test_penalties_name_a_negative_id_in_the_input():
    penalties = PenaltiesLogitsProcessor(repetition_penalty=1.3)
    with pytest.raises(ValueError, match=r"input_ids holds token id -1; token ids must be >= 0"):
        penalties(torch.tensor([[3, -1, 2]]), torch.randn(1, 10))


# --------------------------------------------------------------- in place, as documented


@pytest.mark.parametrize(
    "cls",
    [
        TemperatureLogitsProcessor,
        MinNewTokensLogitsProcessor,
        AllowedTokenIdsLogitsProcessor,
        LogitBiasLogitsProcessor,
        ForcedTextLogitsProcessor,
        PenaltiesLogitsProcessor,
    ],
)
def test_docstrings_say_they_work_in_place(cls):
    assert cls.inplace is True
    assert "in place" in (cls.__doc__ or "").lower()
