"""vLLM's sampling stages of a run, computed when the run is read from its recorded ``natural`` rows.

Inside vLLM, logitscope records one stage per tracked request and step: the
row its processor receives, after vLLM's allowed-token mask, bad words,
min-tokens and logit bias, before the penalties, temperature, min-p, top-k
and top-p. Those later stages are a function of that row, the request's
parameters and the tokens it had output (:mod:`tracker.reading.vllm_sampler`
follows vLLM's arithmetic and order), so they are computed here, when the run
is read, rather than in the engine: the engine's step pays nothing for them
(no more rows copied, no second sampler run on the device), and they are
computed in the same float32 operations vLLM uses, from the very row it
sampled from, and from every token it had output before the step (which the
recording holds once the request has ended).

A run whose metadata says vLLM sampled it (:func:`~tracker.reading.engine_requests.vllm_requests`)
and that holds ``natural`` alone gets, after it, the stages of
:data:`ENGINE_STAGES`, each in the run's storage with the statistics the
recorder gives any stage (log-sum-exp, allowed count, entropy, the chosen
token's probability and rank, the natural mass removed...): ``penalties``,
``temperature``, ``min_p``, ``top_k``, ``top_p`` as logits, and
``sampled``, the distribution drawn from, as log-probabilities (a one-hot for
a greedy request, which skips temperature, min-p, top-k and top-p: those
stages repeat its penalised row). A stage that changes no row of a record
batch shares the previous stage's column (no copy).

A stage's row is null (not known) where it cannot be computed exactly: the
natural row holds NaN or ``+inf`` (vLLM would sample from NaN), or
penalties need output tokens the run does not hold (a generation whose rows
start mid-request, as a request resumed after preemption may; a chosen token
not recorded). :mod:`tracker.reading.engine_topk` says what top-k
storage allows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from tracker.format.schema import FIELD_OFFSET, STAT_COLUMNS, RunMetadata, stage_fields, stat_names
from tracker.reading import metrics
from tracker.reading.block import Block, full_rows
from tracker.reading.engine_requests import History, Request, row_params, rows_by_sequence, vllm_requests
from tracker.reading.rows import NEG_INF, logsumexp_rows, masked, nonfinite_rows, probabilities
from tracker.reading.vllm_sampler import STAGES, min_p, penalties, sampled, temperature, top_k, top_p

__all__ = ["ENGINE_STAGES", "applies", "engine_metadata", "history_of", "derive", "derive_batch"]

#: The stages computed for a vLLM run, in vLLM's order.
ENGINE_STAGES = STAGES
_BLOCK_BYTES = 8 << 20  # rows worked on at once: each stage holds a block of float32 rows this size


def applies(metadata: RunMetadata) -> bool:
    """Whether a run read with ``metadata`` gets :data:`ENGINE_STAGES`: vLLM sampled some of its rows and it
    holds the ``natural`` stage alone. ValueError when a vLLM request's parameters are damaged."""
    return list(metadata.stages) == ["natural"] and bool(vllm_requests(metadata))


def engine_metadata(metadata: RunMetadata) -> RunMetadata:
    """``metadata`` with :data:`ENGINE_STAGES` after ``natural``."""
    return replace(metadata, stages=[*metadata.stages, *ENGINE_STAGES])


def history_of(batches: list[pa.RecordBatch]) -> History:
    """The chosen token of every recorded step, from the id columns of ``batches`` (the whole run)."""

    def column(name: str) -> np.ndarray:
        parts = [b.column(name).fill_null(-1).to_numpy(zero_copy_only=False) for b in batches]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    return History(column("generation"), column("sequence"), column("step"), column("chosen"))


def derive(batches: list[pa.RecordBatch], metadata: RunMetadata) -> list[pa.RecordBatch]:
    """``batches`` (a whole run read with ``metadata``) with the columns of :data:`ENGINE_STAGES` added."""
    requests = vllm_requests(metadata)
    history = history_of(batches)
    return [derive_batch(b, metadata, requests, history) for b in batches]


