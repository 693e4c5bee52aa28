"""The vocabulary of a tokenizer: what each token id spells, as bytes and as display text.

This is the project's one vocabulary module. Processors read it (text-level
bad words, forced text, bias keys), the Generator decodes its outputs with
it, the tracker stores it in every run, and the dashboard shows tokens with
it. It imports no torch and nothing of ours beyond the argument checks
(numpy; pyarrow only to serialise), so that a run's vocabulary can be read back without a model.

Where it lives: ``processors/`` is the lowest layer, and DESIGN.md lets
``tracker/`` import only the protocol from it. This module counts as part of
that shared protocol layer (like :mod:`processors.protocol`): it is what
"token id" means for every processor and every run. ``tracker/`` re-exports
:class:`Vocabulary`; ``dashboard/`` reaches it through ``tracker``.

What a token's bytes are: the bytes the token adds to the text **in the
middle of a text**, the way the tokenizer's own decoder joins it to what
came before (``"▁Paris"`` spells ``b" Paris"`` even where the decoder would
strip the space at the very start). Special tokens (EOS, padding, BOS) spell
nothing; ids beyond the tokenizer (padded logits) spell nothing. Every
decoder family is read from the tokenizer's own token table in one pass,
never by decoding one id at a time: byte-level BPE, Metaspace (with or
without prepend) and ``<0xNN>`` byte fallback, WordPiece, and a ``Sequence``
of these.

Text is decoded from bytes with one rule everywhere (:func:`decode_text`):
invalid or incomplete UTF-8 becomes one ``�`` per broken piece, as
``tokenizer.decode`` does. A single token is shown with :func:`display_bytes`:
a byte that is not (yet) a character is shown as ``⟨F0⟩``, unambiguous
against tokens that spell a literal ``\\x``.

>>> vocab = vocab_for(tokenizer)
>>> vocab.decode(ids)                       # the text, in context
>>> vocab.encode_fragment(" Paris").ids     # tokens of " Paris" mid-text
"""

from __future__ import annotations

import base64
import codecs
import json
import re
import threading
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from processors.checks import check_token_ids

__all__ = [
    "Fragment",
    "Vocabulary",
    "byte_level_alphabet",
    "decode_text",
    "display_bytes",
    "eos_token_ids",
    "hf_tokenizer",
    "vocab_for",
]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_ANGLE_ERRORS = "logitscope-angle-bytes"


def _angle_bytes(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):
        raise error
    broken = error.object[error.start : error.end]
    return "".join(f"⟨{b:02X}⟩" for b in broken), error.end


codecs.register_error(_ANGLE_ERRORS, _angle_bytes)


def display_bytes(piece: bytes) -> str:
    """One token's bytes as display text: UTF-8, each byte that is no character shown as ``⟨F0⟩``."""
    return piece.decode("utf-8", _ANGLE_ERRORS)


def decode_text(data: bytes) -> str:
    """Bytes as text, the same way everywhere: broken or unfinished UTF-8 becomes one ``�`` per piece."""
    return data.decode("utf-8", "replace")


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


@dataclass(frozen=True)
class Fragment:
    """A text fragment's tokens as they come in the middle of a text.

    Attributes:
        text: the fragment.
        ids: its token ids, tokenized after other text (no normaliser prefix,
            no BOS).
        exact: True when those tokens spell exactly ``text`` (False when the
            tokenizer changes it, e.g. lower-cases it, or cannot spell it on
            its own, e.g. a WordPiece fragment glued to the previous word).
    """

    text: str
    ids: tuple[int, ...]
    exact: bool


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
        t.translate(_FROM_BYTE_LEVEL).encode("latin-1") if not set(t) - set(_FROM_BYTE_LEVEL_CHARS) else t.encode("utf-8")
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


