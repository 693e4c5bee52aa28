"""The ``steps`` and ``sequences`` views of many runs at once, from their statistics columns.

A run that recorded its statistics with its rows answers :meth:`tracker.Run.stats`
from those columns; so do the views, for every such run at once: the id and
statistics columns of every file are read part by part through
:mod:`tracker.format.parts` (the same opener and checks as ``Run.load``:
Parquet page checksums verified, each file's schema checked; several files
at a time), checked as
:mod:`tracker.format.checks` checks one run (on failure, run by run, to name
the run at fault), cut where each sequence ends
(:func:`tracker.reading.selection.sequence_end`'s rule, vectorised) and turned
into the views' columns in a few whole-array operations. The numbers are those
of :func:`tracker.reading.query_views.steps_tables` run by run
(``tests/test_query_table.py`` compares them). ``sequences`` (prompts and
texts) is made only when a query names it: the prompts are in each part's
``generation_meta`` column, read then. Runs without recorded statistics, or
with a stage per processor, take the run-by-run path. Needs pyarrow and numpy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from processors.vocab import Vocabulary
from tracker.format.checks import RunFileError, arrow_reason, check_ids, check_stats, stats_damage
from tracker.format.schema import (
    GENERATIONS_COLUMN,
    STAT_COLUMNS,
    check_generations,
    generations_from_column,
    run_schema,
)
from tracker.reading.query_views import INT_PREFIXES, SEQUENCES_SCHEMA, sampling_of

__all__ = ["Scanned", "scan_runs", "steps_of_runs", "sequences_of_runs"]

_IDS = ["generation", "sequence", "step", "chosen", "processor_error"]
#: The statistics the views show or check.
_STATS = list(STAT_COLUMNS)
#: Per statistic, the ``steps`` columns (``<name>_<stage>``) made of it.
_SHOWN = {
    "entropy": ("entropy",),
    "p_chosen": ("p_chosen", "surprisal"),
    "rank_chosen": ("rank_chosen",),
    "p_eos": ("p_eos",),
    "nan": ("nan",),
}
#: The ``steps`` columns every table of it has.
ALWAYS = ("run_id", "generation", "sequence", "step")


@dataclass
class Scanned:
    """The id and statistics columns of several runs (``src``: each row's run, an index into ``sources``;
    ``kept``: some came from what this machine kept of a table's parts)."""

    sources: Sequence[Any]
    table: pa.Table
    src: np.ndarray
    kept: bool = False

    def run_table(self, i: int) -> pa.Table:
        return self.table.filter(pa.array(self.src == i))


def _wanted(source: Any, names: list[str]) -> list[str]:
    return [c for c in names if all(c in cols for cols in source.columns)]


def _kept_parts(source: Any) -> list[str] | None:
    """The source's files as parts of its table (paths inside it), or None: not a table's run."""
    table = source.table
    if table is None or len(source.file_sizes) != len(source.files):
        return None
    return [f[len(table.where) + 1 :] for f in source.files]


def _read(
    sources: Sequence[Any], wanted: list[list[str]], threads: int, *, use_kept: bool = True, keep: bool = True
) -> tuple[pa.Table, np.ndarray, bool]:
    """``wanted[i]`` of every file of ``sources[i]`` as one table, each row's source, and whether any came
    from this machine's cache. Parts are read through the checked opener, ``threads`` runs at a time; a
    table's parts whose columns an earlier scan kept (:func:`~tracker.format.table_index.kept_columns`) come
    from there instead (``use_kept``), and what is read of a table's parts is kept for the next process, with
    what was kept of them before (``keep``). (DuckDB's Parquet reader read a thousand local parts in half
    the time, 0.21-0.24 s against 0.43-0.47 s, but checks no page checksum: a flipped byte of a value was
    answered as another value.)"""
    from tracker.format.table_index import keep_columns, kept_columns

    named = [_kept_parts(s) if use_kept or keep else None for s in sources]
    sizes: dict[str, dict[str, int]] = {}
    for source, parts in zip(sources, named):
        if parts is not None:
            sizes.setdefault(source.table.location, {}).update(zip(parts, source.file_sizes))
    kept = {where: kept_columns(where, parts) if use_kept else {} for where, parts in sizes.items()}
    there = [{} if parts is None else kept[s.table.location] for s, parts in zip(sources, named)]
    cached = [
        parts is not None and all(p in there[i] and set(wanted[i]) <= set(there[i][p].column_names) for p in parts)
        for i, parts in enumerate(named)
    ]
    fresh: dict[str, dict[str, tuple[int, pa.Table]]] = {}
    scanned = _scan(sources, wanted, named, there, cached, threads)
    for i, tables in scanned.items():
        if named[i] is not None and keep:
            for j, table in enumerate(tables):
                fresh.setdefault(sources[i].table.location, {})[named[i][j]] = (sources[i].file_sizes[j], table)

    def read(i: int) -> list[pa.Table]:  # opening and checking a part is on the readers too (half its time)
        parts = named[i]
        if cached[i]:
            return [there[i][p].select(wanted[i]) for p in parts]  # type: ignore[union-attr]
        if i in scanned:
            return [t.select(wanted[i]) for t in scanned[i]]
        done = []
        for j, part in enumerate(sources[i].parts()):
            names = wanted[i]
            if parts is not None and parts[j] in there[i]:  # what was kept of it too: the cache only grows
                names = list(dict.fromkeys(names + there[i][parts[j]].column_names))
            try:
                table = part.read_columns(names)
            except (pa.ArrowException, OSError) as exc:
                raise RunFileError(part.path, arrow_reason(exc)) from exc
            if parts is not None and keep:
                fresh.setdefault(sources[i].table.location, {})[parts[j]] = (sources[i].file_sizes[j], table)
            done.append(table.select([c for c in wanted[i] if c in table.column_names]))
        return done

    opened = [i for i in range(len(sources)) if not cached[i] and i not in scanned]  # the parts' own reader
    pooled = set(opened) if len(opened) > 1 and threads > 1 else set()
    done: list[list[pa.Table]] = [[] for _ in sources]
    if pooled:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="logitscope-read") as pool:
            for i, tables in zip(opened, pool.map(read, opened)):
                done[i] = tables
    for i in range(len(sources)):
        if i not in pooled:
            done[i] = read(i)
    for where, read_now in fresh.items():  # what was kept (of parts still committed) and what was read now
        keep_columns(where, {**{p: (sizes[where][p], t) for p, t in kept[where].items()}, **read_now})
    tables: list[pa.Table] = []
    owners: list[np.ndarray] = []
    for i, read_tables in enumerate(done):
        for table in read_tables:
            tables.append(table)
            owners.append(np.full(table.num_rows, i, dtype=np.int64))
    if not tables:
        return pa.table({}), np.zeros(0, np.int64), any(cached)
    return pa.concat_tables(tables, promote_options="permissive"), np.concatenate(owners), any(cached)


