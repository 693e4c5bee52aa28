"""vLLM's sampling stages of a run kept in top-k storage: what the stored ``k`` best natural tokens allow.

A top-k row keeps the ``k`` best natural logits, the whole row's log-sum-exp
and its allowed count; the tokens it did not keep are known only to lie at or
below its ``k``-th logit. vLLM's stages change those tokens too (a temperature
rescales every one of them), so a stage's row is given only where it leaves
none of them allowed, so that its whole distribution is the stored tokens':

- **min-p** masks every token not kept when the ``k``-th logit (after the
  penalties, divided by the temperature) is below ``max + log(min_p)``;
- **top-k** does when more than the request's ``top_k`` kept tokens lie above
  every token not kept (a request's ``top_k`` below the stored ``k``);
- after either, **top-p** and **sampled** follow exactly;
- a **greedy** request's one-hot is known when its best penalised token was
  kept above every other (always, without penalties that raise logits);
- a row whose natural row allowed at most ``k`` tokens is known whole.

Penalties may raise a token that was not kept above the ``k``-th logit only
when a penalty is negative (a ``repetition_penalty`` below 1, a negative
frequency or presence penalty) on a token of the prompt or the output that was
not kept: then no later stage of that row is known. The ``penalties`` and
``temperature`` stages themselves are given only where they change nothing
(a request without penalties; temperature 1 or greedy) or where the whole row
is known. Every other row of a stage is null: not known, never guessed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tracker.format.schema import STAT_COLUMNS, RunMetadata, stage_fields, stat_names
from tracker.reading.engine_requests import History, Request, row_params, rows_by_sequence
from tracker.reading.vllm_sampler import STAGES, RowParams, min_p, penalties, sampled, temperature, top_k, top_p

__all__ = ["derive_topk_batch"]

_NEG_INF = np.float32(-np.inf)


def _column(batch: pa.RecordBatch, name: str, dtype: type, fill: float) -> tuple[np.ndarray, np.ndarray]:
    """A ``k``-wide list column as ``[n, k]`` (null rows filled) and which rows are valid."""
    column = batch.column(name)
    width = column.type.list_size
    child = column.values.slice(column.offset * width, len(column) * width).fill_null(fill)
    values = child.to_numpy(zero_copy_only=False).astype(dtype).reshape(len(column), width)
    return values, column.is_valid().to_numpy(zero_copy_only=False)


def _scalar(batch: pa.RecordBatch, name: str) -> np.ndarray:
    return batch.column(name).to_numpy(zero_copy_only=False).astype(np.float64)  # nulls as NaN


def derive_topk_batch(
    batch: pa.RecordBatch, metadata: RunMetadata, requests: dict[tuple[int, int], Request], history: History
) -> pa.RecordBatch:
    """One top-k record batch with the columns of the engine stages added (see the module docstring)."""
    ids, valid = _column(batch, "natural_topk_ids", np.int64, 0)
    natural, _ = _column(batch, "natural_topk_logits", np.float32, np.nan)
    order = np.argsort(ids, axis=1, kind="stable")  # kept tokens by id: vLLM's order among equal logits
    ids, natural = np.take_along_axis(ids, order, axis=1), np.take_along_axis(natural, order, axis=1)
    n, width = ids.shape
    lse, allowed = _scalar(batch, "natural_lse"), _scalar(batch, "natural_allowed")
    with np.errstate(invalid="ignore"):
        ok = valid & np.isfinite(lse) & ~np.isnan(natural).any(axis=1) & (natural < np.inf).all(axis=1)
        kept = (natural > -np.inf).sum(axis=1)
        floor = np.where(allowed > kept, natural.min(axis=1), -np.inf).astype(np.float32)  # the others lie below
    values = {stage: np.full((n, width), _NEG_INF) for stage in STAGES}
    given = {stage: np.zeros(n, dtype=bool) for stage in STAGES}
    whole = {stage: np.zeros(n, dtype=bool) for stage in STAGES}
    steps = batch.column("step").to_numpy(zero_copy_only=False)
    for key, rows in rows_by_sequence(batch).items():
        request = requests.get(key)
        rows = rows[ok[rows]]
        if request is None or not rows.size:
            continue
        counts = prompt = None
        outside = np.zeros(rows.size, dtype=bool)
        if request.penalised:
            counts, others, known = history.counts_at(key, steps[rows], ids[rows])
            prompt_ids = np.array(sorted(set(request.prompt_ids)), dtype=np.int64)
            prompt = np.isin(ids[rows], prompt_ids)
            out_prompt = prompt_ids.size - prompt.sum(axis=1)
            outside = (others > 0) | ((request.repetition_penalty != 1) & (out_prompt > 0))
            rows, counts, prompt, outside = rows[known], counts[known], prompt[known], outside[known]
        out, shown, complete = _stages(
            natural[rows], floor[rows], request, counts, prompt, outside, metadata.vocab_size
        )
        for stage in STAGES:
            values[stage][rows], given[stage][rows], whole[stage][rows] = out[stage], shown[stage], complete[stage]
    return _with_columns(batch, metadata, ids, natural, lse, values, given, whole)


def _stages(
    natural: np.ndarray,
    floor: np.ndarray,
    request: Request,
    counts: np.ndarray | None,
    prompt: np.ndarray | None,
    outside: np.ndarray,
    vocab: int,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The stages over the kept tokens of rows of one request: their rows, where each is known, and where it is
    known whole (no token outside the kept ones allowed; else it repeats natural's row, changing nothing).

    ``floor``: the bound on the tokens not kept (``-inf`` when none of them is allowed); ``outside``: a
    penalty reaches one of them. ``bound`` follows that bound through the stages, ``+inf`` once not known."""
    params = row_params([request] * natural.shape[0], vocab)
    lowering = request.repetition_penalty >= 1 and request.frequency_penalty >= 0 and request.presence_penalty >= 0
    values = {"penalties": penalties(natural, prompt, counts, params) if counts is not None else natural.copy()}
    bound = np.where(outside & ~lowering & (floor > -np.inf), np.float32(np.inf), floor).astype(np.float32)
    whole = {"penalties": bound == -np.inf}
    shown = {"penalties": whole["penalties"] | (not request.penalised)}
    values["temperature"] = temperature(values["penalties"], params)
    if not request.greedy:
        bound = (bound / np.float32(request.temperature)).astype(np.float32)
    same = request.greedy or request.temperature == 1
    whole["temperature"] = bound == -np.inf
    shown["temperature"] = whole["temperature"] | (same & shown["penalties"])
    x, previous = values["temperature"], "temperature"
    for stage in ("min_p", "top_k"):
        x, bound, applied = _filter(stage, x, bound, params, request, vocab)
        values[stage], whole[stage] = x, bound == -np.inf
        shown[stage] = whole[stage] | (not applied and shown[previous])
        previous = stage
    applied = not request.greedy and request.top_p < 1
    values["top_p"] = top_p(x, params)
    whole["top_p"] = whole["top_k"]
    shown["top_p"] = whole["top_p"] | (not applied and shown["top_k"])
    values["sampled"] = sampled(values["top_p"], values["penalties"], params)
    if request.greedy:  # its one-hot is known where its best penalised token is above every token not kept
        beaten = np.where(outside & ~lowering, np.float32(np.inf), floor)
        whole["sampled"] = (floor == -np.inf) | (values["penalties"].max(axis=1) > beaten)
    else:
        whole["sampled"] = whole["top_p"]
    shown["sampled"] = whole["sampled"]
    return values, shown, whole


