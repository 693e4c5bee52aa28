"""Batched sampling for the Generator: per-row parameters, per-row random streams, grouped pipes.

Each row has its own parameters (``RowParams``) and its own stream of uniform
numbers, derived by a counter-based hash from the row's seed and the step
(:func:`uniforms`), so a seeded request draws the same numbers whatever else
shares the batch, on any device.

:func:`sample` groups rows whose parameters switch on the same stages (greedy;
or which of min-p, top-k, top-p and the joint filter are on) and samples each
group with one compiled :class:`~sampling.pipe.LogitsPipe`, the parameters
passed per row. Within a pipe a row's token depends only on its logits, its
parameters and its uniform number (the CDF is inverted in the order of
:mod:`sampling.pipe.kernels`, whose docstring states the tie and boundary
rules), so grouping never changes a row's token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from sampling.params import SamplingParams, sampling_stages
from sampling.pipe import SAMPLED, Greedy, LogitsPipe, SampleResult, TaggedTensor, Tap
from sampling.pipe.kernels import Algorithm
from sampling.pipe.pipeline import dead_row_error

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


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
    """One int64 key per row from the request's seed and the sample's index. Does not synchronise."""
    return _splitmix64(_splitmix64(seeds.long()) ^ sample_index.long())


def uniforms(keys: torch.Tensor, step: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) as float64, one per row, for this step. Does not synchronise."""
    z = _splitmix64(keys + _wrap64((step + 1) * _GOLDEN))
    return _shr(z, 11).double() * (1.0 / (1 << 53))


SampleTap = Callable[[torch.Tensor], None]
"""An observer of the distribution sampled from: called with float32 probabilities ``[B, V]``."""

GroupKey = tuple[bool, bool, bool, bool, bool]
"""``(greedy, min_p, top_k, top_p, joint)``: which stages a row needs."""


@cache
def group_pipe(key: GroupKey, algorithm: Algorithm = "auto") -> LogitsPipe:
    """The compiled pipe for rows with this :data:`GroupKey` (parameters come per call)."""
    greedy, min_p, top_k, top_p, joint = key
    if greedy:
        return LogitsPipe([Greedy()], algorithm=algorithm)
    return LogitsPipe(sampling_stages(min_p=min_p, top_k=top_k, top_p=top_p, joint=joint), algorithm=algorithm)


@dataclass(frozen=True)
class RowGroup:
    """Rows that share a pipe: their indices, the pipe's key and their parameters.

    A parameter is a Python scalar when every row of the group has the same
    value (cheaper: no per-row tensor), else a ``[n]`` tensor, float64 for
    the float parameters so that a row's value is the same number either way
    (a float32 top-p of 0.3 would move a cut that lies between tied tokens); a per-row
    ``top_k`` comes with ``max_top_k``, its largest value as a host int, so
    the pipe knows the candidates' width without reading the device.
    """

    rows: torch.Tensor  # int64 [n]
    key: GroupKey
    params: dict[str, Any]

    @property
    def pipe(self) -> LogitsPipe:
        return group_pipe(self.key)


@dataclass(frozen=True)
class RowParams:
    """The rows of a batch grouped by the stages they need, with each group's parameters (built once per generation)."""

    size: int  # rows in the batch
    groups: tuple[RowGroup, ...]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str) -> RowParams:
        """Group rows by :attr:`~sampling.params.SamplingParams.active` (host values only)."""
        keys: list[GroupKey] = [(p.is_greedy, *p.active) for p in params]
        eff = [dict(zip(("temperature", "top_k", "top_p", "min_p"), p.effective)) for p in params]
        groups = []
        for key in dict.fromkeys(keys):
            rows = [i for i, k in enumerate(keys) if k == key]
            values: dict[str, Any] = {}
            for on, name in ((not key[0], "temperature"), (key[1], "min_p"), (key[2], "top_k"), (key[3], "top_p")):
                column = [eff[i][name] for i in rows]
                if on and len(set(column)) == 1:
                    values[name] = column[0]
                elif on:
                    values[name] = torch.tensor(
                        column, dtype=torch.long if name == "top_k" else torch.float64, device=device
                    )
            if isinstance(values.get("top_k"), torch.Tensor):
                values["max_top_k"] = max(eff[i]["top_k"] for i in rows)  # the candidates' width, known on the host
            groups.append(RowGroup(torch.tensor(rows, dtype=torch.long, device=device), key, values))
        return cls(len(keys), tuple(groups))

    def plan(self) -> tuple[RowGroup, ...]:
        return self.groups

    def __len__(self) -> int:
        return self.size


