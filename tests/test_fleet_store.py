"""Runs at fleet scale, storage side: URLs, a real S3-compatible server (moto) on the loopback, many writers
into one table, runs visible only once committed, parts streamed while a run generates, and the folders of
completion markers written before tables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch
from marker_support import marker_run

from tracker import LogitTrackingProcessor, Run
from tracker.format.dataset import COMPLETE, list_runs
from tracker.format.layout import PartialRunWarning
from tracker.format.table import RunTable

pytest.importorskip("moto")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(tracker, steps: int, vocab: int, gen: torch.Generator) -> None:
    """One generation of ``steps`` steps over random logits (two sequences)."""
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for _ in range(steps):
        out = tracker(ids, torch.randn(2, vocab, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    tracker.finish(ids)


def recorded(steps: int = 3, vocab: int = 60, seed: int = 0) -> LogitTrackingProcessor:
    tracker = LogitTrackingProcessor(None)
    record(tracker, steps, vocab, torch.Generator().manual_seed(seed))
    return tracker


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    """list_runs keeps what it read of markers on this machine: here, in the test's folder."""
    monkeypatch.setenv("LOGITSCOPE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 at a free port, with the AWS_* variables pointing at it for this module."""
    from moto.server import ThreadedMotoServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bucket")
    try:
        yield env
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        server.stop()


def same(a: Run, b: Run) -> None:
    assert a.run_id == b.run_id and a.metadata.generations == b.metadata.generations
    ta, tb = a.to_arrow(), b.to_arrow()
    assert ta.schema.names == tb.schema.names
    for name in ta.schema.names:
        assert ta.column(name).combine_chunks().equals(tb.column(name).combine_chunks()), name


def test_a_run_written_to_s3_reads_back_bit_identical(s3):
    run = recorded(steps=4, seed=1).run
    assert run.to_parquet("s3://bucket/one/run.parquet") == "s3://bucket/one/run.parquet"
    same(Run.load("s3://bucket/one/run.parquet"), run)
    part = run.to_dataset("s3://bucket/runs")
    assert part.startswith(f"s3://bucket/runs/run_id={run.run_id}/part-") and part.endswith(".parquet")
    same(Run.load("s3://bucket/runs"), run)
    same(Run.load("s3://bucket/runs", run_id=run.run_id), run)
    [entry] = list_runs("s3://bucket/runs")
    assert entry.run_id == run.run_id and entry.path == f"s3://bucket/runs/run_id={run.run_id}"
    assert entry.summary["steps"] == 4 and entry.summary["rows"] == run.num_rows


def test_the_dashboard_reader_opens_a_run_on_s3_as_it_opens_the_same_run_on_disk(s3, tmp_path):
    from dashboard.reader import RunReader

    run = recorded(steps=5, seed=2).run
    run.to_dataset("s3://bucket/dash")
    remote = RunReader(f"s3://bucket/dash/run_id={run.run_id}")
    local = RunReader(run.to_parquet(tmp_path / "run.parquet"))
    assert remote.generations() == local.generations() and remote.size_bytes > 0
    g = remote.generations()[0]
    for sequence in remote.sequences(g):
        track = remote.track(g, sequence, include_finished=True)
        assert track.length == 5
        for position in range(track.length):
            a, b = remote.step(track, position), local.step(local.track(g, sequence, include_finished=True), position)
            assert (a.step, a.chosen) == (b.step, b.chosen)
            for stage in run.stages:
                x, y = a.stages[stage], b.stages[stage]
                assert x.logits is not None and np.array_equal(x.logits, y.logits, equal_nan=True)
                assert x.lse == y.lse and x.allowed == y.allowed


def test_missing_and_unknown_urls_name_the_argument(s3):
    with pytest.raises(FileNotFoundError, match="no object or folder"):
        Run.load("s3://bucket/nothing-here")
    with pytest.raises(ValueError, match="path 'nosuchscheme://x'"):
        Run.load("nosuchscheme://x")


def test_a_streamed_run_is_invisible_until_closed_then_whole(tmp_path):
    tracker = recorded(steps=3, seed=3)
    stream = tracker.stream_to(tmp_path)
    stream.flush()
    assert list_runs(tmp_path) == []  # written, not committed: no reader sees it
    with pytest.raises(FileNotFoundError, match="no committed run yet"):
        Run.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no commit of its table names a part"):
        Run.load(stream.folder)
    stream.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same(Run.load(tmp_path), tracker.run)
    assert [e.run_id for e in list_runs(tmp_path)] == [tracker.run_id]


def test_a_marker_folder_without_its_marker_is_not_listed_not_loaded_from_its_root_and_warns_by_name(tmp_path):
    """The layout before tables: a run_id= folder without its _complete.json is a run still being written."""
    done, pending = recorded(steps=2, seed=1).run, recorded(steps=3, seed=3).run
    marker_run(done, tmp_path)
    marker_run(pending, tmp_path, marker=False)
    assert [e.run_id for e in list_runs(tmp_path)] == [done.run_id]
    same(Run.load(tmp_path), done)  # the root's one complete run
    with pytest.raises(FileNotFoundError, match="not complete .* a dataset's root shows complete runs only"):
        Run.load(tmp_path, run_id=pending.run_id)
    with pytest.warns(PartialRunWarning, match=COMPLETE):
        same(Run.load(tmp_path / f"run_id={pending.run_id}"), pending)


def test_a_marker_folder_answers_the_same_on_s3_as_on_a_local_disk(s3, tmp_path):
    done, pending = recorded(steps=2, seed=11).run, recorded(steps=3, seed=12).run
    for run, marker in ((done, True), (pending, False)):
        path = marker_run(run, tmp_path, marker=marker)
        fs = pafs.FileSystem.from_uri("s3://bucket/markers")[0]
        for file in path.parent.iterdir():
            fs.create_dir(f"bucket/markers/{path.parent.name}")
            with fs.open_output_stream(f"bucket/markers/{path.parent.name}/{file.name}") as sink:
                sink.write(file.read_bytes())
    for root in (tmp_path, "s3://bucket/markers"):
        assert [e.run_id for e in list_runs(root)] == [done.run_id]
        same(Run.load(root), done)
        with pytest.raises(FileNotFoundError, match="not complete"):
            Run.load(root, run_id=pending.run_id)
        with pytest.warns(PartialRunWarning):
            same(Run.load(f"{root}/run_id={pending.run_id}"), pending)


def test_a_streamed_run_is_written_part_by_part_and_reads_back_whole(s3, tmp_path):
    for root in (tmp_path / "local", "s3://bucket/streamed"):
        tracker = recorded(steps=3, seed=4)
        with tracker.stream_to(root) as stream:
            stream.flush()
            first = tracker.run.num_rows
            record(tracker, 4, 60, torch.Generator().manual_seed(5))  # a second generation: the next part
            stream.flush()
        assert len(stream.parts) == 2
        loaded = Run.load(root)
        assert loaded.num_rows > first and len(loaded.generations()) == 2
        same(loaded, tracker.run)


def test_a_stream_left_by_an_exception_commits_nothing_and_vacuum_removes_its_parts(tmp_path):
    tracker = recorded(steps=3, seed=8)
    with pytest.raises(RuntimeError, match="boom"), tracker.stream_to(tmp_path) as stream:
        stream.flush()
        raise RuntimeError("boom")
    assert len(stream.parts) == 1 and list_runs(tmp_path) == []
    assert RunTable(tmp_path).committed() == []  # nothing was ever committed
    other = recorded(steps=2, seed=9).run
    other.to_dataset(tmp_path)
    assert RunTable(tmp_path).vacuum(older_than_hours=0) == stream.parts
    assert [e.run_id for e in list_runs(tmp_path)] == [other.run_id]


# ---------------------------------------------------------------- many writers at once


WRITER = """
import os, sys, torch
from test_fleet_store import recorded
root, seed, runs, check = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for i in range(runs):
    tracker = recorded(steps=6, vocab=80, seed=seed * 100 + i)
    tracker.run.to_dataset(root)
    tracker.run.to_parquet(os.path.join(check, tracker.run_id + ".parquet"))
"""


@pytest.mark.fleet
def test_many_writers_into_one_local_and_one_s3_dataset(s3, tmp_path):
    """4 processes into a local dataset and 2 into an S3 one at once; a reader polling all along never sees a
    partial run; then every run reads back bit-identical to what its writer also wrote on its own."""
    check = tmp_path / "check"
    check.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    local = str(tmp_path / "runs")
    jobs = [(local, s, 3) for s in range(4)] + [("s3://bucket/fleet", 10 + s, 2) for s in range(2)]
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, root, str(seed), str(n), str(check)], env=env)
        for root, seed, n in jobs
    ]
    seen = 0
    while any(w.poll() is None for w in writers):
        for root in (local, "s3://bucket/fleet"):
            for entry in list_runs(root):  # every listed run is whole
                run = Run.load(entry.path)
                assert run.num_rows == entry.summary["rows"]
                seen += 1
        time.sleep(0.05)
    assert [w.wait() for w in writers] == [0] * len(writers)
    assert seen > 0
    for root, count in ((local, 12), ("s3://bucket/fleet", 4)):
        entries = list_runs(root)
        assert len(entries) == count and len({e.run_id for e in entries}) == count
        for entry in entries:
            same(Run.load(root, run_id=entry.run_id), Run.load(check / f"{entry.run_id}.parquet"))


