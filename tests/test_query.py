"""SQL across runs: tracker.open_dataset's DuckDB views against the analysis API, and `logitscope query`.

The runs are recorded by the tracker (the demo model with a JSON-schema
grammar, so the constraint removes mass; a batch of two prompts; two
generations), in full float32 storage (statistics computed when read) and in
float16 and top-k storage (statistics recorded with the rows). Every view value is
checked against what ``Run.load(...)`` answers for the same run.
"""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from logitscope.cli import main
from tracker import Run, open_dataset
from tracker.format.layout import NoRunError
from tracker.reading.query import QueryError

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Lyon", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def _record(demo, storage: str) -> Run:
    from processors import JSONLogitsProcessor
    from sampling import Generator, SamplingParams
    from tracker import add_tracking

    model, tokenizer = demo
    gen = add_tracking(Generator(model, tokenizer, JSONLogitsProcessor(SCHEMA, tokenizer)), storage=storage, top_k=8)
    gen.logits_processor.annotate(title=f"cities in {storage}")
    gen.generate(["<|endoftext|>", '{"'], SamplingParams(max_new_tokens=12))
    gen.generate(["The city", "A"], SamplingParams(temperature=0.9, seed=3, max_new_tokens=10))
    return gen.logits_processor.run


@pytest.fixture(scope="module")
def recorded(demo, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("query")
    runs = {storage: _record(demo, storage) for storage in ("float32", "float16", "topk")}
    for run in runs.values():
        run.to_dataset(root / "dataset")
        run.to_parquet(root / "files" / f"{run.run_id}.parquet")
    loaded = {storage: Run.load(root / "dataset", run_id=run.run_id) for storage, run in runs.items()}
    return {"root": root, "runs": loaded}


def _stats(run: Run) -> pd.DataFrame:
    frames = [run.stats(sequence=None, generation=g) for g in run.generations()]
    return pd.concat(frames, ignore_index=True).rename(columns={"position": "step"})


def _same(view: pd.DataFrame, expected: pd.DataFrame, columns: list[str]) -> None:
    """Column by column: equal, NaN of the API where the view has NULL, floats to float32 rounding."""
    assert len(view) == len(expected)
    for name in columns:
        got, want = view[name].to_numpy(), expected[name].to_numpy()
        if name == "chosen_token" or want.dtype == object or want.dtype == bool:
            assert list(got) == list(want), name
            continue
        got = np.array([math.nan if v is None or v is pd.NA else float(v) for v in got])
        want = np.array([math.nan if v is None or v is pd.NA else float(v) for v in want])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True, err_msg=name)


# ---------------------------------------------------------------- the views against the Python API


def test_steps_are_the_runs_statistics_for_every_storage(recorded):
    data = open_dataset(recorded["root"] / "dataset")
    for storage, run in recorded["runs"].items():
        view = data.sql(f"SELECT * FROM steps WHERE run_id = '{run.run_id}' ORDER BY generation, sequence, step")
        view = view.to_pandas()
        expected = _stats(run).sort_values(["generation", "sequence", "step"], ignore_index=True)
        columns = [c for c in expected.columns if c in view.columns]
        assert set(expected.columns) - set(columns) == set(), storage
        _same(view, expected, columns)
        assert (view["removed_mass"] > 0).any(), f"{storage}: the grammar removes mass at some step"
        assert view["generation"].nunique() == 2 and view["sequence"].nunique() == 2


