"""Logit bias: add a fixed number to the logits of chosen tokens (OpenAI's and vLLM's ``logit_bias``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from processors.checks import check_number, check_token_id, check_width, vocab_size_of
from processors.protocol import BatchContext, LogitsProcessor
from processors.vocab import vocab_for

__all__ = ["LogitBiasLogitsProcessor"]


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Add ``bias[token]`` to each listed token's logit at every step.

    Args:
        bias: token id or string -> bias (a finite number, or -inf to ban the
            token). A string key means **the one token that spells exactly
            that text in the middle of a text**, the way the tokenizer would
            split it after other words: ``" Paris"`` is the token shown as
            `` Paris`` (``"▁Paris"`` in SentencePiece, ``"ĠParis"`` in
            byte-level BPE), ``"Paris"`` the token glued to the word before.
            No space is added and no normaliser prefix counts. A string with
            no single such token (``" Moreau"`` -> ``" Mor" + "eau"``) is an
            error naming its tokens: pass the id you mean instead (biasing
            a word's first piece touches every word sharing that piece), and
            so is one the tokenizer can only write as its unknown token.
            A string needs ``tokenizer``. Entries on the same token add up.
        tokenizer: the tokenizer, to tokenise string keys and check ids
            against its vocabulary (without it, ids are checked against the
            logits' width at the first call).

    Works in place.
    """

    inplace = True

    def __init__(self, bias: Mapping[int | str, float], tokenizer: Any = None) -> None:
        if not isinstance(bias, Mapping):
            raise TypeError(f"bias must be a mapping of token id or string to a number, got {type(bias).__name__}")
        if not bias:
            raise ValueError("bias must hold at least one entry, got an empty mapping")
        vocab_size = vocab_size_of(tokenizer)
        totals: dict[int, float] = {}
        #: string key -> the token it stands for
        self.key_tokens: dict[str, int] = {}
        for key, value in bias.items():
            amount = check_number(f"bias[{key!r}]", value, allow_neg_inf=True)
            if isinstance(key, str):
                token = self._key_token(key, tokenizer)
                self.key_tokens[key] = token
            else:
                token = check_token_id(f"bias key {key!r}", key, vocab_size)
            totals[token] = totals.get(token, 0.0) + amount
        self.bias = dict(sorted(totals.items()))
        self._ids = torch.tensor(list(self.bias), dtype=torch.long)
        self._values = torch.tensor(list(self.bias.values()), dtype=torch.float32)
        self._on_device: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _key_token(text: str, tokenizer: Any) -> int:
        if tokenizer is None:
            raise ValueError(f"bias key {text!r} is a string; pass tokenizer= to tokenise it, or give token ids")
        if not text:
            raise ValueError("bias keys must be token ids or non-empty strings, got ''")
        vocab = vocab_for(tokenizer)
        fragment = vocab.encode_fragment(text)
        if len(fragment.ids) != 1:
            shown = [vocab.display[i] if i < vocab.size else f"<{i}>" for i in fragment.ids]
            raise ValueError(
                f"bias key {text!r} is no single token in context: the tokenizer splits it into "
                f"{len(fragment.ids)} tokens {shown} (ids {list(fragment.ids)}); give the token id(s) you mean instead"
            )
        return int(vocab.spelled(fragment, "bias key").ids[0])

    def _tensors(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (logits.device, logits.dtype, logits.shape[1])
        pair = self._on_device.get(key)
        if pair is None:
            check_width(self.name, int(self._ids[-1]), logits.shape[1])
            pair = self._on_device[key] = (self._ids.to(logits.device), self._values.to(logits.device, logits.dtype))
        return pair

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Add the biases to the listed tokens' logits, in place. No synchronisation."""
        ids, values = self._tensors(logits)
        logits.index_add_(1, ids, values.expand(logits.shape[0], -1))
        return logits

    def __repr__(self) -> str:
        return f"LogitBiasLogitsProcessor(bias={self.bias})"