def _filter(
    stage: str, x: np.ndarray, bound: np.ndarray, params: RowParams, request: Request, vocab: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """min-p or top-k over the kept tokens: ``(rows, bound after, whether it applies)``. It masks every token not
    kept where the bound proves it (bound ``-inf`` after); where the bound cannot even tell the row's largest
    logit (min-p), nothing after is known (bound ``+inf``)."""
    if request.greedy:
        return x, bound, False
    if stage == "min_p":
        if request.min_p <= 0:
            return x, bound, False
        top = x.max(axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            gone = np.exp(bound - top) < np.float32(request.min_p)  # min-p in vLLM's terms: p < min_p * p_max
        lost = bound > top  # a token not kept may be the largest: the kept tokens' decisions are not known
        return min_p(x, params), np.where(gone, -np.inf, np.where(lost, np.inf, bound)).astype(np.float32), True
    k = int(params.top_k[0]) if x.shape[0] else vocab
    if k >= vocab:
        return x, bound, False
    gone = (x > bound[:, None]).sum(axis=1) >= k
    return top_k(x, params), np.where(gone, np.float32(-np.inf), bound).astype(np.float32), True


def _with_columns(
    batch: pa.RecordBatch,
    metadata: RunMetadata,
    ids: np.ndarray,
    natural: np.ndarray,
    lse: np.ndarray,
    values: dict[str, np.ndarray],
    given: dict[str, np.ndarray],
    whole: dict[str, np.ndarray],
) -> pa.RecordBatch:
    """``batch`` with each stage's top-k columns: the kept ids, the stage's values and the natural ones there, and
    (where the run has them) the statistics of the stage's whole row, which is the kept tokens' where given."""
    names = batch.schema.names
    with_stats = "natural_entropy" in names
    flags = "natural_nonfinite" in names
    width = ids.shape[1]
    chosen = batch.column("chosen").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    eos = np.array(metadata.eos_token_ids, dtype=np.int64)
    fields, arrays = list(batch.schema), list(batch.columns)
    for stage in STAGES:
        missing = ~given[stage]
        rows = np.where(given[stage][:, None], values[stage], _NEG_INF)
        columns = {
            "topk_ids": _lists(ids.astype(np.int32), width, missing),
            "topk_logits": _lists(rows, width, missing),
            "topk_natural": _lists(natural, width, missing),
        }
        stats = _stats(rows, ids, natural, lse, chosen, eos)
        same = given[stage] & ~whole[stage]  # natural's row, unchanged: its statistics (the whole row's)
        for name, value in stats.items():
            if f"natural_{name}" in names:
                recorded = _scalar(batch, f"natural_{name}")[same]
                value[same] = recorded if value.dtype.kind == "f" else np.nan_to_num(recorded, nan=0)
            elif name in ("removed_mass", "margin"):
                value[same] = 0
        columns.update({name: pa.array(stats[name], STAT_COLUMNS[name], mask=_unknown(name, missing, chosen))
                        for name in stat_names(stage) if with_stats or name in ("lse", "allowed")})  # fmt: skip
        if flags:
            columns["nonfinite"] = pa.array(np.zeros(batch.num_rows, dtype=bool))
        schema = stage_fields(stage, "topk", metadata.vocab_size, width, flags=flags, stats=with_stats)
        fields += schema
        arrays += [columns[f.name[len(stage) + 1 :]] for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=batch.schema.metadata))


def _lists(values: np.ndarray, width: int, missing: np.ndarray) -> pa.Array:
    mask = pa.array(missing) if missing.any() else None
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width, mask=mask)


