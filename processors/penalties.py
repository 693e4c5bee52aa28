"""Repetition, presence and frequency penalties, with vLLM's semantics.

- ``repetition_penalty`` (transformers' and vLLM's, from the CTRL paper):
  every token that occurs in the prompt or the generated text has a positive
  logit divided by the penalty and a negative one multiplied by it; 1 is off,
  above 1 discourages repeats.
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI's and vLLM's):
  computed over the generated tokens only, ``logit -= frequency_penalty *
  count + presence_penalty * (count > 0)``; 0 is off, positive discourages
  repeats, negative encourages them.

Order as in vLLM: the repetition penalty first, then frequency and presence.
Left padding is not counted when the context carries an attention mask
(logitscope's ``Generator``). Passed to ``model.generate`` as a processor it
sees only ``input_ids``, so in a left-padded batch the padding counts as prompt
tokens (as transformers' ``RepetitionPenaltyLogitsProcessor`` does when passed
the same way; ``generate(repetition_penalty=...)`` itself is told the padding
and skips it): decode padded batches with the ``Generator`` to leave it out.
"""

from __future__ import annotations

import torch

from processors.checks import check_number, check_width
from processors.protocol import BatchContext, LogitsProcessor

__all__ = ["PenaltiesLogitsProcessor"]


class PenaltiesLogitsProcessor(LogitsProcessor):
    """Penalise tokens already seen (see the module docstring for the exact rules).

    Args:
        repetition_penalty: > 0; 1 leaves the logits alone.
        presence_penalty: in [-2, 2] (vLLM's range); 0 leaves them alone.
        frequency_penalty: in [-2, 2]; 0 leaves them alone.

    Works in place.
    """

    inplace = True

    def __init__(
        self,
        *,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
    ) -> None:
        self.repetition_penalty = check_number("repetition_penalty", repetition_penalty, low=0.0, low_open=True)
        self.presence_penalty = check_number("presence_penalty", presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = check_number("frequency_penalty", frequency_penalty, low=-2.0, high=2.0)

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Apply the penalties to ``logits`` in place.

        Does not synchronise when the host passes its token lists
        (``ctx.generated``, logitscope's ``Generator``, whose ids are checked
        when the prompts are encoded); other hosts' ids are checked against
        the logits' width, which reads them once per step.
        """
        ids = ctx.input_ids.to(logits.device)
        if ctx.generated is None and ids.numel():
            low, high = torch.stack(ids.aminmax()).tolist()  # one read
            if low < 0:
                raise ValueError(f"{self.name}: input_ids holds token id {low}; token ids must be >= 0")
            check_width(self.name, high, logits.shape[1])
        if self.repetition_penalty != 1.0 and ids.shape[1]:
            self._repetition(logits, ids, ctx.attention_mask)
        if (self.presence_penalty or self.frequency_penalty) and ctx.num_generated:
            generated = ids[:, ctx.prompt_length :]
            if self.frequency_penalty:
                step = torch.full(generated.shape, -self.frequency_penalty, dtype=logits.dtype, device=logits.device)
                logits.scatter_add_(1, generated, step)
            if self.presence_penalty:
                # Every occurrence of a token writes the same value, so repeats subtract once.
                logits.scatter_(1, generated, logits.gather(1, generated) - self.presence_penalty)
        return logits

    def _repetition(self, logits: torch.Tensor, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        real = None
        if attention_mask is not None:
            # Padding positions point at the row's last token instead: repeats change nothing.
            real = attention_mask.to(ids.device).bool()
            ids = torch.where(real, ids, ids[:, -1:])
        seen = logits.gather(1, ids)
        penalty = self.repetition_penalty
        new = torch.where(seen > 0, seen / penalty, seen * penalty)
        if real is not None:  # a row of padding only has no token to penalise (its last one is padding too)
            new = torch.where(real.any(1, keepdim=True), new, seen)
        logits.scatter_(1, ids, new)

    def __repr__(self) -> str:
        return (
            f"PenaltiesLogitsProcessor(repetition_penalty={self.repetition_penalty}, "
            f"presence_penalty={self.presence_penalty}, frequency_penalty={self.frequency_penalty})"
        )
