"""Tracking at scale: linear spilling, exact statistics in every storage mode, queries inside the
memory bound, non-finite logits, and temporary spill folders."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tracker_support import MaskThird, json_from_a_fresh_process

from processors import LogitsProcessor
from sampling import Generator, SamplingParams
from tracker import LogitTrackingProcessor
from tracker.format.spill import remove_stale_spill_folders, temporary_spill_folder
from tracker.recording.recorder import Recorder, SpillWarning, Storage

CPU = torch.device("cpu")


def fill(recorder: Recorder, steps: int, batch: int, vocab: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in range(steps):
        rows = recorder.begin_step(0, t, batch, vocab, CPU)
        x = torch.randn(batch, vocab, generator=gen)
        recorder.write(rows, "natural", x)
        recorder.set_chosen(rows, x.argmax(1))
    recorder.end_generation(0)


# ---------------------------------------------------------------- spilling


@pytest.mark.parametrize("steps", [200, 400])
def test_each_spilled_chunk_is_written_once_and_spilled_bytes_is_what_is_on_disk(tmp_path, steps):
    recorder = Recorder(
        Storage.parse("float32"),
        ["natural"],
        chunk_bytes=16 << 10,
        memory_limit=64 << 10,
        spill_dir=tmp_path,
        run_id="r",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fill(recorder, steps, batch=2, vocab=256)
        recorder.flush()
    files = sorted((tmp_path / "r").glob("chunk-*.arrow"))
    assert recorder.chunk_writes == len(files) == recorder.chunks_spilled
    assert recorder.chunks_spilled >= len(recorder._chunks) - 6  # all but the last few chunks left memory
    assert recorder.spilled_bytes == sum(f.stat().st_size for f in files)
    per_row = recorder.storage.row_bytes(recorder.stages, 256)
    assert recorder.spilled_bytes < 2 * steps * 2 * per_row  # linear: about the run's size, no rewrites
    assert recorder.host_bytes <= (64 << 10) + 2 * (16 << 10)
    notices = [w for w in caught if issubclass(w.category, SpillWarning)]
    assert len(notices) == 1, [str(w.message) for w in notices]
    text = str(notices[0].message)
    assert "MB/s" in text and "storage='bfloat16'" in text and "storage='topk'" in text
    table = recorder.batches()
    assert sum(b.num_rows for b in table) == steps * 2


def test_a_full_spill_queue_makes_recording_wait_for_the_disk_not_fail(tmp_path, slow_disk):
    slow_disk(0.02)
    recorder = Recorder(
        Storage.parse("float32"),
        ["natural"],
        chunk_bytes=8 << 10,
        memory_limit=0,
        spill_dir=tmp_path,
        run_id="r",
        spill_queue=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        fill(recorder, 60, batch=1, vocab=512)
        recorder.flush()
    assert recorder.chunk_writes == len(list((tmp_path / "r").glob("chunk-*.arrow")))
    got = np.concatenate([b.column("chosen").to_numpy() for b in recorder.batches()])
    assert got.shape == (60,)


def test_rows_on_their_way_to_a_slow_disk_stay_within_the_memory_bound(tmp_path, slow_disk):
    slow_disk(0.02)
    bound = 256 << 10
    recorder = Recorder(
        Storage.parse("float32"),
        ["natural"],
        chunk_bytes=16 << 10,
        memory_limit=bound,
        spill_dir=tmp_path,
        run_id="r",
    )
    gen = torch.Generator().manual_seed(3)
    held = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for t in range(300):
            rows = recorder.begin_step(0, t, 2, 1024, CPU)
            x = torch.randn(2, 1024, generator=gen)
            recorder.write(rows, "natural", x)
            recorder.set_chosen(rows, x.argmax(1))
            held.append(recorder.host_bytes)  # chunks queued for the disk are still in memory: counted
        recorder.flush()
    assert recorder.chunk_writes > 10, "the run should have spilled"
    assert max(held) <= bound, f"rows in memory reached {max(held):,} bytes, over the bound of {bound:,}"
    assert sum(b.num_rows for b in recorder.batches()) == 600  # every row kept, in memory or on disk


# ---------------------------------------------------------------- exact statistics in every mode


def drive(tracker: LogitTrackingProcessor, logits: torch.Tensor, convention: str) -> torch.Tensor:
    """Feed ``logits [T, B, V]`` step by step; chosen tokens by on_sampled or via the next input_ids."""
    steps, batch, _ = logits.shape
    ids = torch.ones(batch, 3, dtype=torch.long)
    gen = torch.Generator().manual_seed(5)
    for t in range(steps):
        out = tracker(ids, logits[t].clone())
        token = torch.multinomial(torch.softmax(out, 1), 1, generator=gen)[:, 0]
        if convention == "on_sampled":
            tracker.on_sampled(token, None)
        ids = torch.cat([ids, token[:, None]], 1)
    tracker.finish(ids)
    return ids[:, 3:]


@pytest.mark.parametrize("convention", ["on_sampled", "input_ids"])
@pytest.mark.parametrize("storage", ["topk", "bfloat16", "float16"])
def test_reduced_storage_gives_the_statistics_of_a_float32_run_of_the_same_generation(storage, convention):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 2, 300, generator=gen) * 3
    logits[:, :, 7] -= 2.0  # EOS stays unlikely
    full = LogitTrackingProcessor(MaskThird(), storage="float32", eos_token_id=7)
    small = LogitTrackingProcessor(MaskThird(), storage=storage, top_k=4, eos_token_id=7)
    chosen = drive(full, logits, convention)
    assert torch.equal(drive(small, logits, convention), chosen)
    for s in (0, 1):
        a, b = full.stats(sequence=s, include_finished=True), small.stats(sequence=s, include_finished=True)
        for column in a.columns:
            if a[column].dtype.kind == "f":
                np.testing.assert_allclose(b[column], a[column], rtol=1e-5, atol=1e-6, err_msg=column)
        # ... and both equal a float64 reference of the same rows
        x = logits[:, s].double()
        y = x.clone()
        y[:, ::3] = float("-inf")
        for name, rows in (("natural", x), ("constrained", y)):
            p = torch.softmax(rows, 1)
            entropy = -(p * torch.log(p.clamp(min=1e-300))).sum(1)
            np.testing.assert_allclose(b[f"entropy_{name}"], entropy.numpy(), rtol=1e-4, err_msg=name)
            c = chosen[s]
            np.testing.assert_allclose(b[f"p_chosen_{name}"], p.gather(1, c[:, None])[:, 0].numpy(), rtol=1e-4)
            rank = (rows > rows.gather(1, c[:, None])).sum(1)
            assert b[f"rank_chosen_{name}"].tolist() == rank.double().tolist()
            np.testing.assert_allclose(b[f"p_eos_{name}"], p[:, 7].numpy(), rtol=1e-4, atol=1e-12)
        removed = torch.softmax(x, 1)[:, ::3].sum(1)
        np.testing.assert_allclose(b["removed_mass"], removed.numpy(), rtol=1e-4, atol=1e-7)
        margin = x.max(1).values - x.masked_fill(torch.isinf(y), float("-inf")).max(1).values
        np.testing.assert_allclose(b["margin"], margin.numpy(), rtol=1e-5, atol=1e-5)


def test_rows_with_nan_and_plus_inf_get_the_same_statistics_recorded_or_read():
    """Removed mass, margin and rank follow the one-hot rule of a +inf row whether recorded or summed up when read."""
    x = torch.randn(4, 60, generator=torch.Generator().manual_seed(3))
    x[1, 4] = x[1, 9] = float("inf")  # a one-hot on 4 and 9; the constraint masks 9: half the mass removed
    x[2, 5] = float("nan")  # and chosen: a NaN entry weighs 0, so it ranks after the 59 other tokens
    x[3, 3] = float("inf")  # a one-hot on 3, which the constraint masks: everything removed
    frames = {}
    for statistics in ("record", "read"):
        tracker = LogitTrackingProcessor(MaskThird(), statistics=statistics)
        ids = torch.tensor([[1]])
        for t, token in enumerate([4, 4, 5, 4]):
            tracker(ids, x[t : t + 1].clone())
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
        tracker.finish(ids)
        frames[statistics] = tracker.stats()
    recorded, read = frames["record"], frames["read"]
    for column in recorded.columns:
        if recorded[column].dtype.kind == "f":
            np.testing.assert_allclose(recorded[column], read[column], rtol=1e-4, atol=1e-6, err_msg=column)
    assert recorded["removed_mass"][1] == pytest.approx(0.5) and recorded["margin"][1] == 0.0
    assert recorded["rank_chosen_natural"][1] == 0 and recorded["rank_chosen_natural"][3] == 1
    assert recorded["removed_mass"][3] == 1.0 and recorded["margin"][3] == float("inf")
    assert recorded["rank_chosen_natural"][2] == 59 and recorded["p_chosen_natural"][2] == 0.0


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_half_precision_rows_read_as_distributions_and_their_statistics_stay_exact(storage):
    """Probabilities read off a rounded row sum to 1 (none above 1); stats() keeps the full row's values."""
    x = torch.randn(3, 400, generator=torch.Generator().manual_seed(5))
    x[0, 17] = 30.1  # rounds up in both half formats: a dominant token read with the full row's sum passes 1
    x[1] = 10.3  # all tied, rounded up: each token reads 1/400
    x[2, ::2] = float("-inf")
    tracker = LogitTrackingProcessor(None, storage=storage)
    ids = torch.tensor([[1, 2]])
    for t in range(3):
        tracker(ids, x[t : t + 1].clone())
        ids = torch.cat([ids, torch.tensor([[17]])], 1)
    tracker.finish(ids)
    probs = tracker.get_probabilities()["unstructured"]
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    assert probs.max() <= 1.0
    np.testing.assert_allclose(probs[1], 1 / 400, rtol=1e-5)
    top = tracker.get_top_tokens(k=1)
    assert top[0]["tokens"][0]["token"] == "<17>" and top[0]["tokens"][0]["unstructured_prob"] <= 1.0
    exact = torch.softmax(x.double(), 1)
    np.testing.assert_allclose(tracker.stats()["p_chosen_natural"], exact[:, 17].numpy(), rtol=1e-5)


