"""One run's rows of the SQL views of :func:`tracker.open_dataset`: ``steps``, ``sequences`` and ``candidates``.

Each function takes a loaded :class:`~tracker.reading.run.Run` and returns Arrow
tables whose columns are those the views document (``docs/guide.md``, "At
scale"). The numbers are the analysis API's own: ``steps`` holds what
:meth:`~tracker.Run.stats` answers, flattened with Arrow from the
statistics columns where the run recorded them (the columns ``stats``
reads there), and taken from ``stats`` itself otherwise (float32 recorded
on a CPU: computed from the rows by :mod:`tracker.reading.metrics`; runs with a
stage per processor); ``candidates`` reads each stage's rows block by block
as every query does (:mod:`tracker.reading.passes`) and keeps each step's ``k``
best tokens. Values the analysis API gives as NaN (not known) are SQL NULL
here. Needs pyarrow, numpy and pandas; no torch.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracker.format.schema import RunMetadata
from tracker.reading.block import Block
from tracker.reading.rows import NEG_INF, probabilities, topk_rows
from tracker.reading.run import Run
from tracker.reading.selection import sequence_end

__all__ = ["steps_tables", "candidates_table", "sampling_of", "INT_PREFIXES", "SEQUENCES_SCHEMA", "CANDIDATES_SCHEMA"]

#: Statistics columns that count something (ranks, NaN entries, allowed tokens): integers in SQL.
INT_PREFIXES = ("rank_chosen_", "nan_", "allowed")


SEQUENCES_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("generation", pa.int32()),
        ("sequence", pa.int32()),
        ("prompt", pa.string()),
        ("text", pa.string()),
        ("steps", pa.int64()),
        ("sampling", pa.string()),
    ]
)

CANDIDATES_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("generation", pa.int32()),
        ("sequence", pa.int32()),
        ("step", pa.int32()),
        ("stage", pa.string()),
        ("rank", pa.int32()),
        ("token_id", pa.int64()),
        ("token", pa.string()),
        ("logit", pa.float32()),
        ("probability", pa.float32()),
        ("masked", pa.bool_()),
        ("chosen", pa.bool_()),
    ]
)


def sampling_of(metadata: RunMetadata, entry: dict, sequence: int) -> Any:
    """The sampling settings of one sequence: its generation's, per row, where the host told them (its
    seed included), else the run's."""
    rows = entry.get("sampling")
    if isinstance(rows, list) and 0 <= sequence < len(rows):
        return rows[sequence]
    return metadata.sampling


def _nulls_for_nan(column: pa.ChunkedArray | pa.Array, name: str) -> pa.ChunkedArray | pa.Array:
    """A float column with NaN as null (counts as int64)."""
    if not pa.types.is_floating(column.type):
        return column
    column = pc.if_else(pc.is_nan(column), pa.scalar(None, column.type), column)
    return column.cast(pa.int64()) if name.startswith(INT_PREFIXES) else column


def _float(table: pa.Table, name: str, rows: np.ndarray) -> pa.Array:
    """A statistics column at ``rows`` as float64, NaN as null (what :meth:`~tracker.Run.stats` reads as NaN)."""
    return _nulls_for_nan(table.column(name).take(rows).cast(pa.float64()).combine_chunks(), "")


