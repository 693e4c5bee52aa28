"""Bad words: the byte automaton, the text-level mode (any spelling) and vLLM's token mode."""

from __future__ import annotations

import random

import pytest
import torch

from processors import BadWordsLogitsProcessor, BatchContext, vocab_for
from processors.automaton import build_byte_automaton, build_token_automaton

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    lines = [
        '{"name": "Alice Moreau", "age": 34, "city": "Lyon"}',
        "Alice lives in Paris. Malice and police. Alicia and Alex.",
        "Zoë and Chloé live in Zürich.",
    ] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=320, min_frequency=2, special_tokens=[EOT], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT, pad_token=EOT)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def banned_after(proc, generated: list[int], width: int) -> set[int]:
    ctx = BatchContext(input_ids=torch.tensor([[0] + generated]), prompt_length=1)
    out = proc.process(torch.zeros(1, width), ctx)
    return set(torch.isinf(out[0]).nonzero().flatten().tolist())


# --------------------------------------------------------------- the automaton


def test_byte_automaton_finds_every_occurrence_like_a_naive_search():
    rng = random.Random(0)
    for _ in range(50):
        patterns = sorted({bytes(rng.choice(b"abc") for _ in range(rng.randint(1, 4))) for _ in range(3)})
        text = bytes(rng.choice(b"abcd") for _ in range(40))
        automaton = build_byte_automaton(patterns)
        state, found = 0, []
        for i, byte in enumerate(text):
            state = int(automaton.delta[state, byte])
            if automaton.matched[state]:
                found.append(i)
        naive = sorted({i + len(p) - 1 for p in patterns for i in range(len(text)) if text.startswith(p, i)})
        assert found == naive, (patterns, text)


