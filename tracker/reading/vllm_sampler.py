"""vLLM V1's sampler, stage by stage, in numpy: what it does to a row after its logits processors.

vLLM (``vllm/v1/sample/sampler.py``) applies, in this order, to the float32
row its non-argmax-invariant logits processors left (allowed tokens, bad
words, min-tokens, logit bias, then logitscope's, which records the row as
``natural``):

1. **penalties** (``ops/penalties.py``): the repetition penalty on every token
   of the prompt or the output so far (a positive logit times ``1 / r``, any
   other times ``r``; ``1 / r`` rounded to float32 first), then the frequency
   penalty times each token's count in the output, then the presence penalty
   on each token the output holds;
2. **temperature**: the row divided by it (float32). A greedy request
   (temperature below 1e-5) takes the argmax of the penalised row and skips
   every later stage;
3. **min-p** (``logits_processor/builtin.py``): tokens whose float32
   probability is below ``min_p`` times the largest one's are masked;
4. **top-k** (``ops/topk_topp_sampler.py``): tokens below the k-th largest
   logit are masked (ties with it are kept, so more than ``k`` may stay);
   ``top_k`` of 0, -1 or at least the vocabulary means none;
5. **top-p**: over the top-k survivors sorted ascending (equal logits by
   ascending token id, as torch's CPU sort leaves them), their float32
   probabilities summed from the smallest (accumulated in float64, as torch
   does); tokens whose running sum is at most ``1 - top_p`` are masked, the
   largest always kept. ``top_p`` of 1 means none.
6. **sampled**: the distribution drawn from, as log-probabilities: the top-p
   row's log-softmax for a random request, a one-hot on the argmax for a
   greedy one (the first of equal maxima).

Each function takes float32 rows ``[R, V]`` and per-row parameters ``[R]``
and returns new rows (its input untouched). Where vLLM compares a float32
probability with a threshold (min-p, top-p), a token within a float32
rounding of it may be decided the other way: numpy's ``exp`` and sum are not
torch's to the last bit. Everything else is vLLM's float32 arithmetic, so
the rows are vLLM's to the bit.

What these rows cannot show, because vLLM decides it per batch and not per
request: a batch where some request asks for top-p also masks, in every other
request's row, the tokens whose float32 probability is exactly 0 (their
running sum is at most ``1 - 1``). That changes no probability, only the
count of tokens above ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["STAGES", "SAMPLING_EPS", "RowParams", "penalties", "temperature", "min_p", "top_k", "top_p", "sampled"]

#: The stages, in vLLM's order (``sampled``: the distribution drawn from, as log-probabilities).
STAGES = ("penalties", "temperature", "min_p", "top_k", "top_p", "sampled")
#: vLLM's ``_SAMPLING_EPS``: a temperature below it means greedy sampling.
SAMPLING_EPS = 1e-5

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as vLLM's input batch holds them (float32 where vLLM keeps float32).

    ``top_k`` is the vocabulary size where a request asked for none;
    ``greedy`` rows take the argmax and skip temperature, min-p, top-k and top-p.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    greedy: np.ndarray

    def take(self, rows: np.ndarray) -> RowParams:
        """These parameters at ``rows`` (an index or a boolean mask)."""
        return RowParams(**{name: getattr(self, name)[rows] for name in self.__dataclass_fields__})


def penalties(rows: np.ndarray, prompt: np.ndarray | None, counts: np.ndarray | None, params: RowParams) -> np.ndarray:
    """Repetition, frequency and presence penalties, as ``apply_penalties``.

    ``prompt``: ``[R, V]`` bool, the token is in the request's prompt;
    ``counts``: ``[R, V]`` int, how often the token is in the output so far.
    Either may be None where no row needs it (no repetition penalty; no
    penalty at all).
    """
    out = rows.copy()
    rep = params.repetition.astype(_F32)
    if counts is None:
        return out
    seen = counts > 0
    if np.any(rep != 1):
        hit = seen if prompt is None else seen | prompt
        factor = np.where(hit, rep[:, None], _F32(1))
        out *= np.where(out > 0, _F32(1) / factor, factor)
    out -= params.frequency.astype(_F32)[:, None] * counts.astype(_F32)
    out -= params.presence.astype(_F32)[:, None] * seen.astype(_F32)
    return out


def temperature(rows: np.ndarray, params: RowParams) -> np.ndarray:
    """Rows divided by their temperature (greedy rows unchanged: vLLM never scales them for their token)."""
    divisor = np.where(params.greedy, _F32(1), params.temperature.astype(_F32))
    return rows / divisor[:, None]


def _softmax32(rows: np.ndarray) -> np.ndarray:
    """Float32 probabilities as torch's CPU softmax forms them: ``exp(x - max) * (1 / sum)``."""
    top = rows.max(axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, _F32(0))
    with np.errstate(invalid="ignore", over="ignore"):
        terms = np.exp(rows - top)
        scale = _F32(1) / terms.sum(axis=1, dtype=np.float64).astype(_F32)
    return terms * scale[:, None]


