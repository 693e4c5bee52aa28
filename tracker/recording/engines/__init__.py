"""logitscope inside serving engines: each tracked request a generation of a run, written as it ends.

- :mod:`tracker.recording.engines.vllm`: a vLLM V1 batch-level logits processor.
- :mod:`tracker.recording.engines.requests`: one request's recording and the parts written from it (engine-independent).

Dynamo's per-request processors take ``processors.to_dynamo(tracker)``. Importing this package imports no engine.
"""