def _unknown(name: str, missing: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    return missing | (chosen < 0) if name in ("chosen_logit", "p_chosen", "rank_chosen") else missing


def _stats(
    rows: np.ndarray, ids: np.ndarray, natural: np.ndarray, natural_lse: np.ndarray, chosen: np.ndarray, eos: np.ndarray
) -> dict[str, np.ndarray]:
    """Statistics of whole rows that are their kept tokens' (every other token masked), as the recorder's."""
    wide = rows.astype(np.float64)
    top = wide.max(axis=1)
    shift = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lse = np.log(np.exp(wide - shift[:, None]).sum(axis=1)) + shift
        logp = wide - lse[:, None]
        p = np.where(np.isfinite(logp), np.exp(logp), 0.0)
        entropy = -(p * np.where(p > 0, logp, 0.0)).sum(axis=1)
        nat = np.exp(natural.astype(np.float64) - natural_lse[:, None])
        masked = np.isneginf(wide) & np.isfinite(natural)
        removed = (nat * masked).sum(axis=1) + np.clip(1 - nat.sum(axis=1), 0, 1)  # the tokens not kept, too
        allowed_natural = np.where(np.isfinite(wide), natural, -np.inf).max(axis=1)
        margin = natural.max(axis=1) - allowed_natural
    hit = ids == chosen[:, None]
    there = hit.any(axis=1)
    value = np.where(there, np.where(hit, wide, 0).sum(axis=1), -np.inf)
    allowed = np.isfinite(wide).sum(axis=1)
    p_eos = (p * np.isin(ids, eos)).sum(axis=1) if eos.size else np.full(rows.shape[0], np.nan)
    with np.errstate(invalid="ignore"):
        rank = np.where(there, (wide > value[:, None]).sum(axis=1), allowed)
        p_chosen = np.where(np.isfinite(value), np.exp(value - lse), 0.0)
    return {
        "lse": lse.astype(np.float32),
        "allowed": allowed.astype(np.int32),
        "max": top.astype(np.float32),
        "entropy": np.nan_to_num(entropy).astype(np.float32),
        "nan": np.zeros(rows.shape[0], np.int32),
        "p_eos": p_eos.astype(np.float32),
        "removed_mass": np.clip(removed, 0, 1).astype(np.float32),
        "margin": np.nan_to_num(margin, nan=0.0, posinf=np.inf).astype(np.float32),
        "chosen_logit": value.astype(np.float32),
        "p_chosen": p_chosen.astype(np.float32),
        "rank_chosen": rank.astype(np.int32),
    }
