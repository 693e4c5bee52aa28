"""A table's runs rewritten in fewer parts (tracker.reading.compact, ``logitscope compact``): every reader
answers the same before and after, parts committed meanwhile stay, a compaction that lost a race changes
nothing, and plain engines never see a row twice."""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pytest
from test_fleet_store import recorded, s3  # noqa: F401 - s3: the moto server fixture
from test_table import _committed_rows, _part

from tracker import Run, open_dataset
from tracker.format.table import RunTable, TableError
from tracker.format.table_writer import TableWriter
from tracker.format.upkeep import vacuum
from tracker.reading.compact import compact

pytest.importorskip("deltalake")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITSCOPE_CACHE", str(tmp_path / "cache"))


def _server_table(root, generations: int = 12) -> Run:
    """A server's run committed a part at a time (generation 3 in two parts, the later one ending last), and
    another run of one part."""
    run = recorded(steps=3, seed=90).run
    with TableWriter(root, commit_every_s=0.01) as writer:
        for g in range(generations):
            writer.add(*_part(run, g, "server-1"))
            writer.flush()
        later, meta = _part(run, 3, "server-1")
        later = later.set_column(2, "step", pa.array(later.column("step").to_numpy() + 3))
        writer.add(later, replace(meta, generations=[dict(meta.generations[0], lengths=[6], ended_at="~")]))
        writer.flush()
    recorded(steps=4, seed=91).run.to_dataset(root)
    return run


def _parts(root, run_id: str) -> list[str]:
    return [p.path for p in RunTable(root).committed() if p.run_id == run_id]


def _answers(root) -> tuple:
    data = open_dataset(root)
    steps = data.sql("SELECT * FROM steps ORDER BY run_id, generation, sequence, step")
    sequences = data.sql("SELECT * FROM sequences ORDER BY run_id, generation, sequence")
    loaded = Run.load(root, run_id="server-1")
    return steps, sequences, loaded.to_arrow().sort_by([("generation", "ascending"), ("step", "ascending")]), loaded


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_of_many_parts_reads_the_same_in_fewer_and_plain_engines_see_each_row_once(where, s3, tmp_path):  # noqa: F811
    tmp_path = str(tmp_path / "table") if where == "local" else f"s3://bucket/compact-{tmp_path.name}"
    _server_table(tmp_path)
    assert len(_parts(tmp_path, "server-1")) == 13
    other = _parts(tmp_path, next(r for r in _committed_rows(tmp_path) if r != "server-1"))
    steps, sequences, rows, loaded = _answers(tmp_path)
    counts = _committed_rows(tmp_path)

    done = compact(tmp_path, min_parts=2, dry_run=True)
    assert [(d.run_id, d.parts_before, d.parts_after) for d in done] == [("server-1", 13, 1)]
    assert len(_parts(tmp_path, "server-1")) == 13  # a dry run writes nothing

    done = compact(tmp_path, min_parts=2)
    assert [(d.run_id, d.parts_before, d.parts_after) for d in done] == [("server-1", 13, 1)]
    assert len(_parts(tmp_path, "server-1")) == 1
    assert _parts(tmp_path, next(r for r in counts if r != "server-1")) == other  # one part: left as it is
    after = _answers(tmp_path)
    assert after[0].equals(steps) and after[1].equals(sequences) and after[2].equals(rows)
    assert after[3].metadata.generations == loaded.metadata.generations
    assert next(g for g in after[3].metadata.generations if g["generation"] == 3)["lengths"] == [6]
    assert _committed_rows(tmp_path) == counts
    assert compact(tmp_path, min_parts=2) == []  # nothing left to do

    removed = vacuum(tmp_path, older_than_hours=0)
    assert len(removed.parts) == 13
    assert _answers(tmp_path)[0].equals(steps)


