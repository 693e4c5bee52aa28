"""Fuzzing the run readers: a damaged run is read exactly as the undamaged one, or refused with one line naming
its file; never a crash of the process, never a different answer.

Sources are real runs in every layout: shipped sample runs (Parquet, float16, three stages) and runs recorded
here (top-k Parquet, a float32 Arrow IPC file, a bfloat16 table, a float16 run in the completion-marker
layout before tables, a spill folder). Each is damaged
systematically (truncated, bytes flipped, lengths lied about, columns of the wrong type, out-of-range ids,
NaN and infinite statistics, missing and extra columns, deep and huge metadata, a run and its copy side by
side), then read by ``Run.load`` and its main queries, by the dashboard's ``RunReader`` step by step, by
``logitscope inspect`` and by ``logitscope query`` (the ``steps`` and ``sequences`` views), in subprocesses
(a batch of cases each: a crash is the subprocess's death, and the batch is then rerun case by case to name
it). The dashboard's pages read a folder of damaged runs through
AppTest in a subprocess too.

By default a seeded subset of 60 cases runs (``LOGITSCOPE_FUZZ_SEED`` picks another subset); with
``LOGITSCOPE_FUZZ_ALL=1`` every case runs (``-m fuzz`` selects these tests).

Bytes of values in an Arrow IPC file carry no checksum: a flipped bit there is another run, as it would be in
any uncompressed file, so byte flips in IPC files are aimed at its structure (header, schema, footer), not
its value buffers. Parquet pages carry checksums, so flips anywhere in a Parquet file are in scope.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from marker_support import marker_run

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.fuzz
SAMPLE = REPO / "sample_runs" / "json_record.parquet"
#: Cases per subprocess: each subprocess pays the imports (~2 s) once.
BATCH = 40

# ---------------------------------------------------------------- the undamaged runs


def _record(storage: str, **options):
    import torch

    from tracker import LogitTrackingProcessor

    def mask_odd(input_ids, scores):  # a constraint: a constrained stage that differs from natural
        scores = scores.clone()
        scores[:, 1::2] = -float("inf")
        return scores

    tracker = LogitTrackingProcessor(mask_odd, storage=storage, **options)
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for _ in range(6):
        out = tracker(ids, torch.randn(2, 60, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    tracker.finish(ids)
    return tracker


_KEEP: list = []


def make_sources(folder: Path) -> dict[str, Path]:
    """Undamaged runs in every layout: ``{name: path}``."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = {"sample-parquet": folder / "sample.parquet"}
    shutil.copy(SAMPLE, sources["sample-parquet"])
    sources["topk-parquet"] = _record("topk", top_k=5).to_parquet(folder / "topk.parquet")
    table = _record("float32").run.to_arrow()
    sources["f32-ipc"] = folder / "f32.arrow"
    with pa.ipc.new_file(str(sources["f32-ipc"]), table.schema) as writer:
        writer.write_table(table, max_chunksize=5)  # three record batches
    run = _record("bfloat16").run
    run.to_dataset(folder / "dataset")
    sources["bf16-dataset"] = folder / "dataset"
    marker_run(_record("float16").run, folder / "markers")  # the layout before tables: engines wrote it so
    sources["f16-markers"] = folder / "markers"
    spill = _record("float32", memory_limit=0, chunk_bytes=64, spill_dir=folder / "spill")
    spill.recorder.flush()  # chunks go to disk on a background writer: wait for it
    sources["spill"] = folder / "spill" / spill.run.run_id
    _KEEP.append(spill)  # the spill folder lives as long as its tracker
    assert sources["spill"].is_dir() and list(sources["spill"].glob("chunk-*.arrow"))
    return sources


# ---------------------------------------------------------------- damage


def _main_file(path: Path) -> Path:
    """The file of a run that damage goes to: the file itself, a dataset's part, a spill folder's first chunk."""
    if path.is_file():
        return path
    parts = sorted(p for p in path.rglob("*.parquet") if "_delta_log" not in p.parts)  # a table's log: not a run
    return (parts or sorted(path.glob("chunk-*.arrow")))[0]


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    return dst


def _read(path: Path) -> pa.Table:
    if path.suffix == ".parquet":
        return pq.read_table(path)
    return pa.ipc.open_file(pa.py_buffer(path.read_bytes())).read_all()  # not a map: the file is rewritten


