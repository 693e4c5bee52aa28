"""Runs on disk: Parquet round trips, atomic writes, datasets read by pyarrow and DuckDB, metadata."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from test_tracker_support import FailsOnThirdCall, byte_tokenizer, record_until_the_processor_raises

import tracker.format.run_file as run_file_module
from processors import LogitsProcessor
from tracker import LogitTrackingProcessor, Run, Vocabulary
from tracker.format.schema import META_RUN, SCHEMA_VERSION, RunMetadata


class MaskOdd(LogitsProcessor):
    def process(self, logits, ctx):
        out = logits.clone()
        out[:, 1::2] = float("-inf")
        return out


def tracked(storage="float32", seed=0, steps=6, batch=2, generations=1):
    tok = byte_tokenizer()
    tracker = LogitTrackingProcessor(MaskOdd(), tokenizer=tok, storage=storage, top_k=8, model="tiny-test")
    tracker.annotate(sampling={"temperature": 0.7}, purpose="test")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(generations):
        ids = torch.tensor(tok(["the cat", "héllo"], padding=True)["input_ids"])[:batch]
        for _ in range(steps):
            out = tracker(ids, torch.randn(batch, len(tok), generator=gen) * 3)
            ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
        tracker.finish(ids)
    return tracker


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16", "topk"])
def test_parquet_round_trip_answers_the_same_without_a_tokenizer(tmp_path, storage):
    tracker = tracked(storage)
    path = tracker.to_parquet(tmp_path / "run.parquet")
    run = Run.load(path)
    live = tracker.run
    assert run.metadata.storage == storage and run.metadata.vocab_size == live.metadata.vocab_size
    for s in (0, 1):
        assert run.get_top_tokens(k=5, sequence=s) == live.get_top_tokens(k=5, sequence=s)
        assert run.sequence(sequence=s) == live.sequence(sequence=s)
        np.testing.assert_array_equal(
            run.get_logits(sequence=s)["structured"], live.get_logits(sequence=s)["structured"]
        )
    assert run.to_dataframe(min_value=0.01).equals(live.to_dataframe(min_value=0.01))
    assert run.stats().equals(live.stats())


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16", "topk"])
def test_a_run_whose_processor_raised_reads_back_from_parquet_as_it_was_recorded(tmp_path, storage):
    """The failed step's constrained row is null; Parquet writes its values as nulls too, and reading it back
    must not fail (it did, for full storage: 'zero_copy_only was True')."""
    tok = byte_tokenizer()
    tracker = LogitTrackingProcessor(FailsOnThirdCall(), tokenizer=tok, storage=storage, top_k=8)
    record_until_the_processor_raises(tracker, tok, seed=7)
    live = tracker.run
    run = Run.load(tracker.to_parquet(tmp_path / "run.parquet"))
    assert run.stats()["processor_error"].tolist() == [False, False, True]
    pd.testing.assert_frame_equal(run.stats(), live.stats())
    pd.testing.assert_frame_equal(run.to_dataframe(), live.to_dataframe())
    assert run.get_top_tokens(k=4, sequence=1) == live.get_top_tokens(k=4, sequence=1)
    assert np.isnan(run.get_logits()["structured"][2]).all()  # the step the processor failed: not recorded
    np.testing.assert_array_equal(run.get_logits()["unstructured"], live.get_logits()["unstructured"])


def test_run_metadata_travels_with_the_data(tmp_path):
    tracker = tracked(generations=2)
    run = Run.load(tracker.to_parquet(tmp_path / "run.parquet"))
    meta = run.metadata
    assert meta.schema_version == SCHEMA_VERSION
    assert meta.model == "tiny-test" and meta.sampling == {"temperature": 0.7} and meta.extra == {"purpose": "test"}
    assert meta.stages == ["natural", "constrained"] and meta.eos_token_ids == [0]
    assert [g["generation"] for g in meta.generations] == [0, 1]
    tok = byte_tokenizer()
    assert run.vocab.decode(meta.generations[0]["prompt_ids"][1]).endswith("héllo")
    assert "MaskOdd" in meta.processors and meta.created_at and meta.library_version
    assert run.vocab.display[: len(tok)] == tuple(Vocabulary.from_tokenizer(tok, len(tok)).display)


def test_writes_are_atomic_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    tracker = tracked()
    path = tracker.to_parquet(tmp_path / "run.parquet")
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(run_file_module.pq.ParquetWriter, "write_table", broken)
    with pytest.raises(OSError, match="disk full"):
        tracked(seed=1).to_parquet(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["run.parquet"]  # no temporary file left


def test_written_runs_get_ordinary_file_permissions(tmp_path):
    """Atomic writes go through a private temporary file; the run itself must not stay private."""
    umask = os.umask(0o022)
    try:
        path = tracked().to_parquet(tmp_path / "run.parquet")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    finally:
        os.umask(umask)


def test_many_runs_form_one_dataset_for_pyarrow_and_duckdb(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    runs = [tracked(seed=s, steps=3 + s) for s in range(3)]
    for tracker in runs:
        tracker.to_dataset(tmp_path)
    from deltalake import DeltaTable

    dataset = DeltaTable(tmp_path).to_pyarrow_dataset()  # the committed parts, run_id their partition
    table = dataset.to_table(columns=["run_id", "generation", "sequence", "step", "chosen"])
    counts = {
        r: c for r, c in zip(*np.unique(table.column("run_id").to_numpy(zero_copy_only=False), return_counts=True))
    }
    assert counts == {t.run_id: 2 * (3 + s) for s, t in enumerate(runs)}
    con = duckdb.connect()
    con.register("runs", dataset)
    rows = con.execute("select run_id, count(*), max(step) from runs group by run_id order by run_id").fetchall()
    assert rows == sorted((t.run_id, 2 * (3 + s), 2 + s) for s, t in enumerate(runs))
    one = Run.load(tmp_path, run_id=runs[1].run_id)
    assert one.get_top_tokens(k=3) == runs[1].get_top_tokens(k=3)
    with pytest.raises(ValueError, match="holds 3 runs; pass run_id="):
        Run.load(tmp_path)


def test_a_folder_of_separate_run_files_is_never_merged_and_run_id_is_honoured(tmp_path):
    a, b = tracked(seed=0, steps=3), tracked(seed=1, steps=5)
    a.to_parquet(tmp_path / "a.parquet")
    b.to_parquet(tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="holds 2 runs in 2 files") as info:
        Run.load(tmp_path)
    assert a.run_id in str(info.value) and b.run_id in str(info.value)
    one = Run.load(tmp_path, run_id=b.run_id)
    assert one.sequence() == b.sequence() and one.stats().equals(b.stats())
    with pytest.raises(ValueError, match="run_id='zzz' is not in"):
        Run.load(tmp_path, run_id="zzz")
    with pytest.raises(ValueError, match=f"run_id='zzz' is not in .* it holds run '{a.run_id}'"):
        Run.load(tmp_path / "a.parquet", run_id="zzz")
    assert Run.load(tmp_path / "a.parquet", run_id=a.run_id).sequence() == a.sequence()


def test_to_arrow_is_zero_copy_and_carries_the_schema_metadata():
    tracker = tracked()
    table = tracker.to_arrow()
    assert json.loads(table.schema.metadata[META_RUN])["run_id"] == tracker.run_id
    buffers = {
        b.address for batch in tracker.recorder.batches() for b in batch.column("natural_logits").values.buffers() if b
    }
    assert {
        b.address for chunk in table.column("natural_logits").chunks for b in chunk.values.buffers() if b
    } <= buffers
    again = Run.from_arrow(table)
    assert again.get_top_tokens(k=2) == tracker.get_top_tokens(k=2)


def test_loading_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run at"):
        Run.load(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match="no logitscope run metadata"):
        Run.from_arrow(pa.table({"x": [1]}))
    newer = RunMetadata("r", "float32", 0, ["natural"], 4, schema_version="9.0")
    with pytest.raises(ValueError, match="schema version '9.0' cannot be read"):
        RunMetadata.from_json(newer.to_json())


def test_vocabulary_serialises_bytes_that_are_not_utf8():
    pieces = [b"\xe2\x98", b"\x83", b"ok", b""]
    vocab = Vocabulary.from_parts(pieces, [False, False, False, True])
    back = Vocabulary.deserialize(vocab.serialize())
    assert [back.token_bytes(i) for i in range(4)] == pieces
    assert back.display == vocab.display and back.display[0] == "⟨E2⟩⟨98⟩"
    assert back.decode([0, 1, 2]) == "☃ok"
    assert back.special.tolist() == [False, False, False, True]


def test_a_run_outlives_its_tracker_and_a_dropped_tracker_frees_its_buffers_at_once():
    import gc

    from tracker.recording.memory import SHARED_POOL

    tok = byte_tokenizer()
    tracker = LogitTrackingProcessor(MaskOdd(), tokenizer=tok)
    ids = torch.tensor([[1, 2]])
    for _ in range(3):
        ids = torch.cat([ids, tracker(ids, torch.randn(1, len(tok))).argmax(1, keepdim=True)], 1)
    run = tracker.finish(ids)
    del tracker
    assert [t["token"] for t in run.get_top_tokens(k=1)[0]["tokens"]] == [
        run.vocab.display[int(np.argmax(run.get_probabilities()["structured"][0]))]
    ]
    gc.disable()
    try:
        other = LogitTrackingProcessor(MaskOdd(), tokenizer=tok)
        other(ids[:, :2], torch.randn(1, len(tok)))
        other.run.get_top_tokens(k=2)
        before = SHARED_POOL.free_bytes
        del other
        assert SHARED_POOL.free_bytes > before  # returned by reference counting alone: no cycle holds the tracker
    finally:
        gc.enable()


def test_arguments_of_the_wrong_kind_are_refused_by_name(tmp_path):
    tok = byte_tokenizer()
    for kwargs, message in (
        ({"memory_limit": "2GB"}, "memory_limit must be a number of bytes"),
        ({"chunk_bytes": None}, "chunk_bytes must be a number of bytes"),
        ({"tokenizer": "gpt2"}, "tokenizer must be a tokenizer object"),
        ({"processor_stages": "yes"}, "processor_stages must be True or False"),
        ({"prompt_logprobs": 1}, "prompt_logprobs must be True or False"),
        ({"spill_dir": 5}, r"spill_dir must be a path \(a str or os.PathLike\), got 5"),
        ({"pad_token_id": True}, r"pad_token_id must be a token id \(an int >= 0\) or None, got True"),
        ({"pad_token_id": "0"}, r"pad_token_id must be a token id \(an int >= 0\) or None, got '0'"),
    ):
        with pytest.raises(TypeError, match=message):
            LogitTrackingProcessor(None, **kwargs)
    with pytest.raises(ValueError, match=r"pad_token_id must be a token id \(an int >= 0\) or None, got -2"):
        LogitTrackingProcessor(None, pad_token_id=-2)
    with pytest.raises(TypeError, match="processor is a tokenizer"):
        LogitTrackingProcessor(tok)
    with pytest.raises(ValueError, match="nothing recorded yet"):
        LogitTrackingProcessor(None, tokenizer=tok).to_parquet(tmp_path / "empty.parquet")
    run = tracked().run
    with pytest.raises(ValueError, match="compression must be None or one of .*got 'zip'"):
        run.to_parquet(tmp_path / "a.parquet", compression="zip")
    with pytest.raises(IsADirectoryError, match="is a folder; give a file name"):
        run.to_parquet(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    for call, name in ((run.to_parquet, "path"), (run.to_dataset, "root"), (Run.load, "path")):
        with pytest.raises(TypeError, match=f"{name} must be a path \\(a str or os.PathLike\\), got None"):
            call(None)
        with pytest.raises(ValueError, match=f"{name} must be a path, got ''"):
            call("")  # not the current folder
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    with pytest.raises(NotADirectoryError, match=r"root must be a folder \(made if missing\), got .*notes\.txt"):
        run.to_dataset(tmp_path / "notes.txt")
    (tmp_path / "notes.txt").unlink()
    assert Run.load(run.to_parquet(tmp_path / "b.parquet", compression="none")).sequence() == run.sequence()