def _scan(
    sources: Sequence[Any],
    wanted: list[list[str]],
    named: list[list[str] | None],
    there: list[dict[str, pa.Table]],
    cached: list[bool],
    threads: int,
) -> dict[int, list[pa.Table]]:
    """Per run read here, its parts' columns (``wanted``, and what was kept of them before: the cache only
    grows), one table per part: the small local parts of a table whose bytes match their names, in one
    DuckDB scan per set of columns (:mod:`tracker.format.scan`). The other runs are left out, and so is a
    set of columns DuckDB could not read as asked."""
    from tracker.format.scan import MAX_SCAN_BYTES, verified

    chosen = [
        i
        for i, s in enumerate(sources)
        if not cached[i]
        and named[i] is not None
        and isinstance(s.fs, pafs.LocalFileSystem)
        and len(s.file_rows) == len(s.files)
        and all(0 < size <= MAX_SCAN_BYTES for size in s.file_sizes)
    ]
    files = [f for i in chosen for f in sources[i].files]
    if len(files) < 2:  # one part: pyarrow's open costs no more than DuckDB's connection
        return {}
    matching = iter(verified(files, threads))  # before DuckDB reads a byte of them
    groups: dict[tuple[str, ...], list[int]] = {}
    for i in chosen:
        if all([next(matching) for _ in sources[i].files]):
            kept = [c for p in named[i] for c in there[i].get(p, pa.table({})).column_names]  # type: ignore[union-attr]
            present = [c for c in dict.fromkeys(kept) if all(c in cols for cols in sources[i].columns)]
            groups.setdefault(tuple(dict.fromkeys(wanted[i] + present)), []).append(i)
    found: dict[int, list[pa.Table]] = {}
    for columns, members in groups.items():
        found.update(_scan_group(sources, columns, members))
    return found


