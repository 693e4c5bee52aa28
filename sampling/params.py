"""Per-request sampling parameters, with TensorRT-LLM's semantics.

Greedy decoding is used when ``temperature == 0``, ``top_k == 1`` or
``top_p == 0`` (whatever the other values), or when ``temperature``, ``top_k``,
``top_p`` and ``min_p`` are all unset. Otherwise unset values default to
``temperature = 1``, ``top_k = 0`` (the whole vocabulary), ``top_p = 1`` and
``min_p = 0``. TensorRT-LLM leaves ``min_p`` out of the all-unset rule;
logitscope counts it, so that setting only ``min_p`` samples.

The stages run in this order: temperature, min-p (tokens with
``p >= min_p * max(p)``), top-k, renormalise, top-p (the smallest set of most
probable tokens whose mass is at least ``top_p``), renormalise, sample. Min-p
and top-k select by the same ranking, so their order does not matter; top-p
sees the renormalised survivors of both (vLLM's order; transformers applies
min-p after top-p instead). ``joint_top_k_top_p=True`` asks for FlashInfer's
joint filter instead: no renormalisation after top-k, so top-p counts mass
against the whole distribution (a different distribution, kept only when
both top-k and top-p are set). With min-p set as well, min-p runs first and
renormalises, so the joint top-p counts against the min-p survivors' mass.

Ties and boundaries: top-k keeps exactly ``k`` tokens, the lower ids among
equal probabilities; top-p keeps a token iff the mass of the more probable
tokens before it (equal ones: lower ids first) is ``< top_p``. See
:mod:`sampling.pipe.kernels`. :meth:`SamplingParams.to_pipe` gives the
:class:`~sampling.pipe.LogitsPipe` that samples these parameters.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from sampling.pipe import Greedy, LogitsPipe, MinP, Sample, Softmax, Stage, Temperature, TopK, TopP

__all__ = ["SamplingParams", "sampling_stages"]


def _is_int(value: Any) -> bool:
    """An integer, numpy's included; not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A real number, numpy's included; not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """A number as Python's int or float (numpy scalars included); anything else as it is."""
    if _is_int(value):
        return int(value)
    return float(value) if _is_number(value) else value


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string is one stop string)."""
    if isinstance(stop, str):
        stop = (stop,)
    elif not isinstance(stop, (list, tuple, set, frozenset)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
    return tuple(stop)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Args:
        temperature: logits are divided by it before the softmax; 0 means greedy.
        top_k: keep the ``top_k`` most probable tokens; 0 keeps all, 1 is greedy.
        top_p: keep the smallest set of most probable tokens with mass >= ``top_p``;
            0 is greedy, 1 keeps all.
        min_p: keep tokens with probability >= ``min_p`` times the largest.
        max_new_tokens: stop after this many generated tokens.
        stop: strings that end the generation when they appear in the output
            (the text is cut before them).
        seed: the same seed gives the same tokens for this request, whatever
            else shares the batch. ``None`` draws one from torch's global
            generator (so ``torch.manual_seed`` makes runs repeatable).
        n: samples per prompt (sample ``j`` uses the seed ``(seed, j)``).
        ignore_eos: keep generating after the end-of-sequence token.
        joint_top_k_top_p: use the joint top-k/top-p filter (no renormalisation
            after top-k; see the module docstring).

    Numbers may be numpy scalars (kept as Python ints and floats); the two
    flags must be bools. A wrong value raises ``ValueError`` naming it.
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    joint_top_k_top_p: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p", "min_p", "max_new_tokens", "seed", "n"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        t = self.temperature
        if t is not None and (not _is_number(t) or not math.isfinite(t) or t < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if k is not None and (not _is_int(k) or k < 0):
            raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {k!r}")
        for name in ("top_p", "min_p"):
            v = getattr(self, name)
            if v is not None and (not _is_number(v) or not 0.0 <= v <= 1.0):
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        for name in ("ignore_eos", "joint_top_k_top_p"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))

    @property
    def is_greedy(self) -> bool:
        """Whether these parameters mean greedy decoding (see the module docstring)."""
        if self.temperature == 0 or self.top_k == 1 or self.top_p == 0:
            return True
        return all(v is None for v in (self.temperature, self.top_k, self.top_p, self.min_p))

    @property
    def effective(self) -> tuple[float, int, float, float]:
        """``(temperature, top_k, top_p, min_p)`` with defaults filled in."""
        return (
            1.0 if self.temperature is None else float(self.temperature),
            0 if self.top_k is None else int(self.top_k),
            1.0 if self.top_p is None else float(self.top_p),
            0.0 if self.min_p is None else float(self.min_p),
        )

    @property
    def active(self) -> tuple[bool, bool, bool, bool]:
        """Which sampling stages are on: ``(min_p, top_k, top_p, joint)``; all False when greedy."""
        if self.is_greedy:
            return (False, False, False, False)
        _, k, p, m = self.effective
        return (m > 0, k > 0, p < 1, self.joint_top_k_top_p and k > 0 and p < 1)

    def to_pipe(self) -> LogitsPipe:
        """The compiled :class:`~sampling.pipe.LogitsPipe` that decodes with these parameters.

        Greedy parameters give ``LogitsPipe([Greedy()])``; otherwise the stages
        of the module docstring's order that are on, carrying these values.
        """
        if self.is_greedy:
            return LogitsPipe([Greedy()])
        t, k, p, m = self.effective
        min_p, top_k, top_p, joint = self.active
        return LogitsPipe(
            sampling_stages(
                min_p=min_p,
                top_k=top_k,
                top_p=top_p,
                joint=joint,
                values={"temperature": t, "top_k": k, "top_p": p, "min_p": m},
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (for run metadata)."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "max_new_tokens": self.max_new_tokens,
            "stop": list(self.stop),
            "seed": self.seed,
            "n": self.n,
            "ignore_eos": self.ignore_eos,
            "joint_top_k_top_p": self.joint_top_k_top_p,
            "greedy": self.is_greedy,
        }


def sampling_stages(
    *, min_p: bool, top_k: bool, top_p: bool, joint: bool = False, values: dict[str, float] | None = None
) -> list[Stage]:
    """The pipe stages, in the documented order, for the sampling stages that are on.

    ``values`` gives the processors default values; without it they take
    their values (scalars or per-row tensors) when the pipe is called.
    """
    v = values or {}
    stages: list[Stage] = [Temperature(v.get("temperature")), Softmax()]
    if min_p:
        stages.append(MinP(v.get("min_p")))
    if top_k:
        stages.append(TopK(v.get("top_k"), joint=joint and top_p))
    if top_p:
        stages.append(TopP(v.get("top_p")))
    stages.append(Sample())
    return stages