def test_groups_stay_under_max_bytes_and_parts_committed_meanwhile_stay(tmp_path):
    tmp_path = tmp_path / "table"
    run = _server_table(tmp_path)
    size = max(p.size for p in RunTable(tmp_path).committed() if p.run_id == "server-1")
    done = compact(tmp_path, min_parts=2, max_bytes=4 * size)
    assert done[0].parts_after == 4 and len(_parts(tmp_path, "server-1")) == 4  # 13 parts: 4 + 4 + 4 + 1

    table = RunTable(tmp_path)  # a compaction staged against these parts; a writer commits one meanwhile
    before = _parts(tmp_path, "server-1")
    staged = table.stage(
        Run.load(tmp_path, run_id="server-1").to_arrow(), Run.load(tmp_path, run_id="server-1").metadata
    )
    with TableWriter(tmp_path, commit_every_s=0.01) as writer:
        writer.add(*_part(run, 20, "server-1"))
    table.commit([staged], remove=set(before))
    assert 20 in Run.load(tmp_path, run_id="server-1").generations()  # the new part stayed
    assert len(_parts(tmp_path, "server-1")) == 2

    late = table.stage(Run.load(tmp_path, run_id="server-1").to_arrow(), Run.load(tmp_path, run_id="server-1").metadata)
    with pytest.raises(TableError, match="no longer holds 4 of the parts this commit removes"):
        table.commit([late], remove=set(before))  # another compaction removed them first
    assert len(_parts(tmp_path, "server-1")) == 2


def test_bad_arguments_and_a_folder_that_is_not_a_table_are_refused(tmp_path):
    with pytest.raises(ValueError, match="min_parts must be an int >= 2, got 1"):
        compact(tmp_path, min_parts=1)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1, got 0"):
        compact(tmp_path, max_bytes=0)
    with pytest.raises(TableError, match="is not a table"):
        compact(tmp_path)


def test_compact_from_the_command_line(tmp_path, capsys):
    from logitscope.cli import main

    root = tmp_path / "table"
    _server_table(root, generations=5)
    assert main(["compact", str(root), "--min-parts", "2", "--dry-run"]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("server-1: 6 parts (") and "-> 1 (" in said.out and "would rewrite 1 run(s)" in said.err
    assert len(_parts(root, "server-1")) == 6
    assert main(["compact", str(root), "--min-parts", "2", "--run", "server-1"]) == 0
    assert "rewrote 1 run(s)" in capsys.readouterr().err and len(_parts(root, "server-1")) == 1
    with pytest.raises(SystemExit):
        main(["compact", str(root), "--min-parts", "1"])
    assert "argument --min-parts: must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compact", str(tmp_path)])
    assert "is not a table" in capsys.readouterr().err


def test_parts_written_before_names_carried_their_digest_are_rewritten_with_it(tmp_path, monkeypatch):
    """A table written before part names ended with the digest of their bytes (the writer of then is
    imitated: the same part under a name without it) is rewritten by compact, whatever its runs' part
    counts; every reader answers the same after, and each part's name then names its bytes."""
    from pathlib import Path

    import tracker.format.table as table_module
    from tracker.format.run_file import named_digest, part_digest

    written = table_module.write_part

    def undigested(*args, **kwargs):
        where, size, schema = written(*args, **kwargs)
        old = where[: where.rindex("-sha")] + ".parquet"
        Path(where).rename(old)
        return old, size, schema

    root = tmp_path / "table"
    with monkeypatch.context() as patched:
        patched.setattr(table_module, "write_part", undigested)
        _server_table(root, generations=3)
    committed = RunTable(root).committed()
    assert committed and all(named_digest(p.path) is None for p in committed)
    before = _answers(root)

    done = compact(root)  # the default --min-parts: runs of 1 and 4 parts
    assert sorted((d.run_id, d.parts_after) for d in done) == sorted(
        (p.run_id, 1) for p in {c.run_id: c for c in committed}.values()
    )
    after = RunTable(root).committed()
    assert len(after) == len(done)
    for part in after:
        assert named_digest(part.path) == part_digest((root / part.path).read_bytes())
    for old, new in zip(before[:3], _answers(root)[:3]):
        assert old.equals(new)
    assert compact(root) == []  # nothing left to rewrite
