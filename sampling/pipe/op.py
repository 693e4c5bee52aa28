"""The op: one step of a compiled pipe, with the tensor type it takes and gives."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from sampling.pipe.runtime import Runtime
from sampling.pipe.types import TaggedTensor, TensorType

__all__ = ["Op"]


class Op(abc.ABC):
    """A step that maps a tagged tensor of type ``IN`` to one of type ``OUT``.

    ``stage`` names the processor the op came from (taps use it);
    ``defaults`` hold the processor's parameter values; ``ends_stage`` is
    True for the last op of its processor, whose output is the stage's
    output. A fused op lists the ops it replaces in ``parts``.
    Subclasses implement :meth:`__call__` and must not modify ``x.data``.
    """

    IN: TensorType  # a class attribute; fused and user ops may set it per instance
    OUT: TensorType
    PARAMS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, stage: str = "", ends_stage: bool = True, **defaults: Any) -> None:
        self.stage = stage
        self.ends_stage = ends_stage
        self.defaults = {k: v for k, v in defaults.items() if v is not None}

    @abc.abstractmethod
    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor: ...

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def parts(self) -> tuple["Op", ...]:
        return (self,)

    def __repr__(self) -> str:
        return f"{self.name}(stage={self.stage!r})"