def _scan_group(sources: Sequence[Any], columns: tuple[str, ...], members: list[int]) -> dict[int, list[pa.Table]]:
    """``columns`` of the parts of the runs ``members`` in one DuckDB scan, one table per part; {} when DuckDB
    cannot read them so."""
    from tracker.format.scan import ScanUnavailable, scan_columns

    if not members:
        return {}
    meta = sources[members[0]].metadata  # the group's runs read these columns: they have their stages
    schema = run_schema(meta.storage, meta.stages, meta.vocab_size, meta.top_k, stats=True)
    if any(c not in schema.names for c in columns):
        return {}
    kinds = {c: schema.field(c).type for c in columns}
    files = [f for i in members for f in sources[i].files]
    try:
        table, index = scan_columns(files, kinds, [n for i in members for n in sources[i].file_rows])
    except ScanUnavailable:
        return {}
    order = np.argsort(index, kind="stable")
    table, bounds = table.take(order), np.r_[0, np.cumsum(np.bincount(index, minlength=len(files)))]
    found: dict[int, list[pa.Table]] = {}
    k = 0
    for i in members:
        found[i] = []
        for _ in sources[i].files:
            found[i].append(table.slice(int(bounds[k]), int(bounds[k + 1] - bounds[k])))
            k += 1
    return found


def _statistics(columns: set[str] | None, stage: str) -> list[str]:
    """The statistics columns of ``stage`` that the ``steps`` columns ``columns`` (None: all) are made of, and
    those their checks read (a stage's log-sum-exp, allowed count and largest logit, whenever any is read)."""
    if columns is None:
        return [f"{stage}_{n}" for n in _STATS]
    wanted = {n for n, shown in _SHOWN.items() if any(f"{v}_{stage}" in columns for v in shown)}
    wanted |= {n for n in ("allowed", "removed_mass", "margin") if n in columns}
    if "nonfinite" in columns:
        wanted |= {"nan", "lse", "max"}  # the log-sum-exp is checked against the largest logit
    if wanted & {"entropy", "allowed"}:
        wanted |= {"lse", "allowed"}  # which rows hold a distribution, and how many tokens it spreads over
    if "p_chosen" in wanted:
        wanted |= {"chosen_logit", "lse", "rank_chosen"}  # the chosen token's probability is checked against them
    return [f"{stage}_{n}" for n in _STATS if n in wanted]


def scan_runs(
    sources: Sequence[Any], columns: set[str] | None = None, threads: int | None = None, use_kept: bool = True
) -> Scanned:
    """The id and statistics columns of ``sources`` (:class:`~tracker.reading.query_sources.RunSource`) that
    the ``steps`` columns ``columns`` need (None: all), the runs in the order they were read
    (:attr:`Scanned.sources`); a table's parts from what an earlier scan kept of them where it has those
    columns (``use_kept``). RunFileError naming a file that cannot be read."""
    ids = _IDS if columns is None or "processor_error" in columns else _IDS[:4]
    names = [ids + [c for s in source.metadata.stages for c in _statistics(columns, s)] for source in sources]
    if threads is None:  # parts on a disk: opening and checking one holds the interpreter, more readers than
        # cores only wait (1,000 parts: 1.8 s with one, 1.6-1.8 with two or four, 1.9-2.0 with eight, on 2 cores)
        remote = any(not isinstance(s.fs, pafs.LocalFileSystem) for s in sources)
        threads = 8 if remote else min(4, os.cpu_count() or 1)
    table, src, kept = _read(sources, [_wanted(s, n) for s, n in zip(sources, names)], threads, use_kept=use_kept)
    return Scanned(sources, table, src, kept)


