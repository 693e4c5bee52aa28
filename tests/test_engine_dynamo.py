"""The tracker as a Dynamo logits processor (``dynamo.logits_processing.BaseLogitsProcessor``), wrapping Dynamo's own
example processors, made per request by Dynamo's own ``PythonProcessorSpec`` factory.

Needs ``pip install --no-deps -r .ci/engines.txt``; a test skips only when a Dynamo module cannot be imported here,
naming it. Dynamo's TensorRT-LLM adapter needs ``tensorrt_llm``, which does not install without CUDA: not tested.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engines_support import import_or_skip

from processors import from_dynamo, to_dynamo
from tracker import LogitTrackingProcessor
from tracker.reading.block import stage_matrix

pytestmark = pytest.mark.engines

VOCAB = 97
EOS = 0


def test_tracker_is_a_dynamo_processor_recording_what_each_request_received(tmp_path):
    base = import_or_skip("dynamo.logits_processing").BaseLogitsProcessor
    examples = import_or_skip("dynamo.logits_processing.examples")
    engine = import_or_skip("dynamo.common.backend.engine")
    forced = [5, 17, 42, 8]
    tracker = LogitTrackingProcessor(
        from_dynamo(factory=lambda: examples.ForcedSequenceLogitsProcessor(forced, EOS)), storage="float32"
    )
    spec = engine.LogitsProcessorSpec(entries=(engine.PythonProcessorSpec(factory=lambda: to_dynamo(tracker)),))
    rng = torch.Generator().manual_seed(0)
    seen = []
    for prompt in ([3, 4, 5], [9, 1]):  # two requests, each with its own processor, as Dynamo makes them
        processor = spec.entries[0].factory()
        assert isinstance(processor, base)
        ids, received, returned = list(prompt), [], []
        for _ in range(len(forced) + 1):
            logits = torch.randn(VOCAB, generator=rng) * 2
            received.append(logits.clone())
            assert processor(ids, logits) is None  # in place, as the protocol says
            returned.append(logits.clone())
            ids.append(int(logits.argmax()))
        processor.finish(ids)
        seen.append((np.stack(received), np.stack(returned), ids[len(prompt) :]))
    assert [s[2] for s in seen] == [[*forced, EOS]] * 2  # Dynamo's processor steered both requests

    run = tracker.run
    assert len(run.generations()) == 2
    table = run.to_arrow()
    for gid, (received, returned, tokens) in enumerate(seen):
        batch = table.filter(table.column("generation").to_numpy() == gid).combine_chunks().to_batches()[0]
        assert batch.column("step").to_numpy().tolist() == list(range(len(tokens)))
        natural = stage_matrix(batch, "natural", VOCAB)
        constrained = stage_matrix(batch, "constrained", VOCAB)
        assert np.array_equal(natural.view(np.int32), received.view(np.int32))
        assert np.array_equal(constrained.view(np.int32), returned.view(np.int32))
        assert batch.column("chosen").to_numpy().tolist() == tokens
    written = run.to_dataset(tmp_path)
    assert written.parent.name == f"run_id={run.run_id}"
