"""SQL across 1,000 runs, cold: logitscope's ``open_dataset`` against DuckDB alone on the same committed files.

    python benchmarks/bench_query.py                              # 1,000 runs x 100 steps, top-20 of 32,000
    python benchmarks/bench_query.py --runs 100 --keep /tmp/q     # smaller; keep the table for `logitscope query`
    python benchmarks/bench_query.py --previous /tmp/old-checkout # also the previous release on its own format
    python benchmarks/bench_query.py --s3 100                     # also 100 runs in a moto S3 server

The table: ``--distinct`` runs recorded by the real tracker
(:func:`dashboard.synthetic.hand_made_run`: random logits, a constraint that
masks a random share of the vocabulary at each step, top-k storage, so the
statistics are recorded with the rows), each written ``runs / distinct``
times under fresh run ids with :meth:`tracker.Run.to_dataset` (a commit each).

Every timing runs in a new process (imports left out of the time; the files
are in the operating system's cache, as for any second look at a dataset):

- *DuckDB open*: the committed files from the Delta log, then DuckDB reading
  every file's footer (``SELECT count(*) FROM read_parquet(files)``);
- *DuckDB first question*: a new connection answering the question from the
  same files (``read_parquet(files, hive_partitioning=true)``);
- *logitscope open*: ``open_dataset(root)`` and its ``runs`` view (every run's
  metadata), in a process that never saw the table, then again in a second
  process (what the first learnt of the committed parts is cached);
- *logitscope first question*: ``open_dataset(root)`` and the question over
  the ``steps`` view (every run's statistics, checked), both processes.

The questions: "steps where removed mass > 0.5" and "mean entropy per run";
both answers are checked equal to DuckDB's. Bytes: everything under the
table (parts, log, vocabularies) against the Arrow bytes of the runs' rows,
and the parts' footers' share. Goals (issue 41): bytes <= 1.2x the rows,
footers <= 10%, open <= DuckDB's, first question <= 1.5x DuckDB's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REMOVED = "SELECT run_id, generation, sequence, step FROM steps WHERE removed_mass > 0.5"
ENTROPY = "SELECT run_id, avg(entropy_natural) AS entropy FROM steps GROUP BY run_id"
RAW_REMOVED = "SELECT run_id, generation, sequence, step FROM files WHERE constrained_removed_mass > 0.5"
RAW_ENTROPY = "SELECT run_id, avg(natural_entropy) AS entropy FROM files GROUP BY run_id"

#: Each timing's process: prints one JSON line {"open": s, "first": s, "answers": [...]}.
DUCKDB = """
import json, os, sys, time
import duckdb
from deltalake import DeltaTable
root, question = sys.argv[1], sys.argv[2]
remote = "://" in root  # DuckDB reads an object store through the table's pyarrow dataset (no httpfs here)


def files(con):
    if remote:  # the store's options as the writers use them (an http:// endpoint here)
        options = {"allow_http": "true"} if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://") else None
        con.register("committed", DeltaTable(root, storage_options=options).to_pyarrow_dataset())
        return "committed", {}
    return "read_parquet($f, hive_partitioning=true)", {"f": DeltaTable(root).file_uris()}


