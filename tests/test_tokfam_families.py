"""Every tokenizer family right: fragments land on the tokens the tokenizer itself shows, text agrees everywhere.

Each check runs over byte-level BPE, a ``Sequence([ByteLevel])`` decoder,
Llama-2 style SentencePiece (prepend normaliser, byte fallback), Metaspace
with byte fallback, and WordPiece, and compares with the tokenizer's own
``decode`` of the same ids **in context** (after other text): the text a
token adds is ``decode(context + ids)`` minus ``decode(context)``.
"""

from __future__ import annotations

import pytest
import torch
from test_tracker_support import random_gpt2
from tokfam_tokenizers import FAMILIES, build
from transformers import LogitsProcessorList

from processors import (
    BadWordsLogitsProcessor,
    BatchContext,
    ForcedTextLogitsProcessor,
    LogitBiasLogitsProcessor,
    RegexLogitsProcessor,
    vocab_for,
)
from sampling import Generator, SamplingParams
from tracker import LogitTrackingProcessor, add_tracking

PAD = 7  # the model's logits are wider than the tokenizer, as real models' often are


@pytest.fixture(scope="module", params=FAMILIES)
def tok(request):
    return build(request.param)


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def in_context(tok, context: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``context``, by the tokenizer's own decode."""
    before = tok.decode(context, skip_special_tokens=True)
    after = tok.decode(list(context) + list(ids), skip_special_tokens=True)
    assert after.startswith(before), (before, after)
    return after[len(before) :]


def one_trailing_replacement(text: str) -> str:
    """Incomplete UTF-8 at the end shown once: some decoders give one ``�`` per stray byte."""
    stripped = text.rstrip("�")
    return stripped + "�" if stripped != text else text


def ctx(rows: list[list[int]], prompt_length: int) -> BatchContext:
    return BatchContext(input_ids=torch.tensor(rows), prompt_length=prompt_length)


def banned(proc, rows: list[list[int]], prompt_length: int, width: int) -> set[int]:
    out = proc.process(torch.zeros(len(rows), width), ctx(rows, prompt_length))
    return set(torch.isinf(out[0]).nonzero().flatten().tolist())


# ---------------------------------------------------------------- bias


@pytest.mark.parametrize("key", [" Paris", " world", " Hello"])
def test_bias_moves_only_the_token_shown_as_the_key_in_context(tok, key):
    context = ids_of(tok, "We went to")
    proc = LogitBiasLogitsProcessor({key: 5.0}, tok)
    out = proc.process(torch.zeros(1, len(tok) + PAD), ctx([context], len(context)))
    moved = out[0].nonzero().flatten().tolist()
    assert len(moved) == 1 and out[0, moved[0]] == 5.0
    assert in_context(tok, context, moved) == key


def test_bias_refuses_a_key_with_no_single_token_and_names_its_tokens(tok):
    with pytest.raises(ValueError, match=r"bias key ' Parisian zebra' is no single token in context: .* tokens"):
        LogitBiasLogitsProcessor({" Parisian zebra": 1.0}, tok)


# ---------------------------------------------------------------- forced text


@pytest.mark.parametrize("text", [" Hello world", " Paris 世界", " 🎉 world"])
def test_forced_text_generates_exactly_the_text_in_context(tok, text):
    if tok.decode(ids_of(tok, text)).strip() != text.strip():
        pytest.skip("this tokenizer cannot spell the text (unknown characters, or CJK split into words)")
    prompt = ids_of(tok, "We went to")
    proc = ForcedTextLogitsProcessor(text, tok)
    generated: list[int] = []
    for _ in range(len(proc.token_ids) + 1):
        out = proc.process(torch.randn(1, len(tok) + PAD), ctx([prompt + generated], len(prompt)))
        generated.append(int(out.argmax(-1)))
    assert generated[-1] == tok.eos_token_id
    assert in_context(tok, prompt, generated[:-1]) == text


def test_a_text_the_tokenizer_can_only_write_as_its_unknown_token_is_refused_not_forced(tok):
    """WordPiece writes 🎉 as [UNK]: forcing or biasing [UNK] would not give 🎉, so both say so up front."""
    spelled = vocab_for(tok).encode_fragment(" 🎉").ids
    if tok.unk_token_id not in spelled:  # byte-level and byte-fallback families spell every character
        assert ForcedTextLogitsProcessor(" 🎉", tok).token_ids == list(spelled)
        return
    with pytest.raises(ValueError, match=r"text ' 🎉': the tokenizer cannot spell it; it becomes its unknown token"):
        ForcedTextLogitsProcessor(" 🎉", tok)
    with pytest.raises(ValueError, match=r"bias key '🎉': the tokenizer cannot spell it"):
        LogitBiasLogitsProcessor({"🎉": 5.0}, tok)
    assert ForcedTextLogitsProcessor(f" {tok.unk_token}", tok).token_ids == [tok.unk_token_id]  # asked for by name


# ---------------------------------------------------------------- bad words


def test_bad_words_in_tokens_mode_ban_the_words_tokens_in_context(tok):
    prompt = ids_of(tok, "We went to")
    proc = BadWordsLogitsProcessor(["Paris"], tok, mode="tokens")
    singles = banned(proc, [prompt], len(prompt), len(tok) + PAD)
    spaced = vocab_for(tok).encode_fragment(" Paris").ids
    assert len(spaced) == 1 and spaced[0] in singles, "the single token of ' Paris' in context is banned"
    for token in singles:
        assert in_context(tok, prompt, [token]) in ("Paris", " Paris"), tok.convert_ids_to_tokens([token])
    glued = list(vocab_for(tok).encode_fragment("Paris").ids)
    if len(glued) > 1:  # the last piece is banned right after the others, not elsewhere
        assert glued[-1] not in singles
        assert glued[-1] in banned(proc, [prompt + glued[:-1]], len(prompt), len(tok) + PAD)


def test_bad_words_in_text_mode_ban_exactly_what_would_spell_the_word(tok):
    prompt = ids_of(tok, "We")
    generated = list(vocab_for(tok).encode_fragment(" went to Pa").ids)
    proc = BadWordsLogitsProcessor(["Paris"], tok)
    got = banned(proc, [prompt + generated], len(prompt), len(tok))
    expected = {t for t in range(len(tok)) if "Paris" in in_context(tok, prompt, generated + [t])}
    assert expected and got == expected


# ---------------------------------------------------------------- display and text


def test_display_is_the_tokens_text_in_context_and_lone_bytes_show_as_hex(tok):
    vocab = vocab_for(tok, len(tok) + PAD)
    context = ids_of(tok, "We")
    special = set(tok.all_special_ids)
    for token in range(len(tok)):
        shown = vocab.display[token]
        if token in special:
            assert shown == tok.convert_ids_to_tokens(token) and vocab.token_bytes(token) == b""
            continue
        text = in_context(tok, context, [token])
        data = vocab.token_bytes(token)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            assert shown == "".join(f"⟨{b:02X}⟩" for b in data) and "�" in text
        else:
            assert shown == text and data == text.encode(), tok.convert_ids_to_tokens(token)
    assert vocab.display[len(tok) :] == tuple(f"<{i}>" for i in range(len(tok), len(tok) + PAD))
    assert vocab.decode([len(tok), len(tok) + 1]) == ""


@pytest.mark.parametrize("cut", [None, 2])
def test_one_text_in_the_generator_the_tracker_and_model_generate(tok, cut):
    """Force a text that ends in a 4-byte emoji; with ``cut`` the emoji is left unfinished."""
    model = random_gpt2(len(tok) + PAD, seed=3)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    text = " Hello world 🎉" if tok.decode(ids_of(tok, "🎉")) == "🎉" else " Hello world"
    if cut and not text.endswith("🎉"):
        pytest.skip("this tokenizer cannot spell the emoji, so nothing can be cut inside it")
    forced = ForcedTextLogitsProcessor(text, tok)
    budget = len(forced.token_ids) + 1 if cut is None else len(forced.token_ids) - cut
    prompt_text = "We went to"
    prompt = ids_of(tok, prompt_text)

    generator = add_tracking(Generator(model, tok, logits_processor=[forced]))
    tracker = generator.logits_processor
    (out,) = generator.generate([prompt], SamplingParams(temperature=0, max_new_tokens=budget))
    completion = out.outputs[0]
    expected = one_trailing_replacement(in_context(tok, prompt, completion.token_ids))
    if cut is None:
        assert expected == text
    assert completion.text == expected
    assert tracker.sequence() == expected
    frame = tracker.to_dataframe()
    chosen = frame[frame["chosen"]]
    vocab = vocab_for(tok, len(tok) + PAD)
    assert chosen["token"].tolist() == [vocab.display[t] for t in completion.token_ids[: len(chosen)]]

    tracker_hf = LogitTrackingProcessor(ForcedTextLogitsProcessor(text, tok), tokenizer=tok)
    batch = torch.tensor([prompt])
    ids = model.generate(
        input_ids=batch,
        attention_mask=torch.ones_like(batch),
        logits_processor=LogitsProcessorList([tracker_hf]),
        do_sample=False,
        max_new_tokens=budget,
    )
    tracker_hf.finish(ids)
    new = ids[0, len(prompt) :].tolist()
    assert new == completion.token_ids
    assert tracker_hf.sequence() == expected
    last = tracker_hf.get_top_tokens(k=1)[-1]
    assert last["text_so_far"] == tracker_hf.sequence(pos=len(new) - 1)


# ---------------------------------------------------------------- grammar constraints


def _words(data: bytes) -> bool:
    """Whether ``data`` can start a text matching ``[a-z]+( [a-z]+)+``."""
    return bool(data) and set(data) <= set(b"abcdefghijklmnopqrstuvwxyz ") and data[:1] != b" " and b"  " not in data


def _no_space(data: bytes) -> bool:
    """Whether ``data`` (valid UTF-8) can start a text matching ``[^ ]+``."""
    return bool(data) and b" " not in data


@pytest.mark.parametrize(("pattern", "viable"), [(r"[a-z]+( [a-z]+)+", _words), (r"[^ ]+", _no_space)])
def test_a_regex_allows_exactly_the_tokens_that_can_start_a_match(tok, pattern, viable):
    # llguidance must read every token as the bytes it adds in a text (a SentencePiece "▁w" is " w", not "▁w")
    vocab = vocab_for(tok)
    proc = RegexLogitsProcessor(pattern, tok)
    prompt = ids_of(tok, "We went to")
    allowed = set(
        torch.isfinite(proc.process(torch.zeros(1, len(tok)), ctx([prompt], len(prompt)))[0])
        .nonzero()
        .flatten()
        .tolist()
    )
    expected = set()
    for i in range(vocab.size):
        data = vocab.token_bytes(i)
        if vocab.special[i]:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            allowed.discard(i)  # a piece of a character: whether it may start one is the engine's business
            continue
        if viable(data):
            expected.add(i)
    assert allowed == expected, {vocab.display[i] for i in allowed ^ expected}


def test_a_regex_spelled_by_the_generator_in_every_family(tok):
    model = random_gpt2(len(tok) + PAD, seed=4)
    model.generation_config.eos_token_id = tok.eos_token_id
    text = " Hello world and Paris"
    generator = add_tracking(Generator(model, tok, logits_processor=[RegexLogitsProcessor(text, tok)]))
    prompt = ids_of(tok, "We went to")
    (out,) = generator.generate([prompt], SamplingParams(temperature=1.0, seed=0, max_new_tokens=20))
    completion = out.outputs[0]
    assert completion.text == text
    assert completion.finish_reason == "stop"
    assert in_context(tok, prompt, completion.token_ids) == text
    assert generator.logits_processor.sequence() == text


def test_a_regex_no_token_can_start_says_so():
    tok = build("wordpiece")  # a WordPiece word mid-text always brings its space
    proc = RegexLogitsProcessor("Hello", tok)
    prompt = ids_of(tok, "We went to")
    with pytest.raises(ValueError, match="no token of this tokenizer spells a continuation the regex 'Hello' allows"):
        proc.process(torch.zeros(1, len(tok)), ctx([prompt], len(prompt)))
