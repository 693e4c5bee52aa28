"""The recorder's per-row statistics on a GPU as Triton kernels: one launch where torch takes dozens.

On a GPU the decode step of a model in eager PyTorch is bound by the host's kernel launches, not by the device:
on an H200 the tracked step's statistics in torch's kernels (:mod:`.record_stats`' general path: 52 small
kernels for a natural row's statistics, 72 against a natural row, 37 for the chosen token's) cost about 3 ms
of host time a step at batch 1, a quarter of the step of a 1.2B model. Here each is one kernel, a program
per row:

- :func:`row_stats`: two passes over the row (and the natural row): maximum, counts, then the shifted sums.
- :func:`chosen_stats`: the chosen token's logit, probability and rank (one counting pass).
- :func:`half_rows`: the row minus its offset rounded to float16 or bfloat16, and the log-sum-exp of the
  rounded values (two passes).

Each gives :mod:`.record_stats`' general path's values within float32 rounding (the sums run in another
order; the counts, maxima and ranks are equal). Without Triton (``AVAILABLE`` False), or with
``LOGITSCOPE_STATS_TRITON=0``, the torch kernels run. ``TRITON_INTERPRET=1`` (set before Triton is imported)
runs the kernels on CPU tensors, which is how the tests check them without a GPU. None of them synchronises.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from tracker.reading.rows import EXP_FLOOR

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
    try:
        from triton.errors import TritonError as _KernelError
    except ImportError:  # an older Triton: its compiler's error
        from triton.compiler.errors import CompilationError as _KernelError
except ImportError:  # torch's kernels then (record_stats' general path)
    AVAILABLE = False

__all__ = ["AVAILABLE", "chosen_stats", "half_rows", "kernel_ready", "row_stats"]

BLOCK = 1024
"""Entries one program reads at a time."""

FAILED: list[str] = []
"""The kernels' first failure (a Triton that cannot compile them for this GPU), after which torch's run."""


def kernel_ready(x: torch.Tensor) -> bool:
    """Whether the kernels run on ``x``: Triton importable, ``LOGITSCOPE_STATS_TRITON`` not ``0``, no kernel
    failed in this process, and a CUDA tensor (or a CPU one under ``TRITON_INTERPRET=1``) with a vocabulary.
    Every step; reads shapes and the environment only (no synchronisation)."""
    if not AVAILABLE or FAILED or not x.shape[-1] or os.environ.get("LOGITSCOPE_STATS_TRITON") == "0":
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if AVAILABLE:

    @triton.jit
    def _row_stats_kernel(
        x_ptr,
        x_stride,
        nat_ptr,
        nat_stride,
        eos_ptr,
        n_eos,
        out_ptr,
        vocab,
        FLOOR: tl.constexpr,
        HAS_NAT: tl.constexpr,
        HAS_EOS: tl.constexpr,
        EOS_BLOCK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        xb = x_ptr + row * x_stride
        nb = nat_ptr + row * nat_stride
        offs = tl.arange(0, BLOCK)
        neg = float("-inf")
        inf = float("inf")
        # pass 1: NaN count, maximum, +inf count, allowed count (and the natural row's maxima and +inf counts)
        top = tl.full((BLOCK,), neg, tl.float32)
        nans = tl.zeros((BLOCK,), tl.int32)
        pinf = tl.zeros((BLOCK,), tl.int32)
        allowed = tl.zeros((BLOCK,), tl.int32)
        nat_top = tl.full((BLOCK,), neg, tl.float32)
        kept_top = tl.full((BLOCK,), neg, tl.float32)
        gone_top = tl.full((BLOCK,), neg, tl.float32)
        nat_pinf = tl.zeros((BLOCK,), tl.int32)
        gone_pinf = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            inside = idx < vocab
            x = tl.load(xb + idx, mask=inside, other=neg).to(tl.float32)
            isnan = x != x
            nans += isnan.to(tl.int32)
            xs = tl.where(isnan, neg, x)
            top = tl.maximum(top, xs)
            pinf += (xs == inf).to(tl.int32)
            ok = xs > neg
            allowed += ok.to(tl.int32)
            if HAS_NAT:
                n = tl.load(nb + idx, mask=inside, other=neg).to(tl.float32)
                n = tl.where(n != n, neg, n)
                nat_top = tl.maximum(nat_top, n)
                kept_top = tl.maximum(kept_top, tl.where(ok, n, neg))
                gone_top = tl.maximum(gone_top, tl.where(ok, neg, n))
                n_inf = n == inf
                nat_pinf += n_inf.to(tl.int32)
                gone_pinf += (n_inf & (ok == 0)).to(tl.int32)
        best = tl.max(top, 0)
        count_inf = tl.sum(pinf, 0).to(tl.float32)
        finite = tl.abs(best) < inf
        shift = tl.where(finite, best, 0.0)
        # pass 2: the shifted sums (each entry clamped at FLOOR, as the torch path does)
        total = tl.zeros((BLOCK,), tl.float32)
        ez = tl.zeros((BLOCK,), tl.float32)
        nat_sum = tl.zeros((BLOCK,), tl.float32)
        gone_sum = tl.zeros((BLOCK,), tl.float32)
        nat_best = tl.max(nat_top, 0)
        gone_best = tl.max(gone_top, 0)
        nat_shift = tl.where(tl.abs(nat_best) < inf, nat_best, 0.0)
        gone_shift = tl.where(tl.abs(gone_best) < inf, gone_best, 0.0)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            inside = idx < vocab
            x = tl.load(xb + idx, mask=inside, other=neg).to(tl.float32)
            xs = tl.where(x != x, neg, x)
            z = tl.maximum(xs - shift, FLOOR)
            e = tl.where(inside, tl.exp(z), 0.0)
            total += e
            ez += e * z
            if HAS_NAT:
                n = tl.load(nb + idx, mask=inside, other=neg).to(tl.float32)
                n = tl.where(n != n, neg, n)
                nat_sum += tl.where(inside, tl.exp(n - nat_shift), 0.0)
                gone_sum += tl.where(inside & (xs == neg), tl.exp(n - gone_shift), 0.0)
        total_all = tl.sum(total, 0)
        log_total = tl.log(total_all)
        nothing = best == neg
        posinf = best == inf
        lse = tl.where(nothing, neg, tl.where(posinf, inf, shift + log_total))
        entropy = log_total - tl.sum(ez, 0) / total_all
        entropy = tl.where(nothing, float("nan"), tl.where(posinf, tl.log(tl.maximum(count_inf, 1.0)), entropy))
        allowed_n = tl.where(posinf, count_inf, tl.sum(allowed, 0).to(tl.float32))
        if HAS_EOS:
            e_offs = tl.arange(0, EOS_BLOCK)
            e_in = e_offs < n_eos
            ids = tl.load(eos_ptr + e_offs, mask=e_in, other=0)
            v = tl.load(xb + ids, mask=e_in, other=neg).to(tl.float32)
            v = tl.where(v != v, neg, v)
            p = tl.exp(v - lse)
            p = tl.where(lse == inf, (v == inf).to(tl.float32) / tl.maximum(allowed_n, 1.0), p)
            p = tl.where((p != p) | (e_in == 0), 0.0, p)
            p_eos = tl.sum(p, 0)
        else:
            p_eos = float("nan")
        if HAS_NAT:
            # a natural row holding +inf is a one-hot on its +inf tokens (counts); else shifted sums
            n_inf_all = tl.sum(nat_pinf, 0).to(tl.float32)
            n_inf_gone = tl.sum(gone_pinf, 0).to(tl.float32)
            one_hot = n_inf_all > 0
            lse_nat = nat_best + tl.log(tl.sum(nat_sum, 0))
            lse_gone = gone_best + tl.log(tl.sum(gone_sum, 0))
            removed = tl.where(one_hot, n_inf_gone / tl.maximum(n_inf_all, 1.0), tl.exp(lse_gone - lse_nat))
            removed = tl.where(nat_best == neg, 0.0, removed)
            removed = tl.minimum(tl.maximum(removed, 0.0), 1.0)
            removed = tl.where(removed != removed, 0.0, removed)
            kept_best = tl.max(kept_top, 0)
            kept_one_hot = tl.where(n_inf_all - n_inf_gone > 0, 0.0, neg)
            margin = tl.where(one_hot, 0.0 - kept_one_hot, nat_best - kept_best)
        else:
            removed = float("nan")
            margin = float("nan")
        ob = out_ptr + row * 8
        tl.store(ob + 0, lse)
        tl.store(ob + 1, allowed_n)
        tl.store(ob + 2, best)
        tl.store(ob + 3, entropy)
        tl.store(ob + 4, tl.sum(nans, 0).to(tl.float32))
        tl.store(ob + 5, p_eos)
        tl.store(ob + 6, removed)
        tl.store(ob + 7, margin)

    @triton.jit
    def _chosen_kernel(x_ptr, x_stride, ids_ptr, stats_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        xb = x_ptr + row * x_stride
        offs = tl.arange(0, BLOCK)
        neg = float("-inf")
        inf = float("inf")
        token = tl.load(ids_ptr + row)
        valid = (token >= 0) & (token < vocab)
        value = tl.load(xb + tl.minimum(tl.maximum(token, 0), vocab - 1)).to(tl.float32)
        value = tl.where(value != value, neg, value)  # a NaN entry weighs 0: it ranks after every allowed token
        above = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = tl.load(xb + idx, mask=idx < vocab, other=neg).to(tl.float32)
            above += (x > value).to(tl.int32)
        lse = tl.load(stats_ptr + row * 8)
        allowed = tl.load(stats_ptr + row * 8 + 1)
        rank = tl.sum(above, 0).to(tl.float32)
        rank = tl.where(lse == inf, tl.where(value == inf, 0.0, allowed), rank)
        p = tl.exp(value - lse)
        p = tl.where(lse == inf, (value == inf).to(tl.float32) / tl.maximum(allowed, 1.0), p)
        p = tl.where(p != p, 0.0, p)
        nan = float("nan")
        ob = out_ptr + row * 3
        tl.store(ob + 0, tl.where(valid, value, nan))
        tl.store(ob + 1, tl.where(valid, p, nan))
        tl.store(ob + 2, tl.where(valid, rank, nan))

    @triton.jit
    def _rounded(x, offset, BF16: tl.constexpr):
        """``(bits, value)``: ``x - offset`` rounded to the storage type to nearest even, as its 16 bits and its
        float32 value. bfloat16 is rounded on its bits, as torch rounds it (the interpreter's own conversion
        differs), in 64-bit integers (no overflow); NaN is bfloat16's quiet NaN."""
        v = x - offset
        if BF16:
            u = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            top = tl.where(v != v, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
            return top.to(tl.int16), (top << 16).to(tl.int32).to(tl.float32, bitcast=True)
        k = v.to(tl.float16)
        return k.to(tl.int16, bitcast=True), k.to(tl.float32)

    @triton.jit
    def _half_kernel(
        x_ptr, x_stride, stats_ptr, offset_ptr, kept_ptr, stored_ptr, vocab, BF16: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        xb = x_ptr + row * x_stride
        kb = kept_ptr + row * vocab
        offs = tl.arange(0, BLOCK)
        neg = float("-inf")
        inf = float("inf")
        offset = tl.load(offset_ptr + row)
        # pass 1: the rounded row's maximum (NaN left out); pass 2: its kept values and shifted sum
        most = tl.full((BLOCK,), neg, tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = tl.load(xb + idx, mask=idx < vocab, other=neg).to(tl.float32)
            _, r = _rounded(x, offset, BF16)
            most = tl.maximum(most, tl.where(r != r, neg, r))
        m = tl.max(most, 0)
        shift = tl.where(tl.abs(m) < inf, m, 0.0)
        total = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            inside = idx < vocab
            x = tl.load(xb + idx, mask=inside, other=neg).to(tl.float32)
            k, r = _rounded(x, offset, BF16)
            tl.store(kb + idx, k, mask=inside)
            total += tl.where(inside & (r == r), tl.exp(r - shift), 0.0)
        lse = shift + tl.log(tl.sum(total, 0))
        exact = tl.load(stats_ptr + row * 8) - offset
        use = tl.where((tl.abs(lse) < inf) & (tl.abs(exact) < inf), lse, exact)
        for j in tl.static_range(8):
            tl.store(stored_ptr + row * 8 + j, tl.load(stats_ptr + row * 8 + j))
        tl.store(stored_ptr + row * 8, use + offset)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(kernel: Any, batch: int, *args: Any, **meta: Any) -> bool:
    """Launch ``kernel`` with a program per row; False (with a warning, once) where Triton refuses it (a
    compiler or a GPU it does not support): the recording goes on with torch's kernels. Every step; an
    asynchronous launch (no synchronisation; the first one in a process compiles the kernel)."""
    try:
        kernel[(batch,)](*args, **meta)
        return True
    except _KernelError as error:
        last = (str(error).strip().splitlines() or [""])[-1][:300]
        FAILED.append(f"{type(error).__name__}: {last}")
        warnings.warn(
            f"logitscope's statistics kernels cannot run here ({FAILED[0]}); the statistics are computed with "
            "torch's kernels from now on (the same values, more launches a step; LOGITSCOPE_STATS_TRITON=0 "
            "skips the kernels)",
            RuntimeWarning,
            stacklevel=4,
        )
        return False


def row_stats(x: torch.Tensor, eos: torch.Tensor | None, natural: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`tracker.recording.record_stats.row_stats` in one launch (see :func:`kernel_ready`); None where the
    kernel cannot run (:func:`_launch`). Does not synchronise."""
    x = _rows(x)
    batch, vocab = x.shape
    out = torch.empty((batch, 8), dtype=torch.float32, device=x.device)
    if not batch:
        return out
    nat = _rows(natural) if natural is not None else x
    has_eos = eos is not None and eos.numel() > 0
    ids = eos if has_eos else out
    n_eos = eos.numel() if has_eos else 0
    done = _launch(
        _row_stats_kernel,
        batch,
        x,
        x.stride(0),
        nat,
        nat.stride(0),
        ids,
        n_eos,
        out,
        vocab,
        FLOOR=EXP_FLOOR,
        HAS_NAT=natural is not None,
        HAS_EOS=has_eos,
        EOS_BLOCK=triton.next_power_of_2(max(n_eos, 1)),
        BLOCK=BLOCK,
    )
    return out if done else None


def chosen_stats(x: torch.Tensor, chosen: torch.Tensor, stats: torch.Tensor) -> torch.Tensor | None:
    """:func:`tracker.recording.record_stats.chosen_stats` in one launch (None where it cannot run). Does not
    synchronise."""
    x = _rows(x)
    batch, vocab = x.shape
    out = torch.empty((batch, 3), dtype=torch.float32, device=x.device)
    if batch:
        ids = chosen.reshape(-1).to(device=x.device, dtype=torch.int64)
        if not _launch(_chosen_kernel, batch, x, x.stride(0), ids, stats.float().contiguous(), out, vocab, BLOCK=BLOCK):
            return None
    return out


def half_rows(
    x: torch.Tensor, stats: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`tracker.recording.record_stats.half_rows` in one launch (None where it cannot run). Does not
    synchronise."""
    x = _rows(x)
    batch, vocab = x.shape
    kept = torch.empty((batch, vocab), dtype=dtype, device=x.device)
    stored = torch.empty((batch, 8), dtype=torch.float32, device=x.device)
    if batch:
        offset = offset.to(device=x.device, dtype=torch.float32).contiguous()
        bits, bf16 = kept.view(torch.int16), dtype == torch.bfloat16
        args = (x, x.stride(0), stats.contiguous(), offset, bits, stored, vocab)
        if not _launch(_half_kernel, batch, *args, BF16=bf16, BLOCK=BLOCK):
            return None
    return kept, stored
