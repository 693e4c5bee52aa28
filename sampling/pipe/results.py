"""What a sampling pipe returns, with each log-probability named for the distribution it is taken in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sampling.pipe.types import TaggedTensor, TensorType

__all__ = ["SampleResult", "RawLogprobs", "raw_logprobs"]


@dataclass(frozen=True, slots=True)
class RawLogprobs:
    """Log-probabilities under the **raw** distribution: the pipe's input, before any of its stages.

    Attributes:
        logprobs: ``float32 [B]``, the chosen token's raw log-probability.
        ranks: ``int64 [B]``, the chosen token's rank in the raw distribution,
            1-based: 1 + the number of tokens with a strictly larger value.
        top_ids: ``int64 [B, n]``, the ``n`` most likely raw tokens (most likely first).
        top_logprobs: ``float32 [B, n]``, their raw log-probabilities.
    """

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One sampled token per row.

    Attributes:
        tokens: ``int64 [B]``; -1 in a dead row (only with ``on_dead="flag"``).
        logprobs: ``float32 [B]``, the **processed** log-probability: of the
            chosen token in the distribution it was sampled from (after every
            stage of the pipe; for :class:`~sampling.pipe.stages.Greedy`, under
            the greedy stage's input). NaN in a dead row.
        valid: ``bool [B]``; False where the row had nothing to sample.
        raw: log-probabilities before the pipe's stages, when asked for.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    valid: torch.Tensor
    raw: RawLogprobs | None = None


def raw_logprobs(x: TaggedTensor, tokens: torch.Tensor, top: int) -> RawLogprobs:
    """The raw log-probabilities of ``tokens`` (and the ``top`` best) under ``x`` (LOGITS or PROBS)."""
    data = x.data.float()
    if x.type is TensorType.PROBS:
        data = torch.log(data / data.sum(-1, keepdim=True))
    else:
        data = data - torch.logsumexp(data, dim=-1, keepdim=True)
    dead = tokens < 0
    chosen = data.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    ranks = (data > chosen[:, None]).sum(-1) + 1
    top_logprobs, top_ids = torch.topk(data, min(top, data.shape[-1]), dim=-1)
    return RawLogprobs(
        chosen.masked_fill(dead, float("nan")), ranks.masked_fill(dead, 0), top_ids, top_logprobs
    )
