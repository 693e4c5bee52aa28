"""The decode step's one device-to-host copy: chosen ids, log-probabilities and validity together.

On CUDA the values are packed into one float64 ``[4, B]`` tensor, copied
``non_blocking`` into a pinned buffer and waited for through a CUDA event:
the step's only synchronisation. On the CPU the packed tensor is read in place.
float64 holds every token id below 2**53 and every float32 exactly, so the
values reach the host unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["StepCopy", "StepValues"]


@dataclass(frozen=True)
class StepValues:
    """One step's values on the host, one entry per row."""

    tokens: list[int]
    logprobs: list[float]
    raw_logprobs: list[float]
    valid: list[bool]
    token_tensor: torch.Tensor  # int64 [B] on the CPU: ``tokens`` for hosts' callbacks


class StepCopy:
    """Brings a step's ``[B]`` tensors to the host with one copy (see the module docstring)."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._event = None
        if device.type == "cuda":
            self._pinned = torch.empty((4, batch), dtype=torch.float64, pin_memory=True)
            self._event = torch.cuda.Event()

    def fetch(
        self, tokens: torch.Tensor, logprobs: torch.Tensor, raw_logprobs: torch.Tensor, valid: torch.Tensor
    ) -> StepValues:
        """Wait for the values of this step and return them (synchronises once on CUDA)."""
        packed = torch.stack([tokens.double(), logprobs.double(), raw_logprobs.double(), valid.double()])
        if self._pinned is not None and self._event is not None:
            self._pinned.copy_(packed, non_blocking=True)
            self._event.record()
            self._event.synchronize()
            host = self._pinned.numpy()
        elif packed.device.type == "cpu":
            host = packed.numpy()  # a view: the values are already on the host
        else:
            host = packed.cpu().numpy()
        ids = host[0].astype(np.int64)
        return StepValues(
            tokens=ids.tolist(),
            logprobs=host[1].tolist(),
            raw_logprobs=host[2].tolist(),
            valid=(host[3] != 0).tolist(),
            token_tensor=torch.from_numpy(ids),
        )
