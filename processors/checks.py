"""Argument checks shared by the processor library; errors name the argument, the value and what is allowed."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = ["is_number", "check_number", "check_token_id", "check_token_ids", "check_width", "vocab_size_of"]


def is_number(value: Any) -> bool:
    """A real number that is not a bool (``True`` is not a temperature)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    allow_neg_inf: bool = False,
) -> float:
    """``value`` as a float if it is a finite number in range, else ``ValueError`` saying what is allowed."""
    if low is not None and high is not None:
        bounds = f" in {'(' if low_open else '['}{low:g}, {high:g}]"
    elif low is not None:
        bounds = f" {'>' if low_open else '>='} {low:g}"
    else:
        bounds = "" if high is None else f" <= {high:g}"
    allowed = f"a finite number{bounds}" + (" or -inf" if allow_neg_inf else "")
    if not is_number(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    number = float(value)
    if allow_neg_inf and number == float("-inf"):
        return number
    if not math.isfinite(number):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if low is not None and (number < low or (low_open and number == low)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if high is not None and number > high:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def check_token_id(name: str, value: Any, vocab_size: int | None) -> int:
    """``value`` if it is a token id in ``[0, vocab_size)``, else ``ValueError``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be a token id (an int), got {value!r} ({type(value).__name__})")
    token = int(value)
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        limit = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name} must be a token id {limit}, got {token}")
    return token


def check_token_ids(name: str, values: Any, vocab_size: int | None) -> list[int]:
    """A non-empty list of valid token ids, else ``ValueError`` naming the first bad entry."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, set, frozenset)):
        if hasattr(values, "tolist"):
            values = values.tolist()
        else:
            raise ValueError(f"{name} must be a list of token ids, got {type(values).__name__}")
    items = list(values)
    if not items:
        raise ValueError(f"{name} must hold at least one token id, got an empty list")
    return [check_token_id(f"{name}[{i}]", v, vocab_size) for i, v in enumerate(items)]


def check_width(owner: str, largest_id: int, width: int) -> None:
    """Raise if the logits (``width`` tokens) have no column for ``largest_id``."""
    if largest_id >= width:
        raise ValueError(
            f"{owner}: token id {largest_id} is outside the vocabulary of these logits (width {width}); "
            f"token ids must be in [0, {width})"
        )


def vocab_size_of(tokenizer: Any) -> int | None:
    """``len(tokenizer)`` (its ids, added tokens included), or None without a tokenizer."""
    if tokenizer is None:
        return None
    try:
        return len(tokenizer)
    except TypeError:
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}") from None