def test_statistics_of_a_logitscope_generator_run_in_topk_storage_match_float32(tiny_model, char_tokenizer):
    runs = {}
    for storage in ("float32", "topk"):
        tracker = LogitTrackingProcessor(MaskThird(), storage=storage, top_k=3)
        gen = Generator(tiny_model, char_tokenizer, logits_processor=tracker)
        gen.generate(["The cat", "Hi"], SamplingParams(max_new_tokens=12, temperature=1.0, seed=4, ignore_eos=True))
        runs[storage] = tracker
    for s in (0, 1):
        a, b = runs["float32"].stats(sequence=s), runs["topk"].stats(sequence=s)
        assert a["chosen_id"].tolist() == b["chosen_id"].tolist()
        assert b["p_chosen_constrained"].notna().all()
        for column in (
            "entropy_natural",
            "entropy_constrained",
            "p_chosen_natural",
            "p_chosen_constrained",
            "rank_chosen_natural",
            "rank_chosen_constrained",
            "removed_mass",
            "margin",
        ):
            np.testing.assert_allclose(b[column], a[column], rtol=1e-5, atol=1e-6, err_msg=column)


# ---------------------------------------------------------------- non-finite logits


@pytest.mark.parametrize("storage", ["float32", "float16", "topk"])
def test_a_nan_entry_is_left_out_of_the_distribution_and_counted(storage):
    tracker = LogitTrackingProcessor(None, storage=storage, top_k=5)
    x = torch.randn(1, 50, generator=torch.Generator().manual_seed(2)) * 2
    x[0, 11] = float("nan")
    tracker(torch.tensor([[1]]), x.clone())
    tracker.finish(torch.tensor([[1, int(torch.nan_to_num(x, nan=-1e9).argmax())]]))
    top = tracker.get_top_tokens(k=5)[0]
    clean = x.masked_fill(torch.isnan(x), float("-inf")).double()
    p = torch.softmax(clean, 1)[0]
    assert [t["token"] for t in top["tokens"]] == [f"<{i}>" for i in torch.argsort(p, descending=True)[:5].tolist()]
    np.testing.assert_allclose(
        [t["unstructured_prob"] for t in top["tokens"]], torch.sort(p, descending=True).values[:5], rtol=3e-3
    )
    assert top["nonfinite"] and top["nan_count"]["natural"] == 1
    stats = tracker.stats()
    assert stats["nan_natural"].tolist() == [1] and bool(stats["nonfinite"][0])
    entropy = -(p * torch.log(p.clamp(min=1e-300))).sum()
    assert stats["entropy_natural"][0] == pytest.approx(float(entropy), rel=1e-3)
    assert stats["p_chosen_natural"][0] == pytest.approx(float(p.max()), rel=1e-3)


