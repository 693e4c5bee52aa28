"""Vocabulary bytes per tokenizer, and the bitmask helpers every constraint shares."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from processors import eos_token_ids, vocab_for
from processors.bitmask import apply_bitmask_, pack_bool, unpack_bitmask
from processors.vocab import hf_tokenizer

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def byte_level():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["Zoë and Chloé live in Zürich. Alice!"] * 20, vocab_size=300, special_tokens=[EOT], show_progress=False
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT, pad_token=EOT)
    tok.add_tokens(["<custom>"])
    return tok


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-style tokenizer: ``▁`` for spaces and ``<0xNN>`` byte-fallback pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in ["▁", "H", "e", "l", "o", "A", "i", "c", "▁H", "▁He", "ll", "▁Hell", "▁Hello", "▁A", "li", "ce"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "H"), ("▁H", "e"), ("l", "l"), ("▁He", "ll"), ("▁Hell", "o"), ("▁", "A"), ("l", "i"), ("c", "e")]
    model = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    model.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def test_byte_level_tokens_spell_the_decoded_text(byte_level):
    vocab = vocab_for(byte_level)
    text = "Zoë and Chloé <custom> Zürich! 😀"
    ids = byte_level(text, add_special_tokens=False)["input_ids"]
    assert vocab.decode_bytes(ids) == byte_level.decode(ids).encode()
    assert vocab.size == len(byte_level)
    assert vocab.token_bytes(byte_level.eos_token_id) == b"" and bool(vocab.special[byte_level.eos_token_id])
    assert vocab.display[byte_level.eos_token_id] == EOT
    custom = byte_level.convert_tokens_to_ids("<custom>")
    assert vocab.token_bytes(custom) == b"<custom>" and not vocab.special[custom]


def test_byte_matrix_matches_token_bytes(byte_level):
    vocab = vocab_for(byte_level)
    matrix, lengths = vocab.byte_matrix
    for token in range(vocab.size):
        length = int(lengths[token])
        assert bytes(matrix[token, :length].tolist()) == vocab.token_bytes(token)
        assert not matrix[token, length:].any()


def test_sentencepiece_pieces_and_byte_fallback(sentencepiece_like):
    tok = sentencepiece_like
    ids = tok("Hello Zoë! Alice", add_special_tokens=False)["input_ids"]
    assert vocab_for(tok).decode_bytes(ids) == " Hello Zoë! Alice".encode()


def test_vocab_is_cached_per_tokenizer(byte_level, sentencepiece_like):
    assert vocab_for(byte_level) is vocab_for(byte_level)
    assert vocab_for(sentencepiece_like) is not vocab_for(byte_level)


def test_vocab_rejects_what_is_not_a_tokenizer():
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer .* got int"):
        vocab_for(3)


# --------------------------------------------------------------- bitmasks


def test_pack_and_unpack_round_trip():
    allowed = torch.rand(3, 70, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bool(allowed)
    assert packed.shape == (3, 3) and packed.dtype == torch.int32
    assert torch.equal(unpack_bitmask(packed, 70), allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_apply_matches_llguidance_numpy_reference(dtype):
    from llguidance.numpy import apply_token_bitmask_inplace

    gen = torch.Generator().manual_seed(1)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(2, 128, generator=gen)
    expected = logits.numpy().copy()
    apply_token_bitmask_inplace(expected, mask.numpy())
    out = apply_bitmask_(logits.to(dtype), mask)
    assert out.dtype == dtype
    assert torch.equal(out.float(), torch.from_numpy(expected).to(dtype).float())


def test_apply_bans_tokens_beyond_the_mask():
    logits = torch.zeros(1, 40)
    apply_bitmask_(logits, torch.full((1, 1), -1, dtype=torch.int32), n_tokens=30)
    assert torch.isfinite(logits[0, :30]).all() and torch.isinf(logits[0, 30:]).all()
    assert np.isneginf(logits[0, 30:].numpy()).all()


def _structured_mask(rows: int, words: int, seed: int) -> torch.Tensor:
    """Masks like a grammar's: rows of mostly 0 words or mostly -1 words, with a few mixed words."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, words, dtype=torch.int32)
    mask[1::2] = -1
    mixed = torch.randint(0, words, (rows, words // 50), generator=gen)
    values = torch.randint(-(2**31), 2**31 - 1, mixed.shape, dtype=torch.int32, generator=gen)
    mask.scatter_(1, mixed, values)
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, width, n_tokens, random_bits, path",
    [
        (4, 32 * 1024, None, False, "words"),
        (1, 32 * 4096, None, False, "words"),
        (3, 32 * 1024, None, True, "table"),  # too many mixed words
        (2, 32 * 1024 + 7, 32 * 1024 + 7, False, "table"),  # width not a multiple of 32
        (2, 32 * 1024 + 64, 32 * 1024, False, "words"),  # model wider than the mask
        (2, 32 * 1024 + 64, 32 * 1024 - 5, False, "words"),  # a mask ending inside a word
        (2, 32 * 1024 + 40, 32 * 1024, False, "table"),  # wider, but not by whole words
    ],
)
def test_apply_large_masks_matches_the_reference(monkeypatch, dtype, rows, width, n_tokens, random_bits, path):
    from llguidance.numpy import apply_token_bitmask_inplace

    import processors.bitmask as bitmask_module

    used: list[str] = []
    by_table = bitmask_module._apply_by_table_
    monkeypatch.setattr(bitmask_module, "_apply_by_table_", lambda *a: used.append("table") or by_table(*a))

    words = (min(width, n_tokens or width) + 31) // 32
    if random_bits:
        mask = torch.randint(
            -(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=torch.Generator().manual_seed(2)
        )
    else:
        mask = _structured_mask(rows, words, seed=rows)
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(3)).to(dtype)
    expected = logits.float().numpy().copy()
    apply_token_bitmask_inplace(expected, mask.numpy())
    if n_tokens is not None:
        expected[:, n_tokens:] = -np.inf
    out = apply_bitmask_(logits, mask, n_tokens)
    assert out is logits and out.dtype == dtype
    assert torch.equal(out.float(), torch.from_numpy(expected).to(dtype).float())
    assert (used == ["table"]) is (path == "table")


@pytest.mark.parametrize("allowed_share", [0.0, 0.3, 0.7, 1.0])
def test_apply_one_large_row_mostly_banned_or_mostly_allowed(allowed_share):
    from llguidance.numpy import apply_token_bitmask_inplace

    gen = torch.Generator().manual_seed(4)
    words = 4096
    mask = torch.where(torch.rand(1, words, generator=gen) < allowed_share, -1, 0).to(torch.int32)
    mask[0, ::97] = torch.randint(-(2**31), 2**31 - 1, mask[0, ::97].shape, dtype=torch.int32, generator=gen)
    logits = torch.randn(1, 32 * words, generator=gen)
    expected = logits.numpy().copy()
    apply_token_bitmask_inplace(expected, mask.numpy())
    assert torch.equal(apply_bitmask_(logits, mask), torch.from_numpy(expected))


# --------------------------------------------------------------- fragments, EOS, hosts' wrappers


def test_fragments_are_tokenized_in_context(sentencepiece_like):
    tok = sentencepiece_like
    vocab = vocab_for(tok)
    fragment = vocab.encode_fragment(" Hello")
    assert tok.convert_ids_to_tokens(list(fragment.ids)) == ["▁Hello"] and fragment.exact
    glued = vocab.encode_fragment("Alice")
    assert vocab.decode_bytes(glued.ids) == b"Alice" and glued.exact
    with pytest.raises(ValueError, match="text must be a non-empty string, got ''"):
        vocab.encode_fragment("")


def test_a_fragment_the_tokenizer_changes_is_marked_inexact():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "x": 2, "0": 3, "a": 4, ".": 5}, unk_token="[UNK]"))
    model.normalizer = normalizers.Lowercase()
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")
    fragment = vocab_for(tok).encode_fragment("Hello")
    assert fragment.ids == (1,) and not fragment.exact


