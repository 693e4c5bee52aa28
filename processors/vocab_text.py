"""Token bytes as text, by one rule everywhere.

:func:`decode_text` turns bytes into text the way ``tokenizer.decode`` does:
invalid or incomplete UTF-8 becomes one ``�`` per broken piece.
:func:`display_bytes` shows one token's bytes to a person: a byte that is not
(yet) a character is shown as ``⟨F0⟩``, unambiguous against tokens that spell
a literal ``\\x``. Standard library only.
"""

from __future__ import annotations

import codecs

__all__ = ["decode_text", "display_bytes"]

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
