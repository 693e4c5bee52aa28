"""Run files crafted by hand: refused at load with one line naming the file, or read right; never a crash,
never a silent wrong answer; one bad file never hides the good ones; a full disk names the file it failed on."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import streamlit as st
import torch
from marker_support import marker_run
from streamlit.testing.v1 import AppTest
from test_fuzz_files import lying_lengths
from test_run_files import recorded, rewrite

from dashboard.discover import find_runs, summarize
from dashboard.paths import APP
from dashboard.reader import BadRunError, RunReader
from processors.vocab import Vocabulary
from tracker import LogitTrackingProcessor, Run, open_dataset
from tracker.format.layout import RunFileError
from tracker.format.schema import META_RUN, META_VOCAB

REPO = Path(__file__).resolve().parent.parent


def _ipc(table: pa.Table, path: Path) -> Path:
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return path


def lying_ipc(path: Path, rows: int = 1_000_000) -> Path:
    """An Arrow IPC run whose record batch declares ``rows`` rows (and ``rows * V`` logits) while its buffers
    hold 13 rows: read as declared, values lie past the end of the memory map (SIGBUS, or other memory)."""
    table = recorded(steps=8, vocab=50).run.to_arrow().slice(0, 13)
    # ids and values only: no statistics column whose buffer sizes could hold the numbers the lie replaces
    table = table.select(["generation", "sequence", "step", "chosen", "processor_error", "natural_logits"])
    path.write_bytes(lying_lengths(table, {13: rows, 13 * 50: rows * 50}))  # the batch's, columns', values'
    return path


def lying_offsets(path: Path) -> Path:
    """An Arrow IPC run whose ``generation_meta`` string offsets say 2^30 while its text is about 100 bytes:
    read as declared, a string runs a gigabyte past its buffer (SIGSEGV)."""

    from tracker.format.run_file import parquet_table

    run = recorded(steps=3, vocab=40).run
    table = parquet_table(run.to_arrow(), run.metadata)
    column = table.column("generation_meta").combine_chunks()
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[: len(column) + 1]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = bytearray(sink.getvalue().to_pybytes())
    at = data.find(offsets.tobytes())
    assert at > 0 and data.find(offsets.tobytes(), at + 1) < 0
    lie = offsets.copy()
    lie[1:] = 1 << 30
    data[at : at + lie.nbytes] = lie.tobytes()
    path.write_bytes(bytes(data))
    return path


READ_ALL = """
import sys
from tracker import Run
from dashboard.reader import RunReader
what, path = sys.argv[1], sys.argv[2]
try:
    if what == "load":
        run = Run.load(path)
        run.stats(); run.get_top_tokens(k=3)
    else:
        reader = RunReader(path)
        track = reader.track(0, 0)
        [reader.step(track, p) for p in range(track.length)]
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def _subprocess(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("reader", ["load", "reader", "inspect"])
def test_an_ipc_file_declaring_more_rows_than_it_holds_is_refused_not_a_crash(tmp_path, reader):
    path = lying_ipc(tmp_path / "lying.arrow")
    if reader == "inspect":
        done = _subprocess("-m", "logitscope", "inspect", str(path), "--steps", "all")
    else:
        done = _subprocess("-c", READ_ALL, reader, str(path))
    assert done.returncode == 1, f"exit status {done.returncode} (a signal is negative): {done.stderr[-2000:]}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "lying.arrow" in lines[0] and "buffers" in lines[0], done.stderr


QUERY = "SELECT count(*) FROM runs"


@pytest.mark.parametrize("reader", ["load", "reader", "inspect", "query"])
def test_an_ipc_file_whose_string_offsets_lie_is_refused_by_every_reader(tmp_path, reader):
    path = lying_offsets(tmp_path / "offsets.arrow")
    if reader in ("inspect", "query"):
        done = _subprocess(
            "-m", "logitscope", reader, str(path), *(["--steps", "all"] if reader == "inspect" else [QUERY])
        )
    else:
        done = _subprocess("-c", READ_ALL, reader, str(path))
    assert done.returncode in (1, 2), f"exit status {done.returncode} (a signal is negative): {done.stderr[-2000:]}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "offsets.arrow" in lines[0] and "offset" in lines[0], done.stderr
    assert lines[0].count("cannot be read as a logitscope run") <= 1, lines[0]


def test_a_served_folder_holding_a_lying_ipc_file_lists_the_others(tmp_path):
    recorded(steps=3, vocab=40).to_parquet(tmp_path / "good.parquet")
    lying_ipc(tmp_path / "lying.arrow")
    summaries = {Path(p).name: summarize(p, tmp_path) for p in find_runs(tmp_path)}
    assert summaries["good.parquet"].error is None and summaries["good.parquet"].steps == 3
    assert "declares more values than its buffers hold" in summaries["lying.arrow"].error


def test_a_run_whose_chosen_tokens_are_unknown_shows_in_a_notebook():
    tracker = LogitTrackingProcessor(None)
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(3):  # no finish(): the last chosen token is never known
        out = tracker(ids, torch.randn(1, 50, generator=torch.Generator().manual_seed(3)))
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    run = tracker.run
    assert run.stats()["chosen_id"].isna().tolist() == [False, False, True]
    known = ["&lt;" + str(int(i)) + "&gt;" for i in ids[0, 3:5]]
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td>", run.view()._repr_html_())
    assert [name for _, name in rows] == [*known, "—"]
    assert all(token in run._repr_html_() for token in known)


def _two_copies(tmp_path: Path, marker: bool = False) -> Path:
    path = marker_run(recorded(steps=3, vocab=40).run, tmp_path / "runs", marker=marker)
    shutil.copy(path, path.with_name("part-00001.parquet"))  # a run and a copy of it, in one run folder
    return path.parent  # without a marker (a folder copied by hand, or written before markers): every part is read


def test_a_complete_runs_folder_reads_the_parts_its_marker_names_not_a_copy_put_beside_them(tmp_path):
    folder = _two_copies(tmp_path, marker=True)
    run, alone = Run.load(folder), Run.load(folder / "part-00000.parquet")
    assert run.to_arrow().equals(alone.to_arrow()) and run.sequence() == alone.sequence()


def test_a_table_reads_the_parts_its_commits_name_not_a_copy_put_beside_them(tmp_path):
    written = Path(recorded(steps=3, vocab=40).run.to_dataset(tmp_path / "table"))
    shutil.copy(written, written.with_name("part-copy.parquet"))  # dropped into the run's folder, never committed
    run, alone = Run.load(written.parent), Run.load(written)
    assert run.to_arrow().equals(alone.to_arrow()) and run.sequence() == alone.sequence()
    assert [p.name for p in find_runs(tmp_path / "table")] == [written.parent.name]


def test_a_run_and_its_copy_in_one_folder_are_refused_not_read_with_every_step_twice(tmp_path):
    folder = _two_copies(tmp_path)
    with pytest.raises(RunFileError, match=r"generation 0, sequence 0, step 0 is recorded .* times"):
        Run.load(folder)
    with pytest.raises(BadRunError, match="recorded .* times"):
        RunReader(folder)
    summary = summarize(folder)
    assert summary.error is not None and "keep one copy" in summary.error


def test_a_part_symlinked_from_outside_the_served_folder_is_not_listed(tmp_path):
    outside = recorded(steps=3, vocab=40).to_parquet(tmp_path / "elsewhere" / "secret.parquet")
    served = tmp_path / "served"
    marker_run(recorded(steps=2, vocab=40, seed=1).run, served)
    (served / "run_id=x").mkdir()
    (served / "run_id=x" / "part-00000.parquet").symlink_to(outside)
    (served / "run_id=x" / "_complete.json").write_text('{"run_id": "x", "parts": ["part-00000.parquet"]}')
    (served / "inside.parquet").symlink_to(next(served.glob("run_id=2*/part-00000.parquet")))  # inside: kept
    found = sorted(p.relative_to(served).as_posix() for p in find_runs(served))
    assert len(found) == 2 and "run_id=x" not in found and "inside.parquet" in found
    assert find_runs(served / "run_id=x") == []  # nor when pointed at directly


def _table_with(table: pa.Table, name: str, values: list) -> pa.Table:
    index = table.schema.get_field_index(name)
    field = table.schema.field(name)
    return table.set_column(index, field, pa.array(values, field.type))


def _set(name: str, row: int, value):
    def change(table: pa.Table) -> pa.Table:
        values = table.column(name).to_pylist()
        values[row] = value if not isinstance(values[row], list) else [value, *values[row][1:]]
        return _table_with(table, name, values)

    return change


def _meta(change):
    def damage(table: pa.Table) -> pa.Table:
        meta = json.loads(table.schema.metadata[META_RUN])
        raw = change(meta)
        return table.replace_schema_metadata(
            {**table.schema.metadata, META_RUN: raw if isinstance(raw, bytes) else json.dumps(meta).encode()}
        )

    return damage


def _generation_entry(key, value):
    def damage(table: pa.Table) -> pa.Table:
        rows = table.column("generation_meta").to_pylist()
        entries = json.loads(rows[0])
        entries[0][key] = value
        rows[0] = json.dumps(entries)
        return _table_with(table, "generation_meta", rows)

    return damage


def _deep(meta: dict) -> bytes:
    meta["extra"] = {"deep": "@"}
    return json.dumps(meta).encode().replace(b'"@"', b"[" * 100_000 + b"]" * 100_000)


def _null_generation(table: pa.Table) -> pa.Table:
    values = table.column("generation").to_pylist()
    values[-1] = None
    index = table.schema.get_field_index("generation")
    return table.set_column(index, pa.field("generation", pa.int32()), pa.array(values, pa.int32()))


def _cast(name: str, to: pa.DataType):
    def change(table: pa.Table) -> pa.Table:
        index = table.schema.get_field_index(name)
        return table.set_column(index, pa.field(name, to), table.column(name).cast(to, safe=False))

    return change


#: Where the crafted row is named in the refusal.
AT_1 = "at generation 0, sequence 0, step 1"


def _scale(name: str, row: int, factor: float):
    def change(table: pa.Table) -> pa.Table:
        return _set(name, row, table.column(name)[row].as_py() * factor)(table)

    return change


def _twice(name: str):
    def change(table: pa.Table) -> pa.Table:
        return table.append_column(table.schema.field(name), table.column(name))

    return change


def _short_vocabulary(table: pa.Table) -> pa.Table:
    return table.replace_schema_metadata({**table.schema.metadata, META_VOCAB: Vocabulary.placeholder(10).serialize()})


CRAFTED = {
    "chosen-10**12": (_set("chosen", 2, 10**12), r"'chosen' holds 1000000000000, outside the vocabulary \[0, 60\)"),
    "chosen-minus-2": (_set("chosen", 0, -2), r"'chosen' holds -2, outside the vocabulary"),
    "vocabulary-short": (_short_vocabulary, "vocabulary holds 10 tokens, fewer than the 60"),
    "topk-id-past-vocab": (
        _set("natural_topk_ids", 1, 60),
        r"'natural_topk_ids' holds token id 60, outside|token ids outside \[0, 60\)",
    ),
    "topk-id-minus-1": (
        _set("natural_topk_ids", 1, -1),
        r"'natural_topk_ids' holds token id -1, outside|token ids outside \[0, 60\)",
    ),
    "topk-lse-minus-50": (_set("natural_lse", 1, -50.0), "'natural_lse' and 'natural_max' disagree"),
    "entropy-nan": (_set("natural_entropy", 1, float("nan")), "'natural_entropy' holds values outside"),
    "lse-nan": (_set("natural_lse", 1, float("nan")), "'natural_lse' is NaN in a recorded row"),
    "max-inf": (_set("natural_max", 1, float("inf")), "'natural_lse' and 'natural_max' disagree"),
    "p-chosen-2": (_set("natural_p_chosen", 1, 2.0), "'natural_p_chosen' holds probabilities outside"),
    "entropy-as-int": (_cast("natural_entropy", pa.int64()), "column 'natural_entropy' has type int64"),
    "stages-empty": (_meta(lambda m: m.__setitem__("stages", [])), "'stages' must begin with 'natural'"),
    "stages-without-natural": (_meta(lambda m: m.__setitem__("stages", ["constrained"])), "begin with 'natural'"),
    "metadata-100000-deep": (_meta(_deep), "nested deeper than 32 levels"),
    "metadata-40-deep": (_meta(lambda m: m.__setitem__("extra", {"a": json.loads("[" * 40 + "]" * 40)})), "deeper"),
    "prompt-ids-text": (_generation_entry("prompt_ids", [["a"]]), "'prompt_ids' must hold integer token ids"),
    "prompt-ids-past-vocab": (_generation_entry("prompt_ids", [[60]]), r"'prompt_ids' holds token id 60"),
    "generation-entry-float": (_generation_entry("generation", 0.5), "'generation' must be an integer >= 0"),
    "generation-column-null": (_null_generation, "column 'generation' holds 1 null"),
    "lse-minus-inf": (_set("natural_lse", 1, -math.inf), "'natural_lse' and 'natural_allowed' disagree .*" + AT_1),
    "lse-plus-inf": (_set("natural_lse", 1, math.inf), "'natural_lse' and 'natural_max' disagree .*" + AT_1),
    "p-chosen-above-its-rank": (
        lambda t: _set("natural_p_chosen", 1, 0.99)(_set("natural_rank_chosen", 1, 4)(t)),
        r"'natural_p_chosen' and 'natural_rank_chosen' disagree \(with r tokens above it, the chosen token's "
        r"probability is at most 1 / \(r \+ 1\)\), " + AT_1,
    ),
    "p-chosen-not-its-logit": (
        _scale("natural_p_chosen", 1, 0.5),
        "'natural_chosen_logit' and 'natural_lse' disagree .*" + AT_1,
    ),
    "chosen-twice": (_twice("chosen"), r"holds columns \['chosen'\] more than once"),
    "lse-twice": (_twice("natural_lse"), r"holds columns \['natural_lse'\] more than once"),
    "stages-natural-twice": (
        _meta(lambda m: m.__setitem__("stages", ["natural", "natural"])),
        "'stages' must begin with 'natural', each once",
    ),
    "storage-claims-float32": (_meta(lambda m: m.__setitem__("storage", "float32")), "lacks the columns"),
}


@pytest.fixture(scope="module")
def topk_run(tmp_path_factory) -> Path:
    tracker = LogitTrackingProcessor(None, storage="topk", top_k=5)
    gen = torch.Generator().manual_seed(5)
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(4):
        out = tracker(ids, torch.randn(1, 60, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    tracker.finish(ids)
    return tracker.to_parquet(tmp_path_factory.mktemp("topk") / "good.parquet")


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_values_are_refused_at_load_with_one_line_naming_the_file(topk_run, tmp_path, case):
    change, message = CRAFTED[case]
    bad = rewrite(topk_run, tmp_path / f"{case}.parquet", table=change(pq.read_table(topk_run)))
    for read in (Run.load, RunReader):
        with pytest.raises((RunFileError, BadRunError), match=message) as caught:
            reader = read(bad)
            if isinstance(reader, RunReader):  # statistics are checked block by block, as they are read
                reader.step(reader.track(0, 0), 1)
        assert f"{case}.parquet" in str(caught.value) and "\n" not in str(caught.value)
    listed = summarize(bad)
    assert listed.error is not None or case.startswith(("topk-", "entropy", "lse-", "max", "p-"))
    for view in ("steps", "candidates"):  # the query views read through the same checks (every column named)
        if view == "steps" and case.startswith("topk-id"):
            continue  # steps reads no top-k id: its answer holds; candidates reads them
        with pytest.raises(RunFileError, match=message) as caught:
            open_dataset(bad).sql(f"SELECT * FROM {view}")
        assert f"{case}.parquet" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("lse", [-50.0, -math.inf, math.inf])
def test_a_damaged_top_k_row_is_named_by_the_query_that_reads_it(topk_run, tmp_path, lse):
    """Where the load does not check a row (a run without statistics columns), the query reading it refuses:
    a log-sum-exp below the row's largest stored logit, or +inf where the row stores no +inf."""
    table = pq.read_table(topk_run)
    keep = [n for n in table.schema.names if not re.match(r"natural_(max|entropy|nan|p_|chosen_|rank_)", n)]
    table = _set("natural_lse", 1, lse)(table.select(keep))
    from tracker.format.checks import DamagedRowError

    with pytest.raises(DamagedRowError, match=r"log-sum-exp .* below their largest stored logit, or \+inf where"):
        Run.from_arrow(table).get_top_tokens(k=3)
    bad = rewrite(topk_run, tmp_path / "bad.parquet", table=table)  # from a file: refused naming it, at load or read
    with pytest.raises((DamagedRowError, RunFileError), match=r"^'.*bad\.parquet'"):
        Run.load(bad).get_top_tokens(k=3)


FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
from test_run_files import recorded
run = recorded(steps=40, vocab=2000).run
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG, as a full disk fails it
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
for write, target in ((run.to_parquet, sys.argv[1]), (run.to_dataset, sys.argv[2])):
    try:
        write(target)
        print("written")
    except OSError as exc:
        print(f"OSError: {{exc}}")
"""


def test_a_full_disk_names_the_file_and_leaves_no_empty_dataset_folder(tmp_path):
    script = FULL_DISK.format(tests=str(REPO / "tests"))
    done = _subprocess("-c", script, str(tmp_path / "out" / "run.parquet"), str(tmp_path / "dataset"))
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout + done.stderr
    assert re.match(r"OSError: \[Errno 27\] File too large: .*'.*out/run\.parquet'", lines[0]), lines[0]
    assert re.match(r"OSError: \[Errno 27\] File too large: .*'.*dataset/run_id=.*/part-.*\.parquet'", lines[1])
    assert not (tmp_path / "out").exists() and not (tmp_path / "dataset").exists()


def _bad_folder(tmp_path: Path) -> Path:
    for seed in range(2):
        recorded(steps=3 + seed, vocab=40, seed=seed).to_parquet(tmp_path / f"good-{seed}.parquet")
    table = pq.read_table(tmp_path / "good-0.parquet")
    rewrite(tmp_path / "good-0.parquet", tmp_path / "bad.parquet", table=_null_generation(table))
    return tmp_path


def test_inspect_of_a_folder_lists_the_good_runs_and_names_the_bad_one(tmp_path):
    from logitscope.cli import build_parser

    folder = _bad_folder(tmp_path)
    args = build_parser().parse_args(["inspect", str(folder)])
    out = io.StringIO()
    assert args.handler(args, args.command_parser, out) == 1
    lines = out.getvalue().strip().splitlines()
    assert lines[0] == "bad.parquet: not a readable run: column 'generation' holds 1 null(s); every row has one"
    assert lines[1].startswith("good-0.parquet: 3 step(s)") and lines[2].startswith("good-1.parquet: 4 step(s)")


def test_the_runs_page_lists_the_good_runs_and_names_the_bad_one(tmp_path):
    folder = _bad_folder(tmp_path)
    _meta_deep = _meta(_deep)(pq.read_table(folder / "good-1.parquet"))
    rewrite(folder / "good-1.parquet", folder / "deep.parquet", table=_meta_deep)
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["root"] = str(folder)
    at.run()
    assert not at.exception, at.exception[0].message if at.exception else ""
    assert at.dataframe[0].value["file"].tolist() == ["good-0.parquet", "good-1.parquet"]
    errors = [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]
    assert any("bad.parquet" in e and "column 'generation' holds 1 null" in e for e in errors), errors
    assert any("deep.parquet" in e and "nested deeper than 32 levels" in e for e in errors), errors


def test_query_of_a_folder_answers_the_good_runs_and_names_the_bad_ones(tmp_path, topk_run, capsys):
    from logitscope.cli import main

    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(topk_run, folder / "good.parquet")
    for case in ("chosen-twice", "storage-claims-float32"):
        rewrite(topk_run, folder / f"{case}.parquet", table=CRAFTED[case][0](pq.read_table(topk_run)))
    steps = Run.load(topk_run).num_rows
    for view in ("steps", "candidates"):
        assert main(["query", str(folder), f"SELECT count(DISTINCT step) AS n FROM {view}", "--csv"]) == 1
        out, err = capsys.readouterr()
        assert out == f"n\n{steps}\n"
        lines = err.strip().splitlines()
        assert len(lines) == 2 and all(line.startswith("logitscope query: left out of the answer: ") for line in lines)
        assert "chosen-twice.parquet" in lines[0] and "more than once" in lines[0]
        assert "storage-claims-float32.parquet" in lines[1] and "lacks the columns" in lines[1]


def _full_run(folder: Path, storage: str) -> Path:
    """A run in full storage (its rows' statistics recorded with them), 4 steps of 60 tokens."""
    tracker = LogitTrackingProcessor(None, storage=storage)
    gen = torch.Generator().manual_seed(5)
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(4):
        out = tracker(ids, torch.randn(1, 60, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    tracker.finish(ids)
    return tracker.to_parquet(folder / f"{storage}.parquet")


def _value(table: pa.Table, row: int, token: int, value: float) -> pa.Table:
    """``table`` with one stored logit of the natural stage replaced (the statistics left as recorded); in
    half precision the stored value is the logit minus the row's ``natural_max``."""
    name = next(n for n in table.schema.names if n.startswith("natural_logits"))  # float16: its bits, as int16
    index = table.schema.get_field_index(name)
    column = table.column(index).combine_chunks()  # a list column, fixed-size or not, as the file stores it
    width = len(column.values) // len(column)
    stored = column.values.to_numpy(zero_copy_only=False).copy().reshape(-1, width)
    values = stored.view(np.float16) if stored.dtype == np.int16 else stored
    offset = table.column("natural_max")[row].as_py() if values.dtype != np.float32 else 0.0
    values[row, token] = value - offset
    flat = pa.array(stored.reshape(-1), type=column.type.value_type)
    if pa.types.is_fixed_size_list(column.type):
        array = pa.FixedSizeListArray.from_arrays(flat, width)
    else:
        array = pa.ListArray.from_arrays(column.offsets, flat)
    return table.set_column(index, table.schema.field(index), array)


VALUE_DAMAGE = {  # a stored row its recorded statistics contradict
    "nan-where-its-count-says-none": (lambda t: _value(t, 1, t.column("chosen")[1].as_py(), math.nan), "NaN"),
    "logit-above-its-log-sum-exp": (lambda t: _value(t, 1, 7, t.column("natural_lse")[1].as_py() + 3), "log-sum-exp"),
}


@pytest.mark.parametrize("storage", ["float32", "float16"])
@pytest.mark.parametrize("damage", list(VALUE_DAMAGE))
def test_values_their_statistics_contradict_are_refused_naming_the_file_and_row(tmp_path, storage, damage):
    from dashboard import data

    change, word = VALUE_DAMAGE[damage]
    good = _full_run(tmp_path, storage)
    bad = rewrite(good, tmp_path / f"{damage}.parquet", table=change(pq.read_table(good)))
    reader = RunReader(bad)

    def replay():
        return [reader.step(reader.track(0, 0), p) for p in range(4)]

    for name, read in (
        ("get_top_tokens", lambda: Run.load(bad).get_top_tokens(k=3)),
        ("to_dataframe", lambda: Run.load(bad).to_dataframe()),
        ("candidates view", lambda: open_dataset(bad).sql("SELECT * FROM candidates")),
        ("overview window", lambda: data.window(str(bad), 0, 0, 0, 4)),
        ("step replay", replay),
    ):
        with pytest.raises((RunFileError, BadRunError, ValueError)) as caught:
            read()
        text = str(caught.value)
        assert f"{damage}.parquet" in text and AT_1 in text and word in text and "\n" not in text, (name, text)
    answers = Run.load(good).get_top_tokens(k=3)  # the undamaged run: every probability in [0, 1]
    assert all(0 <= t["unstructured_prob"] <= 1 for step in answers for t in step["tokens"])


def _lower_row_group(src: Path, dst: Path, rows: int) -> Path:
    """A copy of a one-row-group Parquet file whose footer says the row group holds ``rows`` rows (its pages
    and the file's own count still say more): read as declared, the rows past ``rows`` are dropped."""
    import struct

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n >> 7 else 0))
            n >>= 7
            if not n:
                return bytes(out)

    data = bytearray(src.read_bytes())
    group = pq.ParquetFile(src).metadata.row_group(0)
    footer = len(data) - 8 - struct.unpack("<i", data[-8:-4])[0]
    # thrift compact: RowGroup field 2 (total_byte_size, i64) then field 3 (num_rows, i64), zigzag varints
    old = b"\x16" + varint(group.total_byte_size << 1) + b"\x16" + varint(group.num_rows << 1)
    at = data.find(old, footer)
    assert at > 0 and len(varint(rows << 1)) == len(varint(group.num_rows << 1))
    data[at : at + len(old)] = old[: -len(varint(rows << 1))] + varint(rows << 1)
    dst.write_bytes(bytes(data))
    return dst


def test_a_row_group_whose_row_count_was_lowered_is_refused_not_read_short(tmp_path, topk_run):
    bad = _lower_row_group(topk_run, tmp_path / "short.parquet", 2)
    assert pq.ParquetFile(bad).read().num_rows == 2  # what a reader trusting the footer would see
    for read in (Run.load, RunReader, lambda p: open_dataset(p).sql("SELECT * FROM steps")):
        with pytest.raises((RunFileError, BadRunError)) as caught:
            read(bad)
        assert "short.parquet" in str(caught.value) and "row group 0 says it holds 2 rows" in str(caught.value)
    done = _subprocess("-m", "logitscope", "inspect", str(bad))
    assert done.returncode == 1 and "row group 0 says it holds 2 rows" in done.stderr and done.stderr.count("\n") == 1


def test_a_row_a_query_finds_damaged_leaves_its_run_out_named_and_answers_the_rest(tmp_path):
    """A damaged row found only when a view reads the values (not at the footers): that run is left out of
    the answer and named with its row, the others answered."""
    folder = tmp_path / "runs"
    folder.mkdir()
    good = _full_run(folder, "float32")
    change, _ = VALUE_DAMAGE["logit-above-its-log-sum-exp"]
    source = _full_run(tmp_path, "float16")
    rewrite(source, folder / "bad.parquet", table=change(pq.read_table(source)))
    dataset = open_dataset(folder)
    answer = dataset.sql("SELECT DISTINCT run_id FROM candidates").column("run_id").to_pylist()
    assert answer == [Run.load(good).run_id]
    [skipped] = dataset.skipped
    assert "bad.parquet" in str(skipped) and AT_1 in str(skipped) and "log-sum-exp" in str(skipped)
