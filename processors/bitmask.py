"""Token bitmasks: int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed.

This is the format of llguidance, xgrammar and outlines-core, so any of them
can fill a mask that logitscope applies. llguidance's own apply kernel is
wrapped in ``torch.compile`` and pays seconds on its first call on a CPU;
:func:`apply_bitmask_` uses plain tensor ops instead, in one of two ways:

- **by table** (small batches, GPUs, masks of scattered bits): each mask byte
  indexes a ``[256, 8]`` table of additive biases (0 or -inf), gathered into a
  reused buffer and added to the logits;
- **by words** (large contiguous CPU batches whose width is a multiple of
  32; a mask narrower than the logits is padded with banned words): grammar
  masks are mostly whole words of 0 (32 banned tokens) or -1 (32 allowed
  tokens). A row where most words ban is filled with -inf and its other
  words are put back; in any other row only the words that ban something
  are touched. The words touched get their exact bits from the table.

Unpacking bits with shifts, ``masked_fill_`` or ``torch.where`` with a bool
mask, numpy's ``unpackbits`` and per-row word strategies all measured slower
on a CPU. A fused kernel still beats both ways on large batches
(``benchmarks/bench_grammar.py`` prints the comparison with llguidance's).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from processors.device import to_device

__all__ = ["bitmask_words", "allocate_bitmask", "apply_bitmask_", "pack_bool", "unpack_bitmask", "HostBitmask"]

#: Below this many logits (rows x tokens) the table is cheaper than the word bookkeeping.
WORDS_MIN_SIZE = 1 << 16
#: Above this share of mixed words (neither 0 nor -1) the table is cheaper.
WORDS_MAX_MIXED = 0.25

_BIAS_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_BOOL_TABLES: dict[torch.device, torch.Tensor] = {}
_SCRATCH = threading.local()


def bitmask_words(n_tokens: int) -> int:
    """int32 words per row for ``n_tokens`` tokens."""
    return (n_tokens + 31) // 32


def allocate_bitmask(batch: int, n_tokens: int, *, fill: int = -1) -> torch.Tensor:
    """A CPU ``[batch, words]`` int32 mask; ``fill=-1`` allows everything, ``0`` nothing."""
    return torch.full((batch, bitmask_words(n_tokens)), fill, dtype=torch.int32)


def _check(bitmask: torch.Tensor) -> None:
    if bitmask.dtype != torch.int32 or bitmask.ndim != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} of shape {tuple(bitmask.shape)}")


def _bits_table(device: torch.device) -> torch.Tensor:
    table = _BOOL_TABLES.get(device)
    if table is None:
        with torch.inference_mode(False):  # shared across calls: never an inference tensor
            table = _BOOL_TABLES[device] = _make_bits_table(device)
    return table


def _make_bits_table(device: torch.device) -> torch.Tensor:
    values = torch.arange(256, dtype=torch.int32)[:, None]
    return to_device(((values >> torch.arange(8, dtype=torch.int32)) & 1).bool(), device)


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = _BIAS_TABLES.get((dtype, device))
    if table is None:
        allowed = _bits_table(torch.device("cpu"))
        with torch.inference_mode(False):  # shared across calls: never an inference tensor
            table = to_device(torch.zeros(256, 8, dtype=dtype).masked_fill_(~allowed, float("-inf")), device)
        _BIAS_TABLES[(dtype, device)] = table
    return table


def _scratch(n_bytes: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Reused per-thread buffers for the byte indices and the biases (fresh memory costs page faults).

    Made outside inference mode: they are written in place on later calls,
    which may run outside ``torch.inference_mode`` (``model.generate``).
    """
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    key = (n_bytes, dtype, device)
    pair = buffers.get(key)
    if pair is None:
        if len(buffers) > 16:
            buffers.clear()
        with torch.inference_mode(False):
            index = torch.empty(n_bytes, dtype=torch.int32, device=device)
            pair = buffers[key] = (index, torch.empty(n_bytes, 8, dtype=dtype, device=device))
    return pair


def unpack_bitmask(bitmask: torch.Tensor, n_tokens: int, *, device: torch.device | None = None) -> torch.Tensor:
    """``[B, n_tokens]`` bool, True where the mask allows the token (little-endian words)."""
    _check(bitmask)
    device = bitmask.device if device is None else device
    rows = bitmask.shape[0]
    index = bitmask.to(device).contiguous().view(torch.uint8).reshape(-1).long()
    return _bits_table(device).index_select(0, index).view(rows, -1)[:, :n_tokens]


