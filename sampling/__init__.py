"""sampling: sampling parameters, the sampling maths and the Generator.

>>> from sampling import Generator, SamplingParams
>>> gen = Generator(model, tokenizer, logits_processor=[...])
>>> gen.generate(["Call "], SamplingParams(temperature=0.8, top_p=0.9, seed=0))

The sampling stages are a :class:`~sampling.pipe.LogitsPipe` (see
:mod:`sampling.pipe`); ``SamplingParams(...).to_pipe()`` gives the one a
request uses, and ``generator.sample_taps`` observes what each step samples from.
"""

from sampling.functional import SampleTap
from sampling.generator import Generator, load_model
from sampling.outputs import Completion, RequestOutput
from sampling.params import SamplingParams
from sampling.pipe import DeadRowError, LogitsPipe, SampleResult, Tap

__all__ = [
    "Generator",
    "SamplingParams",
    "Completion",
    "RequestOutput",
    "DeadRowError",
    "load_model",
    "LogitsPipe",
    "SampleResult",
    "Tap",
    "SampleTap",
]
