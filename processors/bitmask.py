"""Token bitmasks: int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed.

This is the format of llguidance, xgrammar and outlines-core, so any of them
can fill a mask that logitscope applies. llguidance's own apply kernel is
wrapped in ``torch.compile`` and pays seconds on its first call on a CPU;
:func:`apply_bitmask_` uses plain tensor ops instead: each mask byte indexes a
``[256, 8]`` table of additive biases (0 or -inf), and the result is added to
the logits, which measured faster on CPU than unpacking bits with shifts.
"""

from __future__ import annotations

import torch

__all__ = ["bitmask_words", "allocate_bitmask", "apply_bitmask_", "pack_bool", "unpack_bitmask"]

_BIAS_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_BOOL_TABLES: dict[torch.device, torch.Tensor] = {}


def bitmask_words(n_tokens: int) -> int:
    """int32 words per row for ``n_tokens`` tokens."""
    return (n_tokens + 31) // 32


def allocate_bitmask(batch: int, n_tokens: int, *, fill: int = -1) -> torch.Tensor:
    """A CPU ``[batch, words]`` int32 mask; ``fill=-1`` allows everything, ``0`` nothing."""
    return torch.full((batch, bitmask_words(n_tokens)), fill, dtype=torch.int32)


def _bits_table(device: torch.device) -> torch.Tensor:
    table = _BOOL_TABLES.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32)[:, None]
        table = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
        _BOOL_TABLES[device] = table
    return table


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = _BIAS_TABLES.get((dtype, device))
    if table is None:
        allowed = _bits_table(torch.device("cpu"))
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)
        _BIAS_TABLES[(dtype, device)] = table
    return table


def _byte_index(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    if bitmask.dtype != torch.int32 or bitmask.ndim != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} of shape {tuple(bitmask.shape)}")
    mask = bitmask.to(device).contiguous()
    return mask.view(torch.uint8).reshape(-1).long()


def unpack_bitmask(bitmask: torch.Tensor, n_tokens: int, *, device: torch.device | None = None) -> torch.Tensor:
    """``[B, n_tokens]`` bool, True where the mask allows the token (little-endian words)."""
    device = bitmask.device if device is None else device
    rows = bitmask.shape[0]
    bits = _bits_table(device).index_select(0, _byte_index(bitmask, device))
    return bits.view(rows, -1)[:, :n_tokens]


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
    """Set to -inf, in place, the logits of the tokens ``bitmask`` does not allow; return ``logits``.

    Args:
        logits: ``[B, V]`` float logits on any device, in any float dtype.
        bitmask: ``[B, words]`` int32 (on the CPU or the logits' device).
        n_tokens: tokens the mask speaks for (default: all its bits); logits
            of tokens at or beyond it are set to -inf too.
    """
    if logits.ndim != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits [B, V] and bitmask [B, words] must have the same rows, got "
            f"{tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    rows, width = logits.shape
    covered = 32 * bitmask.shape[1] if n_tokens is None else min(n_tokens, 32 * bitmask.shape[1])
    covered = min(covered, width)
    if covered < width:
        logits[:, covered:] = float("-inf")
    bias = _bias_table(logits.dtype, logits.device).index_select(0, _byte_index(bitmask, logits.device))
    logits[:, :covered] += bias.view(rows, -1)[:, :covered]
    return logits


def pack_bool(allowed: torch.Tensor) -> torch.Tensor:
    """Pack ``[S, n]`` bool into a ``[S, words]`` int32 bitmask (True -> bit set)."""
    if allowed.dtype != torch.bool or allowed.ndim != 2:
        raise ValueError(f"allowed must be a 2-D bool tensor, got {allowed.dtype} of shape {tuple(allowed.shape)}")
    rows, n = allowed.shape
    words = bitmask_words(n)
    padded = torch.zeros(rows, words * 32, dtype=torch.bool, device=allowed.device)
    padded[:, :n] = allowed
    weights = torch.ones(8, dtype=torch.int32, device=allowed.device) << torch.arange(
        8, dtype=torch.int32, device=allowed.device
    )
    as_bytes = (padded.view(rows, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)
    return as_bytes.view(rows, words, 4).contiguous().view(torch.int32).view(rows, words)
