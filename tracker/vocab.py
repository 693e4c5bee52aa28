"""Token id to bytes and to display text, built once per tokenizer and carried in runs.

A run must answer "which token is this?" with no tokenizer around, so the
vocabulary travels in its metadata: per id, the token's bytes (what it adds to
the text) and a display string. It is built in one pass over the vocabulary:
``tokenizer.convert_ids_to_tokens(range(V))`` and the tokenizer's own decoder
table (byte-level BPE, SentencePiece byte fallback, WordPiece), never by
calling ``decode`` once per id.
"""

from __future__ import annotations

import base64
import codecs
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa

__all__ = ["Vocabulary", "byte_level_alphabet"]


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(tokenizer: Any) -> str | None:
    """``"bytelevel"``, ``"sentencepiece"``, ``"wordpiece"`` or None, from a fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:
        return None
    kinds = [d.get("type") for d in spec.get("decoders", [spec])] if isinstance(spec, dict) else []
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    if "WordPiece" in kinds:
        return "wordpiece"
    return None


def _added_ids(tokenizer: Any) -> dict[int, str]:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)) for i, t in added.items()}


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """Each token's bytes and display string, by id.

    Attributes:
        data: every token's bytes, concatenated in id order.
        offsets: ``[V + 1]`` int64; token ``i`` is ``data[offsets[i]:offsets[i+1]]``.
        display: ``V`` strings: the token's text, invalid UTF-8 shown as ``\\xNN``.
        special: ``[V]`` bool, True for special / added tokens.
    """

    data: bytes
    offsets: np.ndarray
    display: tuple[str, ...]
    special: np.ndarray

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.display) + 1 or len(self.special) != len(self.display):
            raise ValueError(
                f"vocabulary parts disagree: {len(self.offsets)} offsets, {len(self.display)} "
                f"display strings, {len(self.special)} special flags"
            )

    @property
    def size(self) -> int:
        return len(self.display)

    def __len__(self) -> int:
        return self.size

    def token_bytes(self, token_id: int) -> bytes:
        return self.data[self.offsets[token_id] : self.offsets[token_id + 1]]

    # ------------------------------------------------------------ building

    @classmethod
    def from_parts(cls, pieces: Sequence[bytes], special: Iterable[bool] | None = None) -> "Vocabulary":
        """A vocabulary from each token's bytes (display strings derived from them)."""
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        display = tuple(p.decode("utf-8", "backslashreplace") for p in pieces)
        flags = np.zeros(len(pieces), dtype=bool) if special is None else np.fromiter(special, dtype=bool)
        return cls(b"".join(pieces), offsets, display, flags)

    @classmethod
    def placeholder(cls, vocab_size: int) -> "Vocabulary":
        """``<id>`` for every id: what a run shows when no tokenizer was known."""
        return cls.from_parts([f"<{i}>".encode() for i in range(vocab_size)], [True] * vocab_size)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> "Vocabulary":
        """Build the vocabulary of ``tokenizer`` for logits ``vocab_size`` wide.

        Ids the tokenizer does not know (models often pad their output layer)
        become ``<id>``. Fast tokenizers are read through their decoder table
        in one pass; a tokenizer with no token table falls back to one
        ``batch_decode`` call (or, with nothing else, ``decode`` per id).
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        known = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", vocab_size)
        n = min(int(known), vocab_size)
        added = _added_ids(tokenizer)
        kind = _decoder_kind(tokenizer) if hasattr(tokenizer, "convert_ids_to_tokens") else None
        if kind is not None:
            tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
            pieces = _pieces_from_tokens(tokens, kind, added, tokenizer)
        else:
            pieces = _pieces_by_decoding(tokenizer, n)
        pieces += [f"<{i}>".encode() for i in range(n, vocab_size)]
        special = np.zeros(vocab_size, dtype=bool)
        special[[i for i in added if i < vocab_size]] = True
        special[n:] = True
        return cls.from_parts(pieces, special)

    # ------------------------------------------------------------ text

    def decode(self, ids: Iterable[int]) -> str:
        """The text of a sequence of ids (UTF-8, invalid bytes replaced)."""
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", "replace")

    def prefixes(self, ids: Sequence[int]) -> list[str]:
        """``[decode(ids[:0]), decode(ids[:1]), ..., decode(ids)]``, decoding each byte once.

        A character split across tokens appears once its last byte has come.
        """
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = [""]
        text = ""
        for i in ids:
            text += decoder.decode(self.token_bytes(int(i)))
            out.append(text)
        return out

    @cached_property
    def display_array(self) -> pa.StringArray:
        """Display strings as an Arrow array (``take`` on it builds token columns)."""
        return pa.array(self.display, type=pa.string())

    @cached_property
    def byte_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """``(bytes [V, L] uint8 zero-padded, lengths [V])`` for vectorised prefix tests."""
        lengths = np.diff(self.offsets)
        width = max(int(lengths.max(initial=0)), 1)
        matrix = np.zeros((self.size, width), dtype=np.uint8)
        cols = np.arange(width)
        inside = cols[None, :] < lengths[:, None]
        flat = np.frombuffer(self.data, dtype=np.uint8)
        matrix[inside] = flat[(self.offsets[:-1, None] + cols[None, :])[inside]]
        return matrix, lengths

    # ------------------------------------------------------------ storage

    def to_arrow(self) -> pa.Table:
        n = self.size
        data = pa.BinaryArray.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(self.offsets.astype(np.int64)), pa.py_buffer(self.data)]
        )
        return pa.table({"bytes": data, "display": self.display_array, "special": pa.array(self.special)})

    def serialize(self) -> bytes:
        """A compact, ASCII-safe encoding (Arrow IPC, zstd, base64) for schema metadata."""
        sink = pa.BufferOutputStream()
        table = self.to_arrow()
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
            writer.write_table(table)
        return base64.b64encode(sink.getvalue().to_pybytes())

    @classmethod
    def deserialize(cls, raw: bytes) -> "Vocabulary":
        table = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(raw))).read_all()
        column = table.column("bytes").combine_chunks()
        offsets_buffer, data_buffer = column.buffers()[1], column.buffers()[2]
        offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[column.offset : column.offset + len(column) + 1]
        data = data_buffer.to_pybytes() if data_buffer is not None else b""
        base = int(offsets[0])
        return cls(
            data[base : int(offsets[-1])],
            offsets - base,
            tuple(table.column("display").to_pylist()),
            table.column("special").to_numpy(zero_copy_only=False).astype(bool),
        )


def _pieces_from_tokens(tokens: list[Any], kind: str, added: dict[int, str], tokenizer: Any) -> list[bytes]:
    """Each token's bytes from its string form and the decoder kind."""
    if kind == "bytelevel":
        alphabet = byte_level_alphabet()
        strings = ["" if (t is None or i in added) else t for i, t in enumerate(tokens)]
        joined = "".join(strings)
        stray = set(joined) - alphabet.keys()
        if not stray:
            table = str.maketrans({c: chr(b) for c, b in alphabet.items()})
            blob = joined.translate(table).encode("latin-1")
            ends = np.cumsum(np.fromiter((len(s) for s in strings), dtype=np.int64, count=len(strings)))
            starts = ends - np.fromiter((len(s) for s in strings), dtype=np.int64, count=len(strings))
            pieces = [blob[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        else:
            decoder = {c: b for c, b in alphabet.items()}
            pieces = [
                bytes(decoder[c] for c in s) if not (set(s) - decoder.keys()) else s.encode("utf-8")
                for s in strings
            ]
    elif kind == "sentencepiece":
        pieces = []
        for t in tokens:
            if t is None:
                pieces.append(b"")
            elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                pieces.append(bytes([int(t[3:5], 16)]))
            else:
                pieces.append(t.replace("\u2581", " ").encode("utf-8"))
    else:  # wordpiece
        pieces = [
            b"" if t is None else (t[2:].encode("utf-8") if t.startswith("##") else (" " + t).encode("utf-8"))
            for t in tokens
        ]
    for i, content in added.items():
        if i < len(pieces):
            pieces[i] = content.encode("utf-8")
    return pieces


def _pieces_by_decoding(tokenizer: Any, n: int) -> list[bytes]:
    """Fallback for tokenizers without a token table: one batched decode, else one per id."""
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
