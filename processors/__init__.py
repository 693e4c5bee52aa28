"""processors: the processor protocol, adapters between conventions, and the processor library.

>>> from processors import LogitsProcessor, BatchContext, from_vllm, to_dynamo

logitscope calls :class:`LogitsProcessor.process(logits, ctx)`; every
processor is also a transformers-style callable. ``from_*`` / ``to_*`` adapt
functions of the vLLM, Dynamo and TensorRT-LLM conventions.
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
from processors.protocol import BatchContext, LogitsProcessor, ProcessorError, ProcessorList, check_logits

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
]
