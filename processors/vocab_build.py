"""Reading a tokenizer's token table: what each id spells, as bytes, in one pass.

What a token's bytes are: the bytes the token adds to the text **in the
middle of a text**, the way the tokenizer's own decoder joins it to what
came before (``"▁Paris"`` spells ``b" Paris"`` even where the decoder would
strip the space at the very start). Special tokens (EOS, padding, BOS) spell
nothing; ids beyond the tokenizer (padded logits) spell nothing. Every
decoder family is read from the tokenizer's own token table in one pass,
never by decoding one id at a time: byte-level BPE, Metaspace (with or
without prepend) and ``<0xNN>`` byte fallback, WordPiece, and a ``Sequence``
of these.

:func:`read_tokenizer` returns the parts a
:class:`~processors.vocab.Vocabulary` is made of; :mod:`processors.vocab`
assembles and caches it. The tokenizer is read through its public methods
(duck-typed): this module imports numpy and nothing of transformers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from processors.checks import check_token_ids
from processors.vocab_text import display_bytes

__all__ = ["TokenTable", "byte_level_alphabet", "eos_token_ids", "hf_tokenizer", "read_tokenizer"]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the printable character standing for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_FROM_BYTE_LEVEL = {ord(ch): chr(b) for b, ch in byte_level_alphabet().items()}


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside ``tokenizer`` (a host's wrapper, e.g. Outlines'), or ``tokenizer``.

    Follows ``.tokenizer`` a few levels down to the first object with a token
    table (``convert_ids_to_tokens``); a wrapper's own ``decode`` is never
    used, since hosts' wrappers return other shapes (Outlines' returns a list).
    """
    obj = tokenizer
    for _ in range(4):
        if obj is None:
            break
        if hasattr(obj, "convert_ids_to_tokens"):
            return obj
        obj = getattr(obj, "tokenizer", None)
    return tokenizer


def _int_ids(name: str, value: Any) -> tuple[int, ...]:
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # a tensor or array of ids, as transformers accepts
        value = value.tolist()
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    return tuple(dict.fromkeys(check_token_ids(name, items, None)))


def eos_token_ids(tokenizer: Any = None, eos_token_id: Any = None, *, generation_config: Any = None) -> tuple[int, ...]:
    """The end-of-sequence ids: ``eos_token_id`` if given, else the generation config's, else the tokenizer's.

    Each source may hold one id or a list. Returns ``()`` when no source has
    one; a value that is not a token id raises ``ValueError`` naming it.
    """
    if eos_token_id is not None:
        return _int_ids("eos_token_id", eos_token_id)
    config_ids = getattr(generation_config, "eos_token_id", None)
    if config_ids is not None:
        return _int_ids("generation_config.eos_token_id", config_ids)
    ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = getattr(hf_tokenizer(tokenizer), "eos_token_id", None)
    return () if ids is None else _int_ids("tokenizer.eos_token_id", ids)


# ---------------------------------------------------------------- decoder families


def _decoder_specs(tokenizer: Any) -> list[dict[str, Any]]:
    """The fast tokenizer's decoders, a ``Sequence`` flattened; ``[]`` when there is no decoder table."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return []
    try:
        spec = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return []

    def flatten(node: dict[str, Any]) -> list[dict[str, Any]]:
        if node.get("type") == "Sequence":
            return [d for child in node.get("decoders", []) for d in flatten(child)]
        return [node]

    return flatten(spec) if isinstance(spec, dict) else []


def _pieces_from_tokens(tokens: list[str], specs: list[dict[str, Any]]) -> list[bytes] | None:
    """Each token's bytes from its string form, following the decoders; None for a family not known here."""
    types = [d.get("type") for d in specs]
    if "ByteLevel" in types:
        return _pieces_byte_level(tokens)
    if "WordPiece" in types:
        spec = specs[types.index("WordPiece")]
        return _pieces_wordpiece(tokens, spec.get("prefix", "##"), bool(spec.get("cleanup", True)))
    if any(t in ("Metaspace", "ByteFallback", "Replace") for t in types):
        return _pieces_sentencepiece(tokens, specs)
    return None