def _recorded_steps(run: Run) -> tuple[pa.Table, list[tuple[int, int, np.ndarray]]] | None:
    """The ``steps`` rows of a run that recorded its statistics, flattened with Arrow from its columns
    (the columns :meth:`~tracker.Run.stats` reads), and per sequence ``(generation, sequence, chosen ids)``;
    None for runs whose statistics are computed when read, or that have a stage per processor."""
    batches = run._record_batches()
    if run.metadata.stage_aliases or not batches or any("natural_entropy" not in b.schema.names for b in batches):
        return None
    table = pa.Table.from_batches(batches)
    gen, seq, step = (table.column(n).to_numpy() for n in ("generation", "sequence", "step"))
    chosen = table.column("chosen").fill_null(-1).to_numpy()
    order = np.lexsort((step, seq, gen))
    pieces, texts = [], []
    for g, s in sorted(set(zip(gen[order].tolist(), seq[order].tolist()))):
        rows = order[(gen[order] == g) & (seq[order] == s)]
        rows = rows[: sequence_end(step[rows], chosen[rows], run.metadata, g, s)]
        pieces.append(rows)
        texts.append((g, s, chosen[rows]))
    rows = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    ids = pa.array(chosen[rows], mask=chosen[rows] < 0)
    known = pa.array(chosen[rows] >= 0)
    columns: dict[str, pa.Array] = {
        "run_id": pa.array([run.run_id] * rows.size, pa.string()),
        "generation": pa.array(gen[rows].astype(np.int32)),
        "sequence": pa.array(seq[rows].astype(np.int32)),
        "step": pa.array(step[rows].astype(np.int32)),
        "chosen_id": ids,
        "chosen_token": run.vocab.display_array.take(ids).cast(pa.string()),
    }
    for stage in run.stages:
        columns[f"entropy_{stage}"] = _float(table, f"{stage}_entropy", rows)
        for name in ("p_chosen", "rank_chosen"):
            values = _float(table, f"{stage}_{name}", rows)
            columns[f"{name}_{stage}"] = pc.if_else(known, values, pa.scalar(None, values.type))
        columns[f"p_eos_{stage}"] = _float(table, f"{stage}_p_eos", rows)
    con = run._constrained_stage()
    columns["allowed"] = _float(table, f"{con}_allowed", rows)
    for name in ("removed_mass", "margin"):
        columns[name] = pa.array(np.zeros(rows.size)) if con == "natural" else _float(table, f"{con}_{name}", rows)
    nonfinite = np.zeros(rows.size, dtype=bool)
    for stage in run.stages:
        columns[f"nan_{stage}"] = _float(table, f"{stage}_nan", rows)
        nan = table.column(f"{stage}_nan").take(rows).to_numpy(zero_copy_only=False).astype(np.float64)
        lse = table.column(f"{stage}_lse").take(rows).to_numpy(zero_copy_only=False).astype(np.float64)
        nonfinite |= (nan > 0) | (lse == np.inf)
    columns["processor_error"] = table.column("processor_error").take(rows).combine_chunks()
    columns["nonfinite"] = pa.array(nonfinite)
    for stage in run.stages:
        p = columns[f"p_chosen_{stage}"].to_numpy(zero_copy_only=False)
        with np.errstate(divide="ignore", invalid="ignore"):
            columns[f"surprisal_{stage}"] = _nulls_for_nan(pa.array(-np.log(p)), "surprisal_")
    before = np.zeros(rows.size)
    for stage in run._engine_stages():  # vLLM's sampling stages: each one's allowed count and the mass it cut
        columns[f"allowed_{stage}"] = _float(table, f"{stage}_allowed", rows)
        now = table.column(f"{stage}_removed_mass").take(rows).to_numpy(zero_copy_only=False).astype(np.float64)
        columns[f"removed_mass_{stage}"] = _nulls_for_nan(pa.array(now - before), "")
        before = now
    ints = {n: c.cast(pa.int64()) for n, c in columns.items() if n.startswith(INT_PREFIXES)}
    return pa.table({**columns, **ints}), texts


def steps_tables(run: Run) -> tuple[pa.Table, pa.Table]:
    """``(steps, sequences)`` of one run: one row per generation, sequence and step; one per generation
    and sequence (its prompt, generated text and step count). Finished steps (after a sequence's end,
    as :meth:`~tracker.reading.analysis.Analysis.stats` drops them) are left out."""
    recorded = _recorded_steps(run)
    if recorded is not None:
        steps, texts = recorded
    else:
        steps, texts = _computed_steps(run)
    entries = {g.get("generation"): g for g in run.metadata.generations}
    sequences = []
    for generation, sequence, chosen in texts:
        entry = entries.get(generation, {})
        ids = entry.get("prompt_ids") or []
        prompt = ids[sequence] if sequence < len(ids) and isinstance(ids[sequence], list) else []
        unknown = np.nonzero(chosen < 0)[0]
        known = chosen[: int(unknown[0]) if unknown.size else chosen.size]
        sampling = sampling_of(run.metadata, entry, sequence)
        sequences.append(
            {
                "run_id": run.run_id,
                "generation": generation,
                "sequence": sequence,
                "prompt": run.vocab.decode(prompt) if prompt else None,
                "text": run.vocab.decode(known.tolist()),
                "steps": int(chosen.size),
                "sampling": None if sampling is None else json.dumps(sampling),
            }
        )
    return steps, pa.Table.from_pylist(sequences, schema=SEQUENCES_SCHEMA)


def _computed_steps(run: Run) -> tuple[pa.Table, list[tuple[int, int, np.ndarray]]]:
    """The ``steps`` rows of a run from :meth:`~tracker.Run.stats` (statistics computed from its rows)."""
    steps, texts = [], []
    for generation in run.generations():
        frame = run.stats(sequence=None, generation=generation)
        table = pa.Table.from_pandas(frame, preserve_index=False)
        table = table.rename_columns(["step" if n == "position" else n for n in table.column_names])
        columns = {"run_id": pa.array([run.run_id] * table.num_rows, pa.string())}
        for name in table.column_names:
            column = table.column(name)
            columns[name] = column.cast(pa.int32()) if name in ("generation", "sequence", "step") else column
            columns[name] = _nulls_for_nan(columns[name], name)
        steps.append(pa.table(columns))
        for sequence in run.sequences(generation):
            mine = frame["sequence"].to_numpy() == sequence
            texts.append((generation, sequence, frame["chosen_id"].fillna(-1).to_numpy(dtype=np.int64)[mine]))
    return (pa.concat_tables(steps) if steps else pa.table({"run_id": pa.array([], pa.string())})), texts


