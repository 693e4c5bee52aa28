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
``note`` says so). Where the stored tokens barely overlap that pair reads
two different rows as equal, so the larger of it and a second bound is
kept: what each run stored where the other did not, less the other's mass
on its unstored tokens (:func:`distances`). The token table then lists
only tokens both runs stored.
A run's mass on the tokens it did not store is read in float64 from its
stored logits and the recorded log-sum-exp of the whole row
(``-expm1(logsumexp(stored) - lse)``), which keeps a small remainder
exact. That log-sum-exp is float32, so a remainder below its rounding
cannot be told from 0: KL takes B's bucket at the most it can hold (the
remainder plus that rounding), so that it stays a finite lower bound where
B is peaked. KL and JS are never negative (rounding is clipped at 0).

``stages`` may name a stage by an alias (``after:<processor>`` for the
last processor of a run recorded with ``processor_stages=True``, stored as
``constrained``); the columns use the names asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tracker.format.stages import resolve_stage
from tracker.reading.display import token_label
from tracker.reading.selection import count_arg, positions_arg

__all__ = ["Comparison", "compare", "distances"]

_KEYS = {"natural": "unstructured", "constrained": "structured"}
_BLOCK_ELEMENTS = 1 << 22
#: Bound on a recorded float32 log-sum-exp's error, beside ``4 ulp`` of its value (measured: under 0.7 ulp + 2.6e-7).
_LSE_SLACK = 2.0**-20


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
        stages: the stages compared, named as asked (an alias stays an alias).
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
        """One sentence: identical, or where and how they diverge; and which steps' tokens are not known (the
        last of a sequence whose run stopped before its token came back)."""
        steps = self.steps["step"]
        unknown = {side: steps[self.steps[f"chosen_{side.lower()}"] < 0].tolist() for side in "AB"}
        said = "".join(f"; {side}'s token at step(s) {at} is not known" for side, at in unknown.items() if at)
        if self.divergence is None:
            if said:
                return f"the same tokens at every step both runs know ({self.length_a} steps){said}"
            return f"identical: {self.length_a} steps with the same tokens"
        d = self.divergence
        if d >= min(self.length_a, self.length_b):
            ends = f"then one sequence ends (A has {self.length_a} steps, B {self.length_b})"
            return f"the same first {d} tokens; {ends}{said}"
        row = self.steps.set_index("step").loc[d]
        return f"the same first {d} tokens; at step {d} A chose {_label(row['token_a'])} and B chose {_label(row['token_b'])}{said}"

    def __repr__(self) -> str:
        return f"Comparison({self.summary()}; stages={self.stages}, exact={self.exact})"


def _label(token: str | None) -> str:
    return token_label(token) if isinstance(token, str) else "an unknown token"


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first index where ``a`` and ``b`` (token ids) differ, or the shorter length when one is a prefix; None
    when equal. An unknown id (< 0) differs from no id: it is not known to."""
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    differ = np.nonzero((x != y) & (x >= 0) & (y >= 0))[0]
    if differ.size:
        return int(differ[0])
    return None if len(a) == len(b) else n


def distances(
    p: np.ndarray,
    q: np.ndarray,
    hidden_p: np.ndarray | None = None,
    hidden_q: np.ndarray | None = None,
    slack_q: np.ndarray | None = None,
    slack_p: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``p, q [t, V]`` (probabilities, NaN = unknown): TV, KL(p‖q), JS, and whether the row was exact.

    Rows with unknown values get lower bounds, the larger of two:

    - the distances of the tokens both know plus one bucket holding each
      side's remaining mass (see the module docstring): its known
      probabilities on tokens the other side does not know, plus its mass on
      its own unknown tokens, ``hidden_p``/``hidden_q`` ``[t]`` (NaN or None:
      1 minus its known probabilities);
    - a split bound, for rows whose known tokens barely overlap (where the
      bucket reads two different distributions as equal): on the tokens only
      A knows, ``Σ|p - q| >= Σ p - (B's mass on its unknown tokens)``, and
      the same the other way; KL and JS then from Pinsker's inequality
      (``KL >= 2 TV²``, ``JS >= TV² / 2``, in nats).

    ``slack_p``/``slack_q`` ``[t]`` bound the error of ``hidden_p``/``hidden_q``;
    the bounds read each side's unknown mass as that much larger.
    """
    p64, q64 = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    nan_p, nan_q = np.isnan(p64), np.isnan(q64)
    known = ~(nan_p | nan_q)
    exact = known.all(axis=1)
    hid_p, only_p = _hidden(p64, nan_p, hidden_p), np.where(nan_q & ~nan_p, p64, 0.0).sum(axis=1)
    hid_q, only_q = _hidden(q64, nan_q, hidden_q), np.where(nan_p & ~nan_q, q64, 0.0).sum(axis=1)
    rest_p = np.where(exact, 0.0, only_p + np.where(nan_p.any(axis=1), hid_p, 0.0))
    rest_q = np.where(exact, 0.0, only_q + np.where(nan_q.any(axis=1), hid_q, 0.0))
    p64, q64 = np.where(known, p64, 0.0), np.where(known, q64, 0.0)
    common = np.abs(p64 - q64).sum(axis=1)
    p64 = np.concatenate([p64, rest_p[:, None]], axis=1)
    q64 = np.concatenate([q64, rest_q[:, None]], axis=1)
    tv = 0.5 * np.abs(p64 - q64).sum(axis=1)
    m = 0.5 * (p64 + q64)
    js = 0.5 * (_kl(p64, m) + _kl(q64, m))
    if slack_q is not None:
        unsure = nan_q.any(axis=1) & ~exact
        q64[:, -1] += np.where(unsure, _slack(slack_q), 0.0)
    kl = _kl(p64, q64)
    # the split bound: B's unknown mass (at the most it can be) covers part of what only A knows, and the other way
    most_q = np.where(nan_q.any(axis=1), hid_q + _slack(slack_q), 0.0)
    most_p = np.where(nan_p.any(axis=1), hid_p + _slack(slack_p), 0.0)
    split = 0.5 * (common + np.clip(only_p - most_q, 0.0, None) + np.clip(only_q - most_p, 0.0, None))
    split = np.where(exact, 0.0, np.clip(split, 0.0, 1.0))
    tv = np.maximum(tv, split)
    kl = np.maximum(kl, 2.0 * split**2)
    js = np.maximum(js, 0.5 * split**2)
    return tv, np.clip(kl, 0.0, None), np.clip(js, 0.0, None), exact


