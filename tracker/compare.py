"""Two recorded sequences compared step by step: where they diverge, how far apart their distributions are.

>>> c = compare(run_a, run_b)              # or run_a.diff(run_b)
>>> c.divergence                           # first step whose chosen tokens differ (None: identical)
>>> c.steps                                # per step: chosen tokens, TV / KL / JS per common stage
>>> c.tokens                               # per step and stage: the tokens whose probability moved most

Steps are aligned by index (step ``i`` of A against step ``i`` of B) over
the steps both recorded. Distances are in nats: total variation
``½ Σ|p − q|``, ``KL(A‖B) = Σ p log(p/q)`` (``inf`` where B masked a token
A allowed) and Jensen–Shannon (``½ KL(p‖m) + ½ KL(q‖m)``, ``m = (p+q)/2``).

Top-k storage: a probability is known only where a run stored it. Where a
row does not know every token, the distributions are compared on the tokens
both runs know plus one bucket for all the rest; TV, KL and JS of that
coarser pair are lower bounds of the exact values (``exact`` is False and
``note`` says so). The token table then lists only tokens both runs stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tracker.display import token_label

__all__ = ["Comparison", "compare", "distances"]

_KEYS = {"natural": "unstructured", "constrained": "structured"}
_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare` found.

    Attributes:
        divergence: the first step where the chosen tokens differ, or where
            one sequence ends before the other; None when they are the same.
        steps: one row per aligned step: ``step, chosen_a, chosen_b,
            token_a, token_b, same`` and ``tv_{stage}``, ``kl_{stage}``,
            ``js_{stage}`` per stage both runs recorded.
        tokens: per step and stage, the ``top`` tokens whose probability
            changed most: ``step, stage, token_id, token, p_a, p_b, change``
            (``p_b - p_a``); unchanged tokens are left out.
        stages: the stages compared.
        length_a, length_b: steps in each sequence.
        exact: False when some distances are lower bounds (top-k storage).
        note: what the approximation is, when there is one.
    """

    divergence: int | None
    steps: pd.DataFrame
    tokens: pd.DataFrame
    stages: list[str]
    length_a: int
    length_b: int
    exact: bool
    note: str

    @property
    def same(self) -> bool:
        return self.divergence is None

    def summary(self) -> str:
        """One sentence: identical, or where and how they diverge."""
        if self.divergence is None:
            return f"identical: {self.length_a} steps with the same tokens"
        d = self.divergence
        if d >= min(self.length_a, self.length_b):
            return f"the same first {d} tokens; then one sequence ends (A has {self.length_a} steps, B {self.length_b})"
        row = self.steps.iloc[d]
        return f"the same first {d} tokens; at step {d} A chose {_label(row['token_a'])} and B chose {_label(row['token_b'])}"

    def __repr__(self) -> str:
        return f"Comparison({self.summary()}; stages={self.stages}, exact={self.exact})"


def _label(token: str | None) -> str:
    return "an unknown token" if token is None else token_label(token)


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first index where ``a`` and ``b`` differ, or the shorter length when one is a prefix; None when equal."""
    n = min(len(a), len(b))
    differ = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    if differ.size:
        return int(differ[0])
    return None if len(a) == len(b) else n


def distances(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``p, q [t, V]`` (probabilities, NaN = unknown): TV, KL(p‖q), JS, and whether the row was exact.

    Rows with unknown values are compared on the tokens both know plus one
    bucket holding each side's remaining mass (see the module docstring).
    """
    p64, q64 = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    known = ~(np.isnan(p64) | np.isnan(q64))
    exact = known.all(axis=1)
    p64, q64 = np.where(known, p64, 0.0), np.where(known, q64, 0.0)
    rest_p = np.where(exact, 0.0, np.clip(1.0 - p64.sum(axis=1), 0.0, None))
    rest_q = np.where(exact, 0.0, np.clip(1.0 - q64.sum(axis=1), 0.0, None))
    p64 = np.concatenate([p64, rest_p[:, None]], axis=1)
    q64 = np.concatenate([q64, rest_q[:, None]], axis=1)
    tv = 0.5 * np.abs(p64 - q64).sum(axis=1)
    m = 0.5 * (p64 + q64)
    js = 0.5 * (_kl(p64, m) + _kl(q64, m))
    return tv, _kl(p64, q64), np.clip(js, 0.0, None), exact


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``Σ p log(p/q)`` per row; terms where ``p`` is 0 count 0, ``q`` 0 under ``p > 0`` gives ``inf``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
    return terms.sum(axis=1)


