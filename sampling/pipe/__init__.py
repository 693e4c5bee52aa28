"""A declarative sampling pipe in the spirit of FlashInfer's ``LogitsPipe``, in plain PyTorch.

>>> from sampling.pipe import LogitsPipe, Temperature, Softmax, TopK, TopP, Sample
>>> pipe = LogitsPipe([Temperature(), Softmax(), TopK(), TopP(), Sample()])
>>> tokens = pipe(logits, temperature=0.7, top_k=50, top_p=0.9)

Processors (:mod:`~sampling.pipe.stages`) legalize into ops
(:mod:`~sampling.pipe.ops`) for the tensor type they receive
(:mod:`~sampling.pipe.types`); the compiler (:mod:`~sampling.pipe.compiler`)
checks them (:mod:`~sampling.pipe.validators`) and fuses them
(:mod:`~sampling.pipe.fusion`); the maths live in
:mod:`~sampling.pipe.kernels`, which also states the tie and boundary rules.
Taps (:mod:`~sampling.pipe.taps`) observe any stage.
"""

from sampling.pipe.fusion import FusionRule, default_rules
from sampling.pipe.op import Op
from sampling.pipe.pipeline import LogitsPipe
from sampling.pipe.results import RawLogprobs, SampleResult
from sampling.pipe.runtime import Runtime
from sampling.pipe.stages import Apply, Greedy, MinP, Sample, Softmax, Stage, Temperature, TopK, TopP
from sampling.pipe.taps import INPUT, SAMPLED, Tap
from sampling.pipe.types import (
    CompileError,
    DeadRowError,
    LegalizationError,
    PipeError,
    TaggedTensor,
    TensorType,
)

__all__ = [
    "LogitsPipe",
    "Stage",
    "Temperature",
    "Softmax",
    "TopK",
    "TopP",
    "MinP",
    "Sample",
    "Greedy",
    "Apply",
    "Op",
    "Runtime",
    "FusionRule",
    "default_rules",
    "Tap",
    "INPUT",
    "SAMPLED",
    "TensorType",
    "TaggedTensor",
    "SampleResult",
    "RawLogprobs",
    "PipeError",
    "LegalizationError",
    "CompileError",
    "DeadRowError",
]
