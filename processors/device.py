"""Host-to-device copies that never make the host wait.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory waits for
the copy to finish, a synchronisation per call. Copies from pinned memory
with ``non_blocking=True`` are queued on the stream instead; the caching host
allocator keeps the pinned block alive until the copy has run, so the source
may be dropped right away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["to_device", "tensor_on"]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``: pinned and ``non_blocking`` on CUDA; does not synchronise."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)
    return tensor.to(device)


def tensor_on(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host ``values`` on ``device`` (see :func:`to_device`); does not synchronise."""
    return to_device(torch.tensor(values, dtype=dtype), device)