start = time.perf_counter()
con = duckdb.connect()
source, params = files(con)
n = con.execute(f"SELECT count(*) FROM {source}", params).fetchone()[0]
opened = time.perf_counter() - start
start = time.perf_counter()
con = duckdb.connect()
source, params = files(con)
answer = con.execute(question.replace("FROM files", f"FROM {source}"), params).fetchall()
first = time.perf_counter() - start
print(json.dumps({"open": opened, "first": first, "rows": n, "answer": sorted(map(list, answer))}))
"""

LOGITSCOPE = """
import json, sys, time
import deltalake, duckdb  # imported before the clock starts, as in DuckDB's process
from tracker import open_dataset
root, question = sys.argv[1], sys.argv[2]
start = time.perf_counter()
data = open_dataset(root)
n = data.sql("SELECT count(*) FROM runs").column(0)[0].as_py()
opened = time.perf_counter() - start
start = time.perf_counter()
answer = open_dataset(root).sql(question).to_pylist()
first = time.perf_counter() - start
print(json.dumps({"open": opened, "first": first, "runs": n, "answer": sorted(list(r.values()) for r in answer)}))
"""


def make_table(root: Path, runs: int, distinct: int, steps: int, vocab: int, k: int) -> tuple[list[str], int]:
    """Write ``runs`` top-k runs into the table at ``root``; their ids and the Arrow bytes of their rows."""
    from dashboard.synthetic import hand_made_run
    from tracker import Run

    rng = np.random.default_rng(0)
    tokens = [f"t{i}" for i in range(vocab)]
    ids, nbytes = [], 0
    for d in range(distinct):
        natural = (rng.standard_normal((steps, vocab), dtype=np.float32) * 3).astype(np.float32)
        keep = rng.random((steps, vocab)) < rng.uniform(0.05, 0.95, size=(steps, 1))
        keep[np.arange(steps), rng.integers(0, vocab, steps)] = True  # something is always allowed
        constrained = np.where(keep, natural, -np.inf).astype(np.float32)
        chosen = constrained.argmax(axis=1)
        run = hand_made_run(natural, chosen, tokens, constrained=constrained, storage="topk", top_k=k, prompt=(d,))
        rows = run.to_arrow().nbytes
        for copy in range(d, runs, distinct):
            clone = Run(run._record_batches(), replace(run.metadata, run_id=f"run-{copy:05d}"), run.vocab)
            clone.to_dataset(root)
            ids.append(clone.run_id)
            nbytes += rows
    return sorted(ids), nbytes


def sizes(root: Path) -> dict[str, int]:
    """Bytes under the table: parts, their footers, the log, the vocabularies."""
    import pyarrow.parquet as pq

    out = {"parts": 0, "footers": 0, "log": 0, "vocab": 0, "other": 0}
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).parts
        if rel[0] == "_delta_log":
            out["log"] += path.stat().st_size
        elif rel[0] == "_vocab":
            out["vocab"] += path.stat().st_size
        elif path.suffix == ".parquet":
            out["parts"] += path.stat().st_size
            out["footers"] += pq.ParquetFile(path).metadata.serialized_size + 8
        else:
            out["other"] += path.stat().st_size
    return out


def timed(code: str, root: str, question: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, root, question],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=3600,
    )
    if done.returncode:
        raise SystemExit(f"a timing process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def same(a: list, b: list) -> bool:
    """Answers equal, floats to 1e-5 relative."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if isinstance(u, float) or isinstance(v, float):
                if not np.isclose(float(u), float(v), rtol=1e-5):
                    return False
            elif u != v:
                return False
    return True


def compare(root: str, repeats: int, env: dict[str, str] | None = None, label: str = "") -> dict:
    """Cold timings of DuckDB and logitscope (a first and a second process) on both questions, taken in
    rounds (DuckDB, then logitscope, one right after the other, so that a busy machine slows both alike):
    the best of each, and the median of the rounds' ratios."""
    results: dict = {}
    for name, sql, raw in (("removed", REMOVED, RAW_REMOVED), ("entropy", ENTROPY, RAW_ENTROPY)):
        rounds = []
        for _ in range(repeats):
            cache = tempfile.mkdtemp(prefix="bench-query-cache-")
            try:
                duck = timed(DUCKDB, root, raw, env)
                first = timed(LOGITSCOPE, root, sql, {**(env or {}), "LOGITSCOPE_CACHE": cache})
                second = timed(LOGITSCOPE, root, sql, {**(env or {}), "LOGITSCOPE_CACHE": cache})
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            if not same(first["answer"], duck["answer"]):
                raise SystemExit(f"{name}: logitscope and DuckDB disagree")
            rounds.append((duck, first, second))
        out: dict = {"rows": len(rounds[0][0]["answer"])}
        for i, who in enumerate(("duckdb", "first process", "second process")):
            out[who] = {k: min(r[i][k] for r in rounds) for k in ("open", "first")}
            if i:
                out[who]["ratio"] = {
                    k: float(np.median([r[i][k] / r[0][k] for r in rounds])) for k in ("open", "first")
                }
        results[name] = out
        best = out["duckdb"]
        print(
            f"{label}{name} ({out['rows']:,} rows in the answer), {repeats} rounds, seconds (best) and ratio (median):"
        )
        print(f"  DuckDB alone             open {best['open']:6.2f}          first question {best['first']:6.2f}")
        for who in ("first process", "second process"):
            t, ratio = out[who], out[who]["ratio"]
            print(
                f"  logitscope, {who:14s} open {t['open']:6.2f} ({ratio['open']:4.2f}x)  "
                f"first question {t['first']:6.2f} ({ratio['first']:4.2f}x)"
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--distinct", type=int, default=4, help="runs recorded; the others are copies")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each timing")
    parser.add_argument(
        "--keep",
        default=None,
        metavar="FOLDER",
        help="write the table here and keep it (a table already there is timed as it is)",
    )
    parser.add_argument("--previous", default=None, metavar="CHECKOUT", help="a checkout of the previous release")
    parser.add_argument("--s3", type=int, default=0, metavar="RUNS", help="also this many runs on a moto S3 server")
    args = parser.parse_args(argv)

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-query-"))
    if args.keep and (root / "_delta_log").is_dir():  # a table kept by an earlier run: time it again
        print(f"the table kept at {root}, as written then")
        compare(str(root), args.repeats)
        return 0
    try:
        start = time.perf_counter()
        ids, rows = make_table(root, args.runs, min(args.distinct, args.runs), args.steps, args.vocab, args.k)
        took = time.perf_counter() - start
        on_disk = sizes(root)
        total = sum(on_disk.values())
        print(
            f"{len(ids)} runs x {args.steps} steps, top-{args.k} of {args.vocab:,} tokens, written in {took:.1f} s "
            f"({len(ids) / took:.1f} runs/s, a commit each)"
        )
        print(
            f"bytes: {total / 1e6:.1f} MB on disk for {rows / 1e6:.1f} MB of rows ({total / rows:.2f}x): parts "
            f"{on_disk['parts'] / 1e6:.1f} MB (footers {on_disk['footers'] / on_disk['parts']:.1%} of them), log "
            f"{on_disk['log'] / 1e6:.2f} MB, vocabularies {on_disk['vocab'] / 1e6:.2f} MB"
        )
        compare(str(root), args.repeats)
        if args.previous:
            previous(Path(args.previous), args)
        if args.s3:
            on_s3(root, args)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


