"""The decode step's fast path (``tracker/recording/hot_path.py``) records exactly what the full path records.

Each scenario drives a tracker the way a host does (transformers' ``(input_ids, scores)``
convention, or logitscope's ``process`` + ``on_sampled``) on fresh random logits and ids, twice:
once as shipped, once with the fast path switched off (the full checks and writes every step).
The two recorded runs must be the same, column for column (values, chosen tokens, steps,
sequences, generations, flags), and every call must raise the same error, or none. The rows are
also compared with the values the host gave, so both paths are checked against the inputs.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from processors import BatchContext, LogitsProcessor, ProcessorList
from tracker import LogitTrackingProcessor
from tracker.recording import hosts
from tracker.recording.recorder import Recorder, SpillWarning

V = 96


def fresh_seed() -> int:
    """A new seed per run (printed in failures), so the inputs are not the same every time."""
    return int(np.random.SeedSequence().entropy % (1 << 32))


class RandomMask(LogitsProcessor):
    """Adds a fixed random bias with a few -inf entries (a new tensor, like most processors)."""

    def __init__(self, seed: int, fail_at: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        bias = rng.normal(size=V).astype(np.float32)
        bias[rng.random(V) < 0.3] = -np.inf
        self.bias = torch.from_numpy(bias)
        self.fail_at = fail_at

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        if self.fail_at is not None and ctx.num_generated == self.fail_at:
            raise RuntimeError(f"refused at step {ctx.num_generated}")
        return logits + self.bias.to(logits.dtype)


class InPlaceScale(LogitsProcessor):
    """Scales the logits it is given in place."""

    inplace = True

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return logits.mul_(0.5)


def random_logits(rng: np.random.Generator, batch: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = rng.normal(scale=3.0, size=(batch, V)).astype(np.float32)
    if rng.random() < 0.25:
        x[rng.integers(batch)] = np.nan  # a NaN row
    if rng.random() < 0.25:
        x[rng.integers(batch), rng.integers(V)] = np.inf
    return torch.from_numpy(x).to(dtype)


class Host:
    """A transformers-style host: grows ``input_ids`` by one random token per step, keeps each call's outcome."""

    def __init__(self, tracker: LogitTrackingProcessor, rng: np.random.Generator) -> None:
        self.tracker, self.rng = tracker, rng
        self.events: list[Any] = []
        self.given: list[tuple[np.ndarray, np.ndarray]] = []  # (natural, constrained) of each recorded step

    def call(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        natural = logits.clone()
        try:
            out = self.tracker(ids, logits)
        except Exception as exc:  # the same error must come from both paths
            self.events.append((type(exc).__name__, str(exc)))
            return
        self.events.append(None)
        self.given.append((natural.float().numpy(), out.float().numpy()))

    def generate(
        self,
        prompt: torch.Tensor,
        steps: int,
        *,
        dtype: torch.dtype = torch.float32,
        strided: bool = False,
        bad_token_at: int | None = None,
    ) -> torch.Tensor:
        ids = prompt
        batch = prompt.shape[0]
        for t in range(steps):
            view = ids
            if strided:  # a view of a wider buffer, as a host with a preallocated ids buffer passes
                wide = torch.zeros(batch, ids.shape[1] + 3, dtype=ids.dtype)
                wide[:, : ids.shape[1]] = ids
                view = wide[:, : ids.shape[1]]
            self.call(view, random_logits(self.rng, batch, dtype))
            token = torch.from_numpy(self.rng.integers(0, V, size=(batch, 1))).to(ids.dtype)
            if bad_token_at == t:
                token[-1, 0] = V + 3  # outside the vocabulary: the next call refuses it
            ids = torch.cat([ids, token], dim=1)
        return ids


def prompt(rng: np.random.Generator, batch: int, length: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.from_numpy(rng.integers(1, V, size=(batch, length))).to(dtype)


def canonical(table: pa.Table) -> dict[str, Any]:
    """Every column as numpy (nulls as a mask, values under them zeroed), for an exact NaN-aware comparison."""
    out: dict[str, Any] = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        if pa.types.is_fixed_size_list(column.type):
            width = column.type.list_size
            values = column.values.slice(column.offset * width, len(column) * width)
            values = values.to_numpy(zero_copy_only=False).reshape(len(column), width).copy()
            values[nulls] = 0
        else:
            fill = False if pa.types.is_boolean(column.type) else 0
            values = column.fill_null(fill).to_numpy(zero_copy_only=False)
        out[name] = (nulls, values)
    return out


def assert_same_runs(fast: dict[str, Any], full: dict[str, Any], seed: int) -> None:
    assert fast["events"] == full["events"], f"seed {seed}"
    assert fast["generations"] == full["generations"], f"seed {seed}"
    assert fast["columns"].keys() == full["columns"].keys(), f"seed {seed}"
    for name, (nulls, values) in fast["columns"].items():
        other_nulls, other_values = full["columns"][name]
        assert np.array_equal(nulls, other_nulls), f"{name}: nulls differ (seed {seed})"
        assert values.dtype == other_values.dtype, f"{name} (seed {seed})"
        same = np.array_equal(values, other_values, equal_nan=values.dtype.kind == "f")
        assert same, f"{name}: values differ (seed {seed})"


def outcome(tracker: LogitTrackingProcessor, events: list[Any]) -> dict[str, Any]:
    run = tracker.run
    generations = [{k: v for k, v in g.items() if k != "started_at"} for g in run.metadata.generations]
    return {"events": events, "generations": generations, "columns": canonical(run.to_arrow())}


class Paths:
    """Runs a scenario with the fast path as shipped, and with it switched off; counts the fast steps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.fast_steps = 0

    def both(self, scenario: Callable[[int], dict[str, Any]], seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        plain_step = Recorder.plain_step

        def counted(recorder: Recorder, *args: Any) -> Any:
            rows = plain_step(recorder, *args)
            self.fast_steps += rows is not None
            return rows

        with self.monkeypatch.context() as m:
            m.setattr(Recorder, "plain_step", counted)
            fast = scenario(seed)
        with self.monkeypatch.context() as m:
            m.setattr(Recorder, "plain_step", lambda recorder, *args: None)
            m.setattr(Recorder, "plain_write", lambda recorder, *args: False)
            m.setattr(Recorder, "plain_chosen", lambda recorder, *args: False)
            m.setattr(hosts, "host_ids", lambda ids: None)
            full = scenario(seed)
        return fast, full


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Paths:
    return Paths(monkeypatch)


def assert_rows_are_the_inputs(tracker: LogitTrackingProcessor, given: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """The recorded natural and constrained rows are the values the host passed and got back, in order."""
    table = tracker.run.to_arrow()
    natural = np.concatenate([n for n, _ in given])
    constrained = np.concatenate([c for _, c in given])
    for stage, expected in (("natural", natural), ("constrained", constrained)):
        got = table.column(f"{stage}_logits").combine_chunks()
        got = got.values.to_numpy(zero_copy_only=False).reshape(len(got), V)
        assert np.array_equal(got, expected, equal_nan=True)


#: Storage modes of a CPU run: float32 rows are copied into the chunk, the others into float32 staging
#: that a background thread stores (``tracker/recording/deferred.py``); both are on the fast path.
STORAGES = ["float32", "float16", "bfloat16", "topk"]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_steady_generation_across_chunks_records_the_same_run(paths, batch, storage):
    def scenario(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        # chunks of three steps (a row takes about 1 kB): every third step takes a new chunk (the full path)
        tracker = LogitTrackingProcessor(
            RandomMask(seed), chunk_bytes=3 * batch * 1000, memory_limit=None, storage=storage, top_k=5
        )
        host = Host(tracker, rng)
        out = host.generate(prompt(rng, batch, 5), 13)
        tracker.finish(out)
        if storage == "float32":
            assert_rows_are_the_inputs(tracker, host.given)
        return outcome(tracker, host.events)

    seed = fresh_seed()
    fast, full = paths.both(scenario, seed)
    assert_same_runs(fast, full, seed)
    assert paths.fast_steps >= 6, "the fast path was not taken"
    chosen = fast["columns"]["chosen"][1]
    assert ((chosen >= 0) & (chosen < V)).all()


@pytest.mark.parametrize("storage", STORAGES)
def test_new_sequences_batch_changes_clear_and_ids_that_do_not_continue(paths, storage):
    def scenario(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        tracker = LogitTrackingProcessor(RandomMask(seed), memory_limit=None, storage=storage, top_k=5)
        host = Host(tracker, rng)
        ids = host.generate(prompt(rng, 2, 4), 5)
        host.generate(prompt(rng, 2, 4), 3)  # a new sequence (no finish between)
        host.generate(prompt(rng, 3, 6), 4)  # a batch change
        changed = ids.clone()
        changed[0, 1] = (changed[0, 1] + 1) % V  # one token longer than the last input but its first columns differ
        host.call(changed, random_logits(rng, 2))
        host.call(changed, random_logits(rng, 2))  # the same input again: not the next step
        skipped = torch.cat([changed, prompt(rng, 2, 2)], dim=1)  # two tokens longer
        host.call(skipped, random_logits(rng, 2))
        tracker.clear()  # between generations
        out = host.generate(prompt(rng, 1, 3), 6)
        tracker.finish(out)
        host.generate(prompt(rng, 1, 3), 4)  # the last generation's chosen tokens are never told
        return outcome(tracker, host.events)

    seed = fresh_seed()
    fast, full = paths.both(scenario, seed)
    assert_same_runs(fast, full, seed)
    assert paths.fast_steps > 10
    assert len(fast["generations"]) == 2  # after clear(): the two generations recorded since


@pytest.mark.parametrize("storage", STORAGES)
def test_a_processor_that_raises_and_out_of_range_ids_give_the_same_errors(paths, storage):
    def scenario(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        tracker = LogitTrackingProcessor(RandomMask(seed, fail_at=3), memory_limit=None, storage=storage, top_k=5)
        host = Host(tracker, rng)
        host.generate(prompt(rng, 2, 4), 6)  # raises at step 3; the steps after it go on
        tracker.reset()
        host.generate(prompt(rng, 2, 4), 3, bad_token_at=1)  # step 2's input holds an id outside the vocabulary
        return outcome(tracker, host.events)

    seed = fresh_seed()
    fast, full = paths.both(scenario, seed)
    assert_same_runs(fast, full, seed)
    errors = [e for e in fast["events"] if e is not None]
    assert [name for name, _ in errors] == ["ProcessorError", "ValueError"]
    assert "outside the vocabulary" in errors[-1][1]
    assert fast["columns"]["processor_error"][1].any()


@pytest.mark.parametrize("storage", ["float32", "float16", "topk"])
@pytest.mark.parametrize(
    "variant", ["int32 ids", "strided ids", "float64 logits", "float16 logits", "in-place processor", "stages"]
)
def test_inputs_the_fast_path_leaves_to_the_full_path_record_the_same_run(paths, variant, storage):
    def scenario(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        processor: Any = RandomMask(seed)
        options: dict[str, Any] = {}
        if variant == "in-place processor":
            processor = InPlaceScale()
        elif variant == "stages":
            processor, options = ProcessorList([RandomMask(seed), InPlaceScale()]), {"processor_stages": True}
        tracker = LogitTrackingProcessor(processor, memory_limit=None, storage=storage, top_k=5, **options)
        host = Host(tracker, rng)
        ids_type = torch.int32 if variant == "int32 ids" else torch.int64
        dtype = {"float64 logits": torch.float64, "float16 logits": torch.float16}.get(variant, torch.float32)
        out = host.generate(prompt(rng, 2, 4, ids_type), 7, dtype=dtype, strided=variant == "strided ids")
        tracker.finish(out)
        return outcome(tracker, host.events)

    seed = fresh_seed()
    fast, full = paths.both(scenario, seed)
    assert_same_runs(fast, full, seed)


def test_a_host_that_tells_the_tokens_records_the_same_run(paths):
    """logitscope's Generator convention: ``process`` with a context, ``on_sampled`` after each step, a tap."""

    def scenario(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        tracker = LogitTrackingProcessor(RandomMask(seed), memory_limit=None)
        tracker.add_stage("sampled")
        events: list[Any] = []
        ids = prompt(rng, 2, 3)
        for t in range(6):
            logits = random_logits(rng, 2)
            ctx = BatchContext(input_ids=ids, prompt_length=3)
            out = tracker.process(logits, ctx)
            tracker.sample_tap(torch.softmax(out.nan_to_num(0.0), dim=-1))
            tokens = torch.from_numpy(rng.integers(0, V, size=2))
            if t == 3:  # an id outside the vocabulary is refused, then the host tells the right ones
                try:
                    tracker.on_sampled(torch.tensor([1, V + 2]), ctx)
                except ValueError as exc:
                    events.append(str(exc))
            tracker.on_sampled(tokens if t % 2 else tokens.to(torch.int32)[:, None], ctx)
            ids = torch.cat([ids, tokens[:, None]], dim=1)
            events.append(None)
        tracker.finish()
        return outcome(tracker, events)

    seed = fresh_seed()
    fast, full = paths.both(scenario, seed)
    assert_same_runs(fast, full, seed)
    assert paths.fast_steps == 5  # every step but the first (which makes the first chunk)
    assert "on_sampled (generation 0, step 3): chosen token of row 1" in fast["events"][3]
    assert fast["columns"]["chosen"][1].tolist() == full["columns"]["chosen"][1].tolist()


def test_threads_sharing_a_tracker_record_each_generation_as_given(paths):
    """Two threads, each with a copy of the tracker (one shared recording), generate at once: every
    generation's rows are the ones its thread gave, in order, on both paths."""

    def scenario(seed: int) -> dict[str, Any]:
        tracker = LogitTrackingProcessor(RandomMask(seed), chunk_bytes=5 * 1000, memory_limit=None)
        given: dict[int, list[np.ndarray]] = {}

        def work(index: int) -> None:
            rng = np.random.default_rng([seed, index])
            mine = copy.deepcopy(tracker)
            host = Host(mine, rng)
            out = host.generate(prompt(rng, 1, 2 + index), 40)
            mine.finish(out)
            given[index] = [n for n, _ in host.given]
            assert host.events == [None] * 40

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(work, range(2)))  # an error on a thread is raised here
        table = tracker.run.to_arrow()
        prompts = {len(g["prompt_ids"][0]) - 2: g["generation"] for g in tracker.run.metadata.generations}
        for index, rows in given.items():
            mine = table.filter(pa.compute.equal(table.column("generation"), prompts[index]))
            assert mine.column("step").to_pylist() == list(range(40))
            got = mine.column("natural_logits").combine_chunks()
            got = got.values.to_numpy(zero_copy_only=False).reshape(len(got), V)
            assert np.array_equal(got, np.concatenate(rows), equal_nan=True), f"seed {seed}, thread {index}"
        return {"events": [], "generations": [], "columns": {}}

    seed = fresh_seed()
    paths.both(scenario, seed)
    assert paths.fast_steps > 40


def test_a_run_that_spills_to_disk_records_the_same_run(paths, tmp_path):
    """Past the memory bound finished chunks go to disk while the generation goes on: the last step's chosen
    tokens then land in a chunk that may be on its way there (the full path's case)."""
    spilled: list[int] = []

    def scenario(seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        folder = tmp_path / f"spill{len(spilled)}"
        tracker = LogitTrackingProcessor(RandomMask(seed), memory_limit=0, chunk_bytes=3 * 2 * 1000, spill_dir=folder)
        host = Host(tracker, rng)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SpillWarning)  # said once per run: spilling is what is tested here
            out = host.generate(prompt(rng, 2, 4), 12)
            tracker.finish(out)
            host.generate(prompt(rng, 2, 5), 7)
        tracker.recorder.flush()
        spilled.append(tracker.recorder.chunks_spilled)
        assert_rows_are_the_inputs(tracker, host.given)
        return outcome(tracker, host.events)

    seed = fresh_seed()
    fast, full = paths.both(scenario, seed)
    assert_same_runs(fast, full, seed)
    assert min(spilled) > 0 and paths.fast_steps > 6