def test_eos_ids_come_from_the_argument_then_the_generation_config_then_the_tokenizer(byte_level):
    from types import SimpleNamespace

    eos = byte_level.eos_token_id
    assert eos_token_ids(byte_level) == (eos,)
    assert eos_token_ids(byte_level, generation_config=SimpleNamespace(eos_token_id=[4, 5])) == (4, 5)
    assert eos_token_ids(byte_level, [7, 7, 8], generation_config=SimpleNamespace(eos_token_id=4)) == (7, 8)
    assert eos_token_ids(SimpleNamespace(tokenizer=byte_level)) == (eos,), "a host's wrapper is looked through"
    assert eos_token_ids(None) == ()
    with pytest.raises(ValueError, match=r"eos_token_id\[0\] must be a token id >= 0, got -1"):
        eos_token_ids(byte_level, -1)


def test_a_hosts_wrapper_is_unwrapped_to_the_hugging_face_tokenizer(byte_level):
    class Wrapper:  # what Outlines' TransformerTokenizer looks like to us: decode returns lists
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer
            self.eos_token_id = tokenizer.eos_token_id

        def decode(self, ids):
            return [str(i) for i in ids]

    wrapped = Wrapper(byte_level)
    assert hf_tokenizer(wrapped) is byte_level
    assert vocab_for(wrapped) is vocab_for(byte_level)


def test_vocabularies_of_other_widths_are_cached_apart(byte_level):
    wide = vocab_for(byte_level, len(byte_level) + 5)
    assert wide is vocab_for(byte_level, len(byte_level) + 5) and wide is not vocab_for(byte_level)
    assert wide.size == len(byte_level) + 5 and wide.special[len(byte_level) :].all()
    assert wide.decode_bytes([len(byte_level) + 1, 10_000]) == b""


def test_a_tokenizer_without_a_decoder_table_is_read_from_its_token_strings():
    class SlowSentencePiece:  # a slow tokenizer: token strings, no backend decoder
        tokens = ["<unk>", "</s>", "▁Hello", "▁wor", "ld", "<0xE2>", "<0x98>", "<0x83>"]
        eos_token_id = 1
        all_special_ids = [0, 1]

        def __len__(self):
            return len(self.tokens)

        def convert_ids_to_tokens(self, ids):
            return [self.tokens[i] for i in ids]

    vocab = vocab_for(SlowSentencePiece())
    assert vocab.decode([2, 3, 4, 5, 6, 7, 1]) == " Hello world☃"
    assert vocab.display[5] == "⟨E2⟩" and vocab.display[1] == "</s>"
