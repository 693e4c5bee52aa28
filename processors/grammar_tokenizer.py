"""llguidance's view of a tokenizer, built from logitscope's vocabulary and cached per tokenizer.

llguidance's own reading of a Hugging Face tokenizer takes a Metaspace
piece ``▁w`` for the bytes of ``▁`` and ``w``, and refuses WordPiece and
other decoders. :class:`~processors.vocab.Vocabulary` reads every family (a
token's bytes are what it adds in the middle of a text), so the grammar
constraints hand llguidance those bytes instead.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import llguidance

from processors.vocab import Vocabulary, hf_tokenizer, vocab_for

__all__ = ["llguidance_tokenizer"]

_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...] | None, llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_TOKENIZERS_LOCK = threading.Lock()
_SPLITS_KEPT = 4096  # forced texts whose tokens a tokenizer remembers (llguidance asks once per row and step)


def _eos_key(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id >= 0 or a non-empty list of them, got {eos_token_id!r}")
    return tuple(ids)


class _VocabularyTokens:
    """What ``llguidance.TokenizerWrapper`` reads: each token's bytes as logitscope's vocabulary spells them.

    Special tokens go by name and are marked special, so a grammar cannot
    spell them as text. Holds no strong reference to the tokenizer (the
    cache is keyed by it, weakly).
    """

    def __init__(self, vocab: Vocabulary, eos_token_id: int | None, bos_token_id: int | None) -> None:
        special = vocab.special
        self.tokens = [vocab.display[i].encode() if special[i] else vocab.token_bytes(i) for i in range(vocab.size)]
        self.special_token_ids = [i for i in range(vocab.size) if special[i]]
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self._vocab = vocab
        self._ids: dict[bytes, int] = {}
        for i in reversed(range(vocab.size)):  # the lowest id of equal pieces wins
            if not special[i] and self.tokens[i]:
                self._ids[self.tokens[i]] = i
        self._longest = max(map(len, self._ids), default=1)
        self._split: dict[bytes, list[int]] = {}  # forced texts repeat across rows and steps

    def __call__(self, text: str | bytes) -> list[int]:
        """Tokens that spell ``text`` exactly in the middle of a text (llguidance tokenizes forced text with it).

        The tokenizer's own split when it spells the text exactly, else the
        longest pieces first (a WordPiece word cannot start a text without its
        space, but ``##`` pieces can spell it). llguidance allows the tokens
        given here, so they must spell nothing else.
        """
        if isinstance(text, str):
            text = text.encode("utf-8")
        if not text:
            return []
        known = self._split.get(text)
        if known is None:
            if len(self._split) >= _SPLITS_KEPT:
                self._split.clear()
            known = self._split[text] = self._spell(text)
        return list(known)

    def _spell(self, text: bytes) -> list[int]:
        fragment = self._vocab.encode_fragment(text.decode("utf-8", errors="replace"))
        if fragment.exact and self._vocab.decode_bytes(fragment.ids) == text:
            return list(fragment.ids)
        out, start = [], 0
        while start < len(text):
            for end in range(min(len(text), start + self._longest), start, -1):
                token = self._ids.get(text[start:end])
                if token is not None:
                    out.append(token)
                    start = end
                    break
            else:
                break  # a byte no token spells: llguidance handles the rest
        return out


def llguidance_tokenizer(tokenizer: Any, eos_token_id: int | Sequence[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer, from logitscope's vocabulary, made once per tokenizer and cached.

    Every family :mod:`processors.vocab` reads works (byte-level BPE,
    SentencePiece with or without byte fallback, WordPiece). ``eos_token_id``
    overrides the tokenizer's end-of-sequence id(s) (for models whose
    generation config ends on other tokens).
    """
    key = _eos_key(eos_token_id)
    with _TOKENIZERS_LOCK:
        per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
        cached = per_tokenizer.get(key)
        if cached is None:
            try:
                vocab = vocab_for(tokenizer)
                hf = hf_tokenizer(tokenizer)
            except Exception as exc:
                raise TypeError(
                    f"tokenizer: a grammar needs a Hugging Face tokenizer (or a host's wrapper of one), "
                    f"got {type(tokenizer).__name__} ({exc})"
                ) from exc
            eos = getattr(hf, "eos_token_id", None)
            if key is None and not isinstance(eos, int):
                raise ValueError(
                    f"tokenizer: {type(hf).__name__} has no end-of-sequence token; pass eos_token_id= to the constraint"
                )
            tokens = _VocabularyTokens(vocab, eos, getattr(hf, "bos_token_id", None))
            cached = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(tokens), eos_token=None if key is None else list(key)
            )
            per_tokenizer[key] = cached
        return cached