def _check(scanned: Scanned, src: np.ndarray, vocab: np.ndarray, keys: np.ndarray) -> None:
    """The checks of one run's ids and statistics over every run at once; on a failure, run by run, so that
    the error names the run at fault (and says what :mod:`tracker.format.checks` says of it)."""
    table = scanned.table
    bad = any(
        table.column(n).null_count > 0
        for n in ("generation", "sequence", "step", "processor_error")
        if n in table.column_names
    )
    if not bad and table.num_rows:
        chosen = table.column("chosen").fill_null(-1).to_numpy()
        bad = bool((keys[:, 1:] < 0).any() or (chosen < -1).any() or (chosen >= np.maximum(vocab[src], 1)).any())
        bad = bad or bool(np.all(keys[1:] == keys[:-1], axis=1).any())
    sources = scanned.sources
    if not bad:
        union = list(dict.fromkeys(s for r in sources for s in r.metadata.stages))
        proxy = replace(sources[0].metadata, stages=union, vocab_size=int(vocab.max(initial=0)))
        bad = stats_damage(table, proxy) is not None
        for stage in union:  # each row's allowed count within its own run's vocabulary
            if not bad and f"{stage}_allowed" in table.column_names:
                allowed = table.column(f"{stage}_allowed").to_numpy(zero_copy_only=False).astype(np.float64)
                bad = bool((allowed > vocab[src]).any())
    if bad:
        for i, source in enumerate(sources):
            rows = scanned.run_table(i)
            if "processor_error" not in rows.column_names:  # not read: nothing to check of it
                rows = rows.append_column("processor_error", pa.array(np.zeros(rows.num_rows, bool)))
            check_ids(source.names[0], rows, source.metadata.vocab_size)
            check_stats(source.names[0], rows, source.metadata)


def _float(table: pa.Table, name: str, rows: pa.Array) -> np.ndarray:
    if name not in table.column_names:
        return np.full(len(rows), np.nan)
    return table.column(name).take(rows).to_numpy(zero_copy_only=False).astype(np.float64)


def _nullable(values: np.ndarray, name: str) -> pa.Array:
    """A float column with NaN as null (counts as int64, like :func:`query_views._nulls_for_nan`)."""
    array = pa.array(values, mask=np.isnan(values))
    return array.cast(pa.int64()) if name.startswith(INT_PREFIXES) else array