@pytest.mark.parametrize("storage", ["float32", "topk"])
def test_a_plus_inf_row_is_a_one_hot_on_its_plus_inf_tokens(storage):
    tracker = LogitTrackingProcessor(None, storage=storage, top_k=5)
    x = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    x[0, 4] = x[0, 9] = float("inf")
    tracker(torch.tensor([[1]]), x.clone())
    tracker.finish(torch.tensor([[1, 9]]))
    tokens = tracker.get_top_tokens(k=3)[0]["tokens"]
    assert sorted(t["token"] for t in tokens[:2]) == ["<4>", "<9>"]
    assert [t["unstructured_prob"] for t in tokens[:2]] == [0.5, 0.5]
    assert all(t["unstructured_prob"] == 0.0 for t in tokens[2:])
    stats = tracker.stats()
    assert stats["p_chosen_natural"][0] == 0.5 and stats["rank_chosen_natural"][0] == 0
    assert stats["entropy_natural"][0] == pytest.approx(np.log(2))
    assert bool(stats["nonfinite"][0]) and stats["allowed"][0] == 2
    probs = tracker.get_probabilities()["unstructured"][0]
    assert probs[4] == probs[9] == 0.5


class AllowNothingAtStep1(LogitsProcessor):
    """Allows every token, except at its second call, where it allows none."""

    calls = 0

    def process(self, logits, ctx):
        self.calls += 1
        return torch.full_like(logits, float("-inf")) if self.calls == 2 else logits