def test_token_table_bans_exactly_the_tokens_that_complete_a_word(tok):
    """From states reached by random text, compare the precomputed table with brute force over the vocabulary."""
    words = [b"Alice", b"lic", "Zoë".encode()]
    vocab = vocab_for(tok)
    automaton = build_token_automaton(words, vocab)
    rng = random.Random(1)
    alphabet = "AliceZoë lZ"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        data = text.encode()
        if any(w in data for w in words):
            continue
        state = automaton.advance(0, ids(tok, text))
        allowed_bits = automaton.allowed[state]
        table = [(int(allowed_bits[t // 32]) >> (t % 32)) & 1 == 0 for t in range(vocab.size)]
        brute = [any(w in data + vocab.pieces[t] for w in words) for t in range(vocab.size)]
        assert table == brute, text


# --------------------------------------------------------------- text mode


def test_text_mode_bans_every_spelling(tok):
    proc = BadWordsLogitsProcessor(["Alice"], tok)
    width = len(tok)
    for prefix in ["A", "Al", "Ali", "Alic", " Al", "xAli"]:
        for token in range(width):
            completes = b"Alice" in (prefix.encode() + vocab_for(tok).pieces[token])
            proc.reset()
            assert (token in banned_after(proc, ids(tok, prefix), width)) is completes, (prefix, token)


@pytest.mark.parametrize("word", ["\n\n", "  "])
def test_a_word_of_whitespace_only_is_banned_like_any_other(tok, word):
    proc = BadWordsLogitsProcessor([word], tok)
    pieces = vocab_for(tok).pieces
    for prefix in ["Alice", "Alice" + word[0]]:
        proc.reset()
        banned = banned_after(proc, ids(tok, prefix), len(tok))
        assert banned == {t for t in range(len(tok)) if word.encode() in prefix.encode() + pieces[t]}, prefix
    assert BadWordsLogitsProcessor([word], tok, mode="tokens").words == (word,)


def test_text_mode_follows_bytes_across_many_tokens_and_rows(tok):
    proc = BadWordsLogitsProcessor(["Alice", "Zoë"], tok)
    single = [ids(tok, c)[0] for c in "Alic"]
    zo = ids(tok, "Zo")
    e_token = ids(tok, "e")[0]
    umlaut = [t for t in range(len(tok)) if vocab_for(tok).pieces[t].startswith("ë".encode())]
    rows = [single, zo + [0] * (len(single) - len(zo))]  # row 1 pads with EOS (spells nothing)
    ctx = BatchContext(input_ids=torch.tensor([[0] + r for r in rows]), prompt_length=1)
    out = proc.process(torch.zeros(2, len(tok)), ctx)
    assert torch.isinf(out[0, e_token]) and torch.isfinite(out[1, e_token])
    assert torch.isinf(out[1, umlaut]).all() and torch.isfinite(out[0, umlaut]).all()


def test_text_mode_never_lets_random_sampling_spell_the_word(tok):
    """Logits pushed towards every piece of the word: sampling still never spells it."""
    proc = BadWordsLogitsProcessor(["Alice"], tok)
    pieces = {t for t in range(len(tok)) if vocab_for(tok).pieces[t] and vocab_for(tok).pieces[t] in b" Alice"}
    pieces |= {t for t in range(len(tok)) if b"Alice".startswith(vocab_for(tok).pieces[t]) and vocab_for(tok).pieces[t]}
    boost = torch.zeros(len(tok))
    boost[sorted(pieces)] = 6.0
    gen = torch.Generator().manual_seed(0)
    batch, prompt = 32, torch.zeros(32, 1, dtype=torch.long)
    generated = torch.empty(batch, 0, dtype=torch.long)
    for _ in range(25):
        ctx = BatchContext(input_ids=torch.cat([prompt, generated], 1), prompt_length=1)
        logits = proc.process(torch.randn(batch, len(tok), generator=gen) + boost, ctx)
        token = torch.multinomial(logits.softmax(-1), 1, generator=gen)
        generated = torch.cat([generated, token], 1)
    texts = [tok.decode(row, skip_special_tokens=True) for row in generated]
    assert sum("Alic" in t for t in texts) > 3, "the boost should make the model come close"
    assert not any("Alice" in t for t in texts), [t for t in texts if "Alice" in t]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_text_mode_keeps_dtype_and_leaves_tokens_beyond_the_tokenizer(tok, dtype):
    proc = BadWordsLogitsProcessor(["Alice"], tok)
    logits = torch.randn(1, len(tok) + 10).to(dtype)
    ctx = BatchContext(input_ids=torch.tensor([[0] + ids(tok, "Alic")]), prompt_length=1)
    out = proc.process(logits.clone(), ctx)
    assert out.dtype == dtype
    assert torch.isinf(out[0, ids(tok, "e")[0]])
    assert torch.equal(out[0, len(tok) :], logits[0, len(tok) :])


# --------------------------------------------------------------- token mode (vLLM)


def test_token_mode_bans_single_token_words_always_and_multi_token_words_after_their_prefix(tok):
    word = "Quixote"  # not in the tokenizer's corpus: several tokens, with or without a space
    plain, spaced = ids(tok, word), ids(tok, " " + word)
    assert len(plain) > 1 and len(spaced) > 1
    proc = BadWordsLogitsProcessor([word, "Alice"], tok, mode="tokens")
    assert len(ids(tok, "Alice")) == 1, "Alice is one token in this tokenizer"
    alice = {ids(tok, "Alice")[0]}
    assert banned_after(proc, [], len(tok)) == alice
    assert banned_after(proc, plain[:-1], len(tok)) == alice | {plain[-1]}
    assert banned_after(proc, spaced[:-1], len(tok)) == alice | {spaced[-1]}
    assert banned_after(proc, plain[:-2], len(tok)) == alice


def test_text_mode_catches_what_token_mode_misses(tok):
    letters = [ids(tok, c)[0] for c in "Alic"]
    e_token = ids(tok, "e")[0]
    assert e_token not in banned_after(BadWordsLogitsProcessor(["Alice"], tok, mode="tokens"), letters, len(tok))
    assert e_token in banned_after(BadWordsLogitsProcessor(["Alice"], tok, mode="text"), letters, len(tok))


def test_processor_works_in_place_and_says_so(tok):
    proc = BadWordsLogitsProcessor(["Alice"], tok)
    logits = torch.zeros(1, len(tok))
    assert proc.process(logits, BatchContext(input_ids=torch.zeros(1, 1, dtype=torch.long), prompt_length=1)) is logits
    assert proc.inplace and "in place" in (BadWordsLogitsProcessor.__doc__ or "")


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "words, kwargs, error, message",
    [
        ("Alice", {}, TypeError, "words must be a list of strings, got the single str 'Alice'"),
        ([], {}, ValueError, "words must hold at least one word"),
        (["Alice", ""], {}, ValueError, r"words\[1\] must be a non-empty string, got ''"),
        (["Alice", 3], {}, ValueError, r"words\[1\] must be a non-empty string, got 3"),
        (["Alice"], {"mode": "regex"}, ValueError, "mode must be 'text' or 'tokens', got 'regex'"),
    ],
)
def test_bad_input(tok, words, kwargs, error, message):
    with pytest.raises(error, match=message):
        BadWordsLogitsProcessor(words, tok, **kwargs)
