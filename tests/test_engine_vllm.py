"""logitscope inside vLLM V1, driven by vLLM's own persistent batch (``InputBatch``), its ``BatchUpdateBuilder``,
its built-in logits processors and its ``Sampler``, as its GPU model runner drives them.

Needs ``pip install --no-deps -r .ci/engines.txt``; a test skips only when a vLLM module cannot be imported here,
naming it. vLLM's imports are slow (about a minute on two cores), hence the ``engines`` marker.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from engines_support import import_or_skip
from test_tracker_support import byte_tokenizer

from tracker import Run
from tracker.format.dataset import list_runs
from tracker.reading.block import stage_matrix

pytestmark = pytest.mark.engines

VOCAB = 320


@pytest.fixture(scope="module")
def vllm():
    """vLLM's modules; without CUDA, vLLM's unspecified platform claims pinned memory, which torch refuses on a
    CPU: the flag is set to what this machine has before the batch code reads it."""
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
    """The part of a VllmConfig vLLM's built-in processors read."""

    class scheduler_config:  # noqa: N801 - the attribute name vLLM reads
        max_num_seqs = 8

    model_config = None


def _processor_class(root):
    from tracker.recording.engines.vllm import LogitscopeLogitsProcessor

    class Tracked(LogitscopeLogitsProcessor):
        runs = str(root)
        tokenizer = byte_tokenizer(VOCAB)

    return Tracked


class Server:
    """vLLM's persistent batch and sampler, stepped as ``GPUModelRunner`` steps them (synchronous scheduling)."""

    def __init__(self, vllm, root, *, seed: int) -> None:
        lp = vllm["lp"]
        cpu = torch.device("cpu")
        self.tracker = _processor_class(root)(_Config(), cpu, False)
        builtins = [cls(_Config(), cpu, False) for cls in lp.BUILTIN_LOGITS_PROCESSORS]
        self.batch = vllm["batch"].InputBatch(
            max_num_reqs=8,
            max_model_len=64,
            max_num_batched_tokens=512,
            device=cpu,
            vocab_size=VOCAB,
            block_sizes=[16],
            max_num_blocks_per_req=[4],
            logitsprocs=lp.LogitsProcessors([*builtins, self.tracker]),
            logitsprocs_need_output_token_ids=True,
        )
        self.sampler = vllm["sampler"]()
        self.state_cls = vllm["batch"].CachedRequestState
        self.states: dict[str, object] = {}
        self.rng = torch.Generator().manual_seed(seed)
        self.received: dict[str, list[np.ndarray]] = {}  # what each request's row held when the tracker ran
        self.sampled: dict[str, list[int]] = {}

    def add(self, req_id: str, params, prompt: list[int]) -> None:
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        state = self.state_cls(
            req_id=req_id,
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=params,
            generator=generator,
            block_ids=([len(self.states)],),
            num_computed_tokens=len(prompt),
            output_token_ids=[],
        )
        self.states[req_id] = state
        self.batch.add_request(state)
        self.received[req_id], self.sampled[req_id] = [], []

    def step(self, finished: list[str], new: list[tuple[str, object, list[int]]], swap: tuple[int, int] | None):
        for req_id in finished:
            self.batch.remove_request(req_id)
        for req_id, params, prompt in new:
            self.add(req_id, params, prompt)
        self.batch.condense()
        if swap is not None and max(swap) < self.batch.num_reqs:
            self.batch.swap_states(*swap)
        self.batch.refresh_metadata()
        n = self.batch.num_reqs
        logits = torch.randn(n, VOCAB, generator=self.rng) * 3
        expected = self._received(logits)
        sampled = self.sampler(logits, self.batch.sampling_metadata).sampled_token_ids.view(-1).tolist()
        for index, req_id in enumerate(self.batch.req_ids):
            self.received[req_id].append(expected[index])
            self.sampled[req_id].append(sampled[index])
            self.states[req_id].output_token_ids.append(sampled[index])  # what the runner does after sampling
            self.batch.num_tokens_no_spec[index] += 1

    def _received(self, logits: torch.Tensor) -> np.ndarray:
        """The rows as the tracker must see them: the model's logits after vLLM's min-tokens and logit-bias
        processors (the ones before it in the sampler's order), computed here from the requests' parameters."""
        rows = logits.clone()
        for index, req_id in enumerate(self.batch.req_ids):
            params = self.states[req_id].sampling_params
            outputs = self.states[req_id].output_token_ids
            if params.min_tokens and len(outputs) < params.min_tokens:
                for token in params.all_stop_token_ids:
                    rows[index, token] = float("-inf")
            for token, bias in (params.logit_bias or {}).items():
                rows[index, token] += bias
        return rows.numpy().copy()