def _slack(slack: np.ndarray | None) -> np.ndarray | float:
    return 0.0 if slack is None else np.nan_to_num(np.asarray(slack, dtype=np.float64))


def _hidden(x: np.ndarray, own: np.ndarray, hidden: np.ndarray | None) -> np.ndarray:
    """``[t]`` a side's mass on its own unknown tokens: ``hidden`` where given, else 1 minus its known mass."""
    fallback = np.clip(1.0 - np.where(own, 0.0, x).sum(axis=1), 0.0, None)
    if hidden is None:
        return fallback
    hidden = np.asarray(hidden, dtype=np.float64)
    return np.where(np.isnan(hidden), fallback, hidden)


def _unseen(run: Any, stage: str, logits: np.ndarray, sel: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``(hidden, slack)`` per row of ``stage``: its mass on the tokens not stored and a bound on that value's error.

    ``hidden = -expm1(logsumexp(stored logits) - lse)`` in float64 with the
    recorded log-sum-exp ``lse`` of the whole row (NaN where that cannot be
    read); ``slack`` bounds the float32 rounding of ``lse``. None for a
    run-like object without the recorded log-sum-exp.
    """
    if not hasattr(run, "_lse"):
        return None
    n = logits.shape[0]
    lse = np.asarray(run._lse(stage, sel), dtype=np.float64)[:n]
    hidden = np.full(n, np.nan)
    block = max(1, _BLOCK_ELEMENTS // max(1, logits.shape[1]))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for a in range(0, n, block):
            x = logits[a : a + block].astype(np.float64)
            x[np.isnan(x)] = -np.inf
            top = x.max(axis=1, initial=-np.inf)
            top = np.where(np.isfinite(top), top, 0.0)
            stored = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
            hidden[a : a + block] = -np.expm1(stored - lse[a : a + block])
        hidden = np.where(np.isfinite(hidden), np.clip(hidden, 0.0, 1.0), np.nan)
        ulp = np.spacing(np.abs(lse).astype(np.float32)).astype(np.float64)
        slack = np.where(np.isfinite(lse), 4.0 * ulp + _LSE_SLACK, 0.0)
    return hidden, slack


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


def _pick_stages(run_a: Any, run_b: Any, stages: Sequence[str] | None) -> list[tuple[str, str, str]]:
    """``(name, stage of A, stage of B)`` per stage compared: all both recorded, or those asked for (aliases
    resolved in each run as :func:`tracker.format.stages.resolve_stage` does)."""
    shared = [s for s in run_a.stages if s in run_b.stages]
    if stages is None:
        return [(s, s, s) for s in shared]
    if isinstance(stages, str):
        stages = [stages]
    aliases = [getattr(r.metadata, "stage_aliases", None) or {} for r in (run_a, run_b)]
    picked, missing = [], []
    for name in dict.fromkeys(stages):
        try:
            picked.append((name, *(resolve_stage(r.stages, al, name) for r, al in zip((run_a, run_b), aliases))))
        except ValueError:
            missing.append(name)
    if missing:
        both = shared + [a for a in aliases[0] if a in aliases[1] and aliases[0][a] in shared]
        raise ValueError(f"stages {missing} are not recorded by both runs; both have {both}")
    return picked


def _values(run: Any, sel: Any, index: np.ndarray | None, probs: bool, options: dict[str, Any]) -> dict[str, Any]:
    """``get_probabilities`` (``probs``) or ``get_logits`` of a sequence, or (``index``: ascending rows of its
    selection ``sel``) of those rows alone, read from their batches alone."""
    if index is None:
        return (run.get_probabilities if probs else run.get_logits)(**options)
    return run._arrays_at(sel, index, probs)


def _unseen_rows(
    run: Any, stage: str, sel: Any, index: np.ndarray | None, options: dict[str, Any], n: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_unseen` of the first ``n`` rows of a sequence, or of its rows ``index`` (None when the run keeps
    whole rows)."""
    if getattr(run.metadata, "storage", None) != "topk" or not hasattr(run, "get_logits"):
        return None
    logits = _values(run, sel, index, False, options)[_KEYS.get(stage, stage)][:n]
    return _unseen(run, stage, logits, sel if index is None else sel.subset(index))


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
    positions: int | Sequence[int] | None = None,
) -> Comparison:
    """Compare a sequence of ``run_a`` with one of ``run_b`` (the same run, another generation, another run;
    a tracker stands for the run it recorded).

    ``generation_b``/``sequence_b`` default to A's. ``stages`` picks stages
    both runs recorded, by name or alias (default: all they share). Runs of
    different storage modes can be compared (see the module docstring on
    top-k storage). ``positions`` (an int or a list of steps) compares those steps only, reading only their
    rows; ``divergence`` and the lengths still speak of the whole sequences.
    """
    top = count_arg("top", top)
    run_a, run_b = _as_run(run_a, "run_a"), _as_run(run_b, "run_b")
    va, vb = run_a.metadata.vocab_size, run_b.metadata.vocab_size
    if va != vb:
        raise ValueError(
            f"run_b has a vocabulary of {vb} tokens but run_a has {va}; only runs of one vocabulary compare"
        )
    generation_b = generation_a if generation_b is None else generation_b
    sequence_b = sequence_a if sequence_b is None else sequence_b
    picked = _pick_stages(run_a, run_b, stages)
    stages = [name for name, _, _ in picked]
    sel_a = run_a._select(generation_a, sequence_a, include_finished)
    sel_b = run_b._select(generation_b, sequence_b, include_finished)
    chosen_a, chosen_b = sel_a.chosen, sel_b.chosen
    n = min(sel_a.length, sel_b.length)
    steps, index = np.arange(n, dtype=np.int64), None
    if positions is not None:  # those steps alone: only their rows are read
        index = steps = np.array(sorted({p for p in positions_arg(positions, steps) if p < n}), dtype=np.int64)
        n = steps.size
    display_a, display_b = run_a.vocab.display, run_b.vocab.display
    frame: dict[str, Any] = {
        "step": steps,
        "chosen_a": chosen_a[steps],
        "chosen_b": chosen_b[steps],
        "token_a": [display_a[c] if c >= 0 else None for c in chosen_a[steps].tolist()],
        "token_b": [display_b[c] if c >= 0 else None for c in chosen_b[steps].tolist()],
        "same": pd.array(chosen_a[steps] == chosen_b[steps], dtype="boolean"),
    }
    frame["same"][(chosen_a[steps] < 0) | (chosen_b[steps] < 0)] = pd.NA  # not known either way
    options_a = {"sequence": sequence_a, "generation": generation_a, "include_finished": include_finished}
    options_b = {"sequence": sequence_b, "generation": generation_b, "include_finished": include_finished}
    probs_a = _values(run_a, sel_a, index, True, options_a)
    probs_b = _values(run_b, sel_b, index, True, options_b)
    token_parts: list[pd.DataFrame] = []
    exact = True
    block = max(1, _BLOCK_ELEMENTS // max(1, va))
    for stage, stage_a, stage_b in picked:
        pa_, pb_ = probs_a[_KEYS.get(stage_a, stage_a)][:n], probs_b[_KEYS.get(stage_b, stage_b)][:n]
        unseen_a = _unseen_rows(run_a, stage_a, sel_a, index, options_a, n)
        unseen_b = _unseen_rows(run_b, stage_b, sel_b, index, options_b, n)
        parts: list[tuple[np.ndarray, ...]] = []
        for a in range(0, n, block):
            span = slice(a, a + block)
            hidden_a, slack_a = (None, None) if unseen_a is None else (unseen_a[0][span], unseen_a[1][span])
            hidden_b, slack_b = (None, None) if unseen_b is None else (unseen_b[0][span], unseen_b[1][span])
            tv, kl, js, ok = distances(pa_[span], pb_[span], hidden_a, hidden_b, slack_b, slack_a)
            rows, ids, change = _top_changes(pa_[span], pb_[span], top)
            parts.append((tv, kl, js, ok))
            rows = rows + a
            token_parts.append(
                pd.DataFrame(
                    {
                        "step": steps[rows],
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
            "top-k storage: a run knows only the tokens it stored, so TV, KL and JS are lower bounds (from the "
            "tokens both runs stored and the mass each stored where the other did not); the token table lists "
            "only tokens both runs stored"
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