def _write(table: pa.Table, path: Path) -> None:
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)


def _rewrite_table(change: Callable[[pa.Table], pa.Table]) -> Callable[[Path, random.Random], None]:
    def damage(run: Path, rng: random.Random) -> None:
        part = _main_file(run)
        _write(change(_read(part)), part)

    return damage


def _set_column(name: str, values: Callable[[pa.Table], pa.Array]) -> Callable[[pa.Table], pa.Table]:
    def change(table: pa.Table) -> pa.Table:
        if name not in table.schema.names:
            raise _NotApplicable
        index = table.schema.get_field_index(name)
        array = values(table)
        field = pa.field(name, array.type, metadata=table.schema.field(name).metadata)
        return table.set_column(index, field, array)

    return change


def _fill(name: str, value: object) -> Callable[[pa.Table], pa.Table]:
    """Column ``name`` with ``value`` in its first row (its type kept)."""

    def values(table: pa.Table) -> pa.Array:
        column = table.column(name).combine_chunks()
        rows = column.to_pylist()
        rows[0] = value
        return pa.array(rows, column.type)

    return _set_column(name, values)


def _list_value(name: str, value: object) -> Callable[[pa.Table], pa.Table]:
    """The first entry of the first row of list column ``name`` set to ``value``."""

    def values(table: pa.Table) -> pa.Array:
        column = table.column(name).combine_chunks()
        rows = column.to_pylist()
        rows[0] = [value, *rows[0][1:]]
        return pa.array(rows, column.type)

    return _set_column(name, values)


def _cast(name: str, to: pa.DataType) -> Callable[[pa.Table], pa.Table]:
    return _set_column(name, lambda t: t.column(name).combine_chunks().cast(to, safe=False))


def _drop(name: str) -> Callable[[pa.Table], pa.Table]:
    def change(table: pa.Table) -> pa.Table:
        if name not in table.schema.names:
            raise _NotApplicable
        return table.drop_columns([name])

    return change


def _extra_column(table: pa.Table) -> pa.Table:
    return table.append_column("zz_added_by_someone", pa.array(np.arange(table.num_rows, dtype=np.int64)))


def _null_generation(table: pa.Table) -> pa.Table:
    rows = table.column("generation").to_pylist()
    rows[-1] = None
    index = table.schema.get_field_index("generation")
    return table.set_column(index, pa.field("generation", pa.int32()), pa.array(rows, pa.int32()))


class _NotApplicable(Exception):
    """This damage does not apply to this source (no such column)."""


def _metadata_json(change: Callable[[dict], None]) -> Callable[[Path, random.Random], None]:
    """Rewrite the run metadata JSON (a file's schema metadata, a table part's ``run_meta`` column, or a spill
    folder's ``_run.json``)."""

    def damage(run: Path, rng: random.Random) -> None:
        if (run / "_run.json").is_file():
            data = json.loads((run / "_run.json").read_text())
            raw = _apply(change, data)
            (run / "_run.json").write_bytes(raw)
            return
        part = _main_file(run)
        table = _read(part)
        if "run_meta" in table.schema.names:  # a table's part: the metadata is that column's, on every row
            raw = _apply(change, json.loads(table.column("run_meta")[0].as_py())).decode()
            index = table.schema.get_field_index("run_meta")
            _write(table.set_column(index, "run_meta", pa.array([raw] * table.num_rows, pa.string())), part)
            return
        meta = dict(table.schema.metadata)
        meta[b"logitscope.run"] = _apply(change, json.loads(meta[b"logitscope.run"]))
        _write(table.replace_schema_metadata(meta), part)

    return damage


def _apply(change: Callable[[dict], object], data: dict) -> bytes:
    result = change(data)
    return result if isinstance(result, bytes) else json.dumps(data).encode()


def _deep(depth: int) -> Callable[[dict], bytes]:
    def change(data: dict) -> bytes:
        data["extra"] = {"nested": "@"}
        return json.dumps(data).encode().replace(b'"@"', b"[" * depth + b"]" * depth)

    return change