def test_run_ids_do_not_collide():
    from tracker.recording.run_metadata import new_run_id

    ids = [new_run_id() for _ in range(20000)]
    assert len(set(ids)) == len(ids)
    assert len(ids[0].split("-")[1]) == 16  # 64 random bits: no collision across machines in practice


def test_spill_dir_refuses_a_url():
    from tracker import LogitTrackingProcessor

    with pytest.raises(ValueError, match="spill_dir .*local"):
        LogitTrackingProcessor(None, spill_dir="s3://bucket/spill")


def test_cli_inspect_reads_a_url(s3):
    run = recorded(steps=2, seed=6).run
    run.to_parquet("s3://bucket/cli/run.parquet")
    out = subprocess.run(
        [sys.executable, "-m", "logitscope", "inspect", "s3://bucket/cli/run.parquet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert run.run_id in out.stdout


def test_arrow_columns_types_unchanged_by_s3(s3):
    run = recorded(steps=2, seed=7).run
    run.to_dataset("s3://bucket/types")
    assert Run.load("s3://bucket/types").to_arrow().schema.remove_metadata() == run.to_arrow().schema.remove_metadata()
    assert isinstance(run.to_arrow(), pa.Table)


# ---------------------------------------------------------------- the run browser over a dataset of many runs


def test_the_run_browser_lists_a_dataset_from_its_markers_filters_pages_and_opens_a_run(tmp_path, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from dashboard import reader as reader_module
    from dashboard.paths import APP
    from dashboard.synthetic import FLEET_MODELS, write_run_dataset

    root = tmp_path / "runs"
    ids = write_run_dataset(root, 150, steps=4, vocab=40)
    opened = []
    real = reader_module.RunReader.__init__

    def counting(self, path, **kwargs):
        opened.append(str(path))
        real(self, path, **kwargs)

    monkeypatch.setattr(reader_module.RunReader, "__init__", counting)
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.session_state["root"] = str(root)
    at.run()
    assert not at.exception
    assert len(opened) == 1  # the run shown in the sidebar; the 150 rows came from the markers
    table = at.dataframe[0].value
    assert len(table) == 100 and table["run"].tolist()[:2] == ["request 0", "request 1"]
    summaries = at.session_state["summaries"]  # the table shows no model column (the picked run's details do)
    shown_models = [summaries[path].model for path in at.session_state["runs_shown"]]
    assert table["steps"].tolist()[0] == 4 and shown_models[:2] == list(FLEET_MODELS[:2])
    at.number_input(key="runs_page").set_value(2).run()
    assert at.dataframe[0].value["run"].tolist() == [f"request {i}" for i in range(100, 150)]
    at.text_input(key="runs_model").set_value(FLEET_MODELS[1]).run()
    models = [at.session_state["summaries"][path].model for path in at.session_state["runs_shown"]]
    assert len(at.dataframe[0].value) == len(models) == 150 // 4 + (150 % 4 > 1) and set(models) == {FLEET_MODELS[1]}
    at.text_input(key="runs_processor").set_value("regex").run()
    assert set(at.dataframe[0].value["processors"]) == {"Regex"}
    at.selectbox(key="runs_since").set_value("2026-01-05").run()
    assert all(d >= "2026-01-05" for d in at.dataframe[0].value["date"])
    for key in ("runs_model", "runs_processor"):
        at.text_input(key=key).set_value("")
    at.selectbox(key="runs_since").set_value("").run()
    assert len(at.dataframe[0].value) == 100
    pick = f"{root}/run_id={ids[9]}"
    at.selectbox(key="runs_pick").set_value(pick).run()
    assert not at.exception
    assert at.sidebar.selectbox(key="run").value == pick
    assert "request 9" in at.subheader[0].value and pick in opened


def test_listing_again_reads_only_new_markers_and_a_damaged_one_is_named(tmp_path):
    root = tmp_path / "runs"
    first = [recorded(steps=2, seed=30 + i).run for i in range(3)]
    for run in first:
        marker_run(run, root)
    assert [e.run_id for e in list_runs(root)] == sorted(r.run_id for r in first)
    marker = root / f"run_id={first[0].run_id}" / COMPLETE
    marker.write_text("not json")  # a complete run is never rewritten: its cached summary stands
    more = recorded(steps=3, seed=40).run
    marker_run(more, root)
    entries = list_runs(root)
    assert len(entries) == 4 and next(e for e in entries if e.run_id == more.run_id).summary["steps"] == 3
    with pytest.raises(ValueError, match=f"run_id={first[0].run_id}/{COMPLETE}' cannot be read .* damaged completion"):
        list_runs(root, cache=False)


def test_a_rewritten_run_is_a_new_commit_and_is_listed_anew(tmp_path):
    """A run written again is a new commit: its listing (and the Runs page) shows it as written last."""
    tracker = recorded(steps=2, seed=50)
    tracker.to_dataset(tmp_path)
    [entry] = list_runs(tmp_path)
    assert entry.summary["generations"] == 1
    record(tracker, 3, 60, torch.Generator().manual_seed(51))  # a second generation, then written again
    tracker.to_dataset(tmp_path)
    [entry] = list_runs(tmp_path)
    assert entry.summary["generations"] == 2 and entry.summary["rows"] == tracker.run.num_rows
    same(Run.load(tmp_path), tracker.run)


def test_the_run_browser_lists_and_opens_runs_of_a_dataset_on_s3(s3):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from dashboard.paths import APP

    runs = [recorded(steps=2 + i, seed=20 + i) for i in range(3)]
    for tracker in runs:
        tracker.annotate(title=f"remote {tracker.run.num_rows}")
        tracker.to_dataset("s3://bucket/browse")
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.session_state["root"] = "s3://bucket/browse"
    at.run()
    assert not at.exception
    table = at.dataframe[0].value
    assert sorted(table["steps"].tolist()) == [2, 3, 4]
    assert sorted(table["run"].tolist()) == sorted(f"remote {t.run.num_rows}" for t in runs)
    last = f"s3://bucket/browse/run_id={max(t.run_id for t in runs)}"
    at.sidebar.selectbox(key="run").set_value(last).run()
    assert not at.exception and at.subheader[0].value.startswith("remote")
    at.switch_page("app_pages/replay.py").run()
    assert not at.exception and not at.error
