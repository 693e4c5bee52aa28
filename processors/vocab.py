"""Per-tokenizer vocabulary facts: which bytes each token id stands for.

Text-level constraints (bad words spelled by any tokens, forced text, the
tracker's run metadata) need the bytes of every token. Decoding the
vocabulary one id at a time costs seconds at 128k tokens, so this module
reads the token strings in one batch call and maps them to bytes in one pass
over the joined vocabulary, and caches the result per tokenizer object.

>>> vocab = vocab_for(tokenizer)
>>> vocab.token_bytes[vocab.encode(" Alice")[0]]
b' Al'
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Vocab", "vocab_for", "eos_token_ids", "byte_level_alphabet"]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the printable character standing for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_FROM_BYTE_LEVEL = {ord(ch): chr(b) for b, ch in byte_level_alphabet().items()}


@dataclass(frozen=True, eq=False)
class Vocab:
    """What each token id of a tokenizer spells.

    Attributes:
        size: number of token ids the tokenizer knows (``len(tokenizer)``);
            a model's logits may be wider, and ids beyond ``size`` spell nothing.
        token_bytes: id -> the bytes the token adds to the decoded text;
            special tokens (EOS, padding) add nothing (``b""``).
        special: ``[size]`` bool, True for special tokens.
        lengths: ``[size]`` int64, ``len(token_bytes[i])``.
        byte_matrix: ``[size, max_len]`` uint8, the bytes of each token,
            zero-padded (the form vectorised automata read).
        eos_token_ids: the tokenizer's end-of-sequence ids.
    """

    size: int
    token_bytes: tuple[bytes, ...]
    special: torch.Tensor
    lengths: torch.Tensor
    byte_matrix: torch.Tensor
    eos_token_ids: tuple[int, ...]
    tokenizer_ref: Any

    @property
    def max_len(self) -> int:
        return int(self.byte_matrix.shape[1])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (no BOS added)."""
        tokenizer = self.tokenizer_ref()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this vocabulary no longer exists")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The bytes that ``ids`` spell (ids beyond the vocabulary spell nothing)."""
        return b"".join(self.token_bytes[i] for i in ids if 0 <= i < self.size)


def eos_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence ids (empty when it has none)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _decoder_kind(tokenizer: Any) -> str:
    """'byte_level', 'metaspace' or 'other', from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    text = repr(decoder)
    if text.startswith("ByteLevel"):
        return "byte_level"
    if "ByteFallback" in text or "Metaspace" in text or "▁" in text:
        return "metaspace"
    return "other"


def _token_strings(tokenizer: Any, size: int) -> list[str]:
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    return ["" if t is None else t for t in tokens]


def _bytes_byte_level(tokens: list[str]) -> list[bytes]:
    blob = "".join(tokens).translate(_FROM_BYTE_LEVEL).encode("latin-1")
    ends = np.cumsum(np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)))
    starts = ends - np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    return [blob[s:e] for s, e in zip(starts.tolist(), ends.tolist())]


def _bytes_metaspace(tokens: list[str]) -> list[bytes]:
    out = [t.replace("▁", " ").encode("utf-8") for t in tokens]
    for i, t in enumerate(tokens):
        if t.startswith("<0x"):
            match = _BYTE_FALLBACK.match(t)
            if match:
                out[i] = bytes([int(match.group(1), 16)])
    return out


def _bytes_other(tokenizer: Any, size: int) -> list[bytes]:
    texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
    return [t.encode("utf-8") for t in texts]


def _build(tokenizer: Any) -> Vocab:
    size = len(tokenizer)
    kind = _decoder_kind(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if kind == "other":
        token_bytes = _bytes_other(tokenizer, size)
    else:
        tokens = _token_strings(tokenizer, size)
        for i in added:
            if i < size:
                tokens[i] = ""
        token_bytes = _bytes_byte_level(tokens) if kind == "byte_level" else _bytes_metaspace(tokens)
    special_ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if 0 <= int(i) < size}
    for i, token in added.items():
        if i >= size:
            continue
        if getattr(token, "special", False):
            special_ids.add(int(i))
        else:
            token_bytes[i] = str(token).encode("utf-8")
    for i in special_ids:
        token_bytes[i] = b""

    lengths = np.fromiter(map(len, token_bytes), dtype=np.int64, count=size)
    max_len = max(1, int(lengths.max(initial=0)))
    blob = np.frombuffer(b"".join(token_bytes) + b"\0", dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    columns = np.arange(max_len, dtype=np.int64)
    index = np.minimum(starts[:, None] + columns[None, :], blob.size - 1)
    matrix = np.where(columns[None, :] < lengths[:, None], blob[index], 0).astype(np.uint8)
    special = torch.zeros(size, dtype=torch.bool)
    if special_ids:
        special[torch.tensor(sorted(special_ids))] = True
    return Vocab(
        size=size,
        token_bytes=tuple(token_bytes),
        special=special,
        lengths=torch.from_numpy(lengths),
        byte_matrix=torch.from_numpy(matrix),
        eos_token_ids=eos_token_ids(tokenizer),
        tokenizer_ref=weakref.ref(tokenizer),
    )


_CACHE: "weakref.WeakKeyDictionary[Any, Vocab]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def vocab_for(tokenizer: Any) -> Vocab:
    """The :class:`Vocab` of ``tokenizer``, built once per tokenizer object and cached.

    Works for byte-level BPE (GPT-2 style), SentencePiece-style (``▁`` and
    ``<0xNN>`` byte fallback) and, through one batched decode, any other
    transformers tokenizer.
    """
    if not hasattr(tokenizer, "convert_ids_to_tokens") or not hasattr(tokenizer, "__len__"):
        raise TypeError(
            f"tokenizer must be a transformers tokenizer (with convert_ids_to_tokens and len()), "
            f"got {type(tokenizer).__name__}"
        )
    with _LOCK:
        cached = _CACHE.get(tokenizer)
        if cached is not None and cached.size == len(tokenizer):
            return cached
        vocab = _build(tokenizer)
        _CACHE[tokenizer] = vocab
        return vocab