def _best(block: Block, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values, ids)`` ``[t, k]`` of a block's ``k`` best tokens, best first (ties: lower id first)."""
    if block.full:
        return topk_rows(block.values, k)
    ids = block.ids.astype(np.int64)
    order = np.lexsort((ids, np.where(np.isnan(block.values), np.inf, -block.values)), axis=1)[:, :k]
    return np.take_along_axis(block.values, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _margin(run: Run, sel: Any, stage: str, con_stage: str) -> np.ndarray | None:
    """The constrained stage's recorded ``margin`` over ``sel`` where it tells the natural stage's favourite
    apart (top-k storage with recorded statistics), else None."""
    if stage != "natural" or con_stage == "natural" or run.metadata.storage != "topk" or not run._has_stats(sel):
        return None
    return run._column(f"{con_stage}_margin", sel)


def _favourite_masked(values: np.ndarray, at: np.ndarray, margin: np.ndarray) -> np.ndarray:
    """``at`` (the constrained stage's values at the natural best tokens ``values`` ``[t, k]``, best first)
    with the favourite's answered where it was unknown: -inf where ``margin`` > 0 (every natural best is
    masked), its own value where ``margin`` is 0 and no other token ties with it (it is allowed)."""
    first = values[:, 0]
    tied = (values[:, 1] == first) if values.shape[1] > 1 else np.zeros(first.shape, bool)
    unknown = np.isnan(at[:, 0]) & np.isfinite(first)
    out = at.copy()
    out[unknown & (margin > 0), 0] = NEG_INF
    allowed = unknown & (margin == 0) & ~tied
    out[allowed, 0] = first[allowed]
    return out


def candidates_table(run: Run, k: int) -> pa.Table:
    """The ``k`` best tokens of every step and stage of one run, in long form (``k`` at most the stored
    ``top_k`` in top-k storage). Tokens of probability 0 and entries not stored are left out.

    ``masked``: the run's constrained stage gives the token ``-inf`` (the one
    :meth:`~tracker.reading.analysis.Analysis.stats` compares with natural). In
    top-k storage a token the constrained stage did not keep is masked where the
    stage allowed no more tokens than it kept; the model's favourite (the natural
    stage's best token) is told by the constrained stage's ``margin``, recorded
    from the whole row (positive: every natural best is masked; 0: one is
    allowed, which is the favourite unless another token ties with it); null
    where the stored data cannot tell.
    """
    parts: list[pa.Table] = []
    display = run.vocab.display_array
    con_stage = run._constrained_stage()
    for generation in run.generations():
        for sequence in run.sequences(generation):
            sel = run._select(generation, sequence)
            for stage in run.stages:
                margin = _margin(run, sel, stage, con_stage)

                def best(start: int, blocks: dict[str, Block], stage: str = stage, margin: Any = margin) -> tuple:
                    values, ids = _best(blocks[stage], k)
                    at = blocks[con_stage].at(ids)
                    if margin is not None:  # the favourite, where top-k storage did not keep it
                        at = _favourite_masked(values, at, margin[start : start + values.shape[0]])
                    prob = probabilities(values, blocks[stage].lse[:, None])
                    rows = np.broadcast_to(np.arange(start, start + values.shape[0])[:, None], values.shape)
                    return rows, ids, values, prob, at

                found = run._map(sel, [stage, con_stage], best)
                if not found:
                    continue
                rows, ids, values, prob, at = (np.concatenate([f[i] for f in found]) for i in range(5))
                rank = np.broadcast_to(np.arange(values.shape[1], dtype=np.int32), values.shape)
                keep = ~np.isnan(values) & (values > NEG_INF)
                rows, ids, values, prob, at, rank = (a[keep] for a in (rows, ids, values, prob, at, rank))
                n = rows.size
                parts.append(
                    pa.table(
                        {
                            "run_id": pa.array([run.run_id] * n, pa.string()),
                            "generation": np.full(n, generation, np.int32),
                            "sequence": np.full(n, sequence, np.int32),
                            "step": sel.steps[rows].astype(np.int32),
                            "stage": pa.array([stage] * n, pa.string()),
                            "rank": rank.astype(np.int32),
                            "token_id": ids.astype(np.int64),
                            "token": display.take(pa.array(ids)),
                            "logit": values.astype(np.float32),
                            "probability": prob.astype(np.float32),
                            "masked": pa.array(at == NEG_INF, mask=np.isnan(at)),
                            "chosen": sel.chosen[rows] == ids,
                        },
                        schema=CANDIDATES_SCHEMA,
                    )
                )
    return pa.concat_tables(parts) if parts else CANDIDATES_SCHEMA.empty_table()
