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

from tracker.reading.rows import compact, logsumexp_rows, topk_rows

__all__ = [
    "STAGES",
    "CANDIDATES",
    "SAMPLING_EPS",
    "RowParams",
    "penalties",
    "temperature",
    "min_p",
    "top_k",
    "top_p",
    "sampled",
]

#: The stages, in vLLM's order (``sampled``: the distribution drawn from, as log-probabilities).
STAGES = ("penalties", "temperature", "min_p", "top_k", "top_p", "sampled")
#: Top-p sorts a row's this many largest logits when they hold all but ``1 - top_p`` of its mass (else all).
CANDIDATES = 1024
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
        scale = _F32(1) / terms.sum(axis=1)
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
    allowed = np.count_nonzero(rows[which] > _NEG_INF, axis=1)
    which = which[allowed > k[which]]  # a row allowing at most k tokens keeps them all
    for size in np.unique(k[which]):  # one search per distinct k (requests rarely differ)
        part = which[k[which] == size]
        floor = topk_rows(rows[part], int(size))[0][:, -1]  # the k-th largest logit
        out[part] = np.where(rows[part] < floor[:, None], _NEG_INF, rows[part])
    return out


def top_p(rows: np.ndarray, params: RowParams) -> np.ndarray:
    """Top-p over each row (after top-k), with vLLM's sorted running sum (see the module docstring).

    A row whose :data:`CANDIDATES` largest logits hold all but at most ``1 - top_p`` of its mass (and no
    token outside them ties with the smallest) has every other token cut, since their running sums are
    at most that rest: only the candidates are sorted, their running sums the rest plus theirs (in
    float64, as vLLM's). Other rows are sorted whole."""
    out = rows.copy()
    which = np.nonzero((params.top_p < 1) & ~params.greedy)[0]
    if not which.size:
        return out
    block = rows[which]
    limit = (_F32(1) - params.top_p[which].astype(_F32))[:, None]
    probs = _softmax32(block)
    vocab = block.shape[1]
    fast = np.zeros(which.size, dtype=bool)
    if vocab > CANDIDATES:
        allowed = np.count_nonzero(block > _NEG_INF, axis=1)
        if int(allowed.max()) <= CANDIDATES:  # after top-k or min-p: the allowed tokens are the candidates
            owner, cols = np.nonzero(block > _NEG_INF)
            values, ids, _ = compact(owner, cols, block[owner, cols], which.size, np.float32(_NEG_INF))
            closed = np.ones(which.size, dtype=bool)
        else:
            ids = np.sort(topk_rows(block, CANDIDATES)[1], axis=1)
            values = np.take_along_axis(block, ids, axis=1)
            floor = values.min(axis=1, keepdims=True)  # no other token may tie with it (unless masked: all cut)
            closed = (floor[:, 0] == _NEG_INF) | ((block >= floor).sum(axis=1) == CANDIDATES)
        mass = np.where(values > _NEG_INF, np.take_along_axis(probs, ids, axis=1), 0).astype(np.float64)
        rest = probs.sum(axis=1, dtype=np.float64) - mass.sum(axis=1)
        fast = closed & (rest.astype(_F32) <= limit[:, 0])
        if fast.any():
            order = np.argsort(values[fast], axis=1, kind="stable")  # ascending; equal logits by id (ids sorted)
            running = rest[fast, None] + np.cumsum(np.take_along_axis(mass[fast], order, axis=1), axis=1)
            drop = running.astype(_F32) <= limit[fast]
            drop[:, -1] = False
            ordered = np.take_along_axis(values[fast], order, axis=1)
            keep = ~drop & (ordered > _NEG_INF)  # padding (compacted rows) and masked tokens stay cut
            at = np.take_along_axis(ids[fast], order, axis=1)
            kept = np.full((int(fast.sum()), vocab), _NEG_INF, dtype=_F32)
            r, c = np.nonzero(keep)
            kept[r, at[r, c]] = ordered[r, c]
            block[fast] = kept
    slow = ~fast
    if slow.any():
        rest_rows = block[slow]
        order = np.argsort(rest_rows, axis=1, kind="stable")
        ordered = np.take_along_axis(rest_rows, order, axis=1)
        running = np.cumsum(np.take_along_axis(probs[slow], order, axis=1), axis=1, dtype=np.float64).astype(_F32)
        drop = running <= limit[slow]
        drop[:, -1] = False
        np.put_along_axis(rest_rows, order, np.where(drop, _NEG_INF, ordered), axis=1)
        block[slow] = rest_rows
    out[which] = block
    return out


def sampled(rows: np.ndarray, penalised: np.ndarray, params: RowParams) -> np.ndarray:
    """The distribution drawn from, as log-probabilities: ``log_softmax(rows)`` (float32, as torch's); for
    greedy rows a one-hot on the argmax of ``penalised`` (0 there, ``-inf`` elsewhere)."""
    lse = logsumexp_rows(rows)
    with np.errstate(invalid="ignore"):  # a row with nothing allowed: -inf - -inf
        out = rows - np.where(np.isfinite(lse), lse, _F32(0))[:, None]
    greedy = np.nonzero(params.greedy)[0]
    if greedy.size:
        one_hot = np.full((greedy.size, rows.shape[1]), _NEG_INF, dtype=_F32)
        one_hot[np.arange(greedy.size), penalised[greedy].argmax(axis=1)] = 0
        out[greedy] = one_hot
    return out