def min_p(rows: np.ndarray, params: RowParams) -> np.ndarray:
    """Tokens whose probability is below ``min_p`` times the row's largest masked (rows with ``min_p`` 0 as
    they are)."""
    out = rows.copy()
    which = np.nonzero((params.min_p > 0) & ~params.greedy)[0]
    if which.size:
        probs = _softmax32(rows[which])
        floor = probs.max(axis=1) * params.min_p[which].astype(_F32)
        with np.errstate(invalid="ignore"):
            out[which] = np.where(probs < floor[:, None], _NEG_INF, rows[which])
    return out


def top_k(rows: np.ndarray, params: RowParams) -> np.ndarray:
    """Tokens below each row's k-th largest logit masked (ties with it kept)."""
    out = rows.copy()
    vocab = rows.shape[1]
    k = params.top_k.astype(np.int64)
    which = np.nonzero((k > 0) & (k < vocab) & ~params.greedy)[0]
    for size in np.unique(k[which]):  # one partition per distinct k (requests rarely differ)
        part = which[k[which] == size]
        floor = np.partition(rows[part], vocab - size, axis=1)[:, vocab - size]
        out[part] = np.where(rows[part] < floor[:, None], _NEG_INF, rows[part])
    return out


def top_p(rows: np.ndarray, params: RowParams) -> np.ndarray:
    """Top-p over each row (after top-k), with vLLM's sorted running sum (see the module docstring)."""
    out = rows.copy()
    which = np.nonzero((params.top_p < 1) & ~params.greedy)[0]
    if not which.size:
        return out
    block = rows[which]
    order = np.argsort(block, axis=1, kind="stable")
    ordered = np.take_along_axis(block, order, axis=1)
    running = np.cumsum(_softmax32(ordered), axis=1, dtype=np.float64).astype(_F32)
    drop = running <= (_F32(1) - params.top_p[which].astype(_F32))[:, None]
    drop[:, -1] = False
    np.put_along_axis(block, order, np.where(drop, _NEG_INF, ordered), axis=1)
    out[which] = block
    return out


def sampled(rows: np.ndarray, penalised: np.ndarray, params: RowParams) -> np.ndarray:
    """The distribution drawn from, as log-probabilities: ``log_softmax(rows)`` (float32, computed in
    float64); for greedy rows a one-hot on the argmax of ``penalised`` (0 there, ``-inf`` elsewhere)."""
    wide = rows.astype(np.float64)
    top = wide.max(axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(np.exp(wide - top).sum(axis=1, keepdims=True)) + top
        out = (wide - lse).astype(_F32)
    greedy = np.nonzero(params.greedy)[0]
    if greedy.size:
        one_hot = np.full((greedy.size, rows.shape[1]), _NEG_INF, dtype=_F32)
        one_hot[np.arange(greedy.size), penalised[greedy].argmax(axis=1)] = 0
        out[greedy] = one_hot
    return out
