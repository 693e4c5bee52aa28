"""dashboard.reader and dashboard.discover: runs read step by step, in every layout, and bad files named clearly."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tracker
from dashboard.discover import find_runs, summarize
from dashboard.reader import BadRunError, RunReader
from dashboard.synthetic import hand_made_run, write_large_run
from tracker.format.schema import META_RUN

TOKENS = ["a", " b", "c", "d", "e", "<eos>"]


def _run(storage: str = "float32", generations: int = 1) -> tracker.Run:
    rng = np.random.default_rng(0)
    natural = rng.standard_normal((2, 5, 6)).astype(np.float32)
    constrained = natural.copy()
    constrained[:, :, 0] = -np.inf
    chosen = np.where(np.isfinite(constrained), constrained, -1e9).argmax(-1)
    return hand_made_run(
        natural, chosen, TOKENS, constrained=constrained, storage=storage, top_k=3, generations=generations
    )


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_step_read_by_the_reader_equals_the_trackers_logits(tmp_path, suffix):
    run = _run(generations=2)
    path = tmp_path / f"run{suffix}"
    if suffix == ".parquet":
        run.to_parquet(path)
    else:
        table = run.to_arrow()
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
    reader = RunReader(path)
    assert reader.generations() == [0, 1] and reader.sequences(1) == [0, 1]
    expected = run.get_logits(generation=1, sequence=1)
    track = reader.track(1, 1)
    assert track.steps.tolist() == list(range(5))
    for position in range(track.length):
        row = reader.step(track, position)
        np.testing.assert_array_equal(row.stages["natural"].logits, expected["unstructured"][position])
        np.testing.assert_array_equal(row.stages["constrained"].logits, expected["structured"][position])
        assert row.stages["constrained"].allowed == 5
    stats = reader.window(track, 1, 4).stats(generation=1, sequence=1)
    full = run.stats(generation=1, sequence=1)
    np.testing.assert_allclose(stats["removed_mass"], full["removed_mass"][1:4], rtol=1e-6)
    assert stats["position"].tolist() == [1, 2, 3]


def test_top_k_storage_gives_ids_values_and_the_rows_log_sum_exp(tmp_path):
    run = _run(storage="topk")
    run.to_parquet(tmp_path / "run.parquet")
    reader = RunReader(tmp_path / "run.parquet")
    row = reader.step(reader.track(0, 0), 2)
    natural = row.stages["natural"]
    assert natural.logits is None and natural.ids.shape == (3,) and natural.allowed == 6
    probs = run.get_probabilities(sequence=0)["unstructured"][2]
    np.testing.assert_allclose(np.exp(natural.values - natural.lse), probs[natural.ids], rtol=1e-5)
    assert row.stages["constrained"].natural_at_ids is not None


def test_moving_between_steps_reads_one_row_group_and_never_the_whole_file(tmp_path, monkeypatch):
    path = write_large_run(tmp_path / "long.parquet", 240, 2048, rows_per_block=16)
    monkeypatch.setattr(tracker.Run, "load", lambda *a, **k: pytest.fail("the dashboard must not load whole runs"))
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("the dashboard must not read whole tables"))
    reader = RunReader(path)
    assert reader.num_blocks == 15 and reader.blocks_read == 0
    track = reader.track(0, 0)
    row = reader.step(track, 200)
    assert row.step == 200 and reader.blocks_read == 1
    assert reader.bytes_read < path.stat().st_size / 10
    reader.step(track, 201)  # same row group: served from the cache
    reader.step(track, 199)
    assert reader.blocks_read == 1
    reader.step(track, 10)
    assert reader.blocks_read == 2
    assert row.chosen == int(np.argmax(row.stages["constrained"].logits))


def test_a_dataset_partition_and_a_spill_folder_are_runs(tmp_path):
    run = _run()
    run.to_dataset(tmp_path / "runs")
    folder = tmp_path / "runs" / f"run_id={run.run_id}"
    assert RunReader(folder).track(0, 1).length == 5
    rng = np.random.default_rng(1)
    spill = tmp_path / "spill"
    track = tracker.LogitTrackingProcessor(None, memory_limit=0, spill_dir=spill, chunk_bytes=64)
    from test_tracker_support import spill_six_steps

    spill_six_steps(track, rng)
    track.reset()
    track.recorder.flush()  # what the reset queued, too
    found = [p for p in find_runs(spill) if p.is_dir()]
    assert found, "the spill folder should be found as a run"
    reader = RunReader(found[0])
    assert reader.track(0, 0).length >= 1
    assert "spill folder" in reader.note and "still held in memory are not in it" in reader.note
    assert summarize(found[0]).note == reader.note  # the Runs and Overview pages show it
    assert RunReader(folder).note is None


def _write_with_metadata(table: pa.Table, path, change) -> None:
    meta = dict(table.schema.metadata)
    data = json.loads(meta[META_RUN])
    change(data)
    meta[META_RUN] = json.dumps(data).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p, t: p.write_text("generation,step\n0,1\n"), "truncated or is not a Parquet/Arrow file"),
        (lambda p, t: pq.write_table(pa.table({"x": [1, 2]}), p), "no logitscope run metadata"),
        (lambda p, t: p.write_bytes(_bytes_of(t)[: len(_bytes_of(t)) // 2]), "truncated"),
        (lambda p, t: _write_with_metadata(t, p, lambda d: d.update(schema_version="2.0")), "schema version '2.0'"),
        (
            lambda p, t: pq.write_table(t.drop_columns(["constrained_logits"]), p),
            "columns ['constrained_logits'] are missing",
        ),
    ],
    ids=["not-a-run", "not-a-logitscope-table", "truncated", "newer-schema", "missing-columns"],
)
def test_bad_files_raise_a_clear_error_naming_the_path(tmp_path, make, message):
    path = tmp_path / "bad.parquet"
    make(path, _run().to_arrow())
    with pytest.raises(BadRunError) as info:
        RunReader(path)
    assert message in str(info.value) and str(path) in str(info.value)
    summary = summarize(path, tmp_path)
    assert summary.error is not None and message in summary.error


def _bytes_of(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def test_discovery_finds_files_and_folders_and_skips_hidden_and_temporary_ones(tmp_path):
    run = _run()
    run.to_parquet(tmp_path / "one.parquet")
    run.to_dataset(tmp_path / "nested" / "dataset")
    (tmp_path / ".hidden.parquet").write_bytes(b"x")
    (tmp_path / ".one.parquet.abc.tmp").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not a run")
    found = find_runs(tmp_path)
    assert [p.name for p in found] == [f"run_id={run.run_id}", "one.parquet"]
    summary = summarize(found[1], tmp_path)
    assert summary.error is None and summary.title == "hand-made run"
    assert (summary.steps, summary.sequences, summary.generations) == (5, 2, 1)
    assert summary.prompt == "a" and summary.stages == "natural, constrained"
    with pytest.raises(FileNotFoundError, match="path: nothing at"):
        find_runs(tmp_path / "missing")


def test_a_prompt_of_special_tokens_shows_them_by_name(demo, tmp_path):
    """A prompt that is only the beginning-of-text token is shown as that token, not as an empty box."""
    from sampling import Generator, SamplingParams
    from tracker import add_tracking

    model, tokenizer = demo
    gen = add_tracking(Generator(model, tokenizer))
    gen.generate(["<|endoftext|>", "<|endoftext|>Call Maria at "], SamplingParams(max_new_tokens=3))
    path = tmp_path / "run.parquet"
    gen.logits_processor.to_parquet(path)
    reader = RunReader(path)
    assert reader.prompt(0, 0) == "<|endoftext|>"
    assert reader.prompt(0, 1) == "<|endoftext|>Call Maria at "
    assert summarize(path).prompt == "<|endoftext|>"
    # the text a model continues from is unchanged: special tokens spell nothing there
    assert reader.vocab.decode(tokenizer("<|endoftext|>Hi")["input_ids"]) == "Hi"
