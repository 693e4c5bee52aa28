"""A declarative sampling pipe in the spirit of FlashInfer's ``LogitsPipe``, in plain PyTorch.

>>> from sampling.pipe import LogitsPipe, Temperature, Softmax, TopK, TopP, Sample
>>> pipe = LogitsPipe([Temperature(), Softmax(), TopK(), TopP(), Sample()])
>>> tokens = pipe(logits, temperature=0.7, top_k=50, top_p=0.9)

Processors (:mod:`~sampling.pipe.stages`) legalize into ops
(:mod:`~sampling.pipe.ops`) for the tensor type they receive
(:mod:`~sampling.pipe.types`); :mod:`~sampling.pipe.fusion` checks and fuses
them; every filter and sampler runs one filter chain
(:class:`~sampling.pipe.ops.Chain`) over the maths of
:mod:`~sampling.pipe.kernels`, which also states the tie and boundary rules.
Taps observe any stage.
"""

from sampling.pipe.fusion import FusionRule, default_rules
from sampling.pipe.pipeline import LogitsPipe
from sampling.pipe.stages import Apply, Greedy, MinP, Sample, Softmax, Stage, Temperature, TopK, TopP
from sampling.pipe.types import (
    INPUT,
    SAMPLED,
    CompileError,
    DeadRowError,
    LegalizationError,
    Op,
    PipeError,
    RawLogprobs,
    Runtime,
    SampleResult,
    TaggedTensor,
    Tap,
    TensorType,
)

__all__ = ["LogitsPipe", "Stage", "Temperature", "Softmax", "TopK", "TopP", "MinP", "Sample", "Greedy", "Apply"]
__all__ += ["Op", "Runtime", "FusionRule", "default_rules", "Tap", "INPUT", "SAMPLED", "TensorType", "TaggedTensor"]
__all__ += ["SampleResult", "RawLogprobs", "PipeError", "LegalizationError", "CompileError", "DeadRowError"]
