"""The ``steps`` and ``sequences`` views of many runs at once, from their statistics columns.

A run that recorded its statistics with its rows answers :meth:`tracker.Run.stats`
from those columns; so do the views, for every such run at once: the id and
statistics columns of every file are read (several files at a time; each
file's footer parsed once), put in one table, checked as
:mod:`tracker.format.checks` checks one run (on failure, run by run, to name the
file at fault), cut where each sequence ends
(:func:`tracker.reading.selection.sequence_end`'s rule, vectorised) and turned
into the views' columns in a few whole-array operations. The numbers are those
of :func:`tracker.reading.query_views.steps_tables` run by run
(``tests/test_query_table.py`` compares them). Runs without recorded
statistics, or with a stage per processor, take that run-by-run path.
Needs pyarrow and numpy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from processors.vocab import Vocabulary
from tracker.format.checks import RunFileError, check_ids, check_stats, stats_damage
from tracker.format.schema import GENERATIONS_COLUMN, STAT_COLUMNS, RunMetadata, check_generations
from tracker.reading.query_views import INT_PREFIXES, SEQUENCES_SCHEMA, sampling_of

__all__ = ["RunColumns", "read_runs", "steps_of_runs", "sequences_of_runs"]

_IDS = ["generation", "sequence", "step", "chosen", "processor_error"]


@dataclass
class RunColumns:
    """One run's id and statistics columns (every file's rows), its metadata (generations included) and how to
    name it in errors."""

    metadata: RunMetadata
    table: pa.Table
    where: str


def _columns(metadata: RunMetadata) -> list[str]:
    return _IDS + [f"{s}_{n}" for s in metadata.stages for n in STAT_COLUMNS] + [GENERATIONS_COLUMN]


def read_runs(runs: Sequence[tuple[RunMetadata, list[Any], str]], threads: int = 8) -> list[RunColumns]:
    """Read the id and statistics columns of ``runs`` (``(metadata, parts, name)``: the run's metadata
    without generations, its opened parts (:mod:`tracker.format.parts`, bound to the metadata), its name for
    errors), ``threads`` files at a time. RunFileError naming a file that cannot be read."""
    jobs = [(i, part) for i, (_, parts, _) in enumerate(runs) for part in parts]

    def read(job: tuple[int, Any]) -> tuple[pa.Table, list[dict]]:
        i, part = job
        try:
            table = part.read_columns(_columns(runs[i][0]))
        except (pa.ArrowException, OSError) as exc:
            from tracker.format.checks import arrow_reason

            raise RunFileError(part.path, arrow_reason(exc)) from exc
        entries: list[dict] = []
        if GENERATIONS_COLUMN in table.column_names:
            from tracker.format.schema import generations_from_column

            try:
                entries = generations_from_column(table.column(GENERATIONS_COLUMN))
                check_generations(entries, runs[i][0].vocab_size)
            except ValueError as exc:
                raise RunFileError(part.path, str(exc)) from exc
            table = table.drop_columns([GENERATIONS_COLUMN])
        return table, entries

    if len(jobs) > 1 and threads > 1:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="logitscope-read") as pool:
            done = list(pool.map(read, jobs))
    else:
        done = [read(j) for j in jobs]
    tables: list[list[pa.Table]] = [[] for _ in runs]
    entries: list[list[dict]] = [[] for _ in runs]
    for (i, _), (table, found) in zip(jobs, done):
        tables[i].append(table)
        entries[i] += found
    out = []
    for (metadata, _, where), pieces, found in zip(runs, tables, entries):
        table = pa.concat_tables(pieces, promote_options="permissive") if len(pieces) > 1 else pieces[0]
        generations = sorted(metadata.generations + found, key=lambda e: e.get("generation", -1))
        out.append(RunColumns(replace(metadata, generations=generations), table, where))
    return out


def _check(runs: list[RunColumns], table: pa.Table, src: np.ndarray, vocab: np.ndarray, keys: np.ndarray) -> None:
    """The checks of one run's ids and statistics over every run at once; on a failure, run by run, so that
    the error names the run at fault (and says what :mod:`tracker.format.checks` says of it)."""
    bad = False
    for name in ("generation", "sequence", "step", "processor_error"):
        bad |= table.column(name).null_count > 0
    if not bad and table.num_rows:
        ids = np.stack([table.column(n).to_numpy() for n in ("generation", "sequence", "step")])
        chosen = table.column("chosen").fill_null(-1).to_numpy()
        bad = bool((ids < 0).any() or (chosen < -1).any() or (chosen >= np.maximum(vocab[src], 1)).any())
        bad = bad or bool(np.all(keys[1:] == keys[:-1], axis=1).any())
    if not bad:
        union = list(dict.fromkeys(s for r in runs for s in r.metadata.stages))
        proxy = replace(runs[0].metadata, stages=union, vocab_size=int(vocab.max(initial=0)))
        bad = stats_damage(table, proxy) is not None
        for stage in union:  # each row's allowed count within its own run's vocabulary
            if not bad and f"{stage}_allowed" in table.column_names:
                allowed = table.column(f"{stage}_allowed").to_numpy(zero_copy_only=False).astype(np.float64)
                bad = bool((allowed > vocab[src]).any())
    if bad:
        for run in runs:
            check_ids(run.where, run.table, run.metadata.vocab_size)
            check_stats(run.where, run.table, run.metadata)


def _float(table: pa.Table, name: str, rows: np.ndarray) -> np.ndarray:
    if name not in table.column_names:
        return np.full(rows.size, np.nan)
    return table.column(name).take(rows).to_numpy(zero_copy_only=False).astype(np.float64)


def _nullable(values: np.ndarray, name: str) -> pa.Array:
    """A float column with NaN as null (counts as int64, like :func:`query_views._nulls_for_nan`)."""
    array = pa.array(values, mask=np.isnan(values))
    return array.cast(pa.int64()) if name.startswith(INT_PREFIXES) else array


def _limits(runs: list[RunColumns], first: np.ndarray, src: np.ndarray, gen: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Per sequence (its first row ``first``): the step it ends before, where its host told its length; -1
    where its end is its first end-of-sequence token."""
    lengths: dict[tuple[int, int], list] = {}
    for i, run in enumerate(runs):
        for entry in run.metadata.generations:
            if isinstance(entry.get("lengths"), list) and isinstance(entry.get("generation"), int):
                lengths[(i, entry["generation"])] = entry["lengths"]
    out = np.full(first.size, -1, dtype=np.int64)
    if lengths:
        for k, row in enumerate(first.tolist()):
            found = lengths.get((int(src[row]), int(gen[row])))
            s = int(seq[row])
            if found is not None and 0 <= s < len(found):
                out[k] = int(found[s])
    return out