@pytest.mark.parametrize("statistics", ["record", "read"])
def test_a_step_whose_constraint_allows_nothing_has_the_same_statistics_recorded_or_read(statistics):
    """The chosen token was masked: probability 0 (not NaN) in the constrained stage, no entropy, nothing allowed."""
    tracker = LogitTrackingProcessor(AllowNothingAtStep1(), statistics=statistics, eos_token_id=3)
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([[1, 2]])
    x = torch.randn(3, 40, generator=gen)
    for t in range(3):
        tracker(ids, x[t : t + 1].clone())
        ids = torch.cat([ids, x[t : t + 1].argmax(1, keepdim=True)], 1)
    tracker.finish(ids)
    stats = tracker.stats()
    dead = stats.iloc[1]
    assert dead["allowed"] == 0 and dead["removed_mass"] == 1.0 and np.isnan(dead["entropy_constrained"])
    assert dead["p_chosen_constrained"] == 0.0 and dead["p_eos_constrained"] == 0.0
    p = torch.softmax(x.double(), 1)
    np.testing.assert_allclose(stats["p_chosen_natural"], p.max(1).values.numpy(), rtol=1e-5)
    np.testing.assert_allclose(stats["p_chosen_constrained"], [p[0].max(), 0.0, p[2].max()], rtol=1e-5)
    probs = tracker.get_probabilities()
    assert (probs["structured"][1] == 0).all()  # every token masked: 0, not NaN
    np.testing.assert_allclose(probs["structured"].sum(1), [1.0, 0.0, 1.0], rtol=1e-5)
    assert tracker.continuation_probability("<3>", 1).probabilities["constrained"] == 0.0
    # to_dataframe still lists what the model wanted there, each masked (0)
    frame = tracker.to_dataframe(min_value=0.05, token_ids=True)
    at_dead = frame[frame.position == 1]
    assert set(at_dead.token_id) == set(np.nonzero(p[1].numpy() >= 0.05)[0].tolist())
    assert (at_dead.constrained == 0).all()
    np.testing.assert_allclose(at_dead.natural, p[1].numpy()[at_dead.token_id], rtol=1e-5)


