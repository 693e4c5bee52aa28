"""Two runs over the same tokens, summed up: the statistics of llama.cpp's KL-divergence tool, per step, per
sequence and per run.

>>> other = run.rescore(model_bf16)
>>> c = compare_runs(run, other)            # A is the reference (e.g. the model in its own precision)
>>> print(c.summary())                      # the table
>>> c.steps, c.sequences, c.totals          # per step, per sequence, per run
>>> c.logprob_gaps()                        # each chosen token's log-probability under A and B, largest gap first

Sequences are paired by position (the ``i``-th generation's ``j``-th sequence
of A with B's) and steps by index, over the steps both recorded (a
sequence's own steps; ``include_finished`` adds the ones fed after it ended).
All of it is computed in float64 from the stored values, in natural
logarithms (nats):

- ``kl_{stage}``: ``KL(A‖B) = Σ_t p_A(t) (log p_A(t) − log p_B(t))`` per step,
  A's distribution against B's (``inf`` where B gives 0 to a token A allows),
  for the natural stage and every other stage both runs recorded; per run its
  mean, median, 90th, 99th and 99.9th percentile (linear interpolation) and
  maximum over the steps.
- ``top1_same``: whether A's and B's most likely natural token is the same
  (ties: the lowest id); the run's top-1 agreement is its share of steps.
- ``logprob_a``, ``logprob_b``: the natural log-probability of the token A
  chose under each run; ``gap = logprob_b − logprob_a``; ``dp = p_b − p_a``.
  The run's mean and RMS Δp are ``mean(dp)`` and ``sqrt(mean(dp²))``.
- perplexity: ``exp(−mean(logprob))`` over the steps whose chosen token was
  recorded, for A and for B, and their ratio ``B / A``.

Top-k storage: only the stored tokens are known. KL is then the lower bound
:func:`tracker.reading.compare.compare` gives (``exact`` is False, ``note`` says so);
the chosen token's probability comes from the statistics recorded with each
row (exact), and the top-1 token is the best stored one (exact: top-k keeps
it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tracker.reading.compare import _BLOCK_ELEMENTS, _KEYS, _as_run, _pick_stages, compare, first_divergence

__all__ = ["RunComparison", "compare_runs", "QUANTILES"]

#: The quantiles of the KL divergence reported per run, with their names.
QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99, "p99.9": 0.999}


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """``[t, V]`` float64 log-probabilities of stored logits (NaN entries are left out, as ``-inf``)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    x[np.isnan(x)] = -np.inf
    top = x.max(axis=1, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
        return x - lse[:, None]


def kl64(logp_a: np.ndarray, logp_b: np.ndarray) -> np.ndarray:
    """``[t]`` ``Σ p_a (log p_a − log p_b)``; terms where ``p_a`` is 0 count 0, never negative (rounding clipped)."""
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(logp_a)
        terms = np.where(p > 0, p * (logp_a - logp_b), 0.0)
    return np.clip(terms.sum(axis=1), 0.0, None)


def _quantiles(values: np.ndarray) -> dict[str, float]:
    """Mean, the :data:`QUANTILES` and max of ``values`` (NaN left out; ``inf`` kept)."""
    v = values[~np.isnan(values)]
    if not v.size:
        return {"mean": math.nan, **{k: math.nan for k in QUANTILES}, "max": math.nan}
    with np.errstate(invalid="ignore"):
        q = np.quantile(v, list(QUANTILES.values()))
    q = np.where(np.isnan(q), np.inf, q)  # interpolating between two inf gives NaN: it is inf
    return {"mean": float(v.mean()), **dict(zip(QUANTILES, q.tolist())), "max": float(v.max())}


def _perplexity(logprobs: np.ndarray) -> float:
    v = logprobs[~np.isnan(logprobs)]
    return float(np.exp(-v.mean())) if v.size else math.nan


def _plain(value: Any) -> Any:
    """JSON-ready: NaN as None, infinities as the strings ``"inf"``/``"-inf"``."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


@dataclass(frozen=True)
class RunComparison:
    """What :func:`compare_runs` found (definitions: the module docstring).

    Attributes:
        steps: one row per compared step: ``generation, sequence, step, token_id, token, same`` (both chose
            it), ``kl_{stage}`` per stage, ``top1_a, top1_b, top1_same``, ``logprob_a, logprob_b, gap, p_a,
            p_b, dp``. ``generation``/``sequence`` are A's.
        sequences: one row per sequence: its steps, mean and max KL per stage, top-1 agreement, mean Δp,
            perplexities and their ratio.
        totals: the run's statistics (what :meth:`summary` prints; :meth:`to_json` writes).
        stages: the stages compared.
        exact: False when some KL values are lower bounds (top-k storage).
        note: what the bound is, when there is one.
    """

    steps: pd.DataFrame
    sequences: pd.DataFrame
    totals: dict[str, Any]
    stages: list[str]
    exact: bool
    note: str
    labels: tuple[str, str] = field(default=("A", "B"))

    def table(self) -> pd.DataFrame:
        """The run's statistics as rows ``statistic, value``."""
        t = self.totals
        rows: list[tuple[str, Any]] = [("steps", t["steps"]), ("sequences", t["sequences"])]
        for stage in self.stages:
            for name, value in t["kl"][stage].items():
                rows.append((f"KL {name} ({stage})", value))
        rows += [
            ("top-1 agreement", t["top1_agreement"]),
            ("mean Δp (chosen token, B − A)", t["dp_mean"]),
            ("RMS Δp (chosen token)", t["dp_rms"]),
            ("perplexity A", t["perplexity_a"]),
            ("perplexity B", t["perplexity_b"]),
            ("perplexity ratio B / A", t["perplexity_ratio"]),
        ]
        return pd.DataFrame(rows, columns=["statistic", "value"])

    def summary(self) -> str:
        """The table as text, with the two runs named, and the bound's note when there is one."""
        lines = [f"A: {self.labels[0]}", f"B: {self.labels[1]}"]
        for name, value in self.table().itertuples(index=False):
            shown = f"{value:.6g}" if isinstance(value, float) else str(value)
            lines.append(f"  {name:<32} {shown}")
        if self.note:
            lines.append(f"note: {self.note}")
        differ, shared = self.totals["tokens_differ"], self.totals["same_context"]
        if differ:
            lines.append(
                f"note: the runs chose different tokens at {differ} of {self.totals['steps']} steps: after a "
                "sequence's first different token, B's distributions follow B's own text, so KL, Δp and "
                "perplexity B compare different contexts (B's probabilities of A's tokens). Still comparable: "
                f"perplexity A, and the {shared['steps']} step(s) up to each sequence's first difference, read "
                f"after the same text (KL mean (natural) {shared['kl_mean']:.6g} there)"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        """The run's statistics as JSON (NaN as null, infinities as ``"inf"``)."""
        body = {"a": self.labels[0], "b": self.labels[1], **self.totals, "exact": self.exact, "note": self.note}
        return json.dumps(_plain(body), ensure_ascii=False)

    def logprob_gaps(self, top: int | None = None) -> pd.DataFrame:
        """Per sampled token, A's log-probability against B's (rollout engine against trainer), the largest
        ``|gap|`` first (``top`` rows, default all): ``generation, sequence, step, token_id, token,
        logprob_a, logprob_b, gap, p_a, p_b``."""
        frame = self.steps[
            ["generation", "sequence", "step", "token_id", "token", "logprob_a", "logprob_b", "gap", "p_a", "p_b"]
        ]
        frame = frame[frame["gap"].notna()]
        order = np.argsort(-frame["gap"].abs().to_numpy(), kind="stable")
        frame = frame.iloc[order].reset_index(drop=True)
        return frame if top is None else frame.head(int(top))

    def __repr__(self) -> str:
        t = self.totals
        return (
            f"RunComparison(steps={t['steps']}, kl_mean={t['kl'].get('natural', {}).get('mean')}, "
            f"top1_agreement={t['top1_agreement']}, perplexity_ratio={t['perplexity_ratio']}, exact={self.exact})"
        )


def _label(run: Any) -> str:
    m = run.metadata
    title = m.extra.get("title") if isinstance(m.extra, dict) else None
    return f"{m.run_id}" + (f" ({title})" if title else "") + (f", model {m.model}" if m.model else "")


def _forget(run: Any, before: set[Any]) -> None:
    """Drop the query results cached since ``before`` (one sequence's arrays: memory stays one sequence's)."""
    cache = run._cache()
    for key in [k for k in cache if k not in before]:
        del cache[key]


def _full_stage(run_a: Any, run_b: Any, la: np.ndarray, lb: np.ndarray, n: int) -> np.ndarray:
    block = max(1, _BLOCK_ELEMENTS // max(1, la.shape[1]))
    return np.concatenate(
        [np.zeros(0)]
        + [kl64(log_softmax64(la[a : a + block]), log_softmax64(lb[a : a + block])) for a in range(0, n, block)]
    )


def _one_sequence(
    run_a: Any, run_b: Any, pair: tuple[int, int, int, int], picked: list[tuple[str, str, str]], finished: bool
) -> tuple[dict[str, Any], bool]:
    """The per-step columns of one pair of sequences, and whether they are exact."""
    ga, sa, gb, sb = pair
    sel_a, sel_b = run_a._select(ga, sa, finished), run_b._select(gb, sb, finished)
    n = min(sel_a.length, sel_b.length)
    chosen = sel_a.chosen[:n]
    known = chosen >= 0
    logits_a = run_a.get_logits(sequence=sa, generation=ga, include_finished=finished)
    logits_b = run_b.get_logits(sequence=sb, generation=gb, include_finished=finished)
    full = run_a.metadata.storage != "topk" and run_b.metadata.storage != "topk"
    cols: dict[str, Any] = {
        "generation": np.full(n, sel_a.generation, dtype=np.int64),
        "sequence": np.full(n, sel_a.sequence, dtype=np.int64),
        "step": sel_a.steps[:n].astype(np.int64),
        "token_id": chosen,
        "token": [run_a.vocab.display[c] if c >= 0 else None for c in chosen.tolist()],
        "same": (chosen == sel_b.chosen[:n]) & known,
        # the steps both runs reached through the same text: their distributions answer the same context
        "same_context": np.arange(n) <= (n if (d := first_divergence(chosen, sel_b.chosen[:n])) is None else d),
    }
    exact = True
    if full:
        for name, stage_a, stage_b in picked:
            la, lb = logits_a[_KEYS.get(stage_a, stage_a)][:n], logits_b[_KEYS.get(stage_b, stage_b)][:n]
            cols[f"kl_{name}"] = _full_stage(run_a, run_b, la, lb, n)
    else:
        c = compare(run_a, run_b, generation_a=ga, sequence_a=sa, generation_b=gb, sequence_b=sb,
                    stages=[name for name, _, _ in picked], top=1, include_finished=finished)  # fmt: skip
        for name, _, _ in picked:
            cols[f"kl_{name}"] = c.steps[f"kl_{name}"].to_numpy(dtype=np.float64)[:n]
        exact = c.exact
    nat_a, nat_b = logits_a["unstructured"][:n], logits_b["unstructured"][:n]
    cols["top1_a"] = np.where(np.isnan(nat_a), -np.inf, nat_a).argmax(axis=1) if n else np.zeros(0, np.int64)
    cols["top1_b"] = np.where(np.isnan(nat_b), -np.inf, nat_b).argmax(axis=1) if n else np.zeros(0, np.int64)
    cols["top1_same"] = cols["top1_a"] == cols["top1_b"]
    safe = np.where(known, chosen, 0)[:, None]
    if full:
        lp = []
        for x in (nat_a, nat_b):
            block = max(1, _BLOCK_ELEMENTS // max(1, x.shape[1]))
            parts = [
                np.take_along_axis(log_softmax64(x[a : a + block]), safe[a : a + block], 1)[:, 0]
                for a in range(0, n, block)
            ]
            lp.append(np.concatenate([np.zeros(0)] + parts))
    else:  # the recorded statistics of the whole row (exact in every storage mode)
        lp = []
        for run, g, s in ((run_a, ga, sa), (run_b, gb, sb)):
            p = run.stats(sequence=s, generation=g, include_finished=finished)["p_chosen_natural"].to_numpy(np.float64)
            with np.errstate(divide="ignore"):
                lp.append(np.log(p[:n]))
        if not np.array_equal(chosen, sel_b.chosen[:n]):  # B's statistic is of B's own token
            lp[1] = np.where(cols["same"], lp[1], np.nan)
    cols["logprob_a"] = np.where(known, lp[0], np.nan)
    cols["logprob_b"] = np.where(known, lp[1], np.nan)
    cols["gap"] = cols["logprob_b"] - cols["logprob_a"]
    cols["p_a"], cols["p_b"] = np.exp(cols["logprob_a"]), np.exp(cols["logprob_b"])
    cols["dp"] = cols["p_b"] - cols["p_a"]
    return cols, exact


def _pairs(run_a: Any, run_b: Any) -> list[tuple[int, int, int, int]]:
    """``(generation_a, sequence_a, generation_b, sequence_b)``: sequences paired by position."""
    pairs = []
    for ga, gb in zip(run_a.generations(), run_b.generations()):
        pairs += [(ga, sa, gb, sb) for sa, sb in zip(run_a.sequences(ga), run_b.sequences(gb))]
    return pairs


def compare_runs(
    run_a: Any, run_b: Any, *, stages: Sequence[str] | None = None, include_finished: bool = False
) -> RunComparison:
    """Every sequence of ``run_a`` against ``run_b``'s (a run and its rescoring, two precisions, two engines).

    ``stages``: the stages compared, by name or alias (default: all both runs recorded; the natural stage
    must be among them). ValueError when the vocabularies differ or the runs share no sequence.
    """
    run_a, run_b = _as_run(run_a, "run_a"), _as_run(run_b, "run_b")
    va, vb = run_a.metadata.vocab_size, run_b.metadata.vocab_size
    if va != vb:
        raise ValueError(
            f"run_b has a vocabulary of {vb} tokens but run_a has {va}; only runs of one vocabulary compare"
        )
    picked = _pick_stages(run_a, run_b, stages)
    if not any(a == "natural" and b == "natural" for _, a, b in picked):
        raise ValueError(f"stages must include the natural stage (top-1 and perplexity are the model's); got {stages}")
    pairs = _pairs(run_a, run_b)
    if not pairs:
        raise ValueError("the runs share no sequence to compare (one of them recorded nothing)")
    parts, per_sequence, exact = [], [], True
    for pair in pairs:
        before = (set(run_a._cache()), set(run_b._cache()))
        cols, ok = _one_sequence(run_a, run_b, pair, picked, include_finished)
        _forget(run_a, before[0])
        _forget(run_b, before[1])
        exact &= ok
        frame = pd.DataFrame(cols)
        parts.append(frame)
        row: dict[str, Any] = {"generation": pair[0], "sequence": pair[1], "steps": len(frame)}
        for name, _, _ in picked:
            kl = frame[f"kl_{name}"].to_numpy()
            row[f"kl_mean_{name}"] = float(kl.mean()) if kl.size else math.nan
            row[f"kl_max_{name}"] = float(kl.max()) if kl.size else math.nan
        row.update(_token_stats(frame))
        per_sequence.append(row)
    steps = pd.concat(parts, ignore_index=True)
    names = [name for name, _, _ in picked]
    totals: dict[str, Any] = {"steps": len(steps), "sequences": len(pairs)}
    totals["kl"] = {name: _quantiles(steps[f"kl_{name}"].to_numpy(np.float64)) for name in names}
    totals.update(_token_stats(steps))
    known = steps["token_id"].to_numpy() >= 0
    totals["tokens_differ"] = int((known & ~steps["same"].to_numpy(bool)).sum())
    shared = steps[steps["same_context"].to_numpy(bool)]
    totals["same_context"] = {
        "steps": len(shared),
        "kl_mean": _quantiles(shared["kl_natural"].to_numpy(np.float64))["mean"],
    }
    note = (
        ""
        if exact
        else "top-k storage: KL values are lower bounds (from the tokens both runs stored; see tracker.compare); "
        "top-1 agreement and the chosen tokens' probabilities and perplexities are exact"
    )
    return RunComparison(
        steps, pd.DataFrame(per_sequence), totals, names, exact, note, labels=(_label(run_a), _label(run_b))
    )


def _token_stats(frame: pd.DataFrame) -> dict[str, float]:
    """Top-1 agreement, mean and RMS Δp, perplexities and their ratio over ``frame``'s steps."""
    dp = frame["dp"].to_numpy(np.float64)
    dp = dp[~np.isnan(dp)]
    ppl_a = _perplexity(frame["logprob_a"].to_numpy(np.float64))
    ppl_b = _perplexity(frame["logprob_b"].to_numpy(np.float64))
    same = frame["top1_same"].to_numpy(bool)
    return {
        "top1_agreement": float(same.mean()) if same.size else math.nan,
        "dp_mean": float(dp.mean()) if dp.size else math.nan,
        "dp_rms": float(np.sqrt((dp**2).mean())) if dp.size else math.nan,
        "perplexity_a": ppl_a,
        "perplexity_b": ppl_b,
        "perplexity_ratio": ppl_b / ppl_a if ppl_a else math.nan,
    }
