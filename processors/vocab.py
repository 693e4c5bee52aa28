"""The vocabulary of a tokenizer: what each token id spells, as bytes and as display text.

This is the project's one vocabulary module. Processors read it (text-level
bad words, forced text, bias keys), the Generator decodes its outputs with
it, the tracker stores it in every run, and the dashboard shows tokens with
it. It and what it imports (:mod:`processors.vocab_build`,
:mod:`processors.vocab_text`, :mod:`processors.checks`) load no torch,
transformers or llguidance (numpy; pyarrow only to serialise), so that a
run's vocabulary can be read back without a model.

Where it lives: ``processors/`` is the lowest layer, and DESIGN.md lets
``tracker/`` import only the protocol from it. This module counts as part of
that shared protocol layer (like :mod:`processors.protocol`): it is what
"token id" means for every processor and every run. ``tracker/`` re-exports
:class:`Vocabulary`; ``dashboard/`` reaches it through ``tracker``.

What a token's bytes are (the bytes it adds in the middle of a text) and how
they are read from each decoder family is :mod:`processors.vocab_build`'s job;
how bytes become text (:func:`decode_text`, :func:`display_bytes`) is
:mod:`processors.vocab_text`'s. This module holds the table itself: built
from a tokenizer and cached (:func:`vocab_for`), decoded, and stored in a run.

>>> vocab = vocab_for(tokenizer)
>>> vocab.decode(ids)                       # the text, in context
>>> vocab.encode_fragment(" Paris").ids     # tokens of " Paris" mid-text
"""

from __future__ import annotations

import base64
import codecs
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from processors.vocab_build import byte_level_alphabet, eos_token_ids, hf_tokenizer, read_tokenizer
from processors.vocab_text import decode_text, display_bytes

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
    ) -> Vocabulary:
        """A vocabulary from each token's bytes (display text derived from them unless given)."""
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        shown = tuple(display_bytes(p) for p in pieces) if display is None else tuple(display)
        flags = np.zeros(len(pieces), dtype=bool) if special is None else np.fromiter(special, dtype=bool)
        return cls(b"".join(pieces), offsets, shown, flags, tuple(int(i) for i in eos_token_ids))

    @classmethod
    def placeholder(cls, vocab_size: int) -> Vocabulary:
        """``<id>`` for every id: what a run shows when no tokenizer was known."""
        return cls.from_parts([f"<{i}>".encode() for i in range(vocab_size)], [True] * vocab_size)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> Vocabulary:
        """The vocabulary of ``tokenizer``, ``vocab_size`` ids wide (default: the tokenizer's size).

        A host's wrapper is unwrapped to its Hugging Face tokenizer
        (:func:`hf_tokenizer`). Ids beyond the tokenizer (models often pad
        their output layer) spell nothing and show as ``<id>``. Prefer
        :func:`vocab_for`, which caches the result per tokenizer.
        """
        table = read_tokenizer(tokenizer, vocab_size)
        vocab = cls.from_parts(table.pieces, table.special, display=table.display, eos_token_ids=table.eos_token_ids)
        tok = table.tokenizer
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

    def decode_shown(self, ids: Iterable[int]) -> str:
        """:meth:`decode`, with each special token shown by its name (``<|endoftext|>``) where it stands.

        For a prompt shown to a person: a prompt that is only a beginning-of-text
        token would otherwise show as nothing.
        """
        special, size = self.special, self.size
        parts: list[str] = []
        run: list[int] = []
        for i in map(int, ids):
            if 0 <= i < size and not special[i]:
                run.append(i)
                continue
            parts.append(self.decode(run))
            run = []
            parts.append(self.display[i] if 0 <= i < size else f"<{i}>")
        parts.append(self.decode(run))
        return "".join(parts)

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

    def text_pieces(self, ids: Sequence[int]) -> list[str]:
        """The text each of ``ids`` adds, in order; joined, they are :meth:`decode` of ``ids``.

        A character split across tokens shows with its last byte (the tokens
        before it add ``""``); bytes still unfinished at the end show as one
        ``�`` on the last token. Ids outside the vocabulary (and ``-1``, an
        unknown token) add ``""``.
        """
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pieces = [decoder.decode(self.token_bytes(int(i))) for i in ids]
        if pieces and decoder.getstate()[0]:
            pieces[-1] += decoder.decode(b"", final=True)
        return pieces

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

    def spelled(self, fragment: Fragment, argument: str) -> Fragment:
        """``fragment`` (from :meth:`encode_fragment`), refused if the tokenizer wrote it with its unknown token.

        A WordPiece tokenizer writes a character it lacks (an emoji, say) as
        ``[UNK]``: forcing or biasing that token would not produce the text.
        ``argument`` names the caller's argument in the error.
        """
        text, tok = fragment.text, self._tokenizer()
        unk, unk_text = getattr(tok, "unk_token_id", None), getattr(tok, "unk_token", None)
        if unk is not None and int(unk) in fragment.ids and not (unk_text and str(unk_text) in text):
            raise ValueError(
                f"{argument} {text!r}: the tokenizer cannot spell it; it becomes its unknown token "
                f"{unk_text!r} (ids {list(fragment.ids)}), which would not produce the text"
            )
        return fragment

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
        """A compact, ASCII-safe encoding (Arrow IPC, zstd, base64) for schema metadata; made once per
        vocabulary (a server writes a part per request, each with its vocabulary)."""
        cached = self.__dict__.get("_serialized")
        if cached is not None:
            return cached
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        table = self.to_arrow()
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
            writer.write_table(table)
        raw = base64.b64encode(sink.getvalue().to_pybytes())
        object.__setattr__(self, "_serialized", raw)  # frozen: the cache is not a field
        return raw

    @classmethod
    def deserialize(cls, raw: bytes) -> Vocabulary:
        """Read :meth:`serialize`'s output; ordinary tokens' display text is derived from their bytes again."""
        import pyarrow as pa

        table = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(raw))).read_all()
        table.validate(full=True)  # offsets inside their buffers before any is followed (the bytes come from a file)
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
            shown if flag else display_bytes(data[a:b])
            for shown, flag, a, b in zip(stored, special.tolist(), starts, ends)
        )
        return cls(data, offsets, display, special)


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


_CACHE: weakref.WeakKeyDictionary[Any, dict[int | None, Vocabulary]] = weakref.WeakKeyDictionary()
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