def steps_of_runs(
    runs: list[RunColumns], vocabulary: Callable[[int], Vocabulary]
) -> tuple[pa.Table, list[tuple[int, int, int, np.ndarray]]]:
    """The ``steps`` rows of ``runs`` (runs with recorded statistics and no stage per processor, sorted by
    run id) and, per sequence, ``(run index, generation, sequence, chosen ids)``. ``vocabulary(i)``: run
    ``i``'s vocabulary."""
    table = pa.concat_tables([r.table for r in runs], promote_options="permissive")
    sizes = np.array([r.table.num_rows for r in runs], dtype=np.int64)
    src = np.repeat(np.arange(len(runs), dtype=np.int64), sizes)
    vocab = np.array([r.metadata.vocab_size for r in runs], dtype=np.int64)
    gen, seq, step = (
        table.column(n).fill_null(0).to_numpy().astype(np.int64) for n in ("generation", "sequence", "step")
    )
    chosen = table.column("chosen").fill_null(-1).to_numpy()
    order = np.lexsort((step, seq, gen, src))
    keys = np.stack([src[order], gen[order], seq[order], step[order]], axis=1)
    _check(runs, table, src, vocab, keys)
    # where each sequence ends: its host's length, else its first end-of-sequence token (sequence_end)
    starts = np.flatnonzero(np.r_[True, np.any(keys[1:, :3] != keys[:-1, :3], axis=1)]) if order.size else order
    group = np.cumsum(np.r_[False, np.any(keys[1:, :3] != keys[:-1, :3], axis=1)]) if order.size else order
    limit = _limits(runs, order[starts], src, gen, seq)
    eos = np.zeros(order.size, dtype=bool)
    for ids in {tuple(r.metadata.eos_token_ids) for r in runs if r.metadata.eos_token_ids}:
        mine = np.array([tuple(r.metadata.eos_token_ids) == ids for r in runs])
        eos |= mine[src[order]] & np.isin(chosen[order], ids)
    before = np.cumsum(eos) - eos
    before = before - before[starts][group] if order.size else before
    keep = np.where(limit[group] >= 0, step[order] < limit[group], before == 0) if order.size else eos
    rows = order[keep]
    bounds = np.searchsorted(group[keep], np.arange(starts.size + 1))  # each sequence's kept rows, even none
    firsts = order[starts]
    texts = [
        (int(src[f]), int(gen[f]), int(seq[f]), chosen[rows[a:b]])
        for f, a, b in zip(firsts.tolist(), bounds[:-1].tolist(), bounds[1:].tolist())
    ]
    known = chosen[rows] >= 0
    ids = pa.array(chosen[rows], mask=~known)
    run_ids = pa.array([r.metadata.run_id for r in runs], pa.string()).take(pa.array(src[rows]))
    columns: dict[str, pa.Array] = {
        "run_id": run_ids,
        "generation": pa.array(gen[rows].astype(np.int32)),
        "sequence": pa.array(seq[rows].astype(np.int32)),
        "step": pa.array(step[rows].astype(np.int32)),
        "chosen_id": ids,
        "chosen_token": _tokens(runs, vocabulary, src[rows], chosen[rows], known),
    }
    stages = list(dict.fromkeys(s for r in runs for s in r.metadata.stages))
    for stage in stages:
        columns[f"entropy_{stage}"] = _nullable(_float(table, f"{stage}_entropy", rows), "")
        for name in ("p_chosen", "rank_chosen"):
            values = np.where(known, _float(table, f"{stage}_{name}", rows), np.nan)
            columns[f"{name}_{stage}"] = _nullable(values, f"{name}_")
        columns[f"p_eos_{stage}"] = _nullable(_float(table, f"{stage}_p_eos", rows), "")
    constrained = np.array(["constrained" in r.metadata.stages for r in runs])[src[rows]]
    for name in ("allowed", "removed_mass", "margin"):
        mine = _float(table, f"constrained_{name}", rows)
        other = _float(table, f"natural_{name}", rows) if name == "allowed" else np.zeros(rows.size)
        columns[name] = _nullable(np.where(constrained, mine, other), name)
    nonfinite = np.zeros(rows.size, dtype=bool)
    for stage in stages:
        nan = _float(table, f"{stage}_nan", rows)
        columns[f"nan_{stage}"] = _nullable(nan, "nan_")
        nonfinite |= (nan > 0) | (_float(table, f"{stage}_lse", rows) == np.inf)
    columns["processor_error"] = table.column("processor_error").take(pa.array(rows)).combine_chunks()
    columns["nonfinite"] = pa.array(nonfinite)
    for stage in stages:
        p = columns[f"p_chosen_{stage}"].to_numpy(zero_copy_only=False)
        with np.errstate(divide="ignore", invalid="ignore"):
            columns[f"surprisal_{stage}"] = _nullable(-np.log(p), "")
    return pa.table(columns), texts


