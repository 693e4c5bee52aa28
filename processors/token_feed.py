"""Hands a stateful processor the tokens each row generated since its last call.

Stateful processors (grammar matchers, text automata) keep one state per row
and advance it with the sampled tokens. Hosts differ in whether they report
the sampled tokens (logitscope's ``Generator`` calls ``on_sampled``,
``model.generate`` does not), but every host passes the generated tokens in
``ctx.input_ids[:, ctx.prompt_length:]``, so reading them from there works
everywhere, and calling a processor twice on the same step changes nothing.
When the host also passes its own copy of those tokens (``ctx.generated``,
as logitscope's ``Generator`` does), they are taken from there and the device
is never read; otherwise reading them synchronises once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from processors.protocol import BatchContext

__all__ = ["TokenFeed", "FeedUpdate"]


@dataclass(frozen=True, slots=True)
class FeedUpdate:
    """What happened since the last call.

    Attributes:
        restarted: the per-row state must be (re)created for ``batch`` rows
            (first call, a new generation, or a shorter output than before).
        batch: rows in this step.
        new_tokens: per row, the tokens generated since the last call (after a
            restart: every generated token).
    """

    restarted: bool
    batch: int
    new_tokens: list[list[int]]


class TokenFeed:
    """Tracks how many generated tokens a processor has already consumed."""

    __slots__ = ("batch", "consumed")

    def __init__(self) -> None:
        self.batch: int | None = None
        self.consumed = 0

    def reset(self) -> None:
        self.batch = None
        self.consumed = 0

    def update(self, ctx: BatchContext, owner: str) -> FeedUpdate:
        """The tokens to consume for this step; raises if the batch changed mid-generation."""
        batch, generated = ctx.batch_size, ctx.num_generated
        restarted = self.batch is None or generated < self.consumed or (generated == 0 and batch != self.batch)
        if restarted:
            self.batch, self.consumed = batch, 0
        elif batch != self.batch:
            raise ValueError(
                f"{owner}: this generation started with {self.batch} rows but the batch now has {batch}; "
                "call reset() before starting a generation with another batch"
            )
        if generated > self.consumed:
            if ctx.generated is not None:
                new = [list(row[self.consumed : generated]) for row in ctx.generated]
            else:
                new = ctx.input_ids[:, ctx.prompt_length + self.consumed :].tolist()
            self.consumed = generated
        else:
            new = [[] for _ in range(batch)]
        return FeedUpdate(restarted=restarted, batch=batch, new_tokens=new)

    def consume(self, batch: int, generated: int) -> bool:
        """Take a step's tokens heard outside :meth:`update` (``on_sampled``); False if they do not follow on.

        ``generated`` is the number of tokens generated before the step, so
        the tokens follow on when this feed has consumed exactly that many in
        a generation of ``batch`` rows.
        """
        if self.batch != batch or self.consumed != generated:
            return False
        self.consumed = generated + 1
        return True