# ---------------------------------------------------------------- queries inside the bound


def _anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon")


class AnonPeak:
    """The peak of this process's anonymous resident memory while the block runs, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = _anon_kib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _anon_kib())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_kib())

    @property
    def grew(self) -> int:
        return (self.peak - self.base) * 1024


def measure_queries(folder: str) -> dict[str, int]:
    """Record a spilled float16 run and return, per query, how much anonymous memory it added (bytes)."""
    vocab, steps, chunk, bound = 1 << 15, 240, 2 << 20, 8 << 20
    tracker = LogitTrackingProcessor(
        MaskThird(), storage="float16", memory_limit=bound, chunk_bytes=chunk, spill_dir=folder
    )
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 1, vocab, generator=gen) * 3
    ids = torch.ones(1, 2, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for t in range(steps):
            out = tracker(ids, base[t % 8].clone())
            ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
        tracker.finish(ids)
        run = tracker.run
    grew = {"rows held": tracker.recorder.host_bytes}
    queries = {
        "get_top_tokens": lambda: run.get_top_tokens(k=3, positions=0),
        "stats": lambda: run.stats(),
        "to_dataframe": lambda: run.to_dataframe(min_value=0.05),
        "continuation_probability": lambda: run.continuation_probability("a", position=3),
    }
    for name, query in queries.items():
        run.clear_cache()
        with AnonPeak() as peak:
            query()
        grew[name] = peak.grew
    assert len(run.get_top_tokens(k=3)) == steps
    return grew


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
def test_queries_on_a_spilled_half_precision_run_stay_within_the_bound(tmp_path):
    """Measured in a fresh process whose glibc serves blocks over 128 KiB by mmap (returned on free),
    so its RSS shows the memory a query uses, not what the allocator kept from earlier tests."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 17))
    grew = json_from_a_fresh_process("test_tracker_scale", "measure_queries", str(tmp_path), env)
    chunk, bound = 2 << 20, 8 << 20
    recorded = 240 * 2 * (1 << 15) * 2  # 30 MiB of float16 rows: converting them all to float32 takes 60 MiB
    assert grew.pop("rows held") <= bound + 2 * chunk
    for name, value in grew.items():
        assert value <= bound + chunk < recorded, f"{name} grew anonymous memory by {value / 2**20:.1f} MiB"


# ---------------------------------------------------------------- temporary spill folders


def test_stale_temporary_spill_folders_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = temporary_spill_folder()
    dead = tmp_path / "logitscope-spill-999999999-12345-abcd"
    dead.mkdir()
    (dead / "chunk-000000.arrow").write_bytes(b"x")
    reused = tmp_path / f"logitscope-spill-{os.getpid()}-1-abcd"  # this pid, but another process's start time
    reused.mkdir()
    unrelated = tmp_path / "something-else"
    unrelated.mkdir()
    removed = remove_stale_spill_folders()
    assert sorted(removed) == sorted([dead, reused])
    assert mine.exists() and unrelated.exists() and not dead.exists() and not reused.exists()
    shutil.rmtree(mine)