def _requests(params_cls):
    """Six requests: seeded sampling, greedy, logit bias with min tokens, tracking off, no extra_args, top-k."""

    def p(request_id, track=True, **kw):
        extra = {"logitscope": {"request_id": request_id, "storage": "float32"} if track else False}
        return params_cls(extra_args=extra if track is not None else None, **kw)

    return {
        "seeded": p("seeded", temperature=0.9, seed=11, max_tokens=9),
        "greedy": p("greedy", temperature=0.0, max_tokens=4),  # finishes early
        "biased": p(
            "biased",
            temperature=0.7,
            top_p=0.9,
            logit_bias={5: 4.0, 17: -2.5},
            min_tokens=3,
            stop_token_ids=[0],
            max_tokens=10,
        ),
        "off": p("off", track=False, temperature=1.0, max_tokens=5),  # finishes early, not tracked
        "plain": p("plain", track=None, temperature=1.0, max_tokens=20),
        "late": p("late", temperature=1.2, top_k=40, seed=5, max_tokens=20),
    }


def _serve(vllm, root, seed=0):
    """Six requests over twelve steps: arrivals, early finishes, condensing moves, a swap, a reused row."""
    server = Server(vllm, root, seed=seed)
    params = _requests(vllm["params"])
    arrivals = {0: ["seeded", "greedy", "off"], 1: ["biased"], 3: ["plain"], 6: ["late"]}
    swaps = {8: (0, 1)}
    for step in range(12):
        finished = [
            r
            for r, s in server.states.items()
            if r in server.batch.req_id_to_index and len(s.output_token_ids) >= params[r].max_tokens
        ]
        new = [(r, params[r], [1 + i, 2 + 3 * i, 7]) for i, r in enumerate(arrivals.get(step, []))]
        server.step(finished, new, swaps.get(step))
    for req_id in list(server.batch.req_id_to_index):  # the server drains: every request leaves the batch
        server.batch.remove_request(req_id)
    server.batch.condense()
    server.batch.refresh_metadata()
    server.tracker.flush()
    return server


