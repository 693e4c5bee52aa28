"""Forced text: make every row generate a given text, token by token, then end.

This is the check Dynamo's documentation uses for its processor hook (force
"Hello world!" and see it come back exactly), and a handy way to see how
unlikely a text was under the model: a tracker records the natural logits of
every forced step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from processors.checks import check_width
from processors.protocol import BatchContext, LogitsProcessor
from processors.vocab import eos_token_ids, vocab_for

__all__ = ["ForcedTextLogitsProcessor"]


class ForcedTextLogitsProcessor(LogitsProcessor):
    """Allow only the next token of ``text``, then only the end-of-sequence token.

    ``text`` is tokenised once, as it is tokenised in the middle of a text
    (it continues the prompt): no special tokens and no normaliser prefix, so
    ``" Hello world"`` is forced as ``"▁Hello" + "▁world"`` with a
    SentencePiece tokenizer, not ``"▁" + "▁Hello" + ...`` (see
    :meth:`processors.vocab.Vocabulary.encode_fragment`). At generated position ``k`` every row may take only token ``k``
    of the text; from position ``len(tokens)`` on, only EOS. The allowed
    token keeps its own logit (0 if an earlier processor had set it to -inf),
    so the step's natural score stays visible. The position is read from the
    context (``ctx.num_generated``), so the processor keeps no state and needs
    no reset. A text the tokenizer can only write with its unknown token (an
    emoji under WordPiece) is refused: forcing ``[UNK]`` would not write it.

    Args:
        text: the text to force.
        tokenizer: the model's tokenizer.
        eos_token_id: the id(s) that end generation; the first one is forced.
            Default: the tokenizer's.

    Works in place.
    """

    inplace = True

    def __init__(self, text: str, tokenizer: Any, *, eos_token_id: int | Sequence[int] | None = None) -> None:
        if not isinstance(text, str) or not text:
            raise ValueError(f"text must be a non-empty string, got {text!r}")
        vocab = vocab_for(tokenizer)  # the text is encoded with it: refused first when it is not a tokenizer
        eos = eos_token_ids(tokenizer, eos_token_id)
        if not eos:
            raise ValueError("eos_token_id: the tokenizer has no end-of-sequence token; pass eos_token_id=")
        self.eos_token_id = eos[0]
        self.text = text
        self.token_ids = [int(t) for t in vocab.spelled(vocab.encode_fragment(text), "text").ids]
        if not self.token_ids:
            raise ValueError(f"text {text!r} tokenises to no tokens")
        self._largest = max(max(self.token_ids), self.eos_token_id)

    def next_token(self, position: int) -> int:
        """The token forced at generated position ``position``."""
        return self.token_ids[position] if position < len(self.token_ids) else self.eos_token_id

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Set every logit but the forced token's to -inf, in place.

        No synchronisation: the forced token follows from the context's shape.
        """
        check_width(self.name, self._largest, logits.shape[1])
        token = self.next_token(ctx.num_generated)
        kept = logits[:, token].clone()
        kept = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))
        logits.fill_(float("-inf"))
        logits[:, token] = kept
        return logits

    def __repr__(self) -> str:
        return f"ForcedTextLogitsProcessor(text={self.text!r})"
