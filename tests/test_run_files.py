"""Run files: large prompts, damaged pages, damaged metadata, wrong column types, killed exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_tracker_support import byte_tokenizer

from dashboard.reader import BadRunError, RunReader
from tracker import LogitTrackingProcessor, Run
from tracker.format.schema import META_RUN, META_VOCAB, RunMetadata

REPO = Path(__file__).resolve().parent.parent


def recorded(steps: int = 40, vocab: int = 2000, seed: int = 0) -> LogitTrackingProcessor:
    tracker = LogitTrackingProcessor(None)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for _ in range(steps):
        out = tracker(ids, torch.randn(2, vocab, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    tracker.finish(ids)
    return tracker


def rewrite(src: Path, dst: Path, *, metadata: dict[bytes, bytes] | None = None, table: pa.Table | None = None) -> Path:
    """A copy of a run file with its schema metadata or its table replaced (what damage or a foreign writer does)."""
    table = pq.read_table(src) if table is None else table
    if metadata is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    pq.write_table(table, dst)
    return dst


def test_prompts_far_past_the_footer_limit_round_trip(tmp_path):
    tracker = recorded(steps=3, vocab=300)
    prompt = (np.arange(2_500_000) % 156 + 100).tolist()
    rows = [prompt] * 8 + [[1, 2, 3]]  # ~80 MB of JSON: past Parquet's footer limit if kept there
    tracker._shared.generations[0]["prompt_ids"] = rows
    tracker._shared.run_cache = None
    path = tracker.to_parquet(tmp_path / "big.parquet")
    run = Run.load(path)
    assert run.metadata.generations[0]["prompt_ids"] == rows
    reader = RunReader(path)
    assert reader.metadata.generations[0]["prompt_ids"][8] == [1, 2, 3]
    assert len(reader.metadata.generations[0]["prompt_ids"][7]) == len(prompt)
    del prompt, run, reader


@pytest.mark.parametrize("name", ["run.arrow", "run.feather", "run.ipc", "run.data"])
def test_a_file_reads_by_what_it_holds_whatever_its_suffix(tmp_path, name):
    tracker = recorded(steps=4, vocab=300)
    expected = tracker.get_logits()["unstructured"]
    parquet = tracker.to_parquet(tmp_path / name)  # Parquet, whatever the name says
    ipc = tmp_path / ("ipc-" + name)
    with pa.OSFile(str(ipc), "wb") as sink, pa.ipc.new_file(sink, tracker.run.to_arrow().schema) as writer:
        writer.write_table(tracker.run.to_arrow())
    for path in (parquet, ipc):
        np.testing.assert_array_equal(Run.load(path).get_logits()["unstructured"], expected)
        assert RunReader(path).track(0, 0).length == 4


def test_generation_metadata_survives_the_file_and_the_dashboard_reader(tmp_path):
    tok = byte_tokenizer()
    tracker = LogitTrackingProcessor(None, tokenizer=tok)
    for text in ("the cat", "héllo wörld"):
        ids = torch.tensor([tok(text)["input_ids"]])
        for _ in range(3):
            out = tracker(ids, torch.randn(1, len(tok)))
            ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    path = tracker.to_parquet(tmp_path / "two.parquet")
    assert Run.load(path).metadata.generations == tracker.run.metadata.generations
    footer = json.loads(pq.read_schema(path).metadata[META_RUN])
    assert footer["generations"] == []
    reader = RunReader(path)
    assert [reader.prompt(g) for g in (0, 1)] == ["the cat", "héllo wörld"]


def test_oversized_run_metadata_is_refused_with_the_limit(tmp_path):
    tracker = recorded(steps=2, vocab=100)
    tracker.annotate(notes="x" * (5 << 20))
    with pytest.raises(ValueError, match=r"run metadata is [\d,]+ bytes, over the 4,194,304 .*extra"):
        tracker.to_parquet(tmp_path / "r.parquet")
    assert not any(tmp_path.iterdir())


def test_a_damaged_page_is_detected_not_read_as_other_logits(tmp_path):
    path = recorded().to_parquet(tmp_path / "run.parquet", compression="zstd")
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    middle = (len(data) - footer) // 2
    rng = np.random.default_rng(0)
    data[middle : middle + 2000] = rng.integers(0, 256, 2000, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"run\.parquet.*(checksum|damaged|could not be read)"):
        Run.load(path)


def test_a_damaged_page_read_by_the_dashboard_gives_a_message(tmp_path):
    path = recorded().to_parquet(tmp_path / "run.parquet", compression=None)
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    middle = (len(data) - footer) // 2
    data[middle : middle + 2000] = np.random.default_rng(1).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(BadRunError):
        reader = RunReader(path)
        for g in reader.generations():
            for s in reader.sequences(g):
                track = reader.track(g, s)
                for p in range(track.length):
                    reader.step(track, p)


@pytest.mark.parametrize(
    "damage, message",
    [
        ({META_RUN: b"[1, 2]"}, "must be a JSON object, got list"),
        ({META_RUN: b"{not json"}, "not valid JSON"),
        ({META_VOCAB: b"abc"}, "vocabulary .* is damaged"),
    ],
)
def test_damaged_metadata_names_the_file_and_the_fault(tmp_path, damage, message):
    good = recorded(steps=3, vocab=100).to_parquet(tmp_path / "good.parquet")
    bad = rewrite(good, tmp_path / "bad.parquet", metadata=damage)
    with pytest.raises(ValueError, match=message) as caught:
        Run.load(bad)
    assert "bad.parquet" in str(caught.value)


def test_metadata_fields_of_the_wrong_type_are_named():
    raw = json.loads(RunMetadata("r", "float32", 0, ["natural"], 10).to_json())
    raw["vocab_size"] = "ten"
    with pytest.raises(ValueError, match="'vocab_size' must be an integer, got str"):
        RunMetadata.from_json(json.dumps(raw))


def test_a_wrongly_typed_column_is_refused(tmp_path):
    good = recorded(steps=3, vocab=100).to_parquet(tmp_path / "good.parquet")
    table = pq.read_table(good)
    index = table.schema.get_field_index("generation")
    table = table.set_column(index, pa.field("generation", pa.string()), table.column("generation").cast(pa.string()))
    bad = rewrite(good, tmp_path / "typed.parquet", table=table)
    with pytest.raises(ValueError, match=r"typed\.parquet.*column 'generation' has type string"):
        Run.load(bad)


def test_metadata_that_disagrees_with_the_columns_is_refused(tmp_path):
    good = recorded(steps=3, vocab=100).to_parquet(tmp_path / "good.parquet")
    meta = json.loads(pq.read_schema(good).metadata[META_RUN])
    meta["vocab_size"] = 10**9
    bad = rewrite(good, tmp_path / "wide.parquet", metadata={META_RUN: json.dumps(meta).encode()})
    with pytest.raises(ValueError, match=r"wide\.parquet.*natural_logits"):
        Run.load(bad)


KILLED_EXPORT = """
import os, signal, sys
from tracker.format.spill import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_bytes(b"half a run" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_exports_temporary_file_is_removed_by_the_next_export(tmp_path):
    target = tmp_path / "run.parquet"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(target)], env=env)
    assert done.returncode != 0
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and not target.exists()
    live = tmp_path / ".run.parquet.not-a-writer-tag.tmp"  # not named by this host's writers: kept
    live.write_bytes(b"x")
    recorded(steps=2, vocab=50).to_parquet(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "run.parquet"])
    Run.load(target)


