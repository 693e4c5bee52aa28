"""logitscope inside SGLang, driven by SGLang's own ``Sampler``, requests (``Req``) and ``SamplingBatchInfo``.

SGLang's sampler calls custom logit processors as its scheduler builds them: each batch deserialises the
processor a request names (``CustomLogitProcessor.from_str``) and calls it on the rows of the requests that
name it with their ``custom_params`` (SGLang adds the request under ``"__req__"``). Here SGLang 0.5.23's own
code does all of that on a CPU: ``Sampler.forward`` with its PyTorch sampling backend, a one-process gloo
group for its tensor-parallel handle, ``SamplingBatchInfo.from_schedule_batch`` over real ``Req`` objects.

What stands in: ``torchvision`` alone (no build of it loads beside torch 2.13 CPU; SGLang's multimodal
helpers import it at module level and are never called here): a module that answers every name with an
inert class, put in ``sys.modules`` for the import of SGLang's modules and removed afterwards. What is not
run: SGLang's scheduler, model runner and server (no CPU kernel wheel); the steps below append each sampled
token to ``req.output_ids`` and mark requests finished as its scheduler does.

Needs ``pip install --no-deps -r .ci/engines.txt`` (sglang and the packages its modules import).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import socket
import sys
import types

import numpy as np
import pytest
import torch
from engines_support import import_or_skip

from tracker import Run
from tracker.format.dataset import list_runs
from tracker.recording.engines.sglang import LogitscopeLogitProcessor

pytestmark = pytest.mark.engines

VOCAB = 256
TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
               "torchvision.transforms.v2", "torchvision.transforms.v2.functional", "torchvision.io", "torchvision.ops")  # fmt: skip


class Tracked(LogitscopeLogitProcessor):
    """The processor the requests below name; its runs go where the test says (set before its first call)."""

    runs: str | None = None


def _torchvision_stand_in() -> dict[str, types.ModuleType]:
    """Modules named like torchvision's that give an inert class for any attribute (SGLang only imports names)."""

    class Inert(type):
        def __getattr__(cls, name: str) -> str:
            if name.startswith("__"):
                raise AttributeError(name)
            return f"{cls.__name__}.{name}"

    class Module(types.ModuleType):
        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return Inert(name, (), {})

    modules = {}
    for name in TORCHVISION:
        module = Module(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        modules[name] = module
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


@pytest.fixture(scope="module")
def sglang():
    """SGLang's sampler, request and batch classes, with its process-wide configuration published and a
    one-process gloo group for the sampler's tensor-parallel handle (torn down after the module)."""
    import_or_skip("sglang.srt.sampling.custom_logit_processor")
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # transformers notes the truth (absent) before the stand-in goes in
    stand_in = _torchvision_stand_in()
    saved = {name: sys.modules.get(name) for name in TORCHVISION}
    sys.modules.update(stand_in)
    try:
        modules = {
            name: import_or_skip(name)
            for name in (
                "sglang.srt.layers.sampler",
                "sglang.srt.layers.logits_processor",
                "sglang.srt.managers.schedule_batch",
                "sglang.srt.sampling.sampling_batch_info",
                "sglang.srt.sampling.sampling_params",
                "sglang.srt.server_args",
                "sglang.srt.distributed.parallel_state",
            )
        }
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    server_args = modules["sglang.srt.server_args"]
    args = server_args.ServerArgs(
        model_path=str(importlib.import_module("logitscope.demo_model").__path__[0] + "/files"),
        device="cpu",
        enable_custom_logit_processor=True,
        sampling_backend="pytorch",
    )
    server_args.set_global_server_args_for_scheduler(args)
    parallel = modules["sglang.srt.distributed.parallel_state"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    parallel.initialize_model_parallel(backend="gloo")
    yield modules
    parallel.destroy_model_parallel()
    parallel.destroy_distributed_environment()


def _request(sglang, rid: str, processor: str | None, custom: dict | None, **params):
    sampling = sglang["sglang.srt.sampling.sampling_params"].SamplingParams(custom_params=custom, **params)
    sampling.normalize(None)  # as SGLang's tokenizer manager prepares a request's parameters
    sampling.verify(VOCAB)
    prompt = [3 + len(rid), 17, 42]
    return sglang["sglang.srt.managers.schedule_batch"].Req(rid, "", prompt, sampling, custom_logit_processor=processor)


def _serve(sglang, requests: dict, steps: int, finish: dict[str, int]) -> dict[str, list[np.ndarray]]:
    """Decode steps as SGLang's scheduler runs them: a batch of the running requests, its sampling info built
    by SGLang, SGLang's sampler on random logits, each token appended to its request's output ids; a request
    finishes after ``finish[rid]`` tokens (its finish reason set, and it leaves the batch). What each request's
    row held when the sampler received it."""
    batch_cls = sglang["sglang.srt.managers.schedule_batch"].ScheduleBatch
    info_cls = sglang["sglang.srt.sampling.sampling_batch_info"].SamplingBatchInfo
    finished = sglang["sglang.srt.managers.schedule_batch"].FINISH_LENGTH
    output = sglang["sglang.srt.layers.logits_processor"].LogitsProcessorOutput
    sampler = sglang["sglang.srt.layers.sampler"].Sampler()
    rng = torch.Generator().manual_seed(0)
    running = list(requests.values())
    received: dict[str, list[np.ndarray]] = {rid: [] for rid in requests}
    for _ in range(steps):
        if not running:
            break
        info = info_cls.from_schedule_batch(batch_cls(reqs=running, device="cpu"), VOCAB)
        logits = torch.randn(len(running), VOCAB, generator=rng) * 3
        for i, req in enumerate(running):
            received[req.rid].append(logits[i].numpy().copy())
        n = len(running)
        tokens = sampler(output(next_token_logits=logits), info, False, [0] * n, [None] * n, torch.zeros(n))
        for req, token in zip(running, tokens.tolist()):
            req.output_ids.append(token)
            if len(req.output_ids) >= finish.get(req.rid, steps):
                req.finished_reason = finished(length=len(req.output_ids))
        running = [req for req in running if not req.finished()]
    return received


def test_each_asking_request_is_recorded_bit_for_bit_through_sglangs_sampler(sglang, tmp_path, caplog):
    Tracked.runs = str(tmp_path)
    mine, disallow = Tracked.to_str(), "sglang.srt.sampling.custom_logit_processor"
    other = importlib.import_module(disallow).DisallowedTokensLogitsProcessor.to_str()
    assert isinstance(importlib.import_module(disallow).CustomLogitProcessor.from_str(mine), Tracked)
    requests = {
        "sampled": _request(sglang, "sampled", mine, {"logitscope": {"request_id": "a"}}, temperature=0.7, top_p=0.9),
        "greedy": _request(sglang, "greedy", mine, {"logitscope": True}, temperature=0.0, max_new_tokens=3),
        "topk": _request(sglang, "topk", mine, {"logitscope": '{"storage": "topk", "top_k": 5}'}, temperature=1.0),
        "declined": _request(sglang, "declined", mine, {"logitscope": False}, temperature=1.0),
        "malformed": _request(sglang, "malformed", mine, {"logitscope": {"storage": "fp8"}}, temperature=1.0),
        "plain": _request(sglang, "plain", None, None, temperature=1.0),
        "disallowing": _request(sglang, "disallowing", other, {"token_ids": [7]}, temperature=1.0),
    }
    outputs = {rid: req.output_ids for rid, req in requests.items()}
    with caplog.at_level(logging.WARNING):
        received = _serve(sglang, requests, steps=6, finish={"greedy": 3, "topk": 4})
    assert "does not record request malformed" in caplog.text and "'storage'] must be one of" in caplog.text
    del requests  # SGLang frees finished requests: their parts are written all the same
    Tracked.flush()
    runs = sorted(entry.run_id for entry in list_runs(tmp_path))  # the server's run, and its top-k one
    assert len(runs) == 2 and runs[1] == f"{runs[0]}-topk5"
    run = Run.load(tmp_path, run_id=runs[0])
    by_id = {g["request_id"]: g for g in run.metadata.generations}
    assert sorted(by_id) == ["a", "greedy"]  # what did not ask, asked false or asked wrongly is not recorded
    assert by_id["a"]["sampling"][0]["sampler"] == "sglang" and by_id["a"]["prompt_ids"] == [[10, 17, 42]]
    table = run.to_arrow()
    for request_id, rid in (("a", "sampled"), ("greedy", "greedy")):
        rows = table.filter(pa_equal(table, by_id[request_id]["generation"])).sort_by("step")
        natural = np.array(rows.column("natural_logits").to_pylist(), dtype=np.float32)
        assert np.array_equal(natural.view(np.int32), np.stack(received[rid]).view(np.int32))  # bit for bit
        assert rows.column("chosen").to_pylist() == list(outputs[rid])  # the last token too
    greedy = table.filter(pa_equal(table, by_id["greedy"]["generation"])).sort_by("step")
    assert greedy.column("chosen").to_pylist() == np.stack(received["greedy"]).argmax(axis=1).tolist()
    topk = Run.load(tmp_path, run_id=f"{run.run_id}-topk5")
    assert (topk.metadata.storage, topk.metadata.top_k) == ("topk", 5)
    rows = topk.to_arrow().sort_by("step")
    expected = np.argsort(-np.stack(received["topk"]), axis=1, kind="stable")[:, :5]
    assert np.array_equal(np.sort(np.array(rows.column("natural_topk_ids").to_pylist()), axis=1), np.sort(expected, 1))
    assert rows.column("chosen").to_pylist() == list(outputs["topk"])


def pa_equal(table, generation: int):
    import pyarrow.compute as pc

    return pc.equal(table.column("generation"), generation)