def _pieces_byte_level(tokens: list[str]) -> list[bytes]:
    """GPT-2 style: every character stands for one byte (tokens outside the alphabet are their UTF-8)."""
    joined = "".join(tokens)
    if not set(joined) - set(_FROM_BYTE_LEVEL_CHARS):
        blob = joined.translate(_FROM_BYTE_LEVEL).encode("latin-1")
        lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        ends = np.cumsum(lengths)
        return [blob[s:e] for s, e in zip((ends - lengths).tolist(), ends.tolist())]
    return [
        t.translate(_FROM_BYTE_LEVEL).encode("latin-1")
        if not set(t) - set(_FROM_BYTE_LEVEL_CHARS)
        else t.encode("utf-8")
        for t in tokens
    ]


_FROM_BYTE_LEVEL_CHARS = frozenset(chr(c) for c in _FROM_BYTE_LEVEL)


def _pieces_sentencepiece(tokens: list[str], specs: list[dict[str, Any]]) -> list[bytes]:
    """Metaspace / ``Replace("▁", " ")`` for spaces, ``<0xNN>`` pieces for bytes when ``ByteFallback`` is on."""
    replacements: list[tuple[str, str]] = []
    for spec in specs:
        if spec.get("type") == "Metaspace":
            replacements.append((spec.get("replacement", "▁"), " "))
        elif spec.get("type") == "Replace":
            pattern = spec.get("pattern", {})
            source = pattern.get("String") if isinstance(pattern, dict) else None
            if source:
                replacements.append((source, spec.get("content", "")))
    byte_fallback = any(spec.get("type") == "ByteFallback" for spec in specs)
    out = []
    for t in tokens:
        match = _BYTE_FALLBACK.match(t) if byte_fallback and t.startswith("<0x") else None
        if match:
            out.append(bytes([int(match.group(1), 16)]))
            continue
        for source, target in replacements:
            t = t.replace(source, target)
        out.append(t.encode("utf-8"))
    return out


_GLUED_LEFT = {".", ",", "!", "?", "n't", "'m", "'s", "'ve", "'re"}


def _pieces_wordpiece(tokens: list[str], prefix: str, cleanup: bool) -> list[bytes]:
    """WordPiece: ``##`` pieces continue a word, others start one after a space (cleanup glues punctuation)."""
    out = []
    for t in tokens:
        if t.startswith(prefix):
            out.append(t[len(prefix) :].encode("utf-8"))
        elif cleanup and t in _GLUED_LEFT:
            out.append(t.encode("utf-8"))
        else:
            out.append((" " + t).encode("utf-8"))
    return out


def _pieces_by_decoding(tokenizer: Any, n: int) -> list[bytes]:
    """A tokenizer with no decoder table known here: one batched decode (else one ``decode`` per id)."""
    batch = getattr(tokenizer, "batch_decode", None)
    if callable(batch):
        texts = batch([[i] for i in range(n)])
    elif callable(getattr(tokenizer, "decode", None)):
        texts = [tokenizer.decode([i]) for i in range(n)]
    else:
        raise TypeError(
            f"tokenizer must have convert_ids_to_tokens, batch_decode or decode, got {type(tokenizer).__name__}"
        )
    return [str(t).encode("utf-8") for t in texts]


def _slow_specs(tokens: list[str]) -> list[dict[str, Any]]:
    """For a tokenizer with no decoder table: guess the family from its token strings."""
    if any(t.startswith("▁") for t in tokens):
        return [{"type": "Metaspace", "replacement": "▁"}, {"type": "ByteFallback"}]
    if any(t.startswith("Ġ") for t in tokens):
        return [{"type": "ByteLevel"}]
    return []


