"""Each distinct vocabulary of a table, stored once, named by the SHA-256 of its bytes.

A tokenizer's vocabulary is most of a small run's bytes (369 KB at 32k
tokens against about 40 KB for 100 steps of top-20 rows), and every run of
one model has the same one. A table keeps each distinct vocabulary once, as
``_vocab/<sha256>.arrows``: an Arrow IPC stream (``bytes``, ``display``,
``special`` columns, see :meth:`processors.vocab.Vocabulary.to_arrow`) that
any Arrow reader opens; a run's parts name it by that hash in their footer
(:data:`~tracker.format.schema.META_VOCAB_REF`). The file is written before the
commit that names it, once (its name is its content: writers racing to
write it write the same bytes); a reader checks the bytes against the name.
Delta Lake leaves folders whose name starts with ``_`` alone, so ``vacuum``
never takes a vocabulary; :func:`tracker.format.table.vacuum` removes those
no committed part names. Needs pyarrow and numpy only.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from processors.vocab import Vocabulary
from processors.vocab_text import display_bytes
from tracker.format.spill import atomic_path, fsync_path

__all__ = ["VOCAB_DIR", "VOCAB_SUFFIX", "vocab_key", "store_vocab", "load_vocab", "token_display", "vocab_path"]

VOCAB_DIR = "_vocab"
VOCAB_SUFFIX = ".arrows"
#: The largest vocabulary file a reader takes (a 1M-token vocabulary is about 10 MB).
MAX_VOCAB_BYTES = 256 << 20

_lock = threading.Lock()
_stored: dict[tuple[str, str], float] = {}  # (table, key) -> when this process wrote or saw it
#: Seconds this process trusts a vocabulary it wrote or saw to be there still (vacuum may remove one no part names).
_TRUST_S = 600.0
_loaded: OrderedDict[tuple[str, str], Vocabulary] = OrderedDict()  # a few, shared by every run that names them
_LOADED_MAX = 8
_tables: OrderedDict[tuple[str, str], pa.Table] = OrderedDict()  # the vocabulary files read for token_display


def vocab_key(serialized: bytes) -> tuple[str, bytes]:
    """``(hash, file bytes)`` of a serialised vocabulary (what :meth:`Vocabulary.serialize` gives)."""
    data = base64.b64decode(serialized)
    return hashlib.sha256(data).hexdigest(), data


def vocab_path(root: str, key: str) -> str:
    """Where the vocabulary ``key`` of the table at ``root`` (a path inside its filesystem) lives."""
    return f"{root.rstrip('/')}/{VOCAB_DIR}/{key}{VOCAB_SUFFIX}"


def store_vocab(fs: pafs.FileSystem, root: str, serialized: bytes) -> str:
    """Store a serialised vocabulary in the table at ``root`` unless it is there; returns its hash."""
    key, data = vocab_key(serialized)
    with _lock:
        if time.monotonic() - _stored.get((root, key), -_TRUST_S) < _TRUST_S:
            return key
    where = vocab_path(root, key)
    if fs.get_file_info(where).type != pafs.FileType.File:
        if isinstance(fs, pafs.LocalFileSystem):
            with atomic_path(Path(where)) as tmp:
                tmp.write_bytes(data)
                fsync_path(tmp)
            fsync_path(Path(where).parent)
        else:  # an object store: no folder to make, the object appears whole when its upload completes
            with fs.open_output_stream(where) as sink:
                sink.write(data)
    with _lock:
        _stored[(root, key)] = time.monotonic()
    return key


def _read_checked(fs: pafs.FileSystem, root: str, key: str, shown: str) -> bytes:
    """The bytes of the vocabulary ``key``, checked against its name (ValueError naming the file)."""
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"its vocabulary reference {key[:80]!r} is not a SHA-256 (64 hex digits)")
    where = vocab_path(root, key)
    name = vocab_path(shown, key)
    info = fs.get_file_info(where)
    if info.type != pafs.FileType.File:
        raise ValueError(f"its vocabulary '{name}' is missing (a table keeps each vocabulary once, under {VOCAB_DIR}/)")
    if (info.size or 0) > MAX_VOCAB_BYTES:
        raise ValueError(f"its vocabulary '{name}' is {info.size:,} bytes, more than any vocabulary")
    with fs.open_input_stream(where) as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != key:
        raise ValueError(f"its vocabulary '{name}' does not match its name (the file is damaged)")
    return data


def token_display(fs: pafs.FileSystem, root: str, key: str, shown: str, ids: np.ndarray) -> pa.Array:
    """How the vocabulary ``key`` shows each of ``ids`` (ids inside it; as :attr:`Vocabulary.display` does:
    special tokens by their stored name, the others from their bytes), without building the whole
    vocabulary: a listing of a thousand runs shows a few thousand distinct tokens of 128k."""
    with _lock:
        table = _tables.get((root, key))
    if table is None:
        data = _read_checked(fs, root, key, shown)
        try:
            table = pa.ipc.open_stream(pa.py_buffer(data)).read_all().combine_chunks()
            table.validate(full=True)
        except pa.ArrowException as exc:
            raise ValueError(f"its vocabulary '{vocab_path(shown, key)}' is damaged ({exc})") from exc
        with _lock:
            _tables[(root, key)] = table
            while len(_tables) > _LOADED_MAX:
                _tables.popitem(last=False)
    unique, back = np.unique(ids, return_inverse=True)
    chosen = pa.array(unique)
    pieces = table.column("bytes").take(chosen).to_pylist()
    special = table.column("special").take(chosen).to_pylist()
    stored = table.column("display").take(chosen).to_pylist()
    shown_text = [name if flag else display_bytes(piece) for piece, flag, name in zip(pieces, special, stored)]
    return pa.array(shown_text, pa.string()).take(pa.array(back.reshape(-1)))


def load_vocab(fs: pafs.FileSystem, root: str, key: str, shown: str) -> Vocabulary:
    """The vocabulary ``key`` of the table at ``root``; ValueError naming the file (``shown``: the table as a
    person calls it) when it is missing, too large, not what its name says, or not a vocabulary."""
    with _lock:
        if (root, key) in _loaded:
            _loaded.move_to_end((root, key))
            return _loaded[(root, key)]
    data = _read_checked(fs, root, key, shown)
    name = vocab_path(shown, key)
    try:
        vocab = Vocabulary.deserialize(base64.b64encode(data))
    except Exception as exc:  # Arrow or layout errors: a damaged vocabulary whatever the cause
        raise ValueError(f"its vocabulary '{name}' is damaged ({type(exc).__name__}: {exc})") from exc
    with _lock:
        _loaded[(root, key)] = vocab
        while len(_loaded) > _LOADED_MAX:
            _loaded.popitem(last=False)
    return vocab
