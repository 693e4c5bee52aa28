"""The pivot search of :mod:`sampling.pipe.pivot` as one Triton kernel: a program per row, one launch per call.

Each program runs the row's whole search itself, 4 bits a pass (16
candidate pivots summed in float64 in one read of the row, the largest that
passes kept): 8 passes instead of 31, plus one pass for the row's total and
one for the mass above and the ties, in one launch instead of a few kernels
per bit. Without Triton (``AVAILABLE`` False) the PyTorch version
runs instead. ``TRITON_INTERPRET=1`` (set before Triton is imported) runs the
kernel on CPU tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # plain PyTorch then (sampling.pipe.pivot)
    AVAILABLE = False

BLOCK = 256
"""Tokens one program reads at a time (times 16 candidates: 4,096 float64 sums in flight)."""

if AVAILABLE:

    @triton.jit
    def _pivot_kernel(
        w_ptr,
        need_ptr,
        value_ptr,
        above_ptr,
        ties_ptr,
        vocab,
        stride,
        INCLUSIVE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = w_ptr + row.to(tl.int64) * stride
        need = tl.load(need_ptr + row)
        offsets = tl.arange(0, BLOCK)
        # the smallest positive weight's bits: no candidate at or below it can fail (the fallback; INT_MAX: none)
        low = tl.full((BLOCK,), 2147483647, tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offsets
            x = tl.load(base + idx, mask=idx < vocab, other=0.0)
            low = tl.minimum(low, tl.where(x > 0, x.to(tl.int32, bitcast=True), 2147483647))
        lowest = tl.min(low, 0)
        # 4 bits a pass: the 16 candidates prefix | j << shift (j = 0 is the prefix, always kept) summed at once,
        # the largest that passes kept; S only falls as j grows, so this is the bit-by-bit bisection's answer.
        # The last pass (shift 0) holds 3 bits: a j >= 8 there repeats a candidate of the pass before
        # (bit 3 set) or exceeds one that failed (bit 3 clear), so it never changes the answer.
        j = tl.arange(0, 16)
        prefix = tl.zeros((), tl.int32)
        for chunk in range(8):
            shift = tl.maximum(27 - 4 * chunk, 0)
            candidate = prefix | (j << shift)
            s = tl.zeros((16,), tl.float64)
            for start in range(0, vocab, BLOCK):
                idx = start + offsets
                x = tl.load(base + idx, mask=idx < vocab, other=0.0)
                bits = x.to(tl.int32, bitcast=True)
                s += tl.sum(tl.where(bits[:, None] >= candidate[None, :], x.to(tl.float64)[:, None], 0.0), 0)
            if INCLUSIVE:
                ok = s >= need
            else:
                ok = s > need
            ok = ok | (candidate <= lowest) | (j == 0)
            prefix = prefix | (tl.max(tl.where(ok, j, 0), 0) << shift)
        above = tl.zeros((BLOCK,), tl.float64)
        ties = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offsets
            inside = idx < vocab
            x = tl.load(base + idx, mask=inside, other=0.0)
            bits = x.to(tl.int32, bitcast=True)
            above += tl.where(bits > prefix, x.to(tl.float64), 0.0)
            ties += ((bits == prefix) & inside).to(tl.int32)
        tl.store(value_ptr + row, prefix)
        tl.store(above_ptr + row, tl.sum(above, 0))
        tl.store(ties_ptr + row, tl.sum(ties, 0))


def pivot_crossing_triton(
    w: torch.Tensor, need: torch.Tensor, inclusive: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value, above, ties)`` as :func:`sampling.pipe.pivot.pivot_crossing_torch` gives them. Does not synchronise."""
    w = w.contiguous()
    batch, vocab = w.shape
    value = torch.empty(batch, dtype=torch.int32, device=w.device)
    above = torch.empty(batch, dtype=torch.float64, device=w.device)
    ties = torch.empty(batch, dtype=torch.int32, device=w.device)
    need = need.to(torch.float64).contiguous()
    _pivot_kernel[(batch,)](w, need, value, above, ties, vocab, w.stride(0), INCLUSIVE=inclusive, BLOCK=BLOCK)
    return value.view(torch.float32), above, ties.long()