def _generation_entry(key: str, value: object) -> Callable[[Path, random.Random], None]:
    """A generation entry's ``key`` set to ``value`` (in the ``generation_meta`` column, or the metadata)."""

    def damage(run: Path, rng: random.Random) -> None:
        part = _main_file(run)
        table = _read(part)
        if "generation_meta" not in table.schema.names:
            return _metadata_json(lambda d: d["generations"][0].__setitem__(key, value))(run, rng)
        rows = table.column("generation_meta").to_pylist()
        first = next(i for i, r in enumerate(rows) if r is not None)
        entries = json.loads(rows[first])
        entries[0][key] = value
        rows[first] = json.dumps(entries)
        index = table.schema.get_field_index("generation_meta")
        _write(table.set_column(index, "generation_meta", pa.array(rows, pa.string())), part)

    return damage


def _truncate(fraction: float) -> Callable[[Path, random.Random], None]:
    def damage(run: Path, rng: random.Random) -> None:
        part = _main_file(run)
        data = part.read_bytes()
        part.write_bytes(data[: int(len(data) * fraction)])

    return damage


def _value_buffers(data: bytes) -> list[tuple[int, int]]:
    """Byte ranges of an IPC file's record batch bodies (its value buffers)."""
    whole = pa.py_buffer(data)
    reader = pa.ipc.open_file(whole)
    ranges = []
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        for column in batch.columns:
            for array in (column, *(getattr(column, "values", None),)):
                for buffer in (array.buffers() if array is not None else []) or []:
                    if buffer is not None and buffer.size:
                        start = buffer.address - whole.address
                        ranges.append((start, start + buffer.size))
    return ranges


def _flip(count: int) -> Callable[[Path, random.Random], None]:
    def damage(run: Path, rng: random.Random) -> None:
        part = _main_file(run)
        data = bytearray(part.read_bytes())
        body = _value_buffers(bytes(data)) if data[:6] == b"ARROW1" else []
        spots = [i for i in range(len(data)) if not any(a <= i < b for a, b in body)] if body else range(len(data))
        for spot in rng.sample(list(spots), count):
            data[spot] ^= 1 << rng.randrange(8)
        part.write_bytes(bytes(data))

    return damage


def _lie_rows(run: Path, rng: random.Random) -> None:
    """An IPC file whose record batch says it holds 1,000,000 rows (its buffers hold a few)."""
    part = _main_file(run)
    if part.suffix != ".arrow":
        raise _NotApplicable
    table = _read(part)
    rows = table.num_rows  # the same run in one record batch, then its lengths lied about
    part.write_bytes(lying_lengths(table, {rows: 1_000_000, rows * 60: 60_000_000}))


def lying_lengths(table: pa.Table, lies: dict[int, int]) -> bytes:
    """``table`` as an Arrow IPC file (one record batch) with every 64-bit length ``old`` in ``lies`` replaced by
    its ``new`` value: the batch's and its columns' lengths say more than the buffers hold."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = bytearray(sink.getvalue().to_pybytes())
    # Only the record batch's own header lies: not the schema message, the values or the footer, where the same
    # numbers may stand by chance. Messages: 0xFFFFFFFF, their header's length, the header, then the body.
    schema_end = 16 + struct.unpack("<i", data[12:16])[0]
    header_end = schema_end + 8 + struct.unpack("<i", data[schema_end + 4 : schema_end + 8])[0]
    for old, new in lies.items():
        before, after = struct.pack("<q", old), struct.pack("<q", new)
        for at in range(schema_end + 8, header_end - 7, 8):  # int64 fields sit 8-aligned in the header
            if data[at : at + 8] == before:
                data[at : at + 8] = after
    return bytes(data)


def _duplicate(run: Path, rng: random.Random) -> None:
    """A copy of a run's file beside it (same run id): one folder, the run twice."""
    part = _main_file(run)
    if run.is_file():
        raise _NotApplicable  # handled by _copy_beside
    shutil.copy(part, part.with_name(part.stem.replace("chunk-", "chunk-9") + "-copy" + part.suffix))


