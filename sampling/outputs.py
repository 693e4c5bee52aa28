"""What the Generator returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sampling.params import SamplingParams

__all__ = ["Completion", "RequestOutput", "FinishReason"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Completion:
    """One sample of one request.

    Attributes:
        index: the sample's index within its request (0 .. n-1).
        token_ids: the generated tokens, the end-of-sequence token included
            when it was generated.
        text: the decoded text, without special tokens and cut before a stop
            string.
        finish_reason: ``"stop"`` (end-of-sequence token or a stop string) or
            ``"length"`` (``max_new_tokens`` reached).
        stop_reason: the stop string that ended it, or ``None``.
        logprobs: per token, the log-probability in the distribution it was
            sampled from (after the processors, temperature, min-p, top-k and
            top-p; for greedy rows, the softmax of the processed logits).
        raw_logprobs: per token, the log-probability under the model's own
            distribution (softmax of the logits before any processor).
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RequestOutput:
    """A prompt and its ``n`` completions."""

    request_index: int
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: list[Completion]

    @property
    def text(self) -> str:
        """The first completion's text."""
        return self.outputs[0].text