def _added_piece(content: str, name: str, tokenizer: Any, specs: list[dict[str, Any]]) -> bytes:
    """An added token's bytes: its token string read by the fast tokenizer's decoder, as ``decode`` reads it.

    A WordPiece decoder puts a space before an added word (``" <note>"``
    mid-text), and a SentencePiece normaliser stores a normalised added token
    as ``"▁<note>"``. Under ``ByteLevel`` (and for slow tokenizers, which
    insert added tokens as they are) the content itself: a byte-level decoder
    would read a non-ASCII content such as ``"café"`` as bytes and break it
    (a known tokenizers bug), which is not the text the token was added for.
    """
    types = [d.get("type") for d in specs]
    if not name or not hasattr(tokenizer, "backend_tokenizer") or "ByteLevel" in types:
        return content.encode("utf-8")
    spelled = _pieces_from_tokens([name], specs)
    return content.encode("utf-8") if spelled is None else spelled[0]


@dataclass(frozen=True)
class TokenTable:
    """What a tokenizer says about each id, ``len(pieces)`` ids wide.

    Attributes:
        pieces: each id's bytes (``b""`` for special ids and ids beyond the tokenizer).
        special: ``[V]`` bool, True for special tokens and ids beyond the tokenizer.
        display: each id as shown to a person (special tokens by name, padded ids as ``<id>``).
        eos_token_ids: the tokenizer's end-of-sequence ids.
        tokenizer: the Hugging Face tokenizer that was read (a host's wrapper unwrapped).
    """

    pieces: list[bytes]
    special: np.ndarray
    display: list[str]
    eos_token_ids: tuple[int, ...]
    tokenizer: Any


def read_tokenizer(tokenizer: Any, vocab_size: int | None = None) -> TokenTable:
    """The token table of ``tokenizer``, ``vocab_size`` ids wide (default: the tokenizer's size).

    A host's wrapper is unwrapped to its Hugging Face tokenizer
    (:func:`hf_tokenizer`). Ids beyond the tokenizer (models often pad their
    output layer) spell nothing and show as ``<id>``.
    """
    tok = hf_tokenizer(tokenizer)
    known = len(tok) if hasattr(tok, "__len__") else getattr(tok, "vocab_size", None)
    if known is None and vocab_size is None:
        raise TypeError(f"tokenizer must have len() or vocab_size, got {type(tok).__name__}")
    width = int(known) if vocab_size is None else int(vocab_size)
    if width < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n = min(int(known if known is not None else width), width)
    added = {int(i): t for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items() if 0 <= int(i) < n}
    special_ids = {int(i) for i in getattr(tok, "all_special_ids", []) or [] if 0 <= int(i) < n}
    special_ids |= {i for i, t in added.items() if getattr(t, "special", False)}
    eos = eos_token_ids(tok)
    special_ids |= {i for i in eos if i < n}

    pieces: list[bytes] | None = None
    names: list[str] | None = None
    specs: list[dict[str, Any]] = []
    if hasattr(tok, "convert_ids_to_tokens"):
        raw = tok.convert_ids_to_tokens(list(range(n)))
        names = ["" if t is None else str(t) for t in raw]
        specs = _decoder_specs(tok) if hasattr(tok, "backend_tokenizer") else _slow_specs(names)
        table = [("" if i in added else t) for i, t in enumerate(names)]
        pieces = _pieces_from_tokens(table, specs)
    if pieces is None:
        pieces = _pieces_by_decoding(tok, n)
    for i, token in added.items():
        pieces[i] = _added_piece(str(getattr(token, "content", token)), names[i] if names else "", tok, specs)
    display = [display_bytes(p) for p in pieces]
    for i in special_ids:
        display[i] = names[i] if names is not None and names[i] else display_bytes(pieces[i])
        pieces[i] = b""
    pieces += [b""] * (width - n)
    display += [f"<{i}>" for i in range(n, width)]
    special = np.zeros(width, dtype=bool)
    special[sorted(special_ids)] = True
    special[n:] = True
    return TokenTable(pieces, special, display, eos, tok)