@pytest.mark.parametrize("path", sorted((REPO / "sample_runs").glob("*.parquet")), ids=lambda p: p.stem)
def test_the_shipped_sample_runs_read_as_distributions(path):
    """Every stored row of a shipped run reads as a distribution: no probability above 1, rows summing to 1.

    (Runs recorded before half-precision rows kept the log-sum-exp of their rounded values read a
    rounded-up favourite as p = 1.007; rebuild them with ``python -m logitscope.make_sample_runs``.)
    """
    run = Run.load(path)
    for g in run.generations():
        for s in run.sequences(g):
            for stage, p in run.get_probabilities(sequence=s, generation=g, include_finished=True).items():
                assert np.nanmax(p) <= 1.0 + 1e-6, (stage, float(np.nanmax(p)))
                np.testing.assert_allclose(np.nansum(p, axis=1), 1.0, atol=1e-4, err_msg=stage)


KILLED_DATASET_EXPORT = """
import os, signal, sys
import torch
from tracker import LogitTrackingProcessor

tracker = LogitTrackingProcessor(None)
ids = torch.tensor([[1, 2]])
for _ in range(3):
    ids = torch.cat([ids, tracker(ids, torch.randn(1, 50)).argmax(1, keepdim=True)], 1)
tracker.finish(ids)

def killed(fd):  # the process dies with the part written but not yet on disk for sure
    os.kill(os.getpid(), signal.SIGKILL)

os.fsync = killed
tracker.to_dataset(sys.argv[1])
"""


def test_a_killed_dataset_export_adds_no_run_and_vacuum_removes_what_it_left(tmp_path):
    """An export into a table killed midway adds no run to it: readers see the runs that were there, and
    vacuum removes the file it left."""
    from dashboard.discover import find_runs
    from tracker.format.table import RunTable

    root = tmp_path / "dataset"
    first = recorded(steps=2, vocab=50).run
    first.to_dataset(root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", KILLED_DATASET_EXPORT, str(root)], env=env)
    assert done.returncode == -9
    left = [p for p in root.rglob("*") if p.relative_to(root) not in before and p.is_file()]
    assert left and all(p.name.endswith(".tmp") for p in left)  # the killed writer's temporary file
    assert Run.load(root).run_id == first.run_id  # the one run, without naming it
    assert find_runs(root) == [root / f"run_id={first.run_id}"]
    second = recorded(steps=3, vocab=50, seed=1).run
    second.to_dataset(root)
    assert sorted(p.name for p in find_runs(root)) == sorted(f"run_id={r.run_id}" for r in (first, second))
    removed = RunTable(root).vacuum(older_than_hours=0)
    assert sorted(removed) == sorted(str(p.relative_to(root)) for p in left)
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_a_run_folder_holding_only_an_uncommitted_file_is_not_a_run(tmp_path):
    """A run_id= folder whose part no commit names (an export in progress, or one killed) is not listed,
    does not stop the table's one run from loading, and cannot be loaded by its id."""
    from dashboard.discover import find_runs

    root = tmp_path / "dataset"
    run = recorded(steps=2, vocab=50).run
    run.to_dataset(root)
    pending = root / "run_id=20990101T000000-00000000"
    pending.mkdir()
    (pending / "part-x.parquet").write_bytes(b"PAR1 half a part")
    assert Run.load(root).run_id == run.run_id
    assert find_runs(root) == [root / f"run_id={run.run_id}"]
    assert find_runs(tmp_path) == [root / f"run_id={run.run_id}"]
    with pytest.raises(ValueError, match="no commit names it"):
        Run.load(root, run_id="20990101T000000-00000000")
    with pytest.raises(FileNotFoundError, match="no commit of its table names a part"):
        Run.load(pending)
