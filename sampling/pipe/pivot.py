"""The mass crossing by a bounded pivot search: no sort, no histogram, no host read, fixed shapes.

What :func:`~sampling.pipe.kernels.mass_crossing` finds (the weight at which
the running mass of a row, in the order of :mod:`~sampling.pipe.kernels`,
crosses a target), found by bisection on the weight itself. For a
non-negative float32 ``v`` let ``S(v)`` be the mass of the tokens with weight
``>= v``; ``S`` only falls as ``v`` grows, and the float32 bit patterns of
non-negative numbers are ordered like the numbers. So the crossing weight is
the largest bit pattern ``b`` with ``S(b) >= target`` (top-p, the inclusive
crossing) or ``S(b) > target`` (sampling), found one bit at a time from the
top: 31 masked sums per row, whatever the row holds. Every sum is in float64,
so the decisions are those of the float64 reference. The tokens tied at the
crossing weight are counted exactly, so the tie rule of the kernels module
(lower ids first) applies unchanged.

When rounding leaves no crossing (a target at or above the row's total), the
search stops at the smallest positive weight (found by an exact integer
minimum, so both implementations agree to the bit), as the radix select
does. A row whose total is 0 or NaN ends with a meaningless value; the
caller flags it dead.

Two implementations give the same answer: :func:`pivot_crossing_torch`
(plain PyTorch, a handful of kernels per bit) and, where Triton is present
and the tensor is on a GPU (or ``TRITON_INTERPRET=1`` runs kernels on the
CPU), :mod:`sampling.pipe.pivot_triton`'s one kernel per call, which keeps
each row's search inside one program (``LOGITSCOPE_PIVOT_TRITON=0`` keeps
the PyTorch version). Neither synchronises.
"""

from __future__ import annotations

import os

import torch

_BITS = 31  # a non-negative float32's ordered bits: 8 of exponent, 23 of mantissa
_NONE = 2**31 - 1  # "no positive weight": above every candidate
_TINY = 1e-300  # an inclusive crossing needs at least some mass: a target of 0 takes the largest weight


def targets(
    total: torch.Tensor, fraction: torch.Tensor | float, of_mass: torch.Tensor | None, inclusive: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, what the search needs)`` per row, float64: ``fraction`` of ``of_mass`` (NaN or None: the total)."""
    mass = total if of_mass is None else torch.where(torch.isnan(of_mass), total, of_mass)
    target = (fraction.double() if isinstance(fraction, torch.Tensor) else fraction) * mass
    need = target.clamp(min=_TINY) if inclusive else target
    return target, need


def pivot_crossing_torch(
    w: torch.Tensor, need: torch.Tensor, inclusive: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value, above, ties)``: the crossing weight of each row, the mass above it, how many tokens hold it.

    ``w`` non-negative float32 ``[B, V]``; ``need`` float64 ``[B]`` (see
    :func:`targets`). Plain PyTorch: a compare and a masked sum per bit. Does
    not synchronise.
    """
    prefix = torch.zeros(w.shape[0], dtype=torch.int32, device=w.device)
    # the smallest positive weight's bits: no candidate at or below it can fail (the fallback; INT_MAX: none)
    lowest = torch.where(w > 0, w.view(torch.int32), _NONE).amin(-1)
    need = need[:, None]
    for bit in range(_BITS - 1, -1, -1):
        candidate = prefix | (1 << bit)
        v = candidate.view(torch.float32)[:, None]
        s = torch.where(w >= v, w, 0.0).sum(-1, keepdim=True, dtype=torch.float64)
        ok = (s >= need) if inclusive else (s > need)
        prefix = torch.where(ok.squeeze(1) | (candidate <= lowest), candidate, prefix)
    value = prefix.view(torch.float32)
    above = torch.where(w > value[:, None], w, 0.0).sum(-1, dtype=torch.float64)
    ties = (w == value[:, None]).sum(-1)
    return value, above, ties


def kernel_enabled() -> bool:
    """Whether the Triton kernel may run: triton importable and ``LOGITSCOPE_PIVOT_TRITON`` not ``0``."""
    if os.environ.get("LOGITSCOPE_PIVOT_TRITON") == "0":
        return False
    from sampling.pipe import pivot_triton

    return pivot_triton.AVAILABLE


def _triton_ready(w: torch.Tensor) -> bool:
    """Whether the Triton kernel runs on ``w``: :func:`kernel_enabled`, and a GPU tensor (or any under
    ``TRITON_INTERPRET=1``)."""
    if not kernel_enabled():
        return False
    return w.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and w.device.type == "cpu")


def pivot_crossing(
    w: torch.Tensor, need: torch.Tensor, inclusive: bool, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pivot_crossing_torch`'s answer, by the Triton kernel where it runs (``use_triton=None``: decide here).

    Does not synchronise.
    """
    if use_triton is None:
        use_triton = _triton_ready(w)
    if use_triton:
        from sampling.pipe.pivot_triton import pivot_crossing_triton

        return pivot_crossing_triton(w, need, inclusive)
    return pivot_crossing_torch(w, need, inclusive)
