"""Runs as a Delta Lake table: written by many processes at once, read by every engine (logitscope, DuckDB,
pyarrow, Polars) only once committed, debris removed by vacuum, each vocabulary stored once, and one
discovery for every reader and every kind of location."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from marker_support import marker_run
from test_fleet_store import recorded, s3, same  # noqa: F401 - s3: the moto server fixture

from tracker import LogitTrackingProcessor, Run, open_dataset
from tracker.format.dataset import list_runs
from tracker.format.schema import META_VOCAB
from tracker.format.table import RunTable, TableError
from tracker.format.upkeep import vacuum
from tracker.format.vocab_store import VOCAB_DIR

pytest.importorskip("deltalake")
ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """This process's environment (the S3 server's variables included), with the checkout importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


S3_OPTIONS = {"allow_http": "true", "conditional_put": "etag"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITSCOPE_CACHE", str(tmp_path / "cache"))


def _committed_rows(root: str) -> dict[str, int]:
    """Rows per run as DuckDB sees the table through ``DeltaTable(root).to_pyarrow_dataset()`` (no logitscope)."""
    import duckdb
    from deltalake import DeltaTable

    dataset = DeltaTable(root, storage_options=S3_OPTIONS if "://" in root else None).to_pyarrow_dataset()
    con = duckdb.connect()
    con.register("runs", dataset)
    return dict(con.execute("SELECT run_id, count(*) FROM runs GROUP BY run_id").fetchall())


def _polars_rows(root: str) -> dict[str, int]:
    polars = pytest.importorskip("polars")
    frame = polars.scan_delta(root, storage_options=S3_OPTIONS if "://" in root else None)
    return dict(frame.group_by("run_id").len().collect().iter_rows())


WRITER = """
import sys
from test_fleet_store import recorded
root, seed, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(runs):
    recorded(steps=5, vocab=80, seed=seed * 100 + i).run.to_dataset(root)
"""

#: A writer killed between writing its part and committing it; its run id is printed first.
KILLED = """
import os, signal, sys
from test_fleet_store import recorded
from tracker.format.table import RunTable
run = recorded(steps=5, vocab=80, seed=int(sys.argv[2])).run
print(run.run_id, flush=True)

def killed(self, staged, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

RunTable.commit = killed
run.to_dataset(sys.argv[1])
"""


@pytest.mark.fleet
@pytest.mark.parametrize("where", ["local", "s3"])
def test_concurrent_writers_and_a_killed_one_every_engine_sees_only_whole_runs(where, s3, tmp_path):  # noqa: F811
    """Writer processes append runs while a reader polls through logitscope, DuckDB and Polars: every run any
    of them sees is whole (10 rows), a writer killed before its commit is never seen, and vacuum removes
    what it left."""
    root = str(tmp_path / "table") if where == "local" else f"s3://bucket/concurrent-{tmp_path.name}"
    jobs = [(10, 3), (11, 3)] if where == "s3" else [(1, 3), (2, 3), (3, 3)]
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, root, str(s), str(n)], env=_env()) for s, n in jobs]
    killed = subprocess.run([sys.executable, "-c", KILLED, root, "99"], env=_env(), capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ghost = killed.stdout.split()[0]
    seen: set[str] = set()
    while any(w.poll() is None for w in writers) or not seen:
        if RunTable(root).exists():
            for counts in (_committed_rows(root), _polars_rows(root)):
                assert ghost not in counts and set(counts.values()) <= {10}, counts
                seen |= set(counts)
            for entry in list_runs(root):
                assert entry.run_id != ghost and Run.load(entry.path).num_rows == 10
        time.sleep(0.2)
    assert [w.wait() for w in writers] == [0] * len(writers)
    total = sum(n for _, n in jobs)
    assert len(_committed_rows(root)) == total == len(list_runs(root)) and ghost not in _committed_rows(root)
    table = RunTable(root)
    staged = [p for p in _files(table) if f"run_id={ghost}/" in p]
    assert staged  # the killed writer's part: on the store, named by no commit
    assert vacuum(root, older_than_hours=0).parts == staged
    assert not [p for p in _files(table) if f"run_id={ghost}/" in p]
    assert len(open_dataset(root).sql("SELECT * FROM runs")) == total


def _files(table: RunTable) -> list[str]:
    import pyarrow.fs as pafs

    infos = table.fs.get_file_info(pafs.FileSelector(table.where, recursive=True))
    base = table.where.rstrip("/") + "/"
    return sorted(i.path[len(base) :] for i in infos if i.type == pafs.FileType.File and "run_id=" in i.path)


# ---------------------------------------------------------------- the vocabulary once


def _tokenizer_run(vocab: int, seed: int, steps: int = 4) -> Run:
    from dashboard.synthetic import hand_made_run

    rng = np.random.default_rng(seed)
    natural = rng.standard_normal((steps, vocab)).astype(np.float32) * 3
    keep = rng.random((steps, vocab)) < 0.5
    keep[:, 0] = True
    constrained = np.where(keep, natural, -np.inf).astype(np.float32)
    tokens = [f"tok{i}" for i in range(vocab)]
    return hand_made_run(natural, constrained.argmax(1), tokens, constrained=constrained, storage="topk", top_k=20)


def test_a_table_stores_each_vocabulary_once_and_a_file_carries_its_own_once(tmp_path):
    """100 runs of 100 steps (top-20 of 2,000 tokens) sharing a tokenizer: one vocabulary file, footers a
    small share of the bytes, the table within 1.2x the bytes of the rows; a second tokenizer, a second file."""
    from dataclasses import replace

    root = tmp_path / "table"
    base = _tokenizer_run(2000, 0, steps=100)
    runs = [Run(base._record_batches(), replace(base.metadata, run_id=f"run-{i:03d}"), base.vocab) for i in range(100)]
    table = RunTable.at(root)
    table.create()
    table.commit([table.stage(r.to_arrow(), r.metadata) for r in runs])
    vocabularies = list((root / VOCAB_DIR).iterdir())
    assert len(vocabularies) == 1
    parts = list(root.glob("run_id=*/*.parquet"))
    footers = sum(pq.ParquetFile(p).metadata.serialized_size + 8 for p in parts)
    on_disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    rows = sum(r.to_arrow().nbytes for r in runs)
    assert len(parts) == 100 and footers < 0.10 * sum(p.stat().st_size for p in parts), footers
    assert on_disk < 1.2 * rows, (on_disk, rows)
    assert all(not pq.ParquetFile(p).metadata.metadata for p in parts[:5])  # the footer names nothing
    one = Path(runs[0].to_parquet(tmp_path / "one.parquet"))
    vocab_bytes = vocabularies[0].stat().st_size
    assert on_disk + 99 * vocab_bytes < 100 * one.stat().st_size  # 100 single files carry 100 vocabularies
    footer = pq.ParquetFile(one).metadata
    assert b"ARROW:schema" not in footer.metadata  # pyarrow's copy of the schema would hold it twice
    assert footer.serialized_size < len(runs[0].vocab.serialize()) + 6000  # once, beside the columns
    _tokenizer_run(300, 5).to_dataset(root)  # a second tokenizer: a second file
    assert len(list((root / VOCAB_DIR).iterdir())) == 2
    assert len(list_runs(root)) == 101


# ---------------------------------------------------------------- one discovery for every reader


def _locations(tmp_path: Path, s3_root: str) -> dict[str, tuple[str, list[str]]]:
    """Each kind of location and the run ids it holds."""
    a, b, c = (recorded(steps=3, seed=60 + i).run for i in range(3))
    for run in (a, b):
        run.to_dataset(tmp_path / "table")
        marker_run(run, tmp_path / "markers")
    c.to_parquet(tmp_path / "files" / "c.parquet")
    a.to_parquet(tmp_path / "files" / "a.parquet")
    a.to_dataset(s3_root)
    return {
        "file": (str(tmp_path / "files" / "c.parquet"), [c.run_id]),
        "folder of files": (str(tmp_path / "files"), sorted([a.run_id, c.run_id])),
        "table": (str(tmp_path / "table"), sorted([a.run_id, b.run_id])),
        "table's run": (str(tmp_path / "table" / f"run_id={b.run_id}"), [b.run_id]),
        "markers": (str(tmp_path / "markers"), sorted([a.run_id, b.run_id])),
        "marker run": (str(tmp_path / "markers" / f"run_id={a.run_id}"), [a.run_id]),
        "URL of a table": (s3_root, [a.run_id]),
        "URL of a table's run": (f"{s3_root}/run_id={a.run_id}", [a.run_id]),
    }


def test_every_reader_finds_the_same_runs_at_every_kind_of_location(s3, tmp_path):  # noqa: F811
    from dashboard.discover import find_runs, summarize
    from dashboard.reader import RunReader
    from logitscope.cli import main

    for kind, (where, ids) in _locations(tmp_path, f"s3://bucket/kinds-{tmp_path.name}").items():
        found = find_runs(where)
        summaries = [summarize(p, where) for p in found]
        assert sorted(s.run_id for s in summaries) == ids and not any(s.error for s in summaries), kind
        assert sorted(open_dataset(where).sql("SELECT run_id FROM runs").column(0).to_pylist()) == ids, kind
        for path, run_id in zip(found, (s.run_id for s in summaries)):
            assert Run.load(path).run_id == run_id == RunReader(str(path)).metadata.run_id, kind
        if len(ids) == 1:
            assert Run.load(where).run_id == ids[0], kind
        else:
            assert {Run.load(where, run_id=i).run_id for i in ids} == set(ids), kind
        assert main(["inspect", where]) == 0, kind


def test_inspect_lists_and_shows_the_runs_of_a_table_on_s3(s3, capsys, tmp_path):  # noqa: F811
    from logitscope.cli import main

    runs = [recorded(steps=2 + i, seed=70 + i).run for i in range(2)]
    root = f"s3://bucket/inspect-{tmp_path.name}"
    for run in runs:
        run.to_dataset(root)
    assert main(["inspect", root]) == 0
    listing = capsys.readouterr().out
    assert all(f"run_id={r.run_id}" in listing for r in runs) and "cannot" not in listing
    assert main(["inspect", f"{root}/run_id={runs[1].run_id}", "--json"]) == 0
    assert runs[1].run_id in capsys.readouterr().out


# ---------------------------------------------------------------- many runs and storage modes in one table


def test_storage_modes_and_stages_share_one_table_for_every_engine(tmp_path):
    from dashboard.synthetic import hand_made_run

    rng = np.random.default_rng(3)
    natural = rng.standard_normal((2, 4, 30)).astype(np.float32)
    constrained = np.where(rng.random((2, 4, 30)) < 0.5, natural, -np.inf).astype(np.float32)
    chosen = constrained.argmax(-1)
    runs = [
        hand_made_run(natural, chosen, [f"t{i}" for i in range(30)], constrained=c, storage=s, top_k=6)
        for s in ("float32", "float16", "bfloat16", "topk")
        for c in (constrained, None)
    ]
    for run in runs:
        run.to_dataset(tmp_path)
    for run in runs:
        same(Run.load(tmp_path, run_id=run.run_id), run)
    assert _committed_rows(str(tmp_path)) == {r.run_id: 8 for r in runs} == _polars_rows(str(tmp_path))
    from deltalake import DeltaTable

    names = set(DeltaTable(tmp_path).to_pyarrow_dataset().schema.names)
    assert {"natural_logits", "natural_logits_float16", "natural_logits_bfloat16", "natural_topk_ids"} <= names
    view = open_dataset(tmp_path).sql("SELECT run_id, processors, storage FROM runs ORDER BY run_id").to_pylist()
    assert {r["processors"] for r in view if r["run_id"] in {x.run_id for x in runs[1::2]}} == {"none"}


def test_a_run_written_again_replaces_itself_and_a_crafted_log_path_is_refused(tmp_path):
    tracker = recorded(steps=2, seed=80)
    tracker.to_dataset(tmp_path)
    tracker.to_dataset(tmp_path)
    assert _committed_rows(str(tmp_path)) == {tracker.run_id: tracker.run.num_rows}
    from deltalake import DeltaTable
    from deltalake.transaction import AddAction

    delta = DeltaTable(tmp_path)
    escape = AddAction("../outside.parquet", 10, {"run_id": "x"}, 0, True, "{}")
    delta.create_write_transaction([escape], mode="append", schema=delta.schema(), partition_by=["run_id"])
    with pytest.raises(TableError, match="names a part '../outside.parquet' that is not in one of its run_id="):
        list_runs(tmp_path)


# ---------------------------------------------------------------- the engines' writer


def _part(run: Run, generation: int, run_id: str) -> tuple[pa.Table, object]:
    from dataclasses import replace

    table = run.to_arrow()
    table = table.set_column(0, "generation", pa.array(np.full(table.num_rows, generation, np.int32)))
    entry = dict(run.metadata.generations[0], generation=generation)
    return table, replace(run.metadata, run_id=run_id, generations=[entry])


def test_the_table_writer_commits_parts_in_groups_and_they_read_back_as_one_run(tmp_path):
    from dataclasses import replace

    from tracker.format.table_writer import TableWriter

    run = recorded(steps=3, seed=90).run
    with TableWriter(tmp_path, commit_every_s=30, max_parts=1000) as writer:
        for g in range(40):
            writer.add(*_part(run, g, "server-1"))
        later, meta = _part(run, 3, "server-1")  # generation 3's later steps, in a part of their own
        later = later.set_column(2, "step", pa.array(later.column("step").to_numpy() + 3))
        writer.add(later, replace(meta, generations=[dict(meta.generations[0], lengths=[6], ended_at="~")]))
        writer.flush()
        assert (writer.commits, writer.parts_committed) == (1, 41)
    loaded = Run.load(tmp_path)
    assert loaded.generations() == list(range(40)) and loaded.num_rows == 41 * run.num_rows
    assert loaded.stats(generation=3, sequence=0)["position"].tolist() == list(range(6))
    assert next(g for g in loaded.metadata.generations if g["generation"] == 3)["lengths"] == [6]
    assert len(list(tmp_path.glob("run_id=server-1/*.parquet"))) == 1  # one file for the 40 parts
    with pytest.raises(ValueError, match="is closed"):
        writer.add(*_part(run, 41, "server-1"))
    with pytest.raises(ValueError, match="commit_every_s must be a number of seconds > 0, got 0"):
        TableWriter(tmp_path, commit_every_s=0)


TWO_WRITERS = """
import sys
from test_fleet_store import recorded
from test_table import _part
from tracker.format.table_writer import TableWriter
run = recorded(steps=3, seed=90).run
first = int(sys.argv[2])
writer = TableWriter(sys.argv[1], commit_every_s=0.05)
for g in range(first, first + 10):
    writer.add(*_part(run, g, "shared"))
"""  # no close(): the writer commits what was added at interpreter exit


def test_parts_of_one_run_from_two_processes_read_back_as_one_run(tmp_path):
    done = [subprocess.Popen([sys.executable, "-c", TWO_WRITERS, str(tmp_path), str(f)], env=_env()) for f in (0, 10)]
    assert [p.wait() for p in done] == [0, 0]
    run = Run.load(tmp_path, run_id="shared")
    assert run.generations() == list(range(20))
    assert [g["generation"] for g in run.metadata.generations] == list(range(20))


def test_a_failed_commit_is_raised_by_flush_naming_the_table(s3, tmp_path):  # noqa: F811
    from tracker.format.table_writer import TableWriter

    run = recorded(steps=2, seed=91).run
    writer = TableWriter(f"s3://bucket/failing-{tmp_path.name}", commit_every_s=10)
    writer.table.where = "no-such-bucket/runs"  # the store refuses every write from now on
    writer.add(*_part(run, 0, "server-2"))
    with pytest.raises(
        RuntimeError, match=f"could not commit parts into the table at 's3://bucket/failing-{tmp_path.name}'"
    ):
        writer.flush()
    writer.close()


# ---------------------------------------------------------------- upkeep


def test_vacuum_and_convert_from_the_command_line(tmp_path, capsys):
    from logitscope.cli import main

    runs = [recorded(steps=2, seed=100 + i).run for i in range(2)]
    for run in runs:
        marker_run(run, tmp_path / "old")
    with pytest.raises(SystemExit):
        main(["vacuum", str(tmp_path / "old")])
    assert "is a folder of completion markers, not a table" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    capsys.readouterr()
    for run in runs:
        same(Run.load(tmp_path / "new", run_id=run.run_id), run)
    runs[0].to_dataset(tmp_path / "new")  # written again: its first part is replaced, not removed yet
    assert main(["vacuum", str(tmp_path / "new"), "--older-than", "0", "--dry-run"]) == 0
    listed = capsys.readouterr().out.split()
    assert len(listed) == 1 and listed[0].startswith(f"run_id={runs[0].run_id}/")
    assert (tmp_path / "new" / listed[0]).exists()
    assert main(["vacuum", str(tmp_path / "new"), "--older-than", "0"]) == 0
    assert not (tmp_path / "new" / listed[0]).exists()
    same(Run.load(tmp_path / "new", run_id=runs[0].run_id), runs[0])
    with pytest.raises(SystemExit):
        main(["vacuum", str(tmp_path / "new"), "--older-than", "-1"])
    assert "must be a number of hours >= 0" in capsys.readouterr().err


def test_vacuum_removes_a_vocabulary_no_committed_part_names(tmp_path):
    run = _tokenizer_run(50, 1)
    run.to_dataset(tmp_path)
    other = _tokenizer_run(70, 2)
    table = RunTable.at(tmp_path)
    table.stage(other.to_arrow(), other.metadata)  # staged, never committed: its vocabulary is named by no commit
    assert len(list((tmp_path / VOCAB_DIR).iterdir())) == 2
    assert vacuum(tmp_path, older_than_hours=1).vocabularies == []  # too young: a writer may be at work
    removed = vacuum(tmp_path, older_than_hours=0)
    assert len(removed.vocabularies) == 1 and len(removed.parts) == 1
    same(Run.load(tmp_path), run)


# ---------------------------------------------------------------- the defects issue 41 listed


def test_run_ids_carry_64_random_bits():
    from tracker.format.provenance import new_run_id

    tails = [new_run_id().split("-")[1] for _ in range(2000)]
    assert all(len(t) == 16 for t in tails)
    for position in range(16):  # a uuid4's hex has a fixed version digit; these vary everywhere
        assert len({t[position] for t in tails}) == 16, position


def test_the_favourite_masked_by_the_constraint_is_answered_in_top_k_storage(tmp_path):
    from dashboard.synthetic import hand_made_run

    rng = np.random.default_rng(7)
    steps, vocab = 12, 200
    natural = rng.standard_normal((steps, vocab)).astype(np.float32)
    favourite = natural.argmax(1)
    masked_at = np.arange(steps) % 3 == 0
    allowed = rng.random((steps, vocab)) < 0.5  # many more allowed than top_k keeps
    allowed[np.arange(steps), favourite] = ~masked_at
    constrained = np.where(allowed, natural, -np.inf).astype(np.float32)
    run = hand_made_run(
        natural,
        constrained.argmax(1),
        [f"t{i}" for i in range(vocab)],
        constrained=constrained,
        storage="topk",
        top_k=4,
    )
    run.to_dataset(tmp_path)
    got = (
        open_dataset(tmp_path)
        .sql("SELECT step, masked FROM candidates WHERE stage = 'natural' AND rank = 0 ORDER BY step")
        .to_pylist()
    )
    assert [r["masked"] for r in got] == masked_at.tolist()
    full = open_dataset(tmp_path, k=4).sql(
        "SELECT count(*) FILTER (masked IS NULL) AS unknown FROM candidates WHERE stage = 'natural' AND rank > 0"
    )
    assert full.column(0)[0].as_py() > 0  # other masked tokens top-k storage cannot tell stay NULL


def test_sequences_carry_each_generations_sampling_and_runs_say_none_without_a_processor(demo):
    from sampling import Generator, SamplingParams
    from tracker import add_tracking

    model, tokenizer = demo
    gen = add_tracking(Generator(model, tokenizer), storage="topk", top_k=5)
    gen.generate(["The city"], SamplingParams(max_new_tokens=4, temperature=0.0))
    gen.generate(["Once"], SamplingParams(max_new_tokens=4, temperature=0.8, seed=11))
    with pytest.MonkeyPatch.context() as patch:
        import tempfile

        root = tempfile.mkdtemp()
        patch.setenv("LOGITSCOPE_CACHE", os.path.join(root, "cache"))
        gen.logits_processor.to_dataset(root)
        data = open_dataset(root)
        rows = data.sql("SELECT generation, sampling FROM sequences ORDER BY generation").to_pylist()
        import json

        settings = [json.loads(r["sampling"]) for r in rows]
        assert settings[0]["temperature"] == 0.0 and settings[1]["temperature"] == 0.8 and settings[1]["seed"] == 11
        assert data.sql("SELECT processors FROM runs").column(0).to_pylist() == ["none"]


def test_a_file_written_by_any_parquet_writer_from_a_table_part_reads_back(tmp_path):
    """A part copied by a plain engine (pyarrow here) keeps the run: the columns' types come back from the
    metadata (its run_meta column), the vocabulary from the table beside it."""
    run = recorded(steps=3, seed=110).run
    part = Path(run.to_dataset(tmp_path))
    table = pq.read_table(part)
    assert META_VOCAB not in (table.schema.metadata or {})
    same(Run.load(part), run)
    copy = tmp_path / "elsewhere.parquet"
    pq.write_table(table, copy)
    with pytest.raises(ValueError, match="its vocabulary is kept by the table"):
        Run.load(copy)


def test_a_steered_generation_of_a_table_run_reads_like_its_file(tmp_path):
    """Every generation and sequence of a multi-generation run, through the table and through its file."""
    tracker = LogitTrackingProcessor(None, storage="float16")
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.tensor([[1, 2], [3, 4]])
        for _ in range(4):
            out = tracker(ids, torch.randn(2, 40, generator=gen) * 2)
            ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
        tracker.finish(ids)
    tracker.to_dataset(tmp_path / "t")
    same(Run.load(tmp_path / "t"), Run.load(tracker.to_parquet(tmp_path / "f.parquet")))
