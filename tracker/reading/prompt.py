"""Prompt log-probabilities and perplexity.

The prefill pass already computes the model's logits at every prompt
position; the log-probability of prompt token ``t`` is the log-softmax of
position ``t - 1`` at that token (the first token has none). With
``LogitTrackingProcessor(..., prompt_logprobs=True)`` logitscope's
``Generator`` hands the tracker those logits once per generation
(:meth:`~processors.LogitsProcessor.on_prefill`), and the values are kept in
the generation's metadata as ``"prompt_logprobs"`` (one list per row, ``None``
for the first token). Other hosts (``model.generate``) can score the prompt
with :meth:`~tracker.LogitTrackingProcessor.score_prompt`, one extra forward
pass.

Perplexity is ``exp`` of the mean negative log-probability; a token's
surprisal is its negative log-probability (nats).

Scoring takes a model's logits, so it needs torch; the module imports it when
it scores, so that :func:`perplexity` serves a reader of runs without torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["prompt_logprobs", "prompt_rows", "score_prompt", "perplexity", "leading_pad_mask"]

_CHUNK_ELEMENTS = 1 << 24  # positions scored at a time: about 64 MiB of float32 logits


def prompt_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> list[list[float | None]]:
    """Per row, the log-probability of each real prompt token given the ones before it.

    ``logits [B, L, V]`` at every position, ``input_ids [B, L]`` (left
    padding allowed, with ``attention_mask``). Returns one list per row, as
    long as the row's real tokens, ``None`` first. The maths run on the
    logits' device in chunks of positions; the result is read to the host
    once (one synchronisation, at prefill only).
    """
    if logits.ndim != 3 or input_ids.ndim != 2 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"logits must be [batch, length, vocab] and input_ids [batch, length] with the same batch and length, "
            f"got {tuple(logits.shape)} and {tuple(input_ids.shape)}"
        )
    import torch

    batch, length, vocab = logits.shape
    ids = input_ids.to(logits.device)
    scores = torch.empty(batch, max(length - 1, 0), dtype=torch.float64, device=logits.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * vocab))
    for a in range(0, length - 1, step):
        b = min(length - 1, a + step)
        block = logits[:, a:b].float()
        picked = block.gather(2, ids[:, a + 1 : b + 1, None])[..., 0]
        scores[:, a:b] = (picked - torch.logsumexp(block, dim=2)).double()
    values = scores.cpu().numpy()
    real = np.ones((batch, length), dtype=bool) if attention_mask is None else attention_mask.bool().cpu().numpy()
    out: list[list[float | None]] = []
    for row in range(batch):
        keep = np.nonzero(real[row])[0]
        row_values: list[float | None] = [None] if keep.size else []
        row_values += values[row, keep[1:] - 1].tolist()
        out.append(row_values)
    return out


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """Each row's real prompt ids (the columns ``attention_mask`` marks 1; every column without one).

    Reads the ids to the host (once per generation)."""
    ids = input_ids.cpu()
    if attention_mask is None:
        return ids.tolist()
    return [row[mask].tolist() for row, mask in zip(ids, attention_mask.bool().cpu())]


def leading_pad_mask(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor | None:
    """An attention mask marking 0 each row's leading run of ``pad_token_id`` (None without a pad id):
    the left padding of a batch a host gives without its mask."""
    if pad_token_id is None:
        return None
    import torch

    return (torch.cumprod((input_ids == pad_token_id).to(torch.int64), dim=1) == 0).to(torch.int64)


def score_prompt(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> list[list[float | None]]:
    """:func:`prompt_logprobs` from one forward pass of ``model`` over the prompts (for hosts without ``on_prefill``)."""
    import torch

    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError(f"input_ids must be a [batch, length] tensor, got {type(input_ids).__name__}")
    kwargs: dict[str, Any] = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=input_ids, **kwargs).logits
        return prompt_logprobs(logits, input_ids, attention_mask)


def perplexity(logprobs: Sequence[float | None] | np.ndarray) -> float:
    """``exp`` of the mean negative log-probability over the known values (NaN when there are none)."""
    values = np.array([math.nan if v is None else float(v) for v in logprobs], dtype=np.float64)
    values = values[~np.isnan(values)]
    return float(np.exp(-values.mean())) if values.size else math.nan