def test_runs_come_from_the_metadata(recorded):
    runs = open_dataset(recorded["root"] / "dataset").sql("SELECT * FROM runs ORDER BY storage").to_pylist()
    assert [r["storage"] for r in runs] == ["float16", "float32", "topk"]
    for row in runs:
        run = recorded["runs"][row["storage"]]
        m = run.metadata
        assert row["run_id"] == m.run_id and row["model"] == m.model and row["processors"] == m.processors
        assert row["title"] == f"cities in {row['storage']}" and row["stages"] == m.stages
        assert json.loads(row["sampling"]) == m.sampling and row["created_at"] == m.created_at
        assert row["generations"] == 2 and row["sequences"] == 4 and row["rows"] == run.num_rows
        steps = max(len(run.stats(sequence=s, generation=g, include_finished=True)) for g in (0, 1) for s in (0, 1))
        assert row["steps"] == steps
        assert row["top_k"] == m.top_k and row["vocab_size"] == m.vocab_size


@pytest.mark.parametrize("storage", ["float32", "float16"])
def test_candidates_of_full_rows_are_the_k_best_of_each_stage(recorded, storage):
    run = recorded["runs"][storage]
    k = 6
    data = open_dataset(recorded["root"] / "dataset", k=k)
    view = data.sql(f"SELECT * FROM candidates WHERE run_id = '{run.run_id}'").to_pandas()
    keys = {"natural": "unstructured", "constrained": "structured", "sampled": "sampled"}
    checked = 0
    for g in run.generations():
        for s in run.sequences(g):
            probs = run.get_probabilities(sequence=s, generation=g)
            logits = run.get_logits(sequence=s, generation=g)
            steps = run.stats(sequence=s, generation=g)["position"].to_numpy()
            for stage, key in keys.items():
                mine = view[(view.generation == g) & (view.sequence == s) & (view.stage == stage)]
                for i, step in enumerate(steps):
                    row = mine[mine.step == step].sort_values("rank")
                    p = probs[key][i].astype(np.float64)
                    order = np.lexsort((np.arange(p.size), -p))[:k]
                    order = order[p[order] > 0]
                    assert row["token_id"].tolist() == order.tolist(), (g, s, stage, step)
                    np.testing.assert_allclose(row["probability"], p[order], rtol=2e-6)
                    np.testing.assert_array_equal(row["logit"], logits[key][i][order])
                    assert row["masked"].tolist() == (probs["structured"][i][order] == 0).tolist()
                    checked += 1
    assert checked > 40


def test_candidates_of_topk_runs_are_what_was_stored_and_agree_with_get_top_tokens(recorded):
    run = recorded["runs"]["topk"]
    data = open_dataset(recorded["root"] / "dataset", k=50)  # more than stored: the stored 8
    view = data.sql(f"SELECT * FROM candidates WHERE run_id = '{run.run_id}' AND stage = 'constrained'").to_pandas()
    assert view.groupby(["generation", "sequence", "step"]).size().max() <= 8
    assert not view["masked"].fillna(False).any()
    for g in run.generations():
        top = run.get_top_tokens(k=8, generation=g, sequence=0)
        for entry in top:
            mine = view[(view.generation == g) & (view.sequence == 0) & (view.step == entry["position"])]
            by_token = dict(zip(mine["token"], mine["probability"]))
            for token in entry["tokens"]:
                if token["structured_prob"] > 0:
                    assert by_token[token["token"]] == pytest.approx(token["structured_prob"], rel=1e-6)
    natural = data.sql("SELECT * FROM candidates WHERE stage = 'natural' AND rank = 0 AND masked").to_pandas()
    assert len(natural) > 0, "the grammar masked the model's favourite somewhere"


# ---------------------------------------------------------------- the questions


def test_steps_where_the_constraint_removed_more_than_half(recorded):
    data = open_dataset(recorded["root"] / "dataset")
    got = data.sql("SELECT run_id, generation, sequence, step FROM steps WHERE removed_mass > 0.5").to_pandas()
    expected = []
    for run in recorded["runs"].values():
        stats = _stats(run)
        hit = stats[stats["removed_mass"] > 0.5]
        expected += [(run.run_id, g, s, p) for g, s, p in zip(hit["generation"], hit["sequence"], hit["step"])]
    assert sorted(map(tuple, got.itertuples(index=False))) == sorted(expected)
    assert 0 < len(expected) < sum(len(_stats(r)) for r in recorded["runs"].values())