def _apply_by_table_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Add the 0/-inf bias of every mask bit to ``logits`` ``[B, n]`` (``n <= 32 * words``)."""
    rows, n = logits.shape
    mask_bytes = bitmask.to(logits.device).contiguous().view(torch.uint8).reshape(-1)
    index, bias = _scratch(mask_bytes.numel(), logits.dtype, logits.device)
    index.copy_(mask_bytes)
    torch.index_select(_bias_table(logits.dtype, logits.device), 0, index, out=bias)
    logits += bias.view(rows, -1)[:, :n]


def _apply_by_words_(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Apply a mask made mostly of whole 0 / -1 words to contiguous CPU ``logits`` ``[B, 32 * words]``.

    Returns False, touching nothing, when too many words are mixed.
    """
    words = bitmask.contiguous().numpy()
    zero, full = words == 0, words == -1
    total_zero, total_full = int(np.count_nonzero(zero)), int(np.count_nonzero(full))
    if words.size - total_zero - total_full > WORDS_MAX_MIXED * words.size:
        return False
    if words.shape[0] == 1:
        fill_rows = np.array([total_zero > total_full])
    else:  # mixed words are few: a row that allows fewer than half its words bans most
        fill_rows = full.view(np.int8).sum(axis=1, dtype=np.int32) * 2 < words.shape[1]
    filled = int(np.count_nonzero(fill_rows))
    every_row, no_row = filled == len(fill_rows), filled == 0
    # A row that bans more words than it keeps is filled with -inf and gets its
    # other words back; any other row is touched only where its words ban.
    # Either way the selected words get their exact bits from the table.
    if every_row:
        selected = ~zero
    elif no_row:
        selected = ~full
    else:
        selected = np.where(fill_rows[:, None], ~zero, ~full)
    index = np.flatnonzero(selected)
    blocks = logits.view(-1, 32)
    index_t = torch.from_numpy(index)
    chosen = blocks.index_select(0, index_t)
    if index.size:
        chosen_bytes = torch.from_numpy(np.ascontiguousarray(words.reshape(-1)[index]).view(np.uint8)).long()
        chosen += _bias_table(logits.dtype, logits.device).index_select(0, chosen_bytes).view(-1, 32)
    if every_row:
        logits.fill_(float("-inf"))
    else:
        for row in np.flatnonzero(fill_rows).tolist():
            logits[row].fill_(float("-inf"))
    blocks.index_copy_(0, index_t, chosen)
    return True


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
    """Set to -inf, in place, the logits of the tokens ``bitmask`` does not allow; return ``logits``.

    Allowed logits are left exactly as they were. The mask is added as a
    0 / -inf bias, so a banned token whose logit is +inf (a model that
    overflowed) becomes NaN, which the sampler reports as a dead row rather
    than sampling from it. Reads nothing back from
    the device: a mask on the CPU is copied to the logits' device (send it
    on the device already, from pinned memory, as the grammar processors do,
    and the host never waits).

    Args:
        logits: ``[B, V]`` float logits on any device, in any float dtype.
        bitmask: ``[B, words]`` int32 (on the CPU or the logits' device).
        n_tokens: tokens the mask speaks for (default: all its bits); logits
            of tokens at or beyond it are set to -inf too.
    """
    _check(bitmask)
    if logits.ndim != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits [B, V] and bitmask [B, words] must have the same rows, got "
            f"{tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    rows, width = logits.shape
    covered = 32 * bitmask.shape[1] if n_tokens is None else min(n_tokens, 32 * bitmask.shape[1])
    covered = min(covered, width)
    by_words = (
        logits.device.type == "cpu"
        and bitmask.device.type == "cpu"
        and rows * width >= WORDS_MIN_SIZE
        and width % 32 == 0
        and logits.is_contiguous()
    )
    if by_words and _apply_by_words_(logits, _words_covering(bitmask, covered, width // 32)):
        return logits
    if covered < width:
        logits[:, covered:] = float("-inf")
    _apply_by_table_(logits if covered == width else logits[:, :covered], bitmask)
    return logits


def _words_covering(bitmask: torch.Tensor, covered: int, n_words: int) -> torch.Tensor:
    """``bitmask`` as ``n_words`` words per row, with every bit at or beyond ``covered`` cleared."""
    whole, rest = divmod(covered, 32)
    if whole == n_words == bitmask.shape[1]:
        return bitmask
    words = torch.zeros(bitmask.shape[0], n_words, dtype=torch.int32)
    words[:, :whole] = bitmask[:, :whole]
    if rest:
        words[:, whole] = bitmask[:, whole] & ((1 << rest) - 1)
    return words


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


class HostBitmask:
    """Host buffers for a ``[batch, words]`` bitmask filled on the host and applied on ``device``.

    Two buffers alternate, so the host can fill the next step's mask while the
    last one's copy may still be queued. On CUDA they are pinned and sent with
    a ``non_blocking`` copy followed by an event; a buffer is filled again
    only after its previous copy ran (long done in a decode loop, so the wait
    is normally free). Elsewhere :meth:`send` returns the buffer itself.
    """

    def __init__(self, batch: int, words: int, device: torch.device) -> None:
        self.device = device
        pinned = device.type == "cuda"
        with torch.inference_mode(False):  # written in place on later calls, inside or outside inference mode
            self._buffers = [torch.zeros((batch, words), dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._events: list[Any] = [None, None]
        self._next = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self._buffers[0].shape)  # type: ignore[return-value]

    def acquire(self) -> torch.Tensor:
        """The buffer to fill now (waits, if it must, for that buffer's last copy to the device)."""
        event = self._events[self._next]
        if event is not None and not event.query():
            event.synchronize()
        return self._buffers[self._next]

    def send(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` (the one :meth:`acquire` gave) on the device; does not synchronise."""
        index, self._next = self._next, 1 - self._next
        if self.device.type != "cuda":
            return buffer if self.device.type == "cpu" else buffer.to(self.device)
        on_device = buffer.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[index] = event
        return on_device