# ---------------------------------------------------------------- the vocabulary


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """Each token's bytes and display text, by id.

    Attributes:
        data: every token's bytes, concatenated in id order.
        offsets: ``[V + 1]`` int64; token ``i`` spells ``data[offsets[i]:offsets[i+1]]``.
        display: ``V`` strings, each token as shown to a person
            (:func:`display_bytes`; special tokens by name, padded ids as ``<id>``).
        special: ``[V]`` bool, True for special tokens and ids beyond the tokenizer.
        eos_token_ids: the tokenizer's end-of-sequence ids.
    """

    data: bytes
    offsets: np.ndarray
    display: tuple[str, ...]
    special: np.ndarray
    eos_token_ids: tuple[int, ...] = ()
    tokenizer_ref: Callable[[], Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.display) + 1 or len(self.special) != len(self.display):
            raise ValueError(
                f"vocabulary parts disagree: {len(self.offsets)} offsets, {len(self.display)} "
                f"display strings, {len(self.special)} special flags"
            )

    @property
    def size(self) -> int:
        """Number of ids covered (the logits' width when built for one)."""
        return len(self.display)

    def __len__(self) -> int:
        return self.size

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` adds to the text (``b""`` for ids outside the vocabulary)."""
        if not 0 <= token_id < self.size:
            return b""
        return self.data[self.offsets[token_id] : self.offsets[token_id + 1]]

    @cached_property
    def pieces(self) -> tuple[bytes, ...]:
        """Every token's bytes, by id."""
        offsets = self.offsets.tolist()
        return tuple(self.data[a:b] for a, b in zip(offsets[:-1], offsets[1:]))

    @cached_property
    def lengths(self) -> np.ndarray:
        """``[V]`` int64, the number of bytes each token spells."""
        return np.diff(self.offsets)

    @cached_property
    def byte_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """``(bytes [V, L] uint8 zero-padded, lengths [V])``, the form vectorised automata read."""
        lengths = self.lengths
        width = max(int(lengths.max(initial=0)), 1)
        matrix = np.zeros((self.size, width), dtype=np.uint8)
        cols = np.arange(width)
        inside = cols[None, :] < lengths[:, None]
        flat = np.frombuffer(self.data, dtype=np.uint8)
        matrix[inside] = flat[(self.offsets[:-1, None] + cols[None, :])[inside]]
        return matrix, lengths

    # ------------------------------------------------------------ building

    @classmethod
    def from_parts(
        cls,
        pieces: Sequence[bytes],
        special: Iterable[bool] | None = None,
        *,
        display: Sequence[str] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> "Vocabulary":
        """A vocabulary from each token's bytes (display text derived from them unless given)."""
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        shown = tuple(display_bytes(p) for p in pieces) if display is None else tuple(display)
        flags = np.zeros(len(pieces), dtype=bool) if special is None else np.fromiter(special, dtype=bool)
        return cls(b"".join(pieces), offsets, shown, flags, tuple(int(i) for i in eos_token_ids))

    @classmethod
    def placeholder(cls, vocab_size: int) -> "Vocabulary":
        """``<id>`` for every id: what a run shows when no tokenizer was known."""
        return cls.from_parts([f"<{i}>".encode() for i in range(vocab_size)], [True] * vocab_size)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> "Vocabulary":
        """The vocabulary of ``tokenizer``, ``vocab_size`` ids wide (default: the tokenizer's size).

        A host's wrapper is unwrapped to its Hugging Face tokenizer
        (:func:`hf_tokenizer`). Ids beyond the tokenizer (models often pad
        their output layer) spell nothing and show as ``<id>``. Prefer
        :func:`vocab_for`, which caches the result per tokenizer.
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
        if hasattr(tok, "convert_ids_to_tokens"):
            raw = tok.convert_ids_to_tokens(list(range(n)))
            names = ["" if t is None else str(t) for t in raw]
            specs = _decoder_specs(tok) if hasattr(tok, "backend_tokenizer") else _slow_specs(names)
            table = [("" if i in added else t) for i, t in enumerate(names)]
            pieces = _pieces_from_tokens(table, specs)
        if pieces is None:
            pieces = _pieces_by_decoding(tok, n)
        for i, token in added.items():
            pieces[i] = str(getattr(token, "content", token)).encode("utf-8")
        display = [display_bytes(p) for p in pieces]
        for i in special_ids:
            display[i] = names[i] if names is not None and names[i] else display_bytes(pieces[i])
            pieces[i] = b""
        pieces += [b""] * (width - n)
        display += [f"<{i}>" for i in range(n, width)]
        special = np.zeros(width, dtype=bool)
        special[sorted(special_ids)] = True
        special[n:] = True
        vocab = cls.from_parts(pieces, special, display=display, eos_token_ids=eos)
        object.__setattr__(vocab, "tokenizer_ref", weakref.ref(tok) if _weakrefable(tok) else (lambda: tok))
        return vocab

    # ------------------------------------------------------------ text

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes that ``ids`` spell, in context (special and out-of-vocabulary ids spell nothing)."""
        pieces = self.pieces
        size = self.size
        return b"".join(pieces[i] for i in map(int, ids) if 0 <= i < size)

    def decode(self, ids: Iterable[int]) -> str:
        """The text ``ids`` add after a prompt (:func:`decode_text` of their bytes)."""
        return decode_text(self.decode_bytes(ids))

    def prefixes(self, ids: Sequence[int]) -> list[str]:
        """``[decode(ids[:0]), decode(ids[:1]), ..., decode(ids)]``, decoding each byte once.

        A character split across tokens appears once its last byte has come;
        until then its bytes show as one ``�`` at the end, as in :meth:`decode`.
        """
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = [""]
        text = ""
        for i in ids:
            text += decoder.decode(self.token_bytes(int(i)))
            out.append(text + "\ufffd" if decoder.getstate()[0] else text)
        return out

    def encode_fragment(self, text: str) -> Fragment:
        """The tokens of ``text`` as it is tokenized in the middle of a text.

        Tokenizers whose normaliser prepends a space marker (Llama-2,
        Mistral) would turn ``" Paris"`` on its own into ``"▁" + "▁Paris"``;
        in a text it is ``"▁Paris"``. So the fragment is tokenized after a
        sentinel text, the sentinel's own tokens are dropped, and the split is
        checked: the sentinel's tokens must come first, unchanged, and the
        rest must spell ``text``. Several sentinels are tried; if none gives
        an exact split, the first clean split whose bytes match up to case is
        returned with ``exact=False``, else the plain tokenization.
        """
        if not isinstance(text, str) or not text:
            raise ValueError(f"text must be a non-empty string, got {text!r}")
        tok = self._tokenizer()
        want = text.encode("utf-8")
        loose: tuple[int, ...] | None = None
        for sentinel in ("\n", "x", "。", "0", "a."):
            base = self._encode(tok, sentinel)
            full = self._encode(tok, sentinel + text)
            if not base or full[: len(base)] != base or len(full) == len(base):
                continue
            ids = tuple(full[len(base) :])
            spelled = self.decode_bytes(ids)
            if spelled == want:
                return Fragment(text, ids, True)
            if loose is None and spelled.lower() == want.lower():
                loose = ids
        if loose is not None:
            return Fragment(text, loose, False)
        ids = tuple(self._encode(tok, text))
        return Fragment(text, ids, self.decode_bytes(ids) == want)

    def _tokenizer(self) -> Any:
        tok = self.tokenizer_ref() if self.tokenizer_ref is not None else None
        if tok is None:
            raise RuntimeError("this vocabulary has no tokenizer (it was read from a run, or its tokenizer is gone)")
        return tok

    @staticmethod
    def _encode(tok: Any, text: str) -> list[int]:
        return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]

    # ------------------------------------------------------------ storage

    @cached_property
    def display_array(self) -> Any:
        """Display strings as an Arrow array (``take`` on it builds token columns)."""
        import pyarrow as pa

        return pa.array(self.display, type=pa.string())

    def to_arrow(self) -> Any:
        """The vocabulary as an Arrow table: ``bytes`` (large binary), ``display``, ``special``."""
        import pyarrow as pa

        n = self.size
        data = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(self.offsets.astype(np.int64)), pa.py_buffer(self.data)]
        )
        return pa.table({"bytes": data, "display": self.display_array, "special": pa.array(self.special)})

    def serialize(self) -> bytes:
        """A compact, ASCII-safe encoding (Arrow IPC, zstd, base64) for schema metadata."""
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        table = self.to_arrow()
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
            writer.write_table(table)
        return base64.b64encode(sink.getvalue().to_pybytes())

    @classmethod
    def deserialize(cls, raw: bytes) -> "Vocabulary":
        """Read :meth:`serialize`'s output; ordinary tokens' display text is derived from their bytes again."""
        import pyarrow as pa

        table = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(raw))).read_all()
        column = table.column("bytes").combine_chunks()
        offsets_buffer, data_buffer = column.buffers()[1], column.buffers()[2]
        offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[column.offset : column.offset + len(column) + 1]
        data = data_buffer.to_pybytes() if data_buffer is not None else b""
        base = int(offsets[0])
        data, offsets = data[base : int(offsets[-1])], offsets - base
        special = table.column("special").to_numpy(zero_copy_only=False).astype(bool)
        stored = table.column("display").to_pylist()
        starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
        display = tuple(
            shown if flag else display_bytes(data[a:b]) for shown, flag, a, b in zip(stored, special.tolist(), starts, ends)
        )
        return cls(data, offsets, display, special)


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


_CACHE: "weakref.WeakKeyDictionary[Any, dict[int | None, Vocabulary]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def vocab_for(tokenizer: Any, vocab_size: int | None = None) -> Vocabulary:
    """The :class:`Vocabulary` of ``tokenizer`` (``vocab_size`` ids wide), built once per tokenizer and cached."""
    tok = hf_tokenizer(tokenizer)
    if not (hasattr(tok, "convert_ids_to_tokens") or hasattr(tok, "decode")) or not (
        hasattr(tok, "__len__") or hasattr(tok, "vocab_size") or vocab_size is not None
    ):
        raise TypeError(
            f"tokenizer must be a transformers tokenizer (with convert_ids_to_tokens and len()), "
            f"got {type(tokenizer).__name__}"
        )
    if not _weakrefable(tok):
        return Vocabulary.from_tokenizer(tok, vocab_size)
    with _LOCK:
        by_size = _CACHE.setdefault(tok, {})
        known = len(tok) if hasattr(tok, "__len__") else getattr(tok, "vocab_size", None)
        key = None if vocab_size is None or vocab_size == known else int(vocab_size)
        cached = by_size.get(key)
        if cached is not None and (known is None or cached.size == (known if key is None else key)):
            return cached
        vocab = by_size[key] = Vocabulary.from_tokenizer(tok, vocab_size)
        return vocab
