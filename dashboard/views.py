"""Run data shaped for the pages and charts: pure functions, no Streamlit, no plotting.

- :func:`step_table`: the tokens worth showing at one step, with each stage's
  logit, probability and state (kept, masked, not stored);
- :func:`step_summary`: one step's headline numbers (allowed tokens, removed
  mass, entropies);
- :func:`window_view`: per-step statistics (from the tracker's analysis API),
  the model's top alternatives at each step and a tokens-by-steps matrix, for
  a window of steps;
- :func:`token_pieces`, :func:`aligned`, :func:`first_divergence`: the text
  token by token, and two tracks lined up by step.

Probabilities are ``exp(logit - lse)`` with the row's stored log-sum-exp, so
top-k storage gives exact values for the tokens it kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd

import tracker
from dashboard.reader import StageRow, StepRow
from dashboard.threads import one_torch_thread
from tracker import Vocabulary
from tracker.reading import metrics
from tracker.reading.block import Block, one_hot_rows, read_as_recorded
from tracker.reading.compare import first_divergence  # one definition, shared with tracker.compare
from tracker.reading.display import format_probability, token_label  # one definition, shared with the notebook display
from tracker.reading.engine_stages import ENGINE_STAGES
from tracker.reading.rows import nonfinite_rows, probabilities

__all__ = [
    "COLOR_METRICS",
    "StepSummary",
    "WindowView",
    "aligned",
    "first_divergence",
    "step_summary",
    "step_table",
    "token_label",
    "format_probability",
    "token_pieces",
    "window_view",
]

State = Literal["kept", "masked", "not stored", "not recorded"]

#: Ways to colour the generated text: label -> (stats column, what high means).
COLOR_METRICS: dict[str, tuple[str, str]] = {
    "chosen token's probability (model)": ("p_chosen_natural", "likely"),
    "chosen token's probability (after constraint)": ("p_chosen_constrained", "likely"),
    "chosen token's rank (model)": ("rank_chosen_natural", "far down the list"),
    "probability mass the constraint removed": ("removed_mass", "much removed"),
}


def _unique_labels(ids: np.ndarray, vocab: Vocabulary) -> list[str]:
    labels = [token_label(vocab.display[int(i)]) for i in ids]
    seen: dict[str, int] = {}
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
    return [f"{label} #{int(i)}" if seen[label] > 1 else label for label, i in zip(labels, ids)]


# ---------------------------------------------------------------- one step


def _stage_values(stage: StageRow, ids: np.ndarray) -> tuple[np.ndarray, list[State]]:
    """Logits of ``ids`` at a stage and each one's state (top-k storage may not know them)."""
    n = ids.size
    if not stage.recorded:
        return np.full(n, np.nan, dtype=np.float64), ["not recorded"] * n
    if stage.logits is not None:
        values = stage.logits[ids].astype(np.float64)
        return values, ["masked" if v == -np.inf else "kept" for v in values]
    known = dict(zip(stage.ids.tolist(), stage.values.tolist()))  # type: ignore[union-attr]
    all_stored = stage.allowed <= len(known)
    values = np.full(n, np.nan, dtype=np.float64)
    states: list[State] = []
    for i, token_id in enumerate(ids.tolist()):
        if token_id in known:
            values[i] = known[token_id]
            states.append("masked" if known[token_id] == -np.inf else "kept")
        elif all_stored:
            values[i] = -np.inf
            states.append("masked")
        else:
            states.append("not stored")
    return values, states


def _probabilities(stage: StageRow, values: np.ndarray) -> np.ndarray:
    """Probabilities of logits ``values`` at a stage, read as the tracker reads the row: a masked token 0,
    a row holding ``+inf`` a one-hot on its ``+inf`` tokens; NaN where the value is not known."""
    if not stage.recorded:
        return np.full(values.size, np.nan)
    if stage.lse == np.inf:
        return np.where(np.isnan(values), np.nan, (values == np.inf) / max(stage.allowed, 1))
    return probabilities(values, stage.lse)


def _natural_topk_values(row: StepRow) -> dict[int, float]:
    """Top-k storage: every natural logit the row knows (natural's own list and other stages' ``natural_at_ids``)."""
    known: dict[int, float] = {}
    for stage in row.stages.values():
        if stage.natural_at_ids is not None and stage.ids is not None:
            known.update(zip(stage.ids.tolist(), stage.natural_at_ids.tolist()))
    natural = row.stages.get("natural")
    if natural is not None and natural.ids is not None and natural.values is not None:
        known.update(zip(natural.ids.tolist(), natural.values.tolist()))
    return known


