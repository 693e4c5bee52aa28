"""The state of one call of a pipe: parameters, random numbers, taps, and what the sampler reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import torch

from sampling.pipe.kernels import Param
from sampling.pipe.taps import TapFn
from sampling.pipe.types import PipeError, TaggedTensor

if TYPE_CHECKING:
    from sampling.pipe.op import Op

__all__ = ["Runtime"]


@dataclass
class Runtime:
    """What the ops of one call share.

    ``params`` are the call's validated keyword parameters; an op falls back
    to the defaults of its processor. ``u`` holds one uniform number in
    [0, 1) per row (float64), drawn from ``generator`` when not given. The
    sampling op fills ``logprobs`` (log-probability of each chosen token in
    the distribution sampled from) and ``valid`` (False for a dead row).
    ``algorithm`` is the resolved :data:`~sampling.pipe.kernels.Algorithm`
    (never ``"auto"``); ``max_top_k`` a host-side bound of a per-row top-k.
    """

    batch: int
    device: torch.device
    params: Mapping[str, Param] = field(default_factory=dict)
    u: torch.Tensor | None = None
    generator: torch.Generator | None = None
    taps: Mapping[str, tuple[TapFn, ...]] = field(default_factory=dict)
    flag_dead: bool = False
    algorithm: str = "cpu"
    max_top_k: int | None = None
    logprobs: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    def param(self, op: "Op", name: str) -> Param:
        """The value of ``name`` for ``op``: the call's, else the processor's default."""
        value = self.params.get(name)
        if value is None:
            value = op.defaults.get(name)
        if value is None:
            raise PipeError(
                f"stage {op.stage!r} ({type(op).__name__}) needs {name}: pass {name}= when calling "
                f"the pipe, or give it to the processor"
            )
        return value

    def uniforms(self) -> torch.Tensor:
        """One uniform number in [0, 1) per row, float64 (drawn once per call)."""
        if self.u is None:
            self.u = torch.rand(self.batch, dtype=torch.float64, device=self.device, generator=self.generator)
        return self.u

    @property
    def sync_free(self) -> bool:
        """Whether the ops must not read the device (every algorithm but ``"cpu"``)."""
        return self.algorithm != "cpu"

    def wants(self, stage: str) -> bool:
        return stage in self.taps

    def emit(self, stage: str, tensor: TaggedTensor) -> None:
        for fn in self.taps.get(stage, ()):
            fn(tensor)

    def report(self, logprobs: torch.Tensor, valid: torch.Tensor) -> None:
        """Called by the sampling op with its per-row results."""
        self.logprobs = logprobs
        self.valid = valid