def derive_batch(
    batch: pa.RecordBatch, metadata: RunMetadata, requests: dict[tuple[int, int], Request], history: History
) -> pa.RecordBatch:
    """One record batch with the columns of :data:`ENGINE_STAGES` added after its own (``history``: the
    whole run's chosen tokens, since penalties count every token output before a step)."""
    if metadata.storage == "topk":
        from tracker.reading.engine_topk import derive_topk_batch

        return derive_topk_batch(batch, metadata, requests, history)
    vocab, n = metadata.vocab_size, batch.num_rows
    natural, valid = full_rows(batch, "natural", np.arange(n), vocab)
    ok = ~nonfinite_rows(natural) if valid is None else valid & ~nonfinite_rows(np.where(valid[:, None], natural, 0))
    stages: dict[str, np.ndarray] = {}
    done = np.zeros(n, dtype=bool)
    for key, rows in rows_by_sequence(batch).items():
        request = requests.get(key)
        if request is None:
            continue
        rows = rows[ok[rows]]
        columns = counts = prompt = None
        if request.penalised and rows.size:  # the tokens penalties reach: the prompt's and the output's
            prompt_ids = np.array([t for t in set(request.prompt_ids) if 0 <= t < vocab], dtype=np.int64)
            columns = np.union1d(prompt_ids, history.tokens(key, vocab))
            wanted = np.broadcast_to(columns, (rows.size, columns.size))
            counts, _, known = history.counts_at(key, batch.column("step").to_numpy()[rows], wanted)
            rows, counts = rows[known], counts[known]
            prompt = np.isin(columns, prompt_ids)[None, :]
        per = max(1, _BLOCK_BYTES // (4 * max(vocab, 1)))
        for a in range(0, rows.size, per):
            part = rows[a : a + per]
            used = None if counts is None else (columns, counts[a : a + per], prompt)
            out = _stage_rows(natural[part], request, used)
            if part.size == n:  # the whole batch in one block (a request's part of a run): no copy
                stages = out
                continue
            for stage, values in out.items():
                stages.setdefault(stage, np.zeros((n, vocab), np.float32))[part] = values
        done[rows] = True
    return _with_columns(batch, metadata, natural, done, stages)


def _stage_rows(
    natural: np.ndarray, request: Request, penalised: tuple[np.ndarray, np.ndarray, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """The rows of every engine stage for rows ``natural`` of one request, in vLLM's order. ``penalised``:
    the token ids penalties may reach, their counts in the output before each row and whether the prompt
    holds them (penalties change no other token: ``x * 1`` and ``x - 0``)."""
    params = row_params([request] * natural.shape[0], natural.shape[1])
    out = {"penalties": natural.copy()}
    if penalised is not None and penalised[0].size:
        columns, counts, prompt = penalised
        prompt = np.broadcast_to(prompt, counts.shape)
        out["penalties"][:, columns] = penalties(natural[:, columns], prompt, counts, params)
    out["temperature"] = temperature(out["penalties"], params)
    out["min_p"] = min_p(out["temperature"], params)
    out["top_k"] = top_k(out["min_p"], params)
    out["top_p"] = top_p(out["top_k"], params)
    out["sampled"] = sampled(out["top_p"], out["penalties"], params)
    return out


# ---------------------------------------------------------------- the columns


def _round(values: np.ndarray, storage: str) -> np.ndarray:
    """Float32 rows in ``storage``'s element type (round to nearest even, as torch converts)."""
    if storage == "float16":
        return values.astype(np.float16)
    if storage == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return values


def _as_read(stored: np.ndarray, storage: str) -> np.ndarray:
    if storage == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)


def _list_array(flat: np.ndarray, width: int, missing: np.ndarray) -> pa.Array:
    mask = pa.array(missing) if missing.any() else None
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), width, mask=mask)


def stat_arrays(
    stage: str, values: np.ndarray, natural: Block, chosen: np.ndarray, eos: list[int], missing: np.ndarray
) -> dict[str, pa.Array]:
    """The statistics columns (:data:`~tracker.format.schema.STAT_COLUMNS`) of full rows ``values`` of a
    stage after ``natural`` (rows ``missing`` null; the chosen token's columns null where it is unknown)."""
    n = values.shape[0]
    top = values.max(axis=1) if values.shape[1] else np.full(n, -np.inf, np.float32)
    allowed = np.count_nonzero(values > NEG_INF, axis=1)
    lse, entropy = _lse_entropy(values, top, allowed)
    block = Block(values, lse)
    at = np.take_along_axis(values, np.maximum(chosen, 0)[:, None], axis=1)[:, 0]
    removed, margin = np.zeros(n), np.zeros(n)
    cut = np.nonzero(allowed != natural.allowed)[0]  # a stage that masks no more than natural removed nothing
    if cut.size:
        part, nat = Block(values[cut], lse[cut]), Block(natural.values[cut], natural.lse[cut])
        kept = masked(nat.values, part.values)
        removed[cut], margin[cut] = metrics.removed_mass(nat, part, kept), metrics.margin(nat, part, kept)
    found: dict[str, Any] = {
        "lse": lse,
        "allowed": allowed,
        "max": top,
        "entropy": entropy,
        "nan": np.zeros(n),
        "p_eos": metrics.p_eos(block, eos),
        "removed_mass": removed,
        "margin": margin,
        "chosen_logit": at,
        "p_chosen": probabilities(at, lse),
        "rank_chosen": (values > at[:, None]).sum(axis=1),
    }
    unknown = missing | (chosen < 0)
    out = {}
    for name in stat_names(stage):
        kind = STAT_COLUMNS[name]
        value = np.asarray(found[name])
        value = np.nan_to_num(value, nan=0).astype(np.int32) if pa.types.is_integer(kind) else value.astype(np.float32)
        out[name] = pa.array(
            value, type=kind, mask=unknown if name.endswith("chosen") or name == "chosen_logit" else missing
        )
    return out


