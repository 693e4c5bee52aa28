"""Small stateless processors: temperature, minimum new tokens, allowed token ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from processors.checks import check_number, check_token_ids, check_width
from processors.device import tensor_on, to_device
from processors.protocol import BatchContext, LogitsProcessor
from processors.vocab import eos_token_ids

__all__ = ["TemperatureLogitsProcessor", "MinNewTokensLogitsProcessor", "AllowedTokenIdsLogitsProcessor"]


class TemperatureLogitsProcessor(LogitsProcessor):
    """Divide the logits by ``temperature`` (> 0): below 1 sharpens, above 1 flattens.

    Greedy decoding (temperature 0) is a sampling choice, not a processor:
    use ``SamplingParams(temperature=0)``. A temperature so small that the
    divided logits overflow their dtype (float16 past 65504: a logit of 3 at
    temperature 1e-5) gives infinite logits and NaN probabilities, as in
    transformers; use greedy decoding instead. Works in place.
    """

    inplace = True

    def __init__(self, temperature: float) -> None:
        self.temperature = check_number("temperature", temperature, low=0.0, low_open=True)

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Divide ``logits`` by the temperature, in place. No synchronisation."""
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits

    def __repr__(self) -> str:
        return f"TemperatureLogitsProcessor(temperature={self.temperature})"


class MinNewTokensLogitsProcessor(LogitsProcessor):
    """Ban the end-of-sequence token(s) until ``min_new_tokens`` tokens were generated.

    Counts generated tokens only (``ctx.num_generated``), not the prompt.
    Works in place.
    """

    inplace = True

    def __init__(self, min_new_tokens: int, eos_token_id: int | Sequence[int]) -> None:
        if not isinstance(min_new_tokens, int) or isinstance(min_new_tokens, bool) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
        self.min_new_tokens = min_new_tokens
        if eos_token_id is None:
            raise ValueError("eos_token_id must be a token id or a list of them, got None (the tokenizer has no EOS?)")
        self.eos_token_ids = list(eos_token_ids(eos_token_id=eos_token_id))
        self._eos: dict[torch.device, torch.Tensor] = {}

    def _eos_on(self, device: torch.device) -> torch.Tensor:
        eos = self._eos.get(device)
        if eos is None:
            with torch.inference_mode(False):  # kept across calls: never an inference tensor
                eos = self._eos[device] = tensor_on(self.eos_token_ids, torch.long, device)
        return eos

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Set the EOS logits to -inf (in place) while fewer than ``min_new_tokens`` were generated.

        No synchronisation: the count comes from the context's shape.
        """
        if ctx.num_generated < self.min_new_tokens:
            check_width(self.name, max(self.eos_token_ids), logits.shape[1])
            logits.index_fill_(1, self._eos_on(logits.device), float("-inf"))
        return logits

    def __repr__(self) -> str:
        return f"MinNewTokensLogitsProcessor(min_new_tokens={self.min_new_tokens}, eos_token_id={self.eos_token_ids})"


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """Allow only ``token_ids``: every other token's logit becomes -inf.

    ``vocab_size`` (or a tokenizer's ``len``), when given, checks the ids at
    construction; otherwise they are checked against the logits' width at
    the first call. Works in place.
    """

    inplace = True

    def __init__(self, token_ids: Sequence[int], *, vocab_size: int | None = None) -> None:
        if vocab_size is not None and (
            not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1
        ):
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.token_ids = sorted(set(check_token_ids("token_ids", token_ids, vocab_size)))
        self._banned: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _banned_mask(self, width: int, device: torch.device) -> torch.Tensor:
        mask = self._banned.get((width, device))
        if mask is None:
            check_width(self.name, self.token_ids[-1], width)
            with torch.inference_mode(False):  # kept across calls: never an inference tensor
                mask = torch.ones(width, dtype=torch.bool)
                mask[torch.tensor(self.token_ids)] = False
                mask = self._banned[(width, device)] = to_device(mask, device)
        return mask

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Set every logit outside ``token_ids`` to -inf, in place. No synchronisation."""
        return logits.masked_fill_(self._banned_mask(logits.shape[1], logits.device), float("-inf"))

    def __repr__(self) -> str:
        shown = self.token_ids[:8]
        more = f", ... ({len(self.token_ids)} ids)" if len(self.token_ids) > 8 else ""
        return f"AllowedTokenIdsLogitsProcessor(token_ids={shown}{more})"