def _candidates(row: StepRow, k: int) -> np.ndarray:
    """The ids worth showing: each stage's best ``k`` allowed tokens and the chosen one."""
    found: list[np.ndarray] = []
    for stage in row.stages.values():
        if not stage.recorded:
            continue
        if stage.logits is not None:
            logits = stage.logits
            kk = min(k, logits.size)
            top = np.argpartition(-np.nan_to_num(logits, nan=-np.inf), kk - 1)[:kk]
            found.append(top[logits[top] > -np.inf])
        elif stage.ids is not None and stage.values is not None:
            found.append(stage.ids[:k][stage.values[:k] > -np.inf])
    if row.chosen >= 0:
        found.append(np.array([row.chosen]))
    return np.unique(np.concatenate(found)).astype(np.int64) if found else np.zeros(0, np.int64)


def _best_at_any_stage(probs: list[np.ndarray], n: int) -> np.ndarray:
    """Positions of ``n`` tokens ordered by their best rank at any stage (a token of probability 0 has none there)."""
    if not probs:
        return np.arange(n)
    stacked = np.stack(probs)
    ranks = np.argsort(np.argsort(-stacked, axis=1, kind="stable"), axis=1, kind="stable").astype(np.float64)
    best = np.where(stacked > 0, ranks, np.inf).min(axis=0)
    return np.lexsort((-stacked.max(axis=0), best))