def _lse_entropy(values: np.ndarray, top: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's log-sum-exp (float32, as the record's) and entropy; over the allowed entries alone where
    every row allows few (a filtered stage), else over the whole rows (:mod:`tracker.reading.metrics`)."""
    n, vocab = values.shape
    if not n or int(allowed.max()) > vocab // 16:
        lse = logsumexp_rows(values, top)
        return lse, metrics.entropy(Block(values, lse))
    row, col = np.nonzero(values > NEG_INF)
    shift = np.where(np.isfinite(top), top, np.float32(0))
    terms = np.exp((values[row, col] - shift[row]).astype(np.float32))
    sums = np.bincount(row, weights=terms, minlength=n).astype(np.float32)
    with np.errstate(divide="ignore"):
        lse = (np.log(sums) + shift).astype(np.float32)
    lse[allowed == 0] = NEG_INF
    logp = values[row, col].astype(np.float64) - lse[row]
    entropy = -np.bincount(row, weights=np.exp(logp) * logp, minlength=n)
    return lse, np.where(allowed > 0, entropy, np.nan)


def _with_columns(
    batch: pa.RecordBatch, metadata: RunMetadata, natural: np.ndarray, done: np.ndarray, stages: dict[str, np.ndarray]
) -> pa.RecordBatch:
    """``batch`` with each engine stage's columns (its rows at ``done``, null elsewhere) appended."""
    names = batch.schema.names
    with_stats = "natural_entropy" in names
    flags = "natural_nonfinite" in names
    storage, vocab = metadata.storage, metadata.vocab_size
    missing = ~done
    chosen = batch.column("chosen").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    chosen = np.where(chosen < vocab, chosen, -1)
    plain = natural if done.all() else np.where(done[:, None], natural, np.float32(0))
    natural_block = Block(plain, logsumexp_rows(plain), allowed=np.count_nonzero(plain > NEG_INF, axis=1))
    # the previous stage: its rows, its null rows and its columns by suffix ("logits", a statistic, "nonfinite")
    recorded = batch.column("natural_logits").is_null().to_numpy(zero_copy_only=False)
    previous = (plain, recorded, {n[len("natural_") :]: batch.column(n) for n in names if n.startswith("natural_")})
    fields, arrays = list(batch.schema), list(batch.columns)
    for stage in ENGINE_STAGES:
        values = stages.pop(stage, None)
        if values is None:  # no row of the batch is known
            values = np.zeros((batch.num_rows, vocab), np.float32)
        values[missing] = 0
        schema = stage_fields(stage, storage, vocab, metadata.top_k, flags=flags, stats=with_stats)
        same = np.array_equal(missing, previous[1]) and np.array_equal(
            values.view(np.int32), previous[0].view(np.int32)
        )
        if same:  # the stage changed no row: the previous stage's columns, shared (no copy)
            columns = dict(previous[2])
            if with_stats and "removed_mass" not in columns:  # natural has none: nothing removed
                stats = stat_arrays(stage, values, natural_block, chosen, metadata.eos_token_ids, missing)
                columns.update(removed_mass=stats["removed_mass"], margin=stats["margin"])
        else:
            columns = _columns(stage, schema, values, natural_block, chosen, metadata, missing)
            if flags:
                columns["nonfinite"] = pa.array(np.zeros(batch.num_rows, dtype=bool))
        fields += schema
        arrays += [columns[f.name[len(stage) + 1 :]] for f in schema]
        previous = (values, missing, columns)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=batch.schema.metadata))


def _columns(
    stage: str,
    schema: list[pa.Field],
    values: np.ndarray,
    natural: Block,
    chosen: np.ndarray,
    metadata: RunMetadata,
    missing: np.ndarray,
) -> dict[str, pa.Array]:
    """A stage's value column in the run's storage and, where the run has them, its statistics from the rows as
    they will be read (half precision: rounded, kept relative to the row's largest logit as the recorder keeps it)."""
    storage, vocab = metadata.storage, metadata.vocab_size
    shift = None
    if (schema[0].metadata or {}).get(FIELD_OFFSET) is not None:
        top = values.max(axis=1)
        shift = np.where(np.isfinite(top), top, np.float32(0)).astype(np.float32)
    stored = _round(values if shift is None else values - shift[:, None], storage)
    columns = {"logits": _list_array(stored, vocab, missing)}
    if len(schema) > 1 and schema[1].name == f"{stage}_lse":
        read = values if storage == "float32" else _as_read(stored, storage)
        if shift is not None:
            read = read + shift[:, None]
        columns.update(stat_arrays(stage, read, natural, chosen, metadata.eos_token_ids, missing))
        if shift is not None:
            columns["max"] = pa.array(shift, pa.float32(), mask=missing)
    return columns
