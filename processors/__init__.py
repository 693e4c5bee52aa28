"""processors: the processor protocol, adapters between conventions, and the processor library.

>>> from processors import LogitsProcessor, BatchContext, from_vllm, to_dynamo

logitscope calls :class:`LogitsProcessor.process(logits, ctx)`; every
processor is also a transformers-style callable. ``from_*`` / ``to_*`` adapt
functions of the vLLM, Dynamo and TensorRT-LLM conventions.

The library: grammar constraints on llguidance (``RegexLogitsProcessor``,
``JSONLogitsProcessor``, ``CFGLogitsProcessor``), bad words at the text or
token level, logit bias, forced text, temperature, minimum new tokens,
repetition / presence / frequency penalties and allowed token ids.
"""

from processors.adapters import (
    DynamoProcessor,
    FromDynamo,
    FromTensorRTLLM,
    FromTransformers,
    FromVLLM,
    TensorRTLLMProcessor,
    VLLMProcessor,
    as_processor,
    from_dynamo,
    from_transformers,
    from_trtllm,
    from_vllm,
    to_dynamo,
    to_transformers,
    to_trtllm,
    to_vllm,
)
from processors.bad_words import BadWordsLogitsProcessor
from processors.basic import AllowedTokenIdsLogitsProcessor, MinNewTokensLogitsProcessor, TemperatureLogitsProcessor
from processors.bias import LogitBiasLogitsProcessor
from processors.forced import ForcedTextLogitsProcessor
from processors.grammar import CFGLogitsProcessor, GrammarLogitsProcessor, JSONLogitsProcessor, RegexLogitsProcessor
from processors.penalties import PenaltiesLogitsProcessor
from processors.protocol import BatchContext, LogitsProcessor, ProcessorError, ProcessorList, check_logits
from processors.vocab import Vocabulary, eos_token_ids, vocab_for

__all__ = [
    "BatchContext",
    "LogitsProcessor",
    "ProcessorError",
    "ProcessorList",
    "check_logits",
    "as_processor",
    "from_transformers",
    "from_vllm",
    "from_dynamo",
    "from_trtllm",
    "to_transformers",
    "to_vllm",
    "to_dynamo",
    "to_trtllm",
    "FromTransformers",
    "FromVLLM",
    "FromDynamo",
    "FromTensorRTLLM",
    "VLLMProcessor",
    "DynamoProcessor",
    "TensorRTLLMProcessor",
    "RegexLogitsProcessor",
    "JSONLogitsProcessor",
    "CFGLogitsProcessor",
    "GrammarLogitsProcessor",
    "BadWordsLogitsProcessor",
    "LogitBiasLogitsProcessor",
    "ForcedTextLogitsProcessor",
    "TemperatureLogitsProcessor",
    "MinNewTokensLogitsProcessor",
    "AllowedTokenIdsLogitsProcessor",
    "PenaltiesLogitsProcessor",
    "Vocabulary",
    "eos_token_ids",
    "vocab_for",
]
