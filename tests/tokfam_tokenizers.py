"""Tokenizers of every decoder family, built with the ``tokenizers`` library (no download).

- ``byte_level``: GPT-2 style byte-level BPE.
- ``sequence``: the same, its decoder wrapped in ``decoders.Sequence([ByteLevel])``.
- ``llama2``: SentencePiece style as Llama-2 / Mistral ship it: a normaliser
  that prepends ``▁`` and turns spaces into ``▁``, ``<0xNN>`` byte fallback,
  a decoder that strips the first space.
- ``metaspace``: SentencePiece style with a ``Metaspace`` pre-tokenizer and
  decoder (``prepend_scheme="first"``) and byte fallback.
- ``wordpiece``: BERT style WordPiece (``##`` continuations, cased).

Real tokenizers (Llama-2, Llama-3, Qwen3, gpt-oss) are used by
``test_tokfam_real.py`` when their files are present.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Hello world! The capital of France is Paris.",
    "Paris, Hello, world, 世界 and more words here.",
    "We went to Paris and said Hello to the world.",
    "Numbers 123 and 4567 in text. 世界 is the world.",
]
FAMILIES = ("byte_level", "sequence", "llama2", "metaspace", "wordpiece")


def _byte_level(sequence: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.Sequence([decoders.ByteLevel()]) if sequence else decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    out.add_tokens(["<note>"])
    return out


def _sentencepiece(llama2: bool) -> PreTrainedTokenizerFast:
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    base.train_from_iterator(
        CORPUS * 20, trainers.BpeTrainer(vocab_size=220, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    spec = json.loads(base.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if llama2:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.Fuse()]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


def _wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=260, special_tokens=["[PAD]", "[UNK]", "[SEP]"], show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        clean_up_tokenization_spaces=False,
    )


def build(family: str) -> PreTrainedTokenizerFast:
    """The tokenizer of ``family`` (one of :data:`FAMILIES`)."""
    if family in ("byte_level", "sequence"):
        return _byte_level(family == "sequence")
    if family in ("llama2", "metaspace"):
        return _sentencepiece(family == "llama2")
    if family == "wordpiece":
        return _wordpiece()
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