def sample(
    logits: torch.Tensor,
    params: RowParams,
    u: torch.Tensor,
    *,
    taps: Sequence[SampleTap] | None = None,
    on_dead: str = "raise",
    algorithm: Algorithm = "auto",
) -> SampleResult:
    """Draw one token per row of ``logits [B, V]`` (float32) with the row's parameters.

    Greedy rows take the arg-max (lowest id among equals) and report the
    log-probability under the softmax of ``logits``; sampling rows report it in
    the final (temperature, min-p, top-k, top-p) distribution. Rows that are
    NaN or have nothing allowed are dead: with ``on_dead="raise"``
    (synchronises once to look) a :class:`DeadRowError` names them; with
    ``on_dead="flag"`` nothing is read from the device and ``valid`` marks
    them. ``algorithm`` is the pipes' (:class:`~sampling.pipe.LogitsPipe`):
    ``"auto"`` picks by the device (and on an accelerator by the batch size:
    ``"sort"`` or ``"pivot"``), so that on an accelerator a call with
    ``on_dead="flag"`` and ``u`` on the device does not synchronise, while on
    a CPU the faster CPU algorithms read tensor values; ``"sort"`` runs the
    accelerator path on a CPU (as the test that counts host reads does).

    ``taps``: observers of the distribution actually sampled from (the pipe's
    ``"sampled"`` stage, see :mod:`sampling.pipe.types`; one-hot for greedy
    rows), each called once with float32 ``[B, V]`` on the device, without a
    copy or a synchronisation. Built only when a tap is given.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"params has {len(params)} rows, logits has {logits.shape[0]}")
    if u.shape != (logits.shape[0],):
        raise ValueError(f"u must hold one uniform number per row, shape ({logits.shape[0]},), got {tuple(u.shape)}")
    for i, fn in enumerate(taps or ()):
        if not callable(fn):
            raise TypeError(f"taps[{i}] must be callable with the sampled probabilities, got {type(fn).__name__}")
    if on_dead not in ("raise", "flag"):
        raise ValueError(f"on_dead must be 'raise' or 'flag', got {on_dead!r}")
    logits = logits.float()
    sampled: torch.Tensor | None = None
    captured: list[torch.Tensor] = []
    pipe_taps = [Tap(SAMPLED, lambda t: captured.append(t.data))] if taps else None
    groups = params.groups
    if len(groups) == 1:  # every row, in order
        (group,) = groups
        out = group_pipe(group.key, algorithm).sample(logits, u=u, on_dead="flag", taps=pipe_taps, **group.params)
        tokens, logprobs, valid = out.tokens, out.logprobs, out.valid
        sampled = captured[0] if taps else None
    else:
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        logprobs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        valid = torch.empty(logits.shape[0], dtype=torch.bool, device=logits.device)
        if taps:
            sampled = torch.zeros_like(logits)
        for group in groups:
            rows = group.rows
            out = group_pipe(group.key, algorithm).sample(
                logits.index_select(0, rows), u=u.index_select(0, rows), on_dead="flag", taps=pipe_taps, **group.params
            )
            tokens.index_copy_(0, rows, out.tokens)
            logprobs.index_copy_(0, rows, out.logprobs)
            valid.index_copy_(0, rows, out.valid)
            if sampled is not None:
                sampled.index_copy_(0, rows, captured.pop())
    if on_dead == "raise" and not bool(valid.all()):
        raise dead_row_error(TaggedTensor.logits(logits), ~valid)
    if sampled is not None:
        for fn in taps or ():
            fn(sampled)
    return SampleResult(tokens, logprobs, valid)
