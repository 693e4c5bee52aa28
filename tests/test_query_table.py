"""The ``steps`` and ``sequences`` views made for many runs at once (tracker.reading.query_steps) against the
run-by-run path (tracker.reading.query_views.steps_tables, itself checked against Run.stats): the same
numbers, whatever the runs' storage, stages, ends of sequences and vocabularies, and whichever columns a
query names first."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dashboard.synthetic import hand_made_run
from tracker import Run, open_dataset
from tracker.reading.query_views import SEQUENCES_SCHEMA, steps_tables

KEYS = ["run_id", "generation", "sequence", "step"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITSCOPE_CACHE", str(tmp_path / "cache"))


def _runs() -> list[Run]:
    """Runs the fast path must cut and describe as the slow one does: end-of-sequence tokens inside and at the
    end of sequences, several generations and sequences, every storage, with and without a constraint, two
    vocabularies."""
    rng = np.random.default_rng(11)
    runs = []
    for n, storage in enumerate(["float32", "float16", "bfloat16", "topk", "topk"]):
        vocab = 40 if n < 4 else 25
        natural = rng.standard_normal((2, 3, 6, vocab)).astype(np.float32) * 2
        constrained = np.where(rng.random(natural.shape) < 0.6, natural, -np.inf).astype(np.float32)
        constrained[..., 1] = natural[..., 1]  # something is always allowed
        chosen = constrained.argmax(-1)
        chosen[0, 0, 2] = 0  # an end of sequence mid-way: the steps after it are the sequence's no more
        chosen[1, 2, 5] = 0
        tokens = [f"w{i}" for i in range(vocab)]
        kept = constrained if n % 2 == 0 else None
        runs.append(hand_made_run(natural, chosen, tokens, constrained=kept, eos_token_id=0, storage=storage, top_k=5))
    return runs


def _slow(runs: list[Run]) -> tuple[pa.Table, pa.Table]:
    pairs = [steps_tables(run) for run in runs]
    steps = pa.concat_tables([s for s, _ in pairs], promote_options="permissive")
    return steps, pa.concat_tables([q for _, q in pairs]) if pairs else SEQUENCES_SCHEMA.empty_table()


def _sorted(table: pa.Table, names: list[str]) -> pa.Table:
    return table.select(names).sort_by([(k, "ascending") for k in KEYS if k in names])


def _equal(a: pa.Table, b: pa.Table) -> None:
    names = sorted(b.column_names)
    assert sorted(a.column_names) == names
    a, b = _sorted(a, names), _sorted(b, names)
    assert a.num_rows == b.num_rows
    for name in names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        if pa.types.is_floating(y.type):
            assert x.null_count == y.null_count, name
            np.testing.assert_allclose(
                x.to_numpy(zero_copy_only=False), y.to_numpy(zero_copy_only=False), rtol=0, atol=0, err_msg=name
            )
        else:
            assert x.cast(y.type).equals(y), name


def test_steps_and_sequences_of_many_runs_are_those_of_each_run(tmp_path):
    runs = _runs()
    for run in runs:
        run.to_dataset(tmp_path)
    loaded = [Run.load(tmp_path, run_id=run.run_id) for run in runs]
    slow_steps, slow_sequences = _slow(loaded)
    data = open_dataset(tmp_path)
    _equal(data.table("steps"), slow_steps)
    _equal(data.table("sequences"), slow_sequences)
    assert pc.sum(pc.equal(data.table("steps").column("step"), 5)).as_py() < len(runs) * 6  # some cut short


def test_a_query_reads_the_columns_it_names_and_later_queries_get_the_rest(tmp_path):
    runs = _runs()
    for run in runs:
        run.to_dataset(tmp_path)
    data = open_dataset(tmp_path)
    first = data.sql("SELECT run_id, generation, sequence, step, entropy_natural FROM steps").to_pandas()
    assert set(data.table("steps", {"entropy_natural"}).column_names) < set(_slow(runs)[0].column_names)
    full = data.sql("SELECT * FROM steps")
    _equal(full, _slow([Run.load(tmp_path, run_id=r.run_id) for r in runs])[0])
    again = data.sql("SELECT run_id, generation, sequence, step, entropy_natural FROM steps").to_pandas()
    key = ["run_id", "generation", "sequence", "step"]
    assert first.sort_values(key, ignore_index=True).equals(again.sort_values(key, ignore_index=True))


def test_a_folder_of_files_and_its_table_give_the_same_views(tmp_path):
    runs = _runs()
    for run in runs:
        run.to_dataset(tmp_path / "table")
        run.to_parquet(tmp_path / "files" / f"{run.run_id}.parquet")
    query = "SELECT * FROM steps ORDER BY run_id, generation, sequence, step"
    assert open_dataset(tmp_path / "files").sql(query).equals(open_dataset(tmp_path / "table").sql(query))
    query = "SELECT * FROM sequences ORDER BY run_id, generation, sequence"
    assert open_dataset(tmp_path / "files").sql(query).equals(open_dataset(tmp_path / "table").sql(query))


def test_a_damaged_statistic_in_one_of_many_runs_names_that_run(tmp_path):
    import pyarrow.parquet as pq

    runs = _runs()[:3]
    paths = [run.to_parquet(tmp_path / f"{run.run_id}.parquet") for run in runs]
    table = pq.read_table(paths[1])
    entropy = table.column("natural_entropy").to_pylist()
    entropy[3] = -5.0  # a negative entropy: no distribution has one
    index = table.schema.get_field_index("natural_entropy")
    pq.write_table(table.set_column(index, table.schema.field(index), pa.array(entropy, pa.float32())), paths[1])
    with pytest.raises(ValueError, match=rf"{runs[1].run_id}\.parquet.*'natural_entropy' holds values outside"):
        open_dataset(tmp_path).sql("SELECT avg(entropy_natural) FROM steps")


def _kept_file(cache) -> list:
    return sorted(cache.rglob("*.columns.parquet"))


def test_a_table_answers_the_same_from_what_an_earlier_process_kept_and_sees_new_commits(tmp_path):
    import pyarrow.parquet as pq

    runs = _runs()
    table = tmp_path / "table"
    for run in runs[:3]:
        run.to_dataset(table)
    query = "SELECT run_id, generation, sequence, step, entropy_natural, p_eos_natural FROM steps"
    first = open_dataset(table).sql(query)
    assert len(_kept_file(tmp_path / "cache")) == 1
    _equal(open_dataset(table).sql(query), first)
    _equal(open_dataset(table).sql("SELECT * FROM steps"), _slow(runs[:3])[0])  # more columns than were kept

    runs[3].to_dataset(table)  # a new commit: in the next answer, with the kept ones
    _equal(open_dataset(table).sql(query), _slow(runs[:4])[0].select(first.column_names))

    kept = _kept_file(tmp_path / "cache")[0]
    rows, index_of_parts = pq.read_table(kept), pq.read_metadata(kept).metadata
    at = rows.schema.get_field_index("natural_entropy")
    lies = rows.set_column(at, rows.schema.field(at), pa.array(np.full(rows.num_rows, -1.0, np.float32)))
    with pq.ParquetWriter(kept, lies.schema, store_schema=False) as writer:  # kept values that fail the checks
        writer.write_table(lies)
        writer.add_key_value_metadata(index_of_parts)
    expected = _slow(runs[:4])[0].select(first.column_names)
    _equal(open_dataset(table).sql(query), expected)  # answered from the parts, and kept anew
    assert np.nanmin(pq.read_table(kept).column("natural_entropy").to_numpy(zero_copy_only=False)) >= 0

    kept.write_bytes(kept.read_bytes()[:-100] + bytes(100))  # a damaged file: as if nothing was kept
    _equal(open_dataset(table).sql(query), expected)


def test_a_table_part_with_rows_narrower_than_its_run_says_is_refused_naming_it_once(tmp_path):
    import pyarrow.parquet as pq

    from tracker.format.checks import RunFileError

    runs = _runs()[:2]
    for run in runs:
        run.to_dataset(tmp_path)
    part = next((tmp_path / f"run_id={runs[0].run_id}").glob("*.parquet"))
    rows = pq.read_table(part)
    at = rows.schema.get_field_index("natural_logits")
    narrow = pa.array([None if r is None else r[:-1] for r in rows.column(at).to_pylist()], pa.list_(pa.float32()))
    pq.write_table(rows.set_column(at, rows.schema.field(at).with_type(narrow.type), narrow), part)
    with pytest.raises(RunFileError) as refused:
        open_dataset(tmp_path).sql("SELECT count(*) FROM steps")
    error = str(refused.value)
    assert part.name in error and "'natural_logits'" in error and "not 40 wide" in error
    assert error.count("cannot be read") == 1


def _flip_a_value(part, column: str) -> None:
    """Flip one byte of ``column``'s last data page in the Parquet file ``part`` (inside its compressed
    values, past the page header), keeping the file's size and footer."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(part).metadata.row_group(0)
    chunk = next(meta.column(j) for j in range(meta.num_columns) if meta.column(j).path_in_schema == column)
    data = bytearray(part.read_bytes())
    at = chunk.data_page_offset + chunk.total_compressed_size - 3
    data[at] ^= 0x10
    part.write_bytes(bytes(data))


