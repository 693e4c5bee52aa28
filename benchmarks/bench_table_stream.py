"""A serving engine's stream of ended requests into a table: :class:`tracker.format.table_writer.TableWriter`.

    python benchmarks/bench_table_stream.py                      # 10,000 requests, 64 steps each, top-20 of 32,000
    python benchmarks/bench_table_stream.py --requests 2000 --s3 # also into a moto S3 server

Each request is one part of the server's run (one generation of one
sequence, recorded by the real tracker from random logits, then numbered as
the engine numbers its requests), handed to ``TableWriter.add`` as fast as
this process can (an engine hands them over as requests end; each request's
values are drawn afresh, so that they compress as real ones do). Reported:
requests per second from the first add to the last commit, how long ``add``
held the caller (median, 99th percentile, longest: the engine's thread pays
it), commits per second and parts per commit, and bytes on disk per request.
The baseline, in the same process: the layout before tables as the engine
writes it today (each request its own Parquet file, then the run's
completion marker rewritten to list every part so far), for ``--baseline``
requests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def template(steps: int, vocab: int, k: int):
    """One request's rows and metadata, recorded by the tracker."""
    import torch

    from tracker import LogitTrackingProcessor

    tracker = LogitTrackingProcessor(None, storage="topk", top_k=k)
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 2, 3, 4]])
    for _ in range(steps):
        out = tracker(ids, torch.randn(1, vocab, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    tracker.finish(ids)
    run = tracker.run
    return run.to_arrow(), run.metadata, run


_rng = np.random.default_rng(1)
_KEEP = ("generation", "sequence", "step", "processor_error")


def request(table: pa.Table, metadata, number: int, run_id: str):
    """Request ``number``: the template's columns with every value drawn afresh (token ids, logits,
    statistics: no two requests' rows are alike, and rows repeated across requests would compress to
    nothing; the values are not a valid run, the shapes and types are)."""
    rows, vocab = table.num_rows, metadata.vocab_size
    columns = []
    for field, column in zip(table.schema, table.columns):
        kind = field.type
        if field.name == "generation":
            columns.append(pa.array(np.full(rows, number, np.int32)))
        elif field.name in _KEEP or pa.types.is_boolean(kind):
            columns.append(column)
        elif pa.types.is_fixed_size_list(kind):
            shape = (rows, kind.list_size)
            if pa.types.is_integer(kind.value_type):
                values = pa.array(_rng.integers(0, vocab, shape, dtype=np.int32).ravel())
            else:
                values = pa.array(np.sort(_rng.standard_normal(shape).astype(np.float32), axis=1)[:, ::-1].ravel())
            columns.append(pa.FixedSizeListArray.from_arrays(values, kind.list_size))
        elif pa.types.is_integer(kind):
            columns.append(pa.array(_rng.integers(0, vocab, rows), kind))
        else:
            columns.append(pa.array(_rng.standard_normal(rows).astype(np.float32), kind))
    part = pa.Table.from_arrays(columns, schema=table.schema)
    entry = dict(metadata.generations[0], generation=number)
    return part, replace(metadata, run_id=run_id, generations=[entry])


def stream(root: str, requests: int, table: pa.Table, metadata, commit_every_s: float) -> dict:
    from tracker.format.table_writer import TableWriter

    waits = np.zeros(requests)
    writer = TableWriter(root, commit_every_s=commit_every_s)
    start = time.perf_counter()
    for i in range(requests):
        part, meta = request(table, metadata, i, "server-0")
        began = time.perf_counter()
        writer.add(part, meta)
        waits[i] = time.perf_counter() - began
    writer.close()
    took = time.perf_counter() - start
    return {"seconds": took, "waits": waits, "commits": writer.commits, "parts": writer.parts_committed}


def baseline(root: Path, requests: int, run) -> float:
    """The layout before tables: a part file per request, then the run's marker listing every part so far."""
    from tracker.format.dataset import run_summary, write_marker
    from tracker.format.run_file import write_parquet

    folder = root / "run_id=server-0"
    parts: list[str] = []
    summary = run_summary(run)
    table, metadata = run.to_arrow(), run.metadata
    start = time.perf_counter()
    for i in range(requests):
        part, meta = request(table, metadata, i, "server-0")
        name = f"part-{i:09d}.parquet"
        write_parquet(part, folder / name, meta, scratch=root)
        parts.append(name)
        write_marker(pafs.LocalFileSystem(), str(folder), "server-0", list(parts), 0, summary, growing=True)
    return time.perf_counter() - start


def report(label: str, result: dict, requests: int, nbytes: int) -> None:
    waits = result["waits"] * 1e3
    rate = requests / result["seconds"]
    commits = result["commits"] / result["seconds"]
    print(
        f"{label}: {rate:,.0f} requests/s; add() held the caller {np.median(waits):.2f} ms median, "
        f"{np.percentile(waits, 99):.2f} ms p99, {waits.max():.1f} ms longest; {commits:.1f} commits/s, "
        f"{result['parts'] / max(1, result['commits']):.0f} parts per commit; {nbytes / requests / 1e3:.1f} KB per request"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--commit-every", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument(
        "--baseline", type=int, default=1000, metavar="REQUESTS", help="requests for the baseline (0: none)"
    )
    parser.add_argument("--s3", action="store_true", help="also stream into a moto S3 server on 127.0.0.1")
    args = parser.parse_args(argv)

    table, metadata, run = template(args.steps, args.vocab, args.k)
    print(
        f"{args.requests:,} requests of {args.steps} steps, top-{args.k} of {args.vocab:,} tokens "
        f"({table.nbytes / 1e3:.1f} KB of rows each), commits every {args.commit_every:g} s at most"
    )
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        result = stream(str(work / "table"), args.requests, table, metadata, args.commit_every)
        nbytes = sum(p.stat().st_size for p in (work / "table").rglob("*") if p.is_file())
        report("table", result, args.requests, nbytes)
        if args.baseline > 0:  # 0: the table alone
            took = baseline(work / "markers", args.baseline, run)
            nbytes = sum(p.stat().st_size for p in (work / "markers").rglob("*") if p.is_file())
            print(
                f"baseline (a file and a marker per request): {args.baseline / took:,.0f} requests/s over "
                f"{args.baseline:,} requests; {nbytes / args.baseline / 1e3:.1f} KB per request"
            )
        if args.s3:
            on_s3(args.requests, table, metadata, args.commit_every)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def on_s3(requests: int, table: pa.Table, metadata, commit_every_s: float) -> None:
    import socket

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
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
        result = stream("s3://bench/stream", requests, table, metadata, commit_every_s)
        fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], scheme="http")
        infos = fs.get_file_info(pafs.FileSelector("bench/stream", recursive=True))
        report("S3 (moto)", result, requests, sum(i.size or 0 for i in infos if i.type == pafs.FileType.File))
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
