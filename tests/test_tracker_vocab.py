"""Token texts: built in one pass from the tokenizer's table, exact bytes, readable display strings."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from tracker import Vocabulary


def sentencepiece_style() -> PreTrainedTokenizerFast:
    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "<0x0A>": 3,
        "<0xE2>": 4,
        "<0x98>": 5,
        "<0x83>": 6,
        "▁the": 7,
        "▁cat": 8,
        "fish": 9,
    }
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback_tokens_become_their_bytes():
    tok = sentencepiece_style()
    vocab = Vocabulary.from_tokenizer(tok, 12)
    assert vocab.token_bytes(3) == b"\n" and vocab.token_bytes(4) == b"\xe2"
    assert vocab.token_bytes(7) == b" the" and vocab.token_bytes(9) == b"fish"
    assert vocab.decode([7, 8, 9, 3, 4, 5, 6]) == " the catfish\n☃"
    assert vocab.display[10:] == ("<10>", "<11>") and vocab.token_bytes(10) == b""
    assert vocab.special[[0, 1, 2, 10, 11]].all() and not vocab.special[7]


def test_prefixes_show_a_split_character_once_it_is_complete():
    vocab = Vocabulary.from_parts([b"a", b"\xe2", b"\x98", b"\x83", b"b"])
    assert vocab.prefixes([0, 1, 2, 3, 4]) == ["", "a", "a�", "a�", "a☃", "a☃b"]
    assert vocab.display[1] == "⟨E2⟩"


def test_prefixes_are_the_decoded_prefixes_for_random_bytes():
    rng = np.random.default_rng(0)
    pieces = [bytes(rng.integers(0, 256, rng.integers(0, 4)).tolist()) for _ in range(40)]
    pieces += ["é".encode(), "🎉".encode()[:1], "🎉".encode()[1:3], "🎉".encode()[3:]]
    vocab = Vocabulary.from_parts(pieces)
    for _ in range(20):
        ids = rng.integers(0, len(pieces), 12).tolist()
        assert vocab.prefixes(ids) == [vocab.decode(ids[:k]) for k in range(len(ids) + 1)]


def test_a_tokenizer_with_only_decode_still_gets_a_vocabulary():
    class DecodeOnly:
        eos_token_id = 0

        def decode(self, ids):
            return "".join(chr(65 + i) for i in ids)

    vocab = Vocabulary.from_tokenizer(DecodeOnly(), 5)
    assert vocab.display == ("A", "B", "C", "D", "E")


def test_byte_matrix_lines_up_with_token_bytes():
    vocab = Vocabulary.from_parts([b"", b"cat", b"catfish", b"x"])
    matrix, lengths = vocab.byte_matrix
    assert lengths.tolist() == [0, 3, 7, 1]
    assert bytes(matrix[2, :7]) == b"catfish" and bytes(matrix[1, :3]) == b"cat" and matrix[1, 3:].sum() == 0