def test_mean_entropy_per_run(recorded):
    data = open_dataset(recorded["root"] / "dataset")
    got = data.sql("SELECT run_id, avg(entropy_natural) AS mean FROM steps GROUP BY run_id").to_pandas()
    for run in recorded["runs"].values():
        mean = got.set_index("run_id").loc[run.run_id, "mean"]
        assert mean == pytest.approx(_stats(run)["entropy_natural"].mean(), rel=1e-9)


def test_which_prompts_make_the_eos_probability_collapse(tmp_path):
    from dashboard.synthetic import hand_made_run

    rng = np.random.default_rng(5)
    tokens = ["<eos>", "a", "b", "c", "d", "e"]
    collapsed = []
    for n, squash in enumerate([True, False, True, False]):
        natural = rng.normal(size=(4, 6)).astype(np.float32)
        natural[2, 0] = 9.0  # the model wants to stop at step 2
        constrained = natural.copy()
        if squash:
            constrained[:, 0] = -np.inf  # the constraint never lets it
        chosen = np.argmax(np.where(np.arange(6) == 0, -np.inf, constrained), axis=1)
        run = hand_made_run(natural, chosen, tokens, constrained=constrained, eos_token_id=0, prompt=(1 + n, 2))
        run.to_dataset(tmp_path)
        if squash:
            collapsed.append(run.vocab.decode([1 + n, 2]))
    got = open_dataset(tmp_path).sql(
        """SELECT q.prompt FROM steps s JOIN sequences q USING (run_id, generation, sequence)
           GROUP BY q.prompt HAVING max(s.p_eos_natural) > 0.5 AND max(s.p_eos_constrained) < 0.01"""
    )
    assert sorted(got.column("prompt").to_pylist()) == sorted(collapsed)


# ---------------------------------------------------------------- locations


def test_a_file_a_folder_of_files_and_a_dataset_give_the_same_views(recorded):
    root = recorded["root"]
    query = "SELECT * FROM steps ORDER BY run_id, generation, sequence, step"
    dataset = open_dataset(root / "dataset").sql(query)
    assert open_dataset(root / "files").sql(query).equals(dataset)
    run = recorded["runs"]["topk"]
    one = open_dataset(root / "files" / f"{run.run_id}.parquet").sql(query)
    assert one.equals(dataset.filter(pa.compute.equal(dataset["run_id"], run.run_id)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_views_on_an_s3_compatible_store(recorded, monkeypatch):
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }.items():
            monkeypatch.setenv(name, value)
        s3 = pafs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{port}", allow_bucket_creation=True)
        s3.create_dir("runs")
        pafs.copy_files(str(recorded["root"] / "dataset"), "runs/fleet", destination_filesystem=s3)
        query = "SELECT * FROM steps ORDER BY run_id, generation, sequence, step"
        remote = open_dataset("s3://runs/fleet")
        assert remote.sql(query).equals(open_dataset(recorded["root"] / "dataset").sql(query))
        assert remote.sql("SELECT count(*) AS n FROM runs").column("n").to_pylist() == [3]
    finally:
        server.stop()


# ---------------------------------------------------------------- errors and safety


def test_bad_locations_sql_and_k_say_what_is_wrong(recorded, tmp_path):
    with pytest.raises(NoRunError, match="no run at"):
        open_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoRunError, match="no run files"):
        open_dataset(tmp_path / "empty")
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        open_dataset(recorded["root"] / "dataset", k=0)
    data = open_dataset(recorded["root"] / "dataset")
    with pytest.raises(QueryError, match='syntax error at or near "SELEC"') as err:
        data.sql("SELEC 1")
    assert "\n" not in str(err.value)
    with pytest.raises(QueryError, match="views are runs, steps, sequences, candidates"):
        data.sql("SELECT * FROM stepz")