def test_a_temporary_spill_folder_is_removed_with_its_tracker():
    tracker = LogitTrackingProcessor(None, memory_limit=0, chunk_bytes=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for t in range(20):
            tracker(torch.ones(1, 2 + t, dtype=torch.long), torch.randn(1, 64))
        tracker.finish()
        tracker.recorder.flush()
    folder = tracker.recorder.spill_path
    assert folder is not None and folder.exists() and folder.name.startswith(f"logitscope-spill-{os.getpid()}-")
    del tracker
    import gc

    gc.collect()
    assert not folder.exists()


def test_a_tracker_dropped_with_chunks_on_their_way_to_disk_leaves_no_spill_folder(slow_disk):
    """The chunks still queued when the tracker goes away are not written into a folder made again."""
    slow_disk(0.05)
    tracker = LogitTrackingProcessor(None, memory_limit=0, chunk_bytes=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        for t in range(12):
            tracker(torch.ones(1, 2 + t, dtype=torch.long), torch.randn(1, 64))
    folder = tracker.recorder.spill_path
    writer = tracker.recorder._handoff.writer  # to wait for the queued chunks, not to keep the tracker
    assert folder is not None and folder.exists()
    del tracker
    import gc

    gc.collect()
    writer.flush()  # every chunk that was queued has been written, or refused
    assert not folder.exists()


# ---------------------------------------------------------------- the default storage


def test_auto_storage_keeps_500_steps_of_the_batch_within_the_bound():
    stages = ["natural", "constrained"]
    auto = Storage.parse("auto", 20)
    assert auto.resolve(stages, 131072, 4, 2 << 30).kind == "float32"
    assert auto.resolve(stages, 131072, 8, 2 << 30).kind == "bfloat16"
    assert auto.resolve(stages, 131072, 64, 2 << 30) == Storage("topk", 20)
    assert auto.resolve(stages, 131072, 64, None).kind == "float32"  # no bound: nothing to protect
    tracker = LogitTrackingProcessor(MaskThird(), memory_limit=2_100_000)  # 500 steps of one bfloat16 row pair
    tracker(torch.ones(4, 2, dtype=torch.long), torch.randn(4, 1000))
    assert tracker.storage.kind == "topk" and tracker.run.metadata.storage == "topk"
    tracker.clear()
    tracker(torch.ones(1, 2, dtype=torch.long), torch.randn(1, 1000))
    assert tracker.storage.kind == "bfloat16"
    with pytest.raises(ValueError, match="storage must be one of .* or 'auto', got 'int8'"):
        LogitTrackingProcessor(None, storage="int8")


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_precision_rows_keep_exact_statistics_even_when_read_is_asked(storage):
    """statistics="read" would sum up the rounded rows: half-precision storage records them from the full rows."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 3000, generator=gen) * 4 + 12  # logits around 12: bfloat16 rounds them by up to 0.03
    frames = {}
    for mode, statistics in (("float32", "record"), (storage, "read")):
        tracker = LogitTrackingProcessor(MaskThird(), storage=mode, statistics=statistics)
        ids = torch.tensor([[1]])
        for t in range(6):
            tracker(ids, x[t : t + 1].clone())
            ids = torch.cat([ids, x[t : t + 1].argmax(1, keepdim=True)], 1)
        tracker.finish(ids)
        frames[mode] = tracker.stats()
    exact, half = frames["float32"], frames[storage]
    for column in ("entropy_natural", "p_chosen_natural", "rank_chosen_natural", "margin", "removed_mass"):
        np.testing.assert_allclose(half[column], exact[column], rtol=1e-5, atol=1e-6, err_msg=column)