#: (name, damage, the sources it applies to: None for all)
DAMAGES: list[tuple[str, Callable[[Path, random.Random], None]]] = [
    *[(f"truncate-{f}", _truncate(f)) for f in (0.0, 0.3, 0.9, 0.999)],
    *[(f"flip-{n}-{i}", _flip(n)) for n in (1, 8) for i in range(6)],
    ("lie-rows", _lie_rows),
    ("generation-as-float", _rewrite_table(_cast("generation", pa.float64()))),
    ("chosen-as-string", _rewrite_table(_cast("chosen", pa.string()))),
    ("entropy-as-int", _rewrite_table(_cast("natural_entropy", pa.int64()))),
    ("logits-as-float64", _rewrite_table(_cast("natural_logits", pa.list_(pa.float64())))),
    ("chosen-huge", _rewrite_table(_fill("chosen", 10**12))),
    ("chosen-minus-2", _rewrite_table(_fill("chosen", -2))),
    ("chosen-vocab-size", _rewrite_table(_fill("chosen", 1079))),
    ("step-negative", _rewrite_table(_fill("step", -4))),
    ("topk-id-minus-1", _rewrite_table(_list_value("natural_topk_ids", -1))),
    ("topk-id-past-vocab", _rewrite_table(_list_value("natural_topk_ids", 10**6))),
    ("lse-minus-50", _rewrite_table(_fill("natural_lse", -50.0))),
    ("lse-nan", _rewrite_table(_fill("natural_lse", float("nan")))),
    ("max-nan", _rewrite_table(_fill("natural_max", float("nan")))),
    ("max-inf", _rewrite_table(_fill("natural_max", float("inf")))),
    ("entropy-nan", _rewrite_table(_fill("natural_entropy", float("nan")))),
    ("entropy-minus-inf", _rewrite_table(_fill("natural_entropy", float("-inf")))),
    ("p-chosen-inf", _rewrite_table(_fill("natural_p_chosen", float("inf")))),
    ("allowed-negative", _rewrite_table(_fill("natural_allowed", -3))),
    ("missing-step", _rewrite_table(_drop("step"))),
    ("missing-logits", _rewrite_table(_drop("natural_logits"))),
    ("missing-lse", _rewrite_table(_drop("natural_lse"))),
    ("extra-column", _rewrite_table(_extra_column)),
    ("null-generation", _rewrite_table(_null_generation)),
    ("deep-metadata-100000", _metadata_json(_deep(100_000))),
    ("deep-metadata-40", _metadata_json(_deep(40))),
    ("huge-metadata", _metadata_json(lambda d: d.__setitem__("extra", {"blob": "x" * (3 << 20)}))),
    ("stages-empty", _metadata_json(lambda d: d.__setitem__("stages", []))),
    ("stages-without-natural", _metadata_json(lambda d: d.__setitem__("stages", d["stages"][1:] or ["x"]))),
    ("vocab-size-larger", _metadata_json(lambda d: d.__setitem__("vocab_size", d["vocab_size"] + 7))),
    ("prompt-ids-text", _generation_entry("prompt_ids", [["a", "b"]])),
    ("prompt-ids-float", _generation_entry("prompt_ids", [[1.5, 2]])),
    ("prompt-ids-past-vocab", _generation_entry("prompt_ids", [[10**9]])),
    ("generation-entry-text", _generation_entry("generation", "zero")),
    ("generation-entry-float", _generation_entry("generation", 0.5)),
    ("duplicate-part", _duplicate),
]


def make_cases(sources: dict[str, Path], folder: Path, names: list[str] | None, seed: int) -> list[dict]:
    """Damaged copies of every source: ``[{"case", "source", "path"}]`` (cases that do not apply are left out)."""
    cases = []
    for source, path in sources.items():
        for name, damage in DAMAGES:
            case = f"{source}/{name}"
            if names is not None and case not in names:
                continue
            target = folder / source / name
            target.mkdir(parents=True)
            damaged = _copy(path, target / path.name)
            try:
                damage(damaged, random.Random(f"{seed}/{case}"))
            except _NotApplicable:
                shutil.rmtree(target)
                continue
            cases.append({"case": case, "source": source, "path": str(damaged)})
        if path.is_file():  # a run and a copy of it in one folder, read as the folder
            target = folder / source / "copied-beside"
            target.mkdir(parents=True)
            shutil.copy(path, target / path.name)
            shutil.copy(path, target / f"copy-{path.name}")
            cases.append({"case": f"{source}/copied-beside", "source": source, "path": str(target)})
    return cases


# ---------------------------------------------------------------- what each reader answers (in a subprocess)


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return None if value != value else round(value, 4)
    if isinstance(value, dict):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, np.ndarray):  # values as bytes, rounded: a digest, not a JSON dump of every logit
        rounded = np.round(value.astype(np.float64), 4) if value.dtype.kind == "f" else value.astype(np.int64)
        return hashlib.sha256(np.nan_to_num(rounded, nan=-999.0).tobytes()).hexdigest()[:16]
    if isinstance(value, np.generic):
        return _rounded(value.item())
    return value


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(_rounded(value), sort_keys=True, default=str).encode()).hexdigest()[:16]