def _top_changes(p: np.ndarray, q: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, ids, change)`` of the ``top`` largest ``|q - p|`` per row among known, changed tokens."""
    change = np.asarray(q, dtype=np.float64) - np.asarray(p, dtype=np.float64)
    score = np.where(np.isnan(change), -1.0, np.abs(change))
    k = min(top, score.shape[1])
    ids = (
        np.sort(np.argpartition(-score, k - 1, axis=1)[:, :k], axis=1) if k else np.zeros((score.shape[0], 0), np.int64)
    )
    best = np.take_along_axis(score, ids, axis=1)
    order = np.argsort(-best, axis=1, kind="stable")  # ties: the lower id first
    ids, best = np.take_along_axis(ids, order, axis=1), np.take_along_axis(best, order, axis=1)
    rows = np.broadcast_to(np.arange(score.shape[0])[:, None], ids.shape)
    keep = best > 0
    return rows[keep], ids[keep], np.take_along_axis(change, ids, axis=1)[keep]


def _as_run(value: Any, argument: str) -> Any:
    """A run, or the run a tracker recorded so far."""
    if hasattr(value, "metadata") and hasattr(value, "get_probabilities"):
        return value
    if hasattr(value, "run") and hasattr(value.run, "metadata"):
        return value.run
    raise TypeError(f"{argument} must be a tracker.Run or a LogitTrackingProcessor, got {type(value).__name__}")


def compare(
    run_a: Any,
    run_b: Any,
    *,
    generation_a: int = -1,
    sequence_a: int = 0,
    generation_b: int | None = None,
    sequence_b: int | None = None,
    stages: Sequence[str] | None = None,
    top: int = 5,
    include_finished: bool = False,
) -> Comparison:
    """Compare a sequence of ``run_a`` with one of ``run_b`` (the same run, another generation, another run;
    a tracker stands for the run it recorded).

    ``generation_b``/``sequence_b`` default to A's. ``stages`` picks stages
    both runs recorded (default: all they share). Runs of different storage
    modes can be compared (see the module docstring on top-k storage).
    """
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be an int >= 1, got {top!r}")
    run_a, run_b = _as_run(run_a, "run_a"), _as_run(run_b, "run_b")
    va, vb = run_a.metadata.vocab_size, run_b.metadata.vocab_size
    if va != vb:
        raise ValueError(
            f"run_b has a vocabulary of {vb} tokens but run_a has {va}; only runs of one vocabulary compare"
        )
    generation_b = generation_a if generation_b is None else generation_b
    sequence_b = sequence_a if sequence_b is None else sequence_b
    shared = [s for s in run_a.stages if s in run_b.stages]
    if stages is None:
        stages = shared
    else:
        stages = list(stages)
        missing = [s for s in stages if s not in shared]
        if missing:
            raise ValueError(f"stages {missing} are not recorded by both runs; both have {shared}")
    sel_a = run_a._select(generation_a, sequence_a, include_finished)
    sel_b = run_b._select(generation_b, sequence_b, include_finished)
    chosen_a, chosen_b = sel_a.chosen, sel_b.chosen
    n = min(sel_a.length, sel_b.length)
    display_a, display_b = run_a.vocab.display, run_b.vocab.display
    frame: dict[str, Any] = {
        "step": np.arange(n, dtype=np.int64),
        "chosen_a": chosen_a[:n],
        "chosen_b": chosen_b[:n],
        "token_a": [display_a[c] if c >= 0 else None for c in chosen_a[:n].tolist()],
        "token_b": [display_b[c] if c >= 0 else None for c in chosen_b[:n].tolist()],
        "same": chosen_a[:n] == chosen_b[:n],
    }
    probs_a = run_a.get_probabilities(sequence=sequence_a, generation=generation_a, include_finished=include_finished)
    probs_b = run_b.get_probabilities(sequence=sequence_b, generation=generation_b, include_finished=include_finished)
    token_parts: list[pd.DataFrame] = []
    exact = True
    block = max(1, _BLOCK_ELEMENTS // max(1, va))
    for stage in stages:
        pa_, pb_ = probs_a[_KEYS.get(stage, stage)][:n], probs_b[_KEYS.get(stage, stage)][:n]
        parts: list[tuple[np.ndarray, ...]] = []
        for a in range(0, n, block):
            tv, kl, js, ok = distances(pa_[a : a + block], pb_[a : a + block])
            rows, ids, change = _top_changes(pa_[a : a + block], pb_[a : a + block], top)
            parts.append((tv, kl, js, ok))
            rows = rows + a
            token_parts.append(
                pd.DataFrame(
                    {
                        "step": rows.astype(np.int64),
                        "stage": stage,
                        "token_id": ids.astype(np.int64),
                        "token": [display_a[i] for i in ids.tolist()],
                        "p_a": pa_[rows, ids].astype(np.float64),
                        "p_b": pb_[rows, ids].astype(np.float64),
                        "change": change,
                    }
                )
            )
        empty = np.zeros(0)
        for j, name in enumerate(("tv", "kl", "js")):
            frame[f"{name}_{stage}"] = np.concatenate([p[j] for p in parts]) if parts else empty
        exact &= bool(all(p[3].all() for p in parts))
    columns = ["step", "stage", "token_id", "token", "p_a", "p_b", "change"]
    tokens = pd.concat(token_parts, ignore_index=True) if token_parts else pd.DataFrame(columns=columns)
    if len(tokens):
        order = np.lexsort(
            (
                -tokens["change"].abs().to_numpy(),
                tokens["stage"].map(stages.index).to_numpy(),
                tokens["step"].to_numpy(),
            )
        )
        tokens = tokens.iloc[order].reset_index(drop=True)
    note = (
        ""
        if exact
        else (
            "top-k storage: distances are computed on the tokens both runs stored plus one bucket for the rest, "
            "so TV, KL and JS are lower bounds; the token table lists only tokens both runs stored"
        )
    )
    return Comparison(
        divergence=first_divergence(chosen_a, chosen_b),
        steps=pd.DataFrame(frame),
        tokens=tokens,
        stages=list(stages),
        length_a=sel_a.length,
        length_b=sel_b.length,
        exact=exact,
        note=note,
    )
