"""When the disk refuses a spilled chunk: the error names the folder once, nothing recorded is lost,
and the run goes on (in memory) until clear()."""

from __future__ import annotations

import errno
import warnings

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

import tracker.format.spill as spill
from tracker import LogitTrackingProcessor, Run
from tracker.recording.recorder import SpillWarning

BOUND = dict(memory_limit=0, chunk_bytes=8 << 10, storage="float32")  # every complete step spills


def generate(demo, tracker, seed=0, tokens=12, finish=True):
    model, tok = demo
    torch.manual_seed(seed)
    enc = tok(["Call Maria at ", "The cat"], return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(
        **enc,
        logits_processor=LogitsProcessorList([tracker]),
        do_sample=True,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=tok.pad_token_id,
    )
    if finish:
        tracker.finish(out)
    return out


def logits_by_row(run: Run) -> dict[tuple[int, int, int], np.ndarray]:
    table = run.to_arrow()
    keys = zip(*(table.column(c).to_pylist() for c in ("generation", "sequence", "step")))
    values = table.column("natural_logits").to_pylist()
    return {k: np.asarray(v, dtype=np.float32) for k, v in zip(keys, values)}


def reference(demo, seed=0, tokens=12):
    tracker = LogitTrackingProcessor(tokenizer=demo[1], storage="float32", memory_limit=None)
    generate(demo, tracker, seed, tokens)
    return logits_by_row(tracker.run)


@pytest.mark.parametrize("under", [False, True])
def test_a_spill_dir_that_is_a_file_is_refused_when_the_tracker_is_made(tmp_path, under):
    file = tmp_path / "notes.txt"
    file.write_text("not a folder")
    spill_dir = file / "spill" if under else file
    with pytest.raises(NotADirectoryError, match=r"spill_dir must be a folder.*notes\.txt"):
        LogitTrackingProcessor(spill_dir=spill_dir)


def test_a_spill_folder_that_cannot_be_made_is_said_once_and_the_run_keeps_every_row(demo, tmp_path):
    spill_dir = tmp_path / "spill"
    tracker = LogitTrackingProcessor(tokenizer=demo[1], spill_dir=spill_dir, **BOUND)
    spill_dir.write_text("the folder's name is taken by a file after the tracker was made")
    with pytest.raises(RuntimeError, match=r"spill_dir=.*spill.*Nothing recorded is lost"):
        generate(demo, tracker)
    kept = logits_by_row(tracker.run)  # every query works, from memory
    assert kept
    want = reference(demo)
    for key, values in kept.items():
        np.testing.assert_array_equal(values, want[key])

    path = tracker.to_parquet(tmp_path / "run.parquet")  # and export
    assert logits_by_row(Run.load(path)).keys() == kept.keys()


def test_after_the_refusal_the_generation_in_progress_and_the_next_record_whole_in_memory(demo, tmp_path):
    spill_dir = tmp_path / "spill"
    tracker = LogitTrackingProcessor(tokenizer=demo[1], spill_dir=spill_dir, **BOUND)
    spill_dir.write_text("taken")
    with pytest.raises(RuntimeError, match="spill_dir"):
        generate(demo, tracker, seed=1)
    generate(demo, tracker, seed=2)  # said once: the next generation records, in memory
    run = tracker.run
    assert sorted(set(run.to_arrow().column("generation").to_pylist())) == [0, 1]
    rows = logits_by_row(run)
    want = reference(demo, seed=2)
    assert all(np.array_equal(rows[(1, s, t)], v) for (g, s, t), v in want.items())
    assert tracker.recorder.spill_path is None or not any(tracker.recorder.spill_path.glob("chunk-*"))

    spill_dir.unlink()
    tracker.clear()  # clear() tries the disk again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpillWarning)
        generate(demo, tracker, seed=2)
    tracker.recorder.flush()
    assert list((spill_dir / tracker.run_id).glob("chunk-*.arrow"))
    assert logits_by_row(tracker.run).keys() == {(0, s, t) for (_, s, t) in want}


def test_a_chunk_the_writer_cannot_write_stays_in_memory_and_finish_still_records_the_last_tokens(
    demo, tmp_path, monkeypatch
):
    original = spill.write_ipc

    def disk_full(path, *args, **kwargs):
        if "chunk-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, *args, **kwargs)

    monkeypatch.setattr(spill, "write_ipc", disk_full)
    tracker = LogitTrackingProcessor(tokenizer=demo[1], spill_dir=tmp_path, **BOUND)
    out = None
    with pytest.raises(RuntimeError, match=r"No space left on device.*Nothing recorded is lost"):
        out = generate(demo, tracker, seed=3, tokens=30, finish=False)
        tracker.finish(out)
    if out is None:  # the refusal was said during generate; the steps before it are kept
        rows = logits_by_row(tracker.run)
        want = reference(demo, seed=3, tokens=30)
        assert rows and all(np.array_equal(v, want[k]) for k, v in rows.items())
    else:  # said by finish, which recorded the last step's tokens first
        table = tracker.run.to_arrow()
        assert table.num_rows == 2 * 30
        assert (np.asarray(table.column("chosen").to_pylist()) >= 0).all()
    assert not list(tmp_path.rglob("chunk-*"))  # no partial file left behind


def test_logitscope_generator_says_the_refusal_once_and_keeps_recording(demo, tmp_path):
    from sampling import Generator, SamplingParams
    from tracker import add_tracking

    spill_dir = tmp_path / "spill"
    gen = add_tracking(Generator(*demo), spill_dir=spill_dir, **BOUND)
    tracker = gen.logits_processor
    spill_dir.write_text("taken")
    params = SamplingParams(temperature=0.8, seed=0, max_new_tokens=10)
    with pytest.raises(RuntimeError, match=r"spill_dir=.*Nothing recorded is lost"):
        gen.generate(["Call Maria at "], params)
    first = tracker.run.to_arrow().num_rows
    assert first > 0
    out = gen.generate(["Call Maria at "], params)  # said once; recorded whole, in memory
    run = tracker.run
    assert run.to_arrow().num_rows > first
    assert run.sequence(generation=1, sequence=0) == out[0].outputs[0].text