def _by_request(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each request's (steps, chosen, natural logits) from the run, found by the request_id it gave."""
    table = run.to_arrow()
    ids = {g["generation"]: g["request_id"] for g in run.metadata.generations}
    out = {}
    generation = table.column("generation").to_numpy()
    for gid, request_id in ids.items():
        rows = table.filter(generation == gid)
        order = np.argsort(rows.column("step").to_numpy(), kind="stable")
        batch = rows.take(order).combine_chunks().to_batches()[0]
        out[request_id] = (
            batch.column("step").to_numpy(),
            batch.column("chosen").fill_null(-1).to_numpy(),
            stage_matrix(batch, "natural", run.metadata.vocab_size),
        )
    return out


def test_each_tracked_request_records_what_its_row_received_and_what_was_sampled(vllm, tmp_path):
    server = _serve(vllm, tmp_path)
    run = Run.load(tmp_path, run_id=server.tracker.run_id)
    recorded = _by_request(run)
    assert sorted(recorded) == ["biased", "greedy", "late", "seeded"]  # "off" and "plain" never asked
    for request_id, (steps, chosen, natural) in recorded.items():
        received = np.stack(server.received[request_id])
        assert steps.tolist() == list(range(len(received)))
        assert natural.dtype == np.float32
        assert np.array_equal(natural.view(np.int32), received.view(np.int32)), request_id  # bit for bit
        assert chosen.tolist() == server.sampled[request_id], request_id  # the last token included
    # the greedy request took the argmax of what it received; the biased one got its bias at every step
    greedy = np.stack(server.received["greedy"])
    assert server.sampled["greedy"] == greedy.argmax(axis=1).tolist()
    assert len(server.sampled["greedy"]) == 4 and len(server.sampled["seeded"]) == 9
    biased = recorded["biased"][2]
    assert np.isneginf(biased[:3, 0]).all() and np.isfinite(biased[3:, 0]).all()  # min_tokens held EOS off


def test_each_finished_request_is_its_own_part_read_while_the_server_runs(vllm, tmp_path):
    server = Server(vllm, tmp_path, seed=1)
    params = _requests(vllm["params"])
    server.step([], [("greedy", params["greedy"], [3, 4]), ("late", params["late"], [5])], None)
    for _ in range(params["greedy"].max_tokens - 1):
        server.step([], [], None)
    server.step(["greedy"], [("seeded", params["seeded"], [9, 9])], None)  # "seeded" takes greedy's row
    server.tracker.flush()
    [entry] = list_runs(tmp_path)  # committed, and listed (the dashboard's run browser) while the server runs
    assert entry.run_id == server.tracker.run_id and entry.summary["generations"] == 1
    so_far = Run.load(tmp_path)
    assert [g["request_id"] for g in so_far.metadata.generations] == ["greedy"]
    assert so_far.metadata.generations[0]["prompt_ids"] == [[3, 4]]
    assert so_far.metadata.generations[0]["lengths"] == [4]
    assert _by_request(so_far)["greedy"][1].tolist() == server.sampled["greedy"]
    for _ in range(3):
        server.step([], [], None)
    for req_id in ("late", "seeded"):
        server.batch.remove_request(req_id)
    server.batch.condense()
    server.batch.refresh_metadata()
    server.tracker.flush()
    [entry] = list_runs(tmp_path)  # the run grew: its commits name every part so far
    assert entry.summary["generations"] == 3
    recorded = _by_request(Run.load(tmp_path))
    for request_id in ("greedy", "late", "seeded"):
        received = np.stack(server.received[request_id])
        assert np.array_equal(recorded[request_id][2].view(np.int32), received.view(np.int32))
        assert recorded[request_id][1].tolist() == server.sampled[request_id]


def test_vllm_loads_it_by_name_and_never_skips_it_for_greedy_requests(vllm):
    lp = vllm["lp"]
    from tracker.recording.engines.vllm import LogitscopeLogitsProcessor

    loaded = lp._load_logitsprocs_by_fqcns(["tracker.recording.engines.vllm:LogitscopeLogitsProcessor"])
    assert loaded == [LogitscopeLogitsProcessor]
    instance = LogitscopeLogitsProcessor(None, torch.device("cpu"), False)
    assert instance in list(lp.LogitsProcessors([instance]).non_argmax_invariant)
    logits = torch.randn(3, 11)
    assert instance.apply(logits) is logits  # nothing tracked: untouched, no copy


def test_malformed_tracking_options_are_refused_with_the_key_named(vllm):
    from tracker.recording.engines.vllm import LogitscopeLogitsProcessor

    params = vllm["params"]
    LogitscopeLogitsProcessor.validate_params(params(extra_args={"logitscope": {"storage": "topk", "top_k": 5}}))
    LogitscopeLogitsProcessor.validate_params(params())
    with pytest.raises(ValueError, match=r"\['storage'\] must be one of .* got 'fp8'"):
        LogitscopeLogitsProcessor.validate_params(params(extra_args={"logitscope": {"storage": "fp8"}}))
    with pytest.raises(ValueError, match=r"unknown keys \['k'\]"):
        LogitscopeLogitsProcessor.validate_params(params(extra_args={"logitscope": {"k": 5}}))
    with pytest.raises(ValueError, match=r"\['top_k'\] must be an int >= 1, got 0"):
        LogitscopeLogitsProcessor.validate_params(params(extra_args={"logitscope": {"top_k": 0}}))


def test_per_request_callables_run_inside_vllms_adapter_logits_processor(vllm):
    """vLLM V1 still calls the per-request form ``(prompt_ids, output_ids, logits) -> logits`` through its
    ``AdapterLogitsProcessor``: ``processors.to_vllm(tracker)`` is that form, one callable per request."""
    from processors import to_vllm
    from tracker import LogitTrackingProcessor

    lp = vllm["lp"]
    tracker = LogitTrackingProcessor(None, storage="float32")

    class PerRequestTracking(lp.AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            return to_vllm(tracker, with_prompt=True) if (params.extra_args or {}).get("logitscope") else None

    processor = PerRequestTracking(_Config(), torch.device("cpu"), False)
    builder = lp.BatchUpdateBuilder()
    params = vllm["params"]
    outputs = {"a": [], "b": [], "c": []}
    builder.added += [
        (0, params(extra_args={"logitscope": True}), [1, 2, 3], outputs["a"]),
        (1, params(), [4], outputs["b"]),  # not tracked
        (2, params(extra_args={"logitscope": True}), [5, 6], outputs["c"]),
    ]
    rows, received = ["a", "b", "c"], {"a": [], "c": []}
    rng = torch.Generator().manual_seed(2)
    for step in range(5):
        if step == 3:  # "a" leaves; "c" is moved down into its row, as condense() does
            builder.removed_append(0)
            builder.moved.append((2, 0, lp.MoveDirectionality.UNIDIRECTIONAL))
            rows = ["c", "b"]
        processor.update_state(builder.get_and_reset(len(rows)))
        logits = torch.randn(len(rows), VOCAB, generator=rng)
        for index, name in enumerate(rows):
            if name in received:
                received[name].append(logits[index].numpy().copy())
        sampled = processor.apply(logits).argmax(dim=1).tolist()
        for index, name in enumerate(rows):
            outputs[name].append(sampled[index])
    table = tracker.run.to_arrow()
    generations = table.column("generation").to_numpy()
    for gid, name in enumerate(["a", "c"]):
        batch = table.filter(generations == gid).combine_chunks().to_batches()[0]
        natural = stage_matrix(batch, "natural", VOCAB)
        assert np.array_equal(natural.view(np.int32), np.stack(received[name]).view(np.int32))
        chosen = batch.column("chosen").fill_null(-1).to_numpy().tolist()
        # each step's token is read from the next call's output ids; nothing calls the callable after the last
        assert chosen == outputs[name][: len(chosen) - 1] + [-1]


def test_http_clients_switch_tracking_with_numbers_and_json_text():
    """vLLM's HTTP ``vllm_xargs`` carry strings and numbers only: 1/0 and an object's JSON text work too."""
    from tracker.recording.engines.requests import RequestOptions

    assert RequestOptions.parse(1, "float32", 20, "x").storage == "float32"
    assert RequestOptions.parse(0, "float32", 20, "x") is None
    parsed = RequestOptions.parse('{"storage": "topk", "top_k": 7, "title": "t"}', "float32", 20, "x")
    assert (parsed.storage, parsed.top_k, parsed.title) == ("topk", 7, "t")
    with pytest.raises(ValueError, match="is a string but not JSON"):
        RequestOptions.parse("topk", "float32", 20, "x")
    with pytest.raises(ValueError, match=r"must be true/1, false/0, or an object .* got 2"):
        RequestOptions.parse(2, "float32", 20, "x")


def test_a_request_asking_for_topk_gets_its_own_run_and_an_unwritten_last_token_stays_unknown(vllm, tmp_path):
    """Built from vLLM's ``BatchUpdateBuilder``; the second request's output ids end in vLLM's placeholder -1,
    as they do under asynchronous scheduling when a request leaves the batch."""
    lp = vllm["lp"]
    tracker = _processor_class(tmp_path)(_Config(), torch.device("cpu"), False)
    params = vllm["params"]
    builder = lp.BatchUpdateBuilder()
    full, top = [], []
    builder.added += [
        (0, params(extra_args={"logitscope": True}), [1], full),
        (1, params(extra_args={"logitscope": '{"storage": "topk", "top_k": 5}'}), [2], top),
    ]
    rng = torch.Generator().manual_seed(4)
    received = []
    for _ in range(3):
        tracker.update_state(builder.get_and_reset(2))
        logits = torch.randn(2, VOCAB, generator=rng)
        received.append(logits.numpy().copy())
        sampled = tracker.apply(logits).argmax(dim=1).tolist()
        full.append(sampled[0])
        top.append(-1)  # asynchronous scheduling: a placeholder, repaired by vLLM before the next step's apply
        if len(top) < 3:  # the last one is never repaired: the request leaves first
            top[-1] = sampled[1]
    builder.removed_append(0)
    builder.removed_append(1)
    tracker.update_state(builder.get_and_reset(0))
    tracker.flush()
    assert sorted(e.run_id for e in list_runs(tmp_path)) == [tracker.run_id, f"{tracker.run_id}-topk5"]
    topk = Run.load(tmp_path, run_id=f"{tracker.run_id}-topk5")
    assert (topk.metadata.storage, topk.metadata.top_k) == ("topk", 5)
    table = topk.to_arrow()
    assert table.column("chosen").fill_null(-1).to_pylist() == [top[0], top[1], -1]
    ids = np.array(table.column("natural_topk_ids").to_pylist())
    values = np.array(table.column("natural_topk_logits").to_pylist(), dtype=np.float32)
    rows = np.stack(received)[:, 1]
    expected = np.argsort(-rows, axis=1, kind="stable")[:, :5]
    assert np.array_equal(np.sort(ids, axis=1), np.sort(expected, axis=1))  # the five best of what it received
    assert np.array_equal(values, np.take_along_axis(rows, ids, axis=1))  # with their values, bit for bit
    whole = Run.load(tmp_path, run_id=tracker.run_id).to_arrow()
    assert whole.column("chosen").to_pylist() == full


def test_an_idle_checkpoint_whose_part_is_written_after_the_engine_stepped_again_loses_no_chosen_token(vllm, tmp_path):
    """The idle watch asks for a running request's rows to be written; the writer's thread takes them a moment
    later, when the engine may already have recorded its next step, whose token is not sampled yet. That row
    waits for its token and goes into a later part; every step reads back with the token vLLM sampled."""
    lp, params = vllm["lp"], vllm["params"]
    tracker = _processor_class(tmp_path)(_Config(), torch.device("cpu"), False)
    recording = tracker.recording
    builder, rng = lp.BatchUpdateBuilder(), torch.Generator().manual_seed(8)
    outputs: list[int] = []
    builder.added.append((0, params(extra_args={"logitscope": {"request_id": "paused"}}), [1, 2], outputs))
    received = []
    for step in range(6):
        tracker.update_state(builder.get_and_reset(1))
        logits = torch.randn(1, VOCAB, generator=rng)
        received.append(logits.numpy().copy())
        sampled = tracker.apply(logits).argmax(dim=1).tolist()
        if step in (1, 3):  # the engine stepped again before the writer took the idle checkpoint's rows
            recording.writer.checkpoint([(recording._recorders[r.options.key], r) for r in recording.writer.live()])
            recording.writer.flush()
        outputs.append(sampled[0])
    builder.removed_append(0)
    tracker.update_state(builder.get_and_reset(0))
    tracker.flush()
    assert recording.writer.table.parts_committed >= 3  # the two checkpoints' parts and the end's
    steps, chosen, natural = _by_request(Run.load(tmp_path, run_id=tracker.run_id))["paused"]
    assert steps.tolist() == list(range(6))
    assert chosen.tolist() == outputs
    assert np.array_equal(natural, np.concatenate(received))
    tracker.close()


def _wave(tracker, builder, params_cls, rows: int, steps: int, rng, extra=True):
    """``rows`` tracked requests join, run ``steps`` steps and leave; their sampled ids, by request."""
    outputs = [[] for _ in range(rows)]
    for i in range(rows):
        builder.added.append((i, params_cls(extra_args={"logitscope": True} if extra else None), [1, 2], outputs[i]))
    for _ in range(steps):
        tracker.update_state(builder.get_and_reset(rows))
        sampled = tracker.apply(torch.randn(rows, VOCAB, generator=rng)).argmax(dim=1).tolist()
        for i in range(rows):
            outputs[i].append(sampled[i])
    for i in range(rows):
        builder.removed_append(i)
    return outputs


def test_a_thousand_short_requests_leave_the_thread_count_and_memory_where_they_were(vllm, tmp_path):
    lp, params = vllm["lp"], vllm["params"]
    before = set(threading.enumerate())
    tracker = _processor_class(tmp_path)(_Config(), torch.device("cpu"), False)
    builder, rng = lp.BatchUpdateBuilder(), torch.Generator().manual_seed(3)
    for _ in range(20):
        _wave(tracker, builder, params, rows=50, steps=3, rng=rng)
    tracker.update_state(builder.get_and_reset(0))
    tracker.flush()
    started = set(threading.enumerate()) - before
    assert len(started) <= 3, started  # the writers (rows out, table commits) and the idle watch, whatever the requests
    assert tracker.recording.bound.used() == 0  # every request written, its rows given back
    tracker.close()
    assert not [t for t in started if t.is_alive()], "a thread outlived close()"
    run = Run.load(tmp_path, run_id=tracker.run_id)
    assert len(run.metadata.generations) == 1000 and run.num_rows == 3000


def test_256_concurrent_tracked_requests_stay_within_one_memory_bound_and_every_row_is_written_once(vllm, tmp_path):
    """A 4 MiB bound for every request together (a step of 256 float32 rows is 330 KB): the oldest rows are
    written early as further parts of their requests; each request reads back whole, bit for bit."""
    lp, params = vllm["lp"], vllm["params"]

    class Bounded(_processor_class(tmp_path)):
        memory_limit = 4 << 20

    tracker = Bounded(_Config(), torch.device("cpu"), False)
    builder, rng = lp.BatchUpdateBuilder(), torch.Generator().manual_seed(5)
    rows, steps = 256, 24
    outputs = [[] for _ in range(rows)]
    for i in range(rows):
        builder.added.append((i, params(extra_args={"logitscope": {"request_id": str(i)}}), [1], outputs[i]))
    received, held = [], []
    for _ in range(steps):
        tracker.update_state(builder.get_and_reset(rows))
        logits = torch.randn(rows, VOCAB, generator=rng)
        received.append(logits.numpy().copy())
        sampled = tracker.apply(logits).argmax(dim=1).tolist()
        held.append(tracker.recording.bound.used())
        for i in range(rows):
            outputs[i].append(sampled[i])
    for i in range(rows):
        builder.removed_append(i)
    tracker.update_state(builder.get_and_reset(0))
    tracker.flush()
    assert max(held) <= 4 << 20, f"rows held {max(held):,} bytes, over the bound"
    assert tracker.recording.writer.table.parts_committed > rows  # written early: several parts per request
    recorded = _by_request(Run.load(tmp_path, run_id=tracker.run_id))
    assert len(recorded) == rows
    for i in (0, 17, 255):
        request_steps, chosen, natural = recorded[str(i)]
        assert request_steps.tolist() == list(range(steps)) and chosen.tolist() == outputs[i]
        assert np.array_equal(natural, np.stack(received)[:, i])
    tracker.close()
