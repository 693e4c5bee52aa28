"""vLLM's sampling stages, as a run read back computes them, against vLLM's own ``Sampler``.

vLLM's persistent batch (``InputBatch``) and ``Sampler`` run here in-process, as its model runner drives them,
with logitscope's processor among its logits processors. vLLM's ``logprobs_mode`` returns what it sampled
from: ``processed_logits`` (the row after top-k/top-p, all of it with ``logprobs=-1``) and
``processed_logprobs`` (its log-softmax). The run read back must hold those rows as its ``top_p`` and
``sampled`` stages (the penalised row, for a greedy request), and every sampled token must lie in the
sampled stage's support. Needs ``pip install --no-deps -r .ci/engines.txt``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pytest
import torch
from engines_support import import_or_skip

from tracker import Run
from tracker.reading.engine_stages import ENGINE_STAGES

pytestmark = pytest.mark.engines

VOCAB = 4096  # above vllm_sampler.CANDIDATES: top-p sorts only the best tokens where their mass allows
STEPS = 10


@pytest.fixture(scope="module")
def vllm():
    """vLLM's modules (without CUDA, vLLM's unspecified platform claims pinned memory: set to what a CPU has)."""
    torch_utils = import_or_skip("vllm.utils.torch_utils")
    torch_utils.PIN_MEMORY = False
    batch = import_or_skip("vllm.v1.worker.gpu_input_batch")
    batch.PIN_MEMORY = False
    return {
        "params": import_or_skip("vllm").SamplingParams,
        "batch": batch,
        "lp": import_or_skip("vllm.v1.sample.logits_processor"),
        "sampler": import_or_skip("vllm.v1.sample.sampler").Sampler,
    }


class _Config:
    class scheduler_config:  # noqa: N801 - the attribute name vLLM reads
        max_num_seqs = 16

    model_config = None


#: The requests of one batch: penalties, temperature 0.7, min-p, top-k, top-p, seeded, and a greedy one.
REQUESTS = {
    "everything": dict(
        temperature=0.7,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        min_p=0.02,
        top_k=40,
        top_p=0.9,
        seed=1,
    ),
    "min_p": dict(temperature=1.3, min_p=0.1, seed=2),
    "top_k": dict(temperature=0.7, top_k=5, seed=3),
    "top_p": dict(temperature=1.0, top_p=0.6, presence_penalty=-0.5, seed=4),
    "plain": dict(temperature=1.0, repetition_penalty=0.8, seed=5),
    "greedy": dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
}


def _serve(vllm, root, mode: str, *, ties: bool, twins: int = 0) -> tuple[dict, dict, object]:
    """Every request for :data:`STEPS` steps through vLLM's batch and sampler (``logprobs_mode=mode``,
    ``logprobs=-1``: whole rows); what vLLM returned per request and step, and the tracker. ``twins``: each
    request also has a twin recorded in top-k storage (``top_k=twins``), with the same seed and logits."""
    from tracker.recording.engines.vllm import LogitscopeLogitsProcessor

    class Tracked(LogitscopeLogitsProcessor):
        runs = str(root)

    cpu = torch.device("cpu")
    lp = vllm["lp"]
    tracker = Tracked(_Config(), cpu, False)
    builtins = [cls(_Config(), cpu, False) for cls in lp.BUILTIN_LOGITS_PROCESSORS]
    batch = vllm["batch"].InputBatch(
        max_num_reqs=16,
        max_model_len=64,
        max_num_batched_tokens=512,
        device=cpu,
        vocab_size=VOCAB,
        block_sizes=[16],
        max_num_blocks_per_req=[4],
        logitsprocs=lp.LogitsProcessors([*builtins, tracker]),
        logitsprocs_need_output_token_ids=True,
    )
    states = {}
    names = [(name, name, {}) for name in REQUESTS]
    if twins:
        names += [(f"{name}:topk", name, {"storage": "topk", "top_k": twins}) for name in REQUESTS]
    for i, (name, base, storage) in enumerate(names):
        kw = REQUESTS[base]
        options = {"logitscope": {"request_id": name, **storage}}
        params = vllm["params"](max_tokens=STEPS, logprobs=-1, extra_args=options, **kw)
        prompt = [3 + i % len(REQUESTS), 17, 3 + i % len(REQUESTS), 250 + i % len(REQUESTS)]
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        states[name] = vllm["batch"].CachedRequestState(
            req_id=name,
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=params,
            generator=generator,
            block_ids=([i],),
            num_computed_tokens=len(prompt),
            output_token_ids=[],
        )
        batch.add_request(states[name])
    batch.condense()
    batch.refresh_metadata()
    sampler = vllm["sampler"](logprobs_mode=mode)
    rng = torch.Generator().manual_seed(7)
    returned = {name: [] for name, _, _ in names}
    for _ in range(STEPS):
        batch.refresh_metadata()  # as the model runner does before every step: the processors' update_state
        rows = dict(zip(REQUESTS, torch.randn(len(REQUESTS), VOCAB, generator=rng) * 3))
        logits = torch.stack([rows[name.split(":")[0]] for name in batch.req_ids])  # a twin gets its request's
        if ties:  # many equal logits: the tie rules of top-k and top-p decide
            logits = logits.round(decimals=0) + (torch.arange(VOCAB) < 4).float() * 20
        out = sampler(logits, batch.sampling_metadata)
        sampled = out.sampled_token_ids.view(-1).tolist()
        ids = out.logprobs_tensors.logprob_token_ids[:, 1:].long()
        rows = torch.full((batch.num_reqs, VOCAB), float("nan")).scatter_(1, ids, out.logprobs_tensors.logprobs[:, 1:])
        for index, name in enumerate(batch.req_ids):
            returned[name].append((rows[index].numpy().copy(), sampled[index]))
            states[name].output_token_ids.append(sampled[index])
            batch.num_tokens_no_spec[index] += 1
    for name, _, _ in names:
        batch.remove_request(name)
    batch.condense()
    batch.refresh_metadata()
    tracker.flush()
    return returned, states, tracker


def _stages(run: Run) -> dict[str, dict[str, np.ndarray]]:
    ids = {g["request_id"]: g["generation"] for g in run.metadata.generations}
    return {name: run.get_logits(generation=g, include_finished=True) for name, g in ids.items()}


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_the_rows_vllm_sampled_from_are_the_runs_top_p_stage_to_the_bit(vllm, tmp_path, ties):
    returned, states, tracker = _serve(vllm, tmp_path, "processed_logits", ties=ties)
    run = Run.load(tmp_path, run_id=tracker.run_id)
    assert run.metadata.stages == ["natural", *ENGINE_STAGES]
    stages = _stages(run)
    for name, steps in returned.items():
        stage = "penalties" if name == "greedy" else "top_p"  # vLLM returns a greedy request's penalised row
        mine = stages[name][stage]
        theirs = np.stack([row for row, _ in steps])
        assert mine.shape == theirs.shape == (STEPS, VOCAB)
        assert np.array_equal(mine, theirs), (name, np.argwhere(mine != theirs)[:5])
        chosen = [token for _, token in steps]
        assert chosen == states[name].output_token_ids
        support = stages[name]["sampled"] > -np.inf
        assert support[np.arange(STEPS), chosen].all(), name  # every token drawn lies in the sampled support
        if name == "greedy":
            assert (support.sum(axis=1) == 1).all()
        else:
            assert (support == (theirs > -np.inf)).all()
    # the filters did something, each where the request asked for it
    allowed = {name: (s["top_p"] > -np.inf).sum(axis=1) for name, s in stages.items()}
    assert (allowed["top_k"] <= 5 + 30 * ties).all() and (allowed["top_k"] >= 5).all()
    assert (allowed["plain"] == VOCAB).all() and (allowed["everything"] < 40 + 30 * ties).all()
    assert (allowed["min_p"] < VOCAB).all() and (allowed["top_p"] < VOCAB).all()


def test_vllms_processed_logprobs_are_the_sampled_stage_within_float32_rounding(vllm, tmp_path):
    returned, _, tracker = _serve(vllm, tmp_path, "processed_logprobs", ties=False)
    stages = _stages(Run.load(tmp_path, run_id=tracker.run_id))
    for name, steps in returned.items():
        theirs = np.stack([row for row, _ in steps])
        if name == "greedy":  # vLLM reports the penalised row's log-softmax; the token is its argmax
            row = stages[name]["penalties"].astype(np.float64)
            top = row.max(axis=1, keepdims=True)
            mine = row - (top + np.log(np.exp(row - top).sum(axis=1, keepdims=True)))
        else:
            mine = stages[name]["sampled"]
        assert np.array_equal(np.isneginf(mine), np.isneginf(theirs)), name
        finite = np.isfinite(theirs)
        assert np.abs(mine[finite] - theirs[finite]).max() <= 2e-6 * max(1.0, np.abs(theirs[finite]).max()), name


def test_top_k_storage_gives_the_stages_it_can_know_equal_to_full_storage_and_no_others(vllm, tmp_path):
    """Each request has a twin recorded in top-k storage (k=20) with the same logits and seed: where the twin's
    run gives a stage's row, it is the full run's row at the kept tokens, with its whole row's statistics."""
    returned, _, tracker = _serve(vllm, tmp_path, "processed_logits", ties=False, twins=20)
    full = Run.load(tmp_path, run_id=tracker.run_id)
    top = Run.load(tmp_path, run_id=f"{tracker.run_id}-topk20")
    assert top.metadata.stages == ["natural", *ENGINE_STAGES]
    expected = _stages(full)
    table = top.to_arrow()
    ids = {g["request_id"]: g["generation"] for g in top.metadata.generations}
    full_table = full.to_arrow()
    full_ids = {g["request_id"]: g["generation"] for g in full.metadata.generations}
    shown = {}
    for name in REQUESTS:
        assert [t for _, t in returned[f"{name}:topk"]] == [t for _, t in returned[name]]  # the twins agree
        mine = table.filter(pa.compute.equal(table["generation"], ids[f"{name}:topk"])).sort_by("step")
        theirs = full_table.filter(pa.compute.equal(full_table["generation"], full_ids[name])).sort_by("step")
        for stage in ENGINE_STAGES:
            given = mine[f"{stage}_topk_ids"].is_valid().to_numpy(zero_copy_only=False)
            shown[(name, stage)] = int(given.sum())
            kept = np.array(mine[f"{stage}_topk_ids"].to_pylist(), dtype=object)
            for step in np.nonzero(given)[0]:
                at = np.array(kept[step], dtype=np.int64)
                values = np.array(mine[f"{stage}_topk_logits"][step].as_py(), dtype=np.float32)
                assert np.array_equal(values, expected[name][stage][step, at]), (name, stage, step)
                for stat in ("lse", "allowed", "entropy", "p_chosen", "removed_mass"):
                    a, b = mine[f"{stage}_{stat}"][step].as_py(), theirs[f"{stage}_{stat}"][step].as_py()
                    assert a == pytest.approx(b, rel=1e-5, abs=1e-5), (name, stage, step, stat)
    # what top-k storage can know: a greedy request's token, a top-k below the stored k, min-p that cuts the rest
    assert shown[("greedy", "sampled")] == STEPS and shown[("top_k", "sampled")] == STEPS
    assert shown[("top_k", "penalties")] == STEPS and shown[("top_k", "temperature")] == 0  # its rest rescaled
    assert shown[("min_p", "min_p")] > 0 and shown[("everything", "top_p")] > 0
    assert shown[("plain", "sampled")] == 0 and shown[("top_p", "sampled")] == 0  # the whole row is needed