def step_table(row: StepRow, vocab: Vocabulary, k: int = 10) -> pd.DataFrame:
    """The tokens to show at one step, best first by the model's (natural) probability.

    The ``k`` tokens that rank best at any stage (each stage's first, then
    each stage's second, ...; equal ranks by probability), plus the chosen
    one: so a constraint that renormalises its allowed tokens does not crowd
    the model's own favourites out of the table. Columns: ``token_id, token, label`` (visible whitespace,
    unique), ``chosen``; per stage ``{stage}_logit``, ``{stage}_prob`` and
    ``{stage}_state`` (``kept``, ``masked``: logit ``-inf`` at that stage,
    ``not stored``: top-k storage did not keep it, ``not recorded``); and
    ``removed_by``: the first stage that masked the token ("" if none).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    ids = _candidates(row, k)
    stages = list(row.stages)
    natural_known = (
        _natural_topk_values(row) if row.stages.get("natural") and row.stages["natural"].logits is None else {}
    )
    columns: dict[str, object] = {}
    probs = []
    for name in stages:
        stage = row.stages[name]
        values, states = _stage_values(stage, ids)
        if name == "natural" and natural_known:
            extra = np.array([natural_known.get(int(i), np.nan) for i in ids], dtype=np.float64)
            fill = np.isnan(values) & ~np.isnan(extra)
            values = np.where(fill, extra, values)
            states = ["kept" if f else s for f, s in zip(fill.tolist(), states)]
        prob = _probabilities(stage, values)
        columns[f"{name}_logit"] = values
        columns[f"{name}_prob"] = prob
        columns[f"{name}_state"] = states
        probs.append(np.nan_to_num(prob, nan=0.0))
    keep = _best_at_any_stage(probs, ids.size)[:k]
    chosen_at = np.nonzero(ids == row.chosen)[0]
    if chosen_at.size and chosen_at[0] not in keep:
        keep = np.append(keep, chosen_at[0])
    removed = []
    for i in range(ids.size):
        first = next((s for s in stages if columns[f"{s}_state"][i] == "masked"), "")  # type: ignore[index]
        removed.append(first)
    frame = pd.DataFrame(  # built at once: a column added at a time costs more than the rest of the table
        {
            "token_id": ids,
            "token": [vocab.display[int(i)] for i in ids],
            "chosen": ids == row.chosen,
            **columns,
            "removed_by": removed,
        }
    )
    frame = frame.iloc[keep]
    order = np.lexsort((-frame[f"{stages[-1]}_prob"].fillna(0).to_numpy(), -frame["natural_prob"].fillna(0).to_numpy()))
    frame = frame.iloc[order].reset_index(drop=True)
    frame.insert(2, "label", _unique_labels(frame["token_id"].to_numpy(), vocab))
    return frame


@dataclass(frozen=True)
class StepSummary:
    """Headline numbers of one step (NaN where the storage cannot tell)."""

    step: int
    chosen_id: int
    chosen_token: str
    allowed: int
    vocab_size: int
    removed_mass: float
    entropy: dict[str, float] = field(default_factory=dict)
    p_chosen: dict[str, float] = field(default_factory=dict)
    processor_error: bool = False
    masked_by: str = "constrained"


def _block(stage: StageRow) -> Block:
    """One stage's row as the tracker's metrics read it (a full row as the record reads it, or the stored top-k)."""
    recorded = np.array([stage.lse])
    # a +inf row reads as a one-hot on its +inf tokens: values 0 there, log-sum-exp the log of their count
    lse = np.where(recorded == np.inf, np.log(max(stage.allowed, 1)), recorded).astype(np.float32)
    if stage.logits is not None:
        values = np.asarray(stage.logits, dtype=np.float32)[None, :]
        return Block(read_as_recorded(values, nonfinite_rows(values), None), lse)
    ids = np.zeros((1, 0), np.int64) if stage.ids is None else np.asarray(stage.ids, dtype=np.int64)[None, :]
    values = (
        np.zeros((1, 0), np.float32) if stage.values is None else np.asarray(stage.values, dtype=np.float32)[None, :]
    )
    return Block(one_hot_rows(values, recorded), lse, ids, np.array([stage.allowed]))


def step_summary(row: StepRow, vocab: Vocabulary) -> StepSummary:
    """Allowed tokens, removed mass, each stage's entropy and chosen-token probability at one step
    (the tracker's metrics, :mod:`tracker.reading.metrics`, on this one row)."""
    blocks = {name: _block(stage) for name, stage in row.stages.items() if stage.recorded}
    chosen = np.array([row.chosen])
    # the statistics recorded from the whole row where the run has them (exact in top-k and half precision);
    # NaN for a stage not recorded at this step (the wrapped processor raised)
    entropy = {
        name: row.stages[name].recorded_stats.get("entropy", float(metrics.entropy(blocks[name])[0]))
        if name in blocks
        else math.nan
        for name in row.stages
    }
    p_chosen = {
        name: row.stages[name].recorded_stats.get("p_chosen", float(metrics.chosen(blocks[name], chosen)[0][0]))
        if name in blocks
        else math.nan
        for name in row.stages
    }
    natural = row.stages.get("natural")
    # what the step's headline compares with natural: the constraint, or for a run vLLM sampled its sampler's cut
    by = "sampled" if "constrained" not in row.stages and set(ENGINE_STAGES) <= set(row.stages) else "constrained"
    constrained = row.stages.get(by)
    removed = float("nan")
    allowed = natural.allowed if natural is not None else 0
    if constrained is not None and constrained.recorded:
        allowed = constrained.allowed
        if natural is not None:
            removed = constrained.recorded_stats.get(
                "removed_mass", float(metrics.removed_mass(blocks["natural"], blocks[by])[0])
            )
    elif constrained is None:
        removed = 0.0
    token = vocab.display[row.chosen] if row.chosen >= 0 else ""
    return StepSummary(
        row.step, row.chosen, token, int(allowed), vocab.size, removed, entropy, p_chosen, row.processor_error, by
    )


# ---------------------------------------------------------------- a window of steps


@dataclass(frozen=True)
class WindowView:
    """A window of steps of one sequence, ready for the overview.

    Attributes:
        stats: the tracker's per-step statistics (``Run.stats``), one row per step.
        tokens: each step's chosen token text (see :func:`token_pieces`).
        alternatives: long table ``position, rank, token_id, token, {stage}_prob``:
            the model's best tokens at each step.
        heat: per stage, a tokens-by-steps probability matrix (index: token
            label, columns: positions) over the tokens that were ever near the top.
        heat_chosen: per step, the heat row label of the chosen token (None
            when it is not a row).
    """

    stats: pd.DataFrame
    tokens: list[str]
    alternatives: pd.DataFrame
    heat: dict[str, pd.DataFrame]
    heat_chosen: list[str | None]


def _top_ids(matrix: np.ndarray, n: int) -> np.ndarray:
    """``[T, n]`` ids of each row's largest values, best first, the lower id first among equal values
    (NaN, a value not stored, counts as smallest)."""
    values = np.nan_to_num(matrix, nan=-1.0) if np.isnan(matrix).any() else matrix
    n = min(n, values.shape[1])
    if n == 0:
        return np.zeros((values.shape[0], 0), np.int64)
    kth = -np.partition(-values, n - 1, axis=1)[:, n - 1 : n]  # each row's n-th largest value
    above = values > kth
    # every value above the n-th, then the lowest ids among those equal to it, to n per row
    room = n - above.sum(axis=1, keepdims=True)
    ties = values == kth
    take = above | (ties & (np.cumsum(ties, axis=1) <= room))
    ids = np.nonzero(take)[1].reshape(values.shape[0], n)
    order = np.argsort(-np.take_along_axis(values, ids, axis=1), axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1)


def window_view(
    run: tracker.Run,
    generation: int,
    sequence: int,
    *,
    alternatives: int = 5,
    heat_tokens: int = 20,
) -> WindowView:
    """Statistics, alternatives and heat matrices of ``run`` (a window from :meth:`RunReader.window`)."""
    with one_torch_thread():
        return _window_view(run, generation, sequence, alternatives, heat_tokens)


def _window_view(run: tracker.Run, generation: int, sequence: int, alternatives: int, heat_tokens: int) -> WindowView:
    stats = run.stats(generation=generation, sequence=sequence)
    positions = stats["position"].to_numpy()
    chosen = stats["chosen_id"].fillna(-1).to_numpy(dtype=np.int64)
    probs = run.get_probabilities(generation=generation, sequence=sequence)
    names = {"unstructured": "natural", "structured": "constrained"}
    by_stage = {names.get(key, key): value for key, value in probs.items() if names.get(key, key) in run.stages}
    vocab = run.vocab
    natural = by_stage["natural"]
    top = _top_ids(natural, alternatives) if natural.size else np.zeros((0, alternatives), np.int64)
    rows = np.repeat(np.arange(top.shape[0]), top.shape[1])
    flat = top.reshape(-1)
    alt = pd.DataFrame(
        {
            "position": positions[rows] if rows.size else np.zeros(0, np.int64),
            "rank": np.tile(np.arange(top.shape[1]), top.shape[0]),
            "token_id": flat,
            "token": [vocab.display[int(i)] for i in flat],
        }
    )
    for name, matrix in by_stage.items():
        alt[f"{name}_prob"] = matrix[rows, flat] if rows.size else np.zeros(0)
    ranked = [_top_ids(m, heat_tokens) for m in by_stage.values()] if natural.size else []
    pool = (
        np.unique(np.concatenate([r.reshape(-1) for r in ranked] + [chosen[chosen >= 0]]))
        if ranked
        else np.zeros(0, np.int64)
    )
    if pool.size:
        peak = np.max(np.stack([np.nan_to_num(m[:, pool], nan=0.0).max(axis=0) for m in by_stage.values()]), axis=0)
        is_chosen = np.isin(pool, chosen)
        order = np.lexsort((-peak, ~is_chosen))[: max(heat_tokens, 1)]
        pool = pool[np.sort(order)]
        # NaN where top-k storage did not keep a token at a step: rank by the steps where it did
        best = np.nan_to_num(natural[:, pool], nan=-1.0).max(axis=0)
        pool = pool[np.argsort(-best, kind="stable")] if natural.shape[0] else pool
    labels = _unique_labels(pool, vocab)
    heat = {
        name: pd.DataFrame(
            matrix[:, pool].T if pool.size else np.zeros((0, positions.size)), index=labels, columns=positions
        )
        for name, matrix in by_stage.items()
    }
    label_of = dict(zip(pool.tolist(), labels))
    heat_chosen = [label_of.get(int(c)) for c in chosen]
    return WindowView(stats, token_pieces(vocab, chosen), alt, heat, heat_chosen)


# ---------------------------------------------------------------- text and alignment


def token_pieces(vocab: Vocabulary, ids: Sequence[int] | np.ndarray) -> list[str]:
    """The text each token adds, in order; joined, they are the run's ``sequence()``.

    A character split across tokens shows with its last byte; bytes still
    unfinished at the end show as one ``�`` on the last token.
    """
    return vocab.text_pieces(ids)


def aligned(
    a: pd.DataFrame,
    b: pd.DataFrame,
    columns: Sequence[str] = ("chosen_id", "chosen_token", "p_chosen_natural", "entropy_natural"),
) -> pd.DataFrame:
    """Two stats frames lined up by position: ``position``, ``{col}_a``, ``{col}_b``, ``same``.

    Token text is shown as :func:`token_label` makes it visible (a space as ``␣``).
    """
    left = a[["position", *[c for c in columns if c in a.columns]]]
    right = b[["position", *[c for c in columns if c in b.columns]]]
    if "chosen_token" in columns:
        left, right = (
            f.assign(chosen_token=f["chosen_token"].map(token_label, na_action="ignore")) for f in (left, right)
        )
    merged = left.merge(right, on="position", how="outer", suffixes=("_a", "_b")).sort_values("position")
    merged["same"] = (
        merged["chosen_id_a"].astype("Int64").eq(merged["chosen_id_b"].astype("Int64")).fillna(False).astype(bool)
    )
    return merged.reset_index(drop=True)
