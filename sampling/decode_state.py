"""What the Generator's decode loop carries from step to step.

:class:`Row` is one sequence's book-keeping on the host; :class:`DeviceBatch`
the left-padded batch on the device and the next forward pass's input;
:class:`RowDraws` each row's sampling parameters and random stream;
:class:`Stopping` the rules that end a row (EOS, stop strings, length),
decided from the host's copy of each step. Nothing here reads the device:
the loop's one read per step is :class:`~sampling.step_copy.StepCopy`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from processors.protocol import BatchContext
from processors.vocab import vocab_for
from sampling.functional import RowParams, row_keys, uniforms
from sampling.params import SamplingParams
from sampling.step_copy import StepValues

__all__ = ["DeviceBatch", "Prompt", "Row", "RowDraws", "Stopping", "prompt_list"]

Prompt = str | Sequence[int]


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """``prompts`` as a non-empty list (one string or one list of ids is one prompt)."""
    if isinstance(prompts, (bytes, bytearray, Mapping)) or not isinstance(prompts, Iterable):
        raise TypeError(
            "prompts must be a string, a list of token ids, or a list of those, "
            f"got {type(prompts).__name__} {prompts!r}"
        )
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        prompts = [prompts]  # type: ignore[list-item]
    prompts = list(prompts)  # type: ignore[arg-type]
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    return prompts


@dataclass
class Row:
    """Book-keeping for one sequence of the batch: sample ``sample`` of request ``request``."""

    request: int
    sample: int
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class DeviceBatch:
    """The batch on the device: the ids and mask so far, and the next forward pass's input.

    ``keep`` is the mask the model gets (``None``: it gets none);
    ``attention_mask`` is what processors see.
    """

    input_ids: torch.Tensor  # [B, L] int64: the left-padded prompts, then the tokens fed back
    attention_mask: torch.Tensor  # [B, L] int64, 0 on left padding
    width: int  # the padded prompts' length
    padded: bool  # some prompt is shorter than the longest
    keep: torch.Tensor | None  # [B, L] bool
    step_input: torch.Tensor  # the ids of the next forward pass: the prompts, then one column
    step_positions: torch.Tensor  # their positions

    @classmethod
    def left_padded(
        cls, prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device, *, mask_unpadded: bool
    ) -> DeviceBatch:
        """One row per prompt, left-padded with ``pad_token_id``; positions count from each row's first real token.

        The model gets a mask when some prompt is padded, or always with
        ``mask_unpadded``.
        """
        batch, width = len(prompts), max(len(ids) for ids in prompts)
        input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for b, ids in enumerate(prompts):
            input_ids[b, width - len(ids) :] = torch.tensor(ids)
            attention_mask[b, width - len(ids) :] = 1
        padded = any(len(ids) < width for ids in prompts)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            width=width,
            padded=padded,
            keep=attention_mask.bool() if padded or mask_unpadded else None,
            step_input=input_ids,
            step_positions=position_ids,
        )

    def prompt_context(self) -> BatchContext:
        """The prompts' context (what processors hear the prefill logits with)."""
        return BatchContext(input_ids=self.input_ids, prompt_length=self.width, attention_mask=self.attention_mask)

    def context(self, step: int, generated: list[list[int]]) -> BatchContext:
        """The processors' view of ``step``, with the host's copy of the tokens so far. No synchronisation.

        An unpadded batch needs no mask after the first step (the first tells
        a tracker where prompts start).
        """
        mask = self.attention_mask if self.padded or step == 0 else None
        return BatchContext(
            input_ids=self.input_ids, prompt_length=self.width, attention_mask=mask, generated=generated
        )

    def feed(self, tokens: torch.Tensor) -> None:
        """Append the step's tokens ``[B]``: a new column of ids, mask and positions. No synchronisation."""
        batch = tokens.shape[0]
        self.input_ids = torch.cat([self.input_ids, tokens[:, None]], dim=1)
        if self.padded:
            self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((batch, 1))], dim=1)
        if self.keep is not None:
            self.keep = torch.cat([self.keep, self.keep.new_ones((batch, 1))], dim=1)
        self.step_input, self.step_positions = tokens[:, None], self.step_positions[:, -1:] + 1


@dataclass(frozen=True)
class RowDraws:
    """Each row's sampling parameters and random stream, on the device."""

    params: RowParams
    keys: torch.Tensor
    no_draws: torch.Tensor | None  # every row greedy: they ignore their uniform numbers, so the hash is skipped

    @classmethod
    def build(cls, rows: Sequence[Row], seeds: Sequence[int], device: torch.device) -> RowDraws:
        """Row ``b`` draws from the stream of its request's seed and its sample index."""
        keys = row_keys(
            torch.tensor([seeds[r.request] for r in rows], device=device),
            torch.tensor([r.sample for r in rows], device=device),
        )
        all_greedy = all(r.params.is_greedy for r in rows)
        no_draws = torch.zeros(len(rows), dtype=torch.float64, device=device) if all_greedy else None
        return cls(RowParams.build([r.params for r in rows], device), keys, no_draws)

    def uniforms(self, step: int) -> torch.Tensor:
        """``[B]`` float64 uniform numbers for ``step``. No synchronisation."""
        return self.no_draws if self.no_draws is not None else uniforms(self.keys, step)


class Stopping:
    """When each row stops: on an EOS id, a stop string or its length limit (from host values only)."""

    def __init__(self, rows: Sequence[Row], eos_token_ids: Sequence[int], tokenizer: Any) -> None:
        self.rows = rows
        self.eos = set(eos_token_ids)
        self.tokenizer = tokenizer  # spells the tokens that stop strings are matched against
        self.limits = [r.params.max_new_tokens for r in rows]
        self.stops = [r.params.stop for r in rows]
        self.stop_tail = [max((len(s.encode()) for s in st), default=0) + 1 for st in self.stops]

    @property
    def max_steps(self) -> int:
        """The most steps any row may take."""
        return max(self.limits)

    def record(self, host: StepValues, live: list[int]) -> list[int]:
        """Append the step's values to the live rows and end those that stop; returns the rows still live."""
        for b in live:
            row = self.rows[b]
            token = host.tokens[b]
            row.tokens.append(token)
            row.logprobs.append(host.logprobs[b])
            row.raw_logprobs.append(host.raw_logprobs[b])
            if token in self.eos and not row.params.ignore_eos:
                row.finish_reason = "stop"
            elif self.stops[b] and (hit := self.stop_hit(row.tokens, self.stops[b], self.stop_tail[b])):
                row.finish_reason, row.stop_reason = "stop", hit
            elif len(row.tokens) >= self.limits[b]:
                row.finish_reason = "length"
        return [b for b in live if self.rows[b].finish_reason is None]

    def stop_hit(self, tokens: list[int], stop: tuple[str, ...], tail: int) -> str | None:
        """The first stop string the last ``tail`` tokens spell (matched on the text's bytes, in context)."""
        spelled = vocab_for(self.tokenizer).decode_bytes(tokens[-tail:])
        for s in stop:
            if s.encode("utf-8") in spelled:
                return s
        return None
