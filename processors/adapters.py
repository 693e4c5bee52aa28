"""Adapters between logitscope's processor protocol and the conventions users have.

Each convention has an explicit adapter in each direction; nothing is guessed
from a function's parameter count.

=============== ====================================================== =============
convention      call                                                   returns
=============== ====================================================== =============
transformers    ``fn(input_ids [B, L], scores [B, V])``                 scores
vLLM (*)        ``fn(output_ids, logits [V])``                          logits
vLLM + prompt   ``fn(prompt_ids, output_ids, logits [V])``              logits
Dynamo          ``fn(input_ids, logits [V])``, in place                 None
TensorRT-LLM    ``fn(req_id, logits [beam, 1, V], token_ids,``          None
                ``stream_ptr, client_id)``, in place
=============== ====================================================== =============

(*) vLLM's per-request form (``vllm.logits_process.LogitsProcessor``), which vLLM V1
calls through ``AdapterLogitsProcessor.new_req_logits_processor``; a vLLM V1
engine's own interface is the batch-level class (``tracker.recording.engines.vllm``). Where
TensorRT-LLM runs under Dynamo, Dynamo's adapter calls the Dynamo form.

``from_*`` turns a function of that convention into a logitscope
:class:`~processors.protocol.LogitsProcessor` (:mod:`processors.from_conventions`);
``to_*`` turns a logitscope processor into a callable of that convention
(:mod:`processors.to_conventions`). logitscope processors already follow the
transformers convention, so :func:`to_transformers` returns the processor
itself, and :func:`as_processor` (:mod:`processors.protocol`) takes any
transformers-style callable as a processor.
"""

from processors.from_conventions import (
    FromDynamo,
    FromTensorRTLLM,
    FromTransformers,
    FromVLLM,
    from_dynamo,
    from_transformers,
    from_trtllm,
    from_vllm,
)
from processors.protocol import as_processor
from processors.to_conventions import (
    DynamoProcessor,
    TensorRTLLMProcessor,
    VLLMProcessor,
    to_dynamo,
    to_transformers,
    to_trtllm,
    to_vllm,
)

__all__ = [
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