def test_small_table_parts_are_read_in_one_scan_only_when_their_bytes_are_the_ones_written(tmp_path):
    """Small local parts are read by DuckDB's reader, which checks no page checksum: each part's name carries
    its bytes' digest, and a part whose bytes changed is read through the checked opener instead, which
    refuses it naming the file (rather than answer a flipped value as another value)."""
    from tracker.format.checks import RunFileError
    from tracker.format.run_file import part_digest

    runs = _runs()
    for run in runs:
        run.to_dataset(tmp_path)
    parts = sorted(tmp_path.glob("run_id=*/*.parquet"))
    assert len(parts) == len(runs)
    for part in parts:  # named for their bytes
        assert part.name.endswith(f"-sha{part_digest(part.read_bytes())}.parquet")
    query = "SELECT * FROM steps"
    _equal(open_dataset(tmp_path).sql(query), _slow(runs)[0])

    damaged = parts[2]
    _flip_a_value(damaged, "natural_entropy")
    with pytest.raises(RunFileError, match=damaged.name):
        _fresh(tmp_path).sql(query)


def _fresh(root):
    """The dataset at ``root`` as a process that kept nothing of it sees it."""
    import os
    import shutil

    shutil.rmtree(os.environ["LOGITSCOPE_CACHE"], ignore_errors=True)
    return open_dataset(root)
