"""The sampling maths as plain functions over a batch of rows.

Each row has its own parameters (``RowParams``) and its own stream of uniform
numbers, derived by a counter-based hash from the row's seed and the step
(:func:`uniforms`), so a seeded request draws the same numbers whatever else
shares the batch, on any device. A token is drawn by inverting the CDF of the
row's final distribution at its uniform number: exact, and with no sampling
kernel that depends on batch layout.

Rows with ``top_k > 0`` use a partial selection (``torch.topk``) of the
largest ``max(top_k)`` logits; only rows without top-k sort the whole
vocabulary. Ties at the top-k boundary are broken by ``torch.topk``; ties
inside the sorted order by lower token id first is not guaranteed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sampling.params import SamplingParams

__all__ = ["RowParams", "SampleOutput", "DeadRowError", "row_keys", "uniforms", "sample"]

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


class DeadRowError(RuntimeError):
    """A row has no token left to sample (all -inf) or holds NaN."""


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _wrap64(value: int) -> int:
    """A Python int reduced to the signed int64 it would be after overflow."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """One int64 key per row from the request's seed and the sample's index."""
    return _splitmix64(_splitmix64(seeds.long()) ^ sample_index.long())


def uniforms(keys: torch.Tensor, step: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) as float64, one per row, for this step."""
    z = _splitmix64(keys + _wrap64((step + 1) * _GOLDEN))
    return _shr(z, 11).double() * (1.0 / (1 << 53))


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as tensors (built once per generation)."""

    greedy: torch.Tensor  # bool [B]
    temperature: torch.Tensor  # float32 [B]; 1.0 in greedy rows (never divided by zero)
    top_k: torch.Tensor  # int64 [B]; 0 = off
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str) -> "RowParams":
        eff = [p.effective for p in params]
        greedy = [p.is_greedy for p in params]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=torch.tensor(
                [1.0 if g else e[0] for g, e in zip(greedy, eff)], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor([e[1] for e in eff], dtype=torch.long, device=device),
            top_p=torch.tensor([e[2] for e in eff], dtype=torch.float32, device=device),
            min_p=torch.tensor([e[3] for e in eff], dtype=torch.float32, device=device),
        )

    def __len__(self) -> int:
        return int(self.greedy.shape[0])


@dataclass(frozen=True)
class SampleOutput:
    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # float32 [B]: log-probability in the distribution sampled from


def _check_rows(logits: torch.Tensor) -> None:
    bad_nan = torch.isnan(logits).any(dim=-1)
    dead = ~torch.isfinite(logits.max(dim=-1).values)
    if bool(bad_nan.any()) or bool(dead.any()):
        nan_rows = bad_nan.nonzero().flatten().tolist()
        dead_rows = (dead & ~bad_nan).nonzero().flatten().tolist()
        parts = []
        if nan_rows:
            parts.append(f"rows {nan_rows} hold NaN logits")
        if dead_rows:
            parts.append(f"rows {dead_rows} have no allowed token (every logit is -inf or +inf)")
        raise DeadRowError("cannot sample: " + "; ".join(parts))


def _sample_candidates(
    values: torch.Tensor,
    indices: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from rows of candidates sorted by descending (temperature-scaled) logit."""
    width = values.shape[-1]
    rank = torch.arange(width, device=values.device)
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    values = values.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)  # renormalised over the top-k survivors
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    cdf = torch.cumsum(probs.double(), dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=width - 1)
    # searchsorted never lands on a zero-probability slot except by rounding at the end
    pick = torch.where(probs.gather(1, pick) > 0, pick, torch.zeros_like(pick))
    tokens = indices.gather(1, pick).squeeze(1)
    logprobs = torch.log(probs.gather(1, pick).squeeze(1))
    return tokens, logprobs


def sample(logits: torch.Tensor, params: RowParams, u: torch.Tensor) -> SampleOutput:
    """Draw one token per row of ``logits [B, V]`` (float32) with the row's parameters.

    Greedy rows take the arg-max (lowest id among equals) and report the
    log-probability under the softmax of ``logits``. Sampling rows report the
    log-probability in the final (temperature, min-p, top-k, top-p)
    distribution. Raises :class:`DeadRowError` naming rows that are NaN or have
    nothing allowed.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"params has {len(params)} rows, logits has {logits.shape[0]}")
    _check_rows(logits)
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)
    logprobs = (logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)).float()
    sampling = (~params.greedy).nonzero().flatten()
    if sampling.numel() == 0:
        return SampleOutput(tokens, logprobs)

    rows = logits.index_select(0, sampling) / params.temperature.index_select(0, sampling)[:, None]
    top_k = params.top_k.index_select(0, sampling)
    has_k = top_k > 0
    groups = [(has_k, True), (~has_k, False)]
    for mask, partial in groups:
        sub = mask.nonzero().flatten()
        if sub.numel() == 0:
            continue
        x = rows.index_select(0, sub)
        if partial:
            width = int(top_k.index_select(0, sub).max())
            values, indices = torch.topk(x, min(width, x.shape[-1]), dim=-1)
        else:
            values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        target = sampling.index_select(0, sub)
        t, lp = _sample_candidates(
            values,
            indices,
            params.top_k.index_select(0, target),
            params.top_p.index_select(0, target),
            params.min_p.index_select(0, target),
            u.index_select(0, target),
        )
        tokens[target] = t
        logprobs[target] = lp.float()
    return SampleOutput(tokens, logprobs)
