"""sampling: sampling parameters, the sampling maths and the Generator.

>>> from sampling import Generator, SamplingParams
>>> gen = Generator(model, tokenizer, logits_processor=[...])
>>> gen.generate(["Call "], SamplingParams(temperature=0.8, top_p=0.9, seed=0))
"""

from sampling.functional import DeadRowError
from sampling.generator import Generator, load_model
from sampling.outputs import Completion, RequestOutput
from sampling.params import SamplingParams

__all__ = ["Generator", "SamplingParams", "Completion", "RequestOutput", "DeadRowError", "load_model"]
