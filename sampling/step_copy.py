"""The decode step's one device-to-host copy: chosen ids, log-probabilities and validity together.

On CUDA the values are packed into one float64 ``[4, B]`` tensor, copied
``non_blocking`` into a pinned buffer and waited for through a CUDA event:
the step's only synchronisation. That planned wait is exempt from
``torch.cuda.set_sync_debug_mode``, so that the debug mode reports every
other synchronisation of the step (and ``"error"`` can guard a decode loop).
Elsewhere the packed tensor is read with one
``tolist`` (the read a test of the decode loop counts as the step's one).
float64 holds every token id below 2**53 and every float32 exactly, so the
values reach the host unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

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
            mode = torch.cuda.get_sync_debug_mode()
            if mode:
                torch.cuda.set_sync_debug_mode(0)
            try:
                self._event.synchronize()
            finally:
                if mode:
                    torch.cuda.set_sync_debug_mode(mode)
            tokens, logprobs, raw, valid = self._pinned.numpy().tolist()  # numpy: the values are here now
        else:
            tokens, logprobs, raw, valid = packed.tolist()
        ids = [int(t) for t in tokens]
        return StepValues(
            tokens=ids,
            logprobs=logprobs,
            raw_logprobs=raw,
            valid=[v != 0 for v in valid],
            token_tensor=torch.tensor(ids, dtype=torch.long),
        )