def test_a_query_reads_and_writes_nothing_but_the_views(recorded, tmp_path):
    data = open_dataset(recorded["root"] / "dataset")
    secret = tmp_path / "secret.csv"
    secret.write_text("a\n1\n")
    for sql in (
        f"SELECT * FROM read_csv('{secret}')",
        f"COPY runs TO '{tmp_path / 'out.csv'}'",
        "INSTALL httpfs",
        "SELECT * FROM read_parquet('s3://bucket/x.parquet')",
        "SET enable_external_access = true",
    ):
        with pytest.raises(QueryError):
            data.sql(sql)
    assert not (tmp_path / "out.csv").exists()


# ---------------------------------------------------------------- the command line


def test_the_query_command_prints_a_table_csv_json_and_writes_parquet(recorded, tmp_path, capsys):
    root = str(recorded["root"] / "dataset")
    sql = "SELECT run_id, generation, sequence, step, removed_mass FROM steps WHERE removed_mass > 0.5 ORDER BY ALL"
    expected = open_dataset(root).sql(sql)
    assert main(["query", root, sql]) == 0
    shown = capsys.readouterr().out
    assert "removed_mass" in shown and expected.column("run_id")[0].as_py() in shown
    assert main(["query", root, sql, "--csv"]) == 0
    csv = capsys.readouterr().out.splitlines()
    assert csv[0] == "run_id,generation,sequence,step,removed_mass" and len(csv) == expected.num_rows + 1
    assert main(["query", root, sql, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == expected.column("step").to_pylist()
    out = tmp_path / "answer.parquet"
    assert main(["query", root, sql, "--parquet", str(out)]) == 0
    assert pq.read_table(out).equals(expected)
    assert [p.name for p in tmp_path.iterdir()] == ["answer.parquet"]  # no temporary file left


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["SELEC 1"], 'argument SQL: Parser Error: syntax error at or near "SELEC"'),
        (["SELECT 1", "--k", "0"], "argument --k: must be >= 1, got 0"),
        (["SELECT * FROM nope"], "argument SQL: Catalog Error: Table with name nope does not exist"),
    ],
)
def test_the_query_command_fails_in_one_line(recorded, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["query", str(recorded["root"] / "dataset"), *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("logitscope query: error: ") and message in err and err.count("\n") == 1, err


def test_the_query_command_names_a_missing_dataset(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["query", str(tmp_path / "nowhere"), "SELECT 1"])
    assert "argument DATASET: path: no run at" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_views_need_no_torch_to_import():
    import subprocess
    import sys

    code = "import sys, tracker; tracker.open_dataset; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_the_views_can_be_asked_in_any_order(recorded):
    query = "SELECT count(*) AS n FROM {}"
    first = open_dataset(recorded["root"] / "dataset")
    counts = {view: first.sql(query.format(view)).column("n")[0].as_py() for view in ("sequences", "steps", "runs")}
    again = open_dataset(recorded["root"] / "dataset")
    assert {
        view: again.sql(query.format(view)).column("n")[0].as_py() for view in ("steps", "runs", "sequences")
    } == counts
    assert counts["sequences"] == 12 and counts["runs"] == 3


def test_an_arrow_ipc_run_file_gives_the_same_steps(recorded, tmp_path):
    run = recorded["runs"]["topk"]
    table = run.to_arrow()
    with pa.OSFile(str(tmp_path / "run.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    query = "SELECT * FROM steps ORDER BY generation, sequence, step"
    from_ipc = open_dataset(tmp_path / "run.arrow").sql(query)
    assert from_ipc.equals(open_dataset(recorded["root"] / "files" / f"{run.run_id}.parquet").sql(query))


def test_a_file_that_is_not_a_run_is_named_and_the_runs_beside_it_answered(recorded, tmp_path):
    recorded["runs"]["topk"].to_parquet(tmp_path / "run.parquet")
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "other.parquet")
    dataset = open_dataset(tmp_path)
    assert dataset.sql("SELECT count(*) AS n FROM steps").column("n").to_pylist() == [recorded["runs"]["topk"].num_rows]
    [skipped] = dataset.skipped
    assert re.search(r"other\.parquet' cannot be read as a logitscope run: it holds no", str(skipped))
    with pytest.raises(ValueError, match=r"other\.parquet' cannot be read as a logitscope run: it holds no"):
        open_dataset(tmp_path / "other.parquet")  # alone, it is the answer


def test_text_from_run_files_in_an_answer_is_shown_escaped_never_obeyed_by_the_terminal(tmp_path, capsys):
    from test_cli_inspect import HOSTILE, OBEYED, hostile_run

    path, texts = hostile_run(tmp_path)
    sql = "SELECT r.title, s.chosen_token FROM runs r JOIN steps s USING (run_id) ORDER BY s.step"
    assert main(["query", str(path), sql]) == 0
    shown = capsys.readouterr().out
    assert not OBEYED & set(shown) and "title\\x1b]0;owned\\x07\\nforged line" in shown and "\\x9b2J" in shown
    assert main(["query", str(path), sql, "--json"]) == 0
    out = capsys.readouterr().out
    assert not OBEYED & set(out)
    rows = [json.loads(line) for line in out.splitlines()]  # the same text, once parsed
    assert [r["title"] for r in rows] == [texts[0]] * 3 and [r["chosen_token"] for r in rows] == [
        HOSTILE[i] for i in (0, 2, 3)
    ]
    with pytest.raises(SystemExit):  # an error quoting a value of a run file
        main(["query", str(path), "SELECT CAST(title AS INTEGER) FROM runs"])
    err = capsys.readouterr().err
    assert not OBEYED & set(err) and err.count("\n") == 1 and "\\x1b]0;owned" in err, err


def test_a_query_stops_at_its_time_limit_and_the_dataset_still_answers(recorded):
    from tracker.reading.query import QueryLimitError

    dataset = open_dataset(recorded["root"] / "dataset")
    with pytest.raises(QueryLimitError, match=r"^the query ran past its time limit of 1 s$") as stopped:
        dataset.sql("SELECT count(*) FROM range(1000000000000)", timeout=1)
    assert stopped.value.limit == "timeout"
    assert dataset.sql("SELECT count(*) AS n FROM range(7)", timeout=60).column("n").to_pylist() == [7]
    for bad in (0, -1, float("nan"), "1"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            dataset.sql("SELECT 1", timeout=bad)


def test_the_query_command_says_which_limit_it_hit_in_one_line(recorded, capsys):
    root = str(recorded["root"] / "dataset")
    for argv, line in (
        (
            ["SELECT count(*) FROM range(1000000000000)", "--timeout", "1"],
            "argument --timeout: the query ran past its time limit of 1 s; give more with --timeout",
        ),
        (
            [
                "SELECT max(length(s)) FROM (SELECT string_agg(x::VARCHAR, ',') s FROM range(5000000) t(x))",
                "--memory",
                "20MB",
            ],
            "argument --memory: the query needed more than its memory limit of 20MB; give more with --memory",
        ),
        (["SELECT 1", "--memory", "lots"], "argument --memory: must be a size such as 500MB or 4GB, got 'lots'"),
        (["SELECT 1", "--timeout", "-1"], "argument --timeout: must be a number of seconds >= 0 (0: no limit)"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["query", root, *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"logitscope query: error: {line}") and err.count("\n") == 1, (
            err
        )
    assert (
        main(["query", root, "SELECT count(*) AS n FROM range(3)", "--csv", "--timeout", "0", "--memory", "1GB"]) == 0
    )
    assert capsys.readouterr().out == "n\n3\n"
    with pytest.raises(SystemExit):
        main(["query", "--help"])
    assert "(default: 600; 0: no limit)" in " ".join(capsys.readouterr().out.split())