def answers_of_load(path: str) -> str:
    """``Run.load`` and its main queries (text, top tokens, statistics, the notebook view), every sequence."""
    import warnings

    from tracker import Run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = Run.load(path)
    out = []
    for g in run.generations():
        for s in run.sequences(g):
            stats = run.stats(sequence=s, generation=g)
            out.append(
                {
                    "text": run.sequence(sequence=s, generation=g),
                    "top": run.get_top_tokens(k=3, sequence=s, generation=g),
                    "stats": {c: stats[c].to_numpy() for c in stats.select_dtypes("number").columns},
                }
            )
    out.append(len(run.view()._repr_html_()) > 0)
    return _digest(out)


def answers_of_reader(path: str) -> str:
    """The dashboard's reader: every stage of every step of every sequence, and the first sequence's window."""
    from dashboard.reader import RunReader
    from dashboard.views import step_summary, window_view

    reader = RunReader(path)
    out = []
    for g in reader.generations():
        for s in reader.sequences(g):
            track = reader.track(g, s)
            out.append([reader.prompt(g, s), track.chosen])
            for position in range(track.length):
                row = reader.step(track, position)
                out.append({k: v.__dict__ for k, v in row.stages.items()})
            out.append(step_summary(reader.step(track, 0), reader.vocab).__dict__)
    track = reader.track(reader.generations()[0], 0)
    view = window_view(reader.window(track, 0, track.length), track.generation, 0)
    out.append({k: v for k, v in view.__dict__.items() if isinstance(v, (np.ndarray, list, str, int, float))})
    return _digest(out)