def _limits(sources: Sequence[Any], first: np.ndarray, src: np.ndarray, gen: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Per sequence (its first row ``first``): the step it ends before, where its host told its length; -1
    where its end is its first end-of-sequence token."""
    out = np.full(first.size, -1, dtype=np.int64)
    if not any(s.lengths for s in sources):
        return out
    for k, row in enumerate(first.tolist()):
        found = sources[int(src[row])].lengths.get(int(gen[row]))
        s = int(seq[row])
        if found is not None and 0 <= s < len(found):
            out[k] = int(found[s])
    return out


Texts = list[tuple[int, int, int, np.ndarray]]


def steps_of_runs(scanned: Scanned, shared: dict, columns: set[str] | None = None) -> tuple[pa.Table, Texts]:
    """The ``steps`` rows of the scanned runs (those with recorded statistics and no stage per processor),
    with the columns ``columns`` (None: all; :data:`ALWAYS` always), and, per sequence, ``(run index,
    generation, sequence, chosen ids)``; ``shared``: vocabularies read, by their bytes (kept for the next
    view)."""
    sources, table, src = scanned.sources, scanned.table, scanned.src
    vocab = np.array([s.metadata.vocab_size for s in sources], dtype=np.int64)
    gen, seq, step = (
        table.column(n).fill_null(0).to_numpy().astype(np.int64) for n in ("generation", "sequence", "step")
    )
    chosen = table.column("chosen").fill_null(-1).to_numpy()
    order = np.lexsort((step, seq, gen, src))
    keys = np.stack([src[order], gen[order], seq[order], step[order]], axis=1)
    _check(scanned, src, vocab, keys)
    # where each sequence ends: its host's length, else its first end-of-sequence token (sequence_end)
    new = np.r_[True, np.any(keys[1:, :3] != keys[:-1, :3], axis=1)] if order.size else np.zeros(0, bool)
    starts, group = np.flatnonzero(new), np.cumsum(new) - 1
    limit = _limits(sources, order[starts], src, gen, seq)
    eos = np.zeros(order.size, dtype=bool)
    for ids in {tuple(s.metadata.eos_token_ids) for s in sources if s.metadata.eos_token_ids}:
        mine = np.array([tuple(s.metadata.eos_token_ids) == ids for s in sources])
        eos |= mine[src[order]] & np.isin(chosen[order], ids)
    before = np.cumsum(eos) - eos
    if order.size:
        before = before - before[starts][group]
    keep = np.where(limit[group] >= 0, step[order] < limit[group], before == 0) if order.size else eos
    rows = order[keep]
    bounds = np.searchsorted(group[keep], np.arange(starts.size + 1))  # each sequence's kept rows, even none
    texts = [
        (int(src[f]), int(gen[f]), int(seq[f]), chosen[rows[a:b]])
        for f, a, b in zip(order[starts].tolist(), bounds[:-1].tolist(), bounds[1:].tolist())
    ]
    out = _columns(scanned, shared, rows, src, gen, seq, step, chosen, columns)
    return pa.table(out), texts


def _columns(
    scanned: Scanned,
    shared: dict,
    rows: np.ndarray,
    src: np.ndarray,
    gen: np.ndarray,
    seq: np.ndarray,
    step: np.ndarray,
    chosen: np.ndarray,
    wanted: set[str] | None,
) -> dict[str, pa.Array]:
    """The ``steps`` columns ``wanted`` (None: all; :data:`ALWAYS` always) of ``rows``."""
    sources, table = scanned.sources, scanned.table

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    known = chosen[rows] >= 0
    at = pa.array(rows)
    columns: dict[str, pa.Array] = {
        "run_id": pa.array([s.metadata.run_id for s in sources], pa.string()).take(pa.array(src[rows])),
        "generation": pa.array(gen[rows].astype(np.int32)),
        "sequence": pa.array(seq[rows].astype(np.int32)),
        "step": pa.array(step[rows].astype(np.int32)),
    }
    if want("chosen_id"):
        columns["chosen_id"] = pa.array(chosen[rows], mask=~known)
    if want("chosen_token"):
        columns["chosen_token"] = _tokens(sources, shared, src[rows], chosen[rows], known)
    stages = list(dict.fromkeys(s for r in sources for s in r.metadata.stages))
    for stage in stages:
        if want(f"entropy_{stage}"):
            columns[f"entropy_{stage}"] = _nullable(_float(table, f"{stage}_entropy", at), "")
        for name in ("p_chosen", "rank_chosen"):
            if want(f"{name}_{stage}") or (name == "p_chosen" and want(f"surprisal_{stage}")):
                values = np.where(known, _float(table, f"{stage}_{name}", at), np.nan)
                columns[f"{name}_{stage}"] = _nullable(values, f"{name}_")
        if want(f"p_eos_{stage}"):
            columns[f"p_eos_{stage}"] = _nullable(_float(table, f"{stage}_p_eos", at), "")
    constrained = np.array(["constrained" in s.metadata.stages for s in sources])[src[rows]]
    for name in ("allowed", "removed_mass", "margin"):
        if want(name):
            mine = _float(table, f"constrained_{name}", at)
            other = _float(table, f"natural_{name}", at) if name == "allowed" else np.zeros(rows.size)
            columns[name] = _nullable(np.where(constrained, mine, other), name)
    nonfinite = np.zeros(rows.size, dtype=bool)
    for stage in stages:
        nan = _float(table, f"{stage}_nan", at) if want(f"nan_{stage}") or want("nonfinite") else None
        if want(f"nan_{stage}"):
            columns[f"nan_{stage}"] = _nullable(nan, "nan_")
        if want("nonfinite"):
            nonfinite |= (nan > 0) | (_float(table, f"{stage}_lse", at) == np.inf)
    if want("processor_error"):
        columns["processor_error"] = table.column("processor_error").take(at).combine_chunks()
    if want("nonfinite"):
        columns["nonfinite"] = pa.array(nonfinite)
    for stage in stages:
        if want(f"surprisal_{stage}"):
            p = columns[f"p_chosen_{stage}"].to_numpy(zero_copy_only=False)
            with np.errstate(divide="ignore", invalid="ignore"):
                columns[f"surprisal_{stage}"] = _nullable(-np.log(p), "")
    if wanted is not None:  # p_chosen made for a surprisal only
        columns = {n: c for n, c in columns.items() if n in wanted or n in ALWAYS}
    return columns


def _tokens(sources: Sequence[Any], shared: dict, src: np.ndarray, chosen: np.ndarray, known: np.ndarray) -> pa.Array:
    """Each row's chosen token as its run's vocabulary shows it (null where unknown); the runs sharing a
    vocabulary are looked up together."""
    by_vocab: dict[object, list[int]] = {}
    for i in np.unique(src).tolist():
        by_vocab.setdefault(sources[i].vocab_identity(), []).append(i)
    pieces, positions = [], []
    for members in by_vocab.values():
        where = np.flatnonzero(np.isin(src, members) & known)
        if where.size:
            pieces.append(sources[members[0]].token_display(shared, chosen[where]))
            positions.append(where)
    if not pieces:
        return pa.nulls(src.size, pa.string())
    filled = np.concatenate(positions)
    order = np.full(src.size, filled.size, dtype=np.int64)  # past the end: null
    order[filled] = np.arange(filled.size)
    joined = pa.concat_arrays([*pieces, pa.nulls(1, pa.string())])
    return joined.take(pa.array(order))


def _entries(sources: Sequence[Any], threads: int) -> list[dict[int, dict]]:
    """Per source, its generations' metadata entries by generation (the prompts and per-row sampling)."""
    need = [i for i, s in enumerate(sources) if s.metadata.generations == [] and s.generations]
    found: dict[int, list[dict]] = {i: list(s.metadata.generations) for i, s in enumerate(sources) if i not in need}
    chosen = [sources[i] for i in need]
    table, src, _ = _read(chosen, [[GENERATIONS_COLUMN] for _ in need], threads, use_kept=False, keep=False)
    if need and GENERATIONS_COLUMN in table.column_names:
        column = table.column(GENERATIONS_COLUMN)
        column = column if pa.types.is_string(column.type) else column.cast(pa.string())
        at = np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False))  # a generation's first row
        texts = column.take(pa.array(at)).to_pylist()
        for m, source in enumerate(chosen):
            mine = pa.array([t for t, i in zip(texts, src[at].tolist()) if i == m], pa.string())
            try:
                entries = generations_from_column(mine)
                check_generations(entries, source.metadata.vocab_size)
            except ValueError as exc:
                raise RunFileError(source.names[0], str(exc)) from exc
            found[need[m]] = entries
    for i in need:
        found.setdefault(i, [])
    return [{e.get("generation"): e for e in found[i]} for i in range(len(sources))]