PREVIOUS = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
from tracker import open_dataset
root, question = sys.argv[1], sys.argv[2]
start = time.perf_counter()
data = open_dataset(root)
n = data.sql("SELECT count(*) FROM runs").column(0)[0].as_py()
opened = time.perf_counter() - start
start = time.perf_counter()
answer = open_dataset(root).sql(question).to_pylist()
print(json.dumps({"open": opened, "first": time.perf_counter() - start, "runs": n}))
"""

PREVIOUS_WRITE = """
import sys
from dataclasses import replace
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[2])
{source}
make_table(Path(sys.argv[1]), *map(int, sys.argv[3:]))
"""


def previous(checkout: Path, args: argparse.Namespace) -> None:
    """The previous release's code on its own format (completion markers, the vocabulary in every footer)."""
    root = Path(tempfile.mkdtemp(prefix="bench-query-previous-"))
    try:
        shape = [str(v) for v in (args.runs, min(args.distinct, args.runs), args.steps, args.vocab, args.k)]
        code = PREVIOUS_WRITE.format(source=inspect.getsource(make_table))
        done = subprocess.run(
            [sys.executable, "-c", code, str(root), str(checkout), *shape],
            env={**os.environ, "PYTHONPATH": str(checkout)},
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"the previous release could not write its dataset:\n{done.stderr[-3000:]}")
        total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        cache = tempfile.mkdtemp(prefix="bench-query-cache-")
        env = {**os.environ, "PYTHONPATH": str(checkout), "LOGITSCOPE_CACHE": cache}
        times = []
        for _ in range(args.repeats):
            run = subprocess.run(
                [sys.executable, "-c", PREVIOUS, str(root), ENTROPY, str(checkout)],
                env=env,
                capture_output=True,
                text=True,
            )
            times.append(json.loads(run.stdout.strip().splitlines()[-1]))
        shutil.rmtree(cache, ignore_errors=True)
        best = {k: min(t[k] for t in times) for k in ("open", "first")}
        print(
            f"previous release on its own format: {total / 1e6:.1f} MB; open {best['open']:.2f} s, "
            f"first question (entropy) {best['first']:.2f} s"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def on_s3(local: Path, args: argparse.Namespace) -> None:
    """The first ``--s3`` runs in a moto S3 server on 127.0.0.1, timed the same way."""
    import socket

    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
        small = Path(tempfile.mkdtemp(prefix="bench-query-s3-"))
        make_table(small, args.s3, min(args.distinct, args.s3), args.steps, args.vocab, args.k)
        s3 = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], scheme="http")
        pafs.copy_files(str(small), "bench/table", destination_filesystem=s3)
        shutil.rmtree(small, ignore_errors=True)
        print(f"on S3 (moto, 127.0.0.1), {args.s3} runs:")
        compare("s3://bench/table", max(1, args.repeats - 1), label="  S3 ")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