def answers_of_inspect(path: str) -> str:
    """``logitscope inspect PATH --steps 0:2 --json``: each sequence's text and its first steps' tables."""
    import contextlib
    import io

    from dashboard.discover import find_runs
    from logitscope.cli import build_parser

    found = find_runs(path)  # a dataset root: its one run; a folder of runs: each (kept apart, each the same)
    if len(found) > 1:
        answers = {answers_of_inspect(str(run)) for run in found}
        return answers.pop() if len(answers) == 1 else "runs that differ"
    parser = build_parser()
    args = parser.parse_args(["inspect", str(found[0]) if found else path, "--steps", "0:2", "--json"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        status = args.handler(args, args.command_parser, out)
    if status != 0:
        lines = err.getvalue().strip().splitlines()
        raise _InspectRefused(lines[0] if len(lines) == 1 else f"{len(lines)} lines: {err.getvalue()!r}")
    document = json.loads(out.getvalue())
    return _digest(document["sequences"])


class _InspectRefused(Exception):
    pass


QUERY = (
    "SELECT s.generation, s.sequence, s.step, s.chosen_token, round(s.entropy_natural, 4) AS entropy, q.text "
    "FROM steps s JOIN sequences q USING (run_id, generation, sequence) ORDER BY 1, 2, 3"
)


def answers_of_query(path: str) -> str:
    """``logitscope query PATH SQL --json`` over the ``steps`` and ``sequences`` views, as a user runs it (a
    process of its own: DuckDB's threads and the probe's readers stay apart): every step's chosen token and
    natural entropy, every sequence's text. A run left out of the answer, or a refused dataset, is its lines on
    stderr (judged as any refusal: one line naming the file)."""
    command = [sys.executable, "-m", "logitscope.cli", "query", path, QUERY, "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if done.returncode < 0:
        raise RuntimeError(f"logitscope query died of signal {-done.returncode}: {done.stderr[-500:]!r}")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise _InspectRefused(lines[0] if len(lines) == 1 else f"{len(lines)} lines: {done.stderr!r}")
    return _digest([json.loads(line) for line in done.stdout.splitlines() if line.strip()])


#: (source, reader) pairs refused by design: ``query`` reads run files, folders of them and tables, not a
#: tracker's spill folder (its working folder while recording), and says so in one line.
REFUSED = {("spill", "query")}

READERS = {
    "load": answers_of_load,
    "reader": answers_of_reader,
    "inspect": answers_of_inspect,
    "query": answers_of_query,
}


def probe(cases: list[dict]) -> None:
    """Print one JSON line per (case, reader): what it answered (a digest) or the error it raised."""
    for case in cases:
        for name, answer in READERS.items():
            try:
                record = {"digest": answer(case["path"])}
            except (Exception, SystemExit) as exc:  # judged by the parent: one line naming the file
                record = {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}
            print(json.dumps({"case": case["case"], "reader": name, **record}), flush=True)


def run_batch(cases: list[dict]) -> tuple[list[dict], int]:
    """Probe ``cases`` in one subprocess: its records and its exit status.

    The probe leaves through ``os._exit`` once every record is printed: pyarrow (26.0.1 here) may abort a
    process at interpreter exit when its thread pool was busy just before (``terminate called without an active
    exception``; apache/arrow#34314; four lines of pyarrow alone abort 6 runs in 8 on this machine), which is not
    a case's crash. A signal while probing still ends the process with it."""
    code = (
        f"import os, sys, json; sys.path.insert(0, {str(REPO / 'tests')!r}); import test_fuzz_files as t; "
        "t.probe(json.loads(sys.stdin.read())); sys.stdout.flush(); sys.stderr.flush(); os._exit(0)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=600
    )
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return records, done.returncode


def probe_all(cases: list[dict]) -> tuple[dict[tuple[str, str], dict], list[str]]:
    """Every case probed in batches; a batch whose process dies is rerun case by case to name the crash."""
    results: dict[tuple[str, str], dict] = {}
    crashed: list[str] = []
    for start in range(0, len(cases), BATCH):
        batch = cases[start : start + BATCH]
        records, status = run_batch(batch)
        if status != 0:
            records = []
            for case in batch:
                alone, status = run_batch([case])
                if status != 0:
                    crashed.append(f"{case['case']} (exit status {status})")
                records += alone
        for record in records:
            results[(record["case"], record["reader"])] = record
    return results, crashed


# ---------------------------------------------------------------- the tests


def _selected(all_cases: list[str], seed: int) -> list[str] | None:
    if os.environ.get("LOGITSCOPE_FUZZ_ALL"):
        return None
    rng = random.Random(seed)
    return sorted(rng.sample(all_cases, min(len(all_cases), 60)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return make_sources(tmp_path_factory.mktemp("sources"))


def judge(cases: list[dict], results: dict[tuple[str, str], dict], originals: dict[tuple[str, str], dict]) -> list[str]:
    """What went wrong: an error that is not one line naming the file, or an answer unlike the original's."""
    faults = []
    for case in cases:
        names = {Path(case["path"]).name, Path(case["path"]).parent.name}
        for reader in READERS:
            record = results.get((case["case"], reader))
            if record is None:
                faults.append(f"{case['case']} [{reader}]: no answer")
                continue
            if "error" in record:
                message = record["error"]
                if "\n" in message.strip() or not any(n in message for n in names):
                    faults.append(f"{case['case']} [{reader}]: error not one line naming the file: {message[:300]}")
                continue
            original = originals[(case["source"], reader)]
            if record["digest"] != original.get("digest"):
                faults.append(f"{case['case']} [{reader}]: answered differently from the undamaged run")
    return faults


def test_damaged_runs_are_read_exactly_or_refused_with_one_line_naming_the_file(sources, tmp_path):
    seed = int(os.environ.get("LOGITSCOPE_FUZZ_SEED", "31"))
    every = [f"{s}/{n}" for s in sources for n, _ in DAMAGES] + [f"{s}/copied-beside" for s in sources]
    cases = make_cases(sources, tmp_path / "damaged", _selected(every, seed), seed)
    originals_cases = [{"case": f"original/{s}", "source": s, "path": str(p)} for s, p in sources.items()]
    results, crashed = probe_all(originals_cases + cases)
    originals = {}
    for case in originals_cases:
        for reader in READERS:
            record = results[(case["case"], reader)]
            if (case["source"], reader) in REFUSED:  # by design: one line naming it, damaged or not
                assert "\n" not in record.get("error", "\n").strip(), record
            else:
                assert "digest" in record, f"the undamaged {case['source']} fails in {reader}: {record}"
            originals[(case["source"], reader)] = record
    faults = judge(cases, results, originals)
    assert not crashed, f"these damaged runs crashed the process: {crashed}"
    assert not faults, f"{len(faults)} of {len(cases) * len(READERS)} reads went wrong:\n" + "\n".join(faults)