def sequences_of_runs(
    sources: Sequence[Any], vocabulary: Callable[[int], Vocabulary], texts: Texts, threads: int = 8
) -> pa.Table:
    """The ``sequences`` rows: per run, generation and sequence, its prompt, generated text, step count and
    sampling settings (JSON)."""
    entries = _entries(sources, threads)
    rows = []
    for i, generation, sequence, chosen in texts:
        source = sources[i]
        entry = entries[i].get(generation, {})
        prompts = entry.get("prompt_ids") or []
        prompt = prompts[sequence] if sequence < len(prompts) and isinstance(prompts[sequence], list) else []
        unknown = np.flatnonzero(chosen < 0)
        kept = chosen[: int(unknown[0]) if unknown.size else chosen.size]
        vocab = vocabulary(i)
        sampling = sampling_of(source.metadata, entry, sequence)
        rows.append(
            {
                "run_id": source.metadata.run_id,
                "generation": generation,
                "sequence": sequence,
                "prompt": vocab.decode(prompt) if prompt else None,
                "text": vocab.decode(kept.tolist()),
                "steps": int(chosen.size),
                "sampling": None if sampling is None else json.dumps(sampling),
            }
        )
    return pa.Table.from_pylist(rows, schema=SEQUENCES_SCHEMA)
