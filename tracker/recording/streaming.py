"""Copies of rows into chunk memory that bypass the cache.

A recorded row is written once and read long after it has left every cache. An
ordinary copy (``np.copyto``, memcpy) reads each destination line from memory
before writing it: twice the memory traffic of the write. The optional
extension ``tracker.recording._stream`` (built by ``setup.py`` from
``_stream.c``) copies with streaming stores instead, which write whole lines
straight to memory: a 512 KiB row (131,072 float32 logits) into memory no
cache holds takes about half the time. Where the extension was not built (no
C compiler at install time) or the arrays are not contiguous, the copy is
``np.copyto``: the same values.
"""

from __future__ import annotations

import numpy as np

try:
    from tracker.recording import _stream
except ImportError:  # built without a C compiler: numpy copies (the same values, more memory traffic)
    _stream = None

__all__ = ["STREAMING", "copy_rows"]

_stream_copy = None if _stream is None else _stream.copy
#: Whether copies into chunk memory use streaming stores (the extension is built, on x86-64; elsewhere it
#: is a memcpy).
STREAMING = _stream is not None and bool(_stream.STREAMING)
#: Smaller copies go through numpy: the call's fixed cost is then worth more than the traffic saved.
_MIN_BYTES = 16 << 10


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype; ``dst`` rows of chunk memory that nothing reads
    soon) with streaming stores where possible, else ``np.copyto``. Does not synchronise (host arrays)."""
    if _stream_copy is not None and dst.nbytes >= _MIN_BYTES and dst.shape == src.shape and dst.dtype == src.dtype:
        try:
            _stream_copy(dst, src)  # checks that both are contiguous (the common case) and the same size
            return
        except (ValueError, BufferError):
            pass  # not contiguous: numpy copies it
    np.copyto(dst, src)
