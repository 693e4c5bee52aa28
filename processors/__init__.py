"""processors: the processor protocol, adapters between conventions, and the processor library.

>>> from processors import LogitsProcessor, BatchContext, from_vllm, to_dynamo

logitscope calls :class:`LogitsProcessor.process(logits, ctx)`; every
processor is also a transformers-style callable. ``from_*`` / ``to_*`` adapt
functions of the vLLM, Dynamo and TensorRT-LLM conventions.

The library: grammar constraints on llguidance (``RegexLogitsProcessor``,
``JSONLogitsProcessor``, ``CFGLogitsProcessor``), bad words at the text or
token level, logit bias, forced text, temperature, minimum new tokens,
repetition / presence / frequency penalties and allowed token ids.

Each name is imported from its module on first use (PEP 562), so that
``import processors.vocab`` (the vocabulary table a run carries; numpy only)
loads no torch, transformers or llguidance: a run can be read where they are
not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from processors.exports import lazy_exports

if TYPE_CHECKING:
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
    from processors.basic import (
        AllowedTokenIdsLogitsProcessor,
        MinNewTokensLogitsProcessor,
        TemperatureLogitsProcessor,
    )
    from processors.bias import LogitBiasLogitsProcessor
    from processors.forced import ForcedTextLogitsProcessor
    from processors.grammar import (
        CFGLogitsProcessor,
        GrammarLogitsProcessor,
        JSONLogitsProcessor,
        RegexLogitsProcessor,
    )
    from processors.penalties import PenaltiesLogitsProcessor
    from processors.protocol import BatchContext, LogitsProcessor, ProcessorError, ProcessorList, check_logits
    from processors.vocab import Vocabulary, eos_token_ids, vocab_for

# each public name -> the module that defines it
_HOMES = {
    "BatchContext": "processors.protocol",
    "LogitsProcessor": "processors.protocol",
    "ProcessorError": "processors.protocol",
    "ProcessorList": "processors.protocol",
    "check_logits": "processors.protocol",
    "as_processor": "processors.protocol",
    "FromTransformers": "processors.protocol",
    "from_transformers": "processors.from_conventions",
    "from_vllm": "processors.from_conventions",
    "from_dynamo": "processors.from_conventions",
    "from_trtllm": "processors.from_conventions",
    "FromVLLM": "processors.from_conventions",
    "FromDynamo": "processors.from_conventions",
    "FromTensorRTLLM": "processors.from_conventions",
    "to_transformers": "processors.to_conventions",
    "to_vllm": "processors.to_conventions",
    "to_dynamo": "processors.to_conventions",
    "to_trtllm": "processors.to_conventions",
    "VLLMProcessor": "processors.to_conventions",
    "DynamoProcessor": "processors.to_conventions",
    "TensorRTLLMProcessor": "processors.to_conventions",
    "RegexLogitsProcessor": "processors.grammar",
    "JSONLogitsProcessor": "processors.grammar",
    "CFGLogitsProcessor": "processors.grammar",
    "GrammarLogitsProcessor": "processors.grammar",
    "BadWordsLogitsProcessor": "processors.bad_words",
    "LogitBiasLogitsProcessor": "processors.bias",
    "ForcedTextLogitsProcessor": "processors.forced",
    "TemperatureLogitsProcessor": "processors.basic",
    "MinNewTokensLogitsProcessor": "processors.basic",
    "AllowedTokenIdsLogitsProcessor": "processors.basic",
    "PenaltiesLogitsProcessor": "processors.penalties",
    "Vocabulary": "processors.vocab",
    "eos_token_ids": "processors.vocab",
    "vocab_for": "processors.vocab",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