def _tokens(
    runs: list[RunColumns],
    vocabulary: Callable[[int], Vocabulary],
    src: np.ndarray,
    chosen: np.ndarray,
    known: np.ndarray,
) -> pa.Array:
    """Each row's chosen token as its run's vocabulary shows it (null where unknown)."""
    pieces, positions = [], []
    by_vocab: dict[int, list[int]] = {}
    shared: dict[int, Vocabulary] = {}
    for i in np.unique(src).tolist():
        vocab = vocabulary(i)
        by_vocab.setdefault(id(vocab), []).append(i)
        shared[id(vocab)] = vocab
    for key, members in by_vocab.items():
        where = np.flatnonzero(np.isin(src, members))
        ids = pa.array(chosen[where], mask=~known[where])
        pieces.append(shared[key].display_array.take(ids).cast(pa.string()))
        positions.append(where)
    if not pieces:
        return pa.array([], pa.string())
    joined = pa.concat_arrays(pieces)
    order = np.empty(src.size, dtype=np.int64)
    order[np.concatenate(positions)] = np.arange(src.size)
    return joined.take(pa.array(order))


def sequences_of_runs(
    runs: list[RunColumns], vocabulary: Callable[[int], Vocabulary], texts: list[tuple[int, int, int, np.ndarray]]
) -> pa.Table:
    """The ``sequences`` rows: per run, generation and sequence, its prompt, generated text, step count and
    sampling settings (JSON)."""
    rows = []
    for i, generation, sequence, chosen in texts:
        run = runs[i]
        entry = next((g for g in run.metadata.generations if g.get("generation") == generation), {})
        prompts = entry.get("prompt_ids") or []
        prompt = prompts[sequence] if sequence < len(prompts) and isinstance(prompts[sequence], list) else []
        unknown = np.flatnonzero(chosen < 0)
        kept = chosen[: int(unknown[0]) if unknown.size else chosen.size]
        vocab = vocabulary(i)
        sampling = sampling_of(run.metadata, entry, sequence)
        rows.append(
            {
                "run_id": run.metadata.run_id,
                "generation": generation,
                "sequence": sequence,
                "prompt": vocab.decode(prompt) if prompt else None,
                "text": vocab.decode(kept.tolist()),
                "steps": int(chosen.size),
                "sampling": None if sampling is None else json.dumps(sampling),
            }
        )
    return pa.Table.from_pylist(rows, schema=SEQUENCES_SCHEMA)
