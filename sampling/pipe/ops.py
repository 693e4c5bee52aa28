"""The ops a pipe runs: each wires maths from :mod:`sampling.pipe.kernels` to tagged tensors.

Plain ops do one thing on the whole vocabulary (what a processor means, and
what an uncompiled pipe runs). Fused ops, built by the fusion rules, do the
same in fewer passes:

- :class:`TemperatureSoftmaxOp`: ``softmax(logits / T)``.
- :class:`FusedSampleOp`: a chain of filters (top-k, top-p, min-p) and the
  sampler, optionally with the softmax (and temperature) in front. With a
  top-k in the chain it works on the ``k`` candidates of a partial selection
  only (no softmax over the vocabulary); without one it uses the sorting-free
  mass crossing of the kernels. Either way it samples the distribution the
  plain ops define and maps the same uniform number to the same token.

Every sampler fills ``Runtime.logprobs`` and ``Runtime.valid`` (and, when
dead rows are flagged rather than raised, gives them token -1), and builds
the ``"sampled"`` tap tensor only when a tap asks for it.
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple, Sequence

import torch

from sampling.pipe import kernels as K
from sampling.pipe.op import Op
from sampling.pipe.runtime import Runtime
from sampling.pipe.taps import SAMPLED
from sampling.pipe.types import PipeError, TaggedTensor, TensorType

__all__ = [
    "TemperatureOp",
    "SoftmaxOp",
    "TemperatureSoftmaxOp",
    "LogitsTopKOp",
    "ProbsFilterOp",
    "ProbsTopKOp",
    "ProbsTopPOp",
    "ProbsMinPOp",
    "LogitsSampleOp",
    "ProbsSampleOp",
    "LogitsGreedyOp",
    "ProbsGreedyOp",
    "FunctionOp",
    "Filter",
    "FusedSampleOp",
    "fusable",
]

LOGITS, PROBS, INDICES = TensorType.LOGITS, TensorType.PROBS, TensorType.INDICES


def _report(rt: Runtime, tokens: torch.Tensor, logprobs: torch.Tensor, valid: torch.Tensor) -> TaggedTensor:
    """Hand the sampler's per-row results to the runtime; mark dead rows only when they are flagged.

    (When dead rows raise, the pipe raises before anyone sees their token.)
    """
    if rt.flag_dead:
        tokens = torch.where(valid, tokens, -1)
        logprobs = torch.where(valid, logprobs, float("nan"))
    rt.report(logprobs.float().reshape(-1), valid.reshape(-1))
    return TaggedTensor.indices(tokens.reshape(-1))


def _valid(logprobs: torch.Tensor) -> torch.Tensor:
    """A row was sampled validly iff its token's log-probability is finite.

    It is NaN when the mass sampled from is NaN, 0 or inf (a dead row), and
    -inf for a token of probability 0.
    """
    return logprobs > float("-inf")


def _ones(w: torch.Tensor) -> torch.Tensor:
    return torch.ones(w.shape[0], dtype=torch.float64, device=w.device)


# --------------------------------------------------------------------------- logits and softmax


class TemperatureOp(Op):
    """``logits / temperature``."""

    IN, OUT, PARAMS = LOGITS, LOGITS, ("temperature",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        t = rt.param(self, "temperature")
        return TaggedTensor.logits(x.data / K.as_column(t, x.data))


class SoftmaxOp(Op):
    """Logits to probabilities (float32)."""

    IN, OUT = LOGITS, PROBS

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return TaggedTensor.probs(torch.softmax(x.data.float(), dim=-1))


class _FusedOp(Op):
    """An op standing for several: it keeps them as ``parts`` (for taps and the repr)."""

    def __init__(self, parts: Sequence[Op]) -> None:
        flat = tuple(p for op in parts for p in op.parts)
        super().__init__(stage=flat[-1].stage, ends_stage=flat[-1].ends_stage)
        self._parts = flat

    @property
    def parts(self) -> tuple[Op, ...]:
        return self._parts


class TemperatureSoftmaxOp(_FusedOp):
    """``softmax(logits / temperature)`` in one op."""

    IN, OUT, PARAMS = LOGITS, PROBS, ("temperature",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        t = rt.param(self.parts[0], "temperature")
        return TaggedTensor.probs(torch.softmax(x.data.float() / K.as_column(t, x.data), dim=-1))


# --------------------------------------------------------------------------- filters


class LogitsTopKOp(Op):
    """Keep exactly ``top_k`` logits per row (ties: lower id), the rest -inf."""

    IN, OUT, PARAMS = LOGITS, LOGITS, ("top_k",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        keep = K.top_k_mask(
            x.data, rt.param(self, "top_k"), float("-inf"), sync_free=rt.sync_free, bound=rt.max_top_k
        )
        return TaggedTensor.logits(x.data.masked_fill(~keep, float("-inf")))


class Filter(NamedTuple):
    """A filter as the fused sampler sees it: its kind, the op holding its defaults, renormalisation."""

    kind: Literal["top_k", "top_p", "min_p"]
    op: Op
    renormalize: bool = True


class ProbsFilterOp(Op):
    """A filter on probabilities; it keeps a prefix of the order (see :mod:`~sampling.pipe.kernels`)."""

    IN, OUT = PROBS, PROBS
    KIND: Literal["top_k", "top_p", "min_p"]
    renormalize = True

    @property
    def filter(self) -> Filter:
        return Filter(self.KIND, self, self.renormalize)


class ProbsTopKOp(ProbsFilterOp):
    """Keep exactly ``top_k`` tokens (ties: lower id); renormalise unless it is the joint filter's top-k."""

    KIND, PARAMS = "top_k", ("top_k",)

    def __init__(self, stage: str = "", ends_stage: bool = True, *, renormalize: bool = True, **defaults) -> None:
        super().__init__(stage, ends_stage, **defaults)
        self.renormalize = renormalize

    @property
    def name(self) -> str:
        return "ProbsTopKOp" if self.renormalize else "ProbsJointTopKOp"

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        p = x.data
        keep = K.top_k_mask(p, rt.param(self, "top_k"), 0.0, sync_free=rt.sync_free, bound=rt.max_top_k)
        kept = torch.where(keep, p, 0.0)
        return TaggedTensor.probs(kept / kept.sum(-1, keepdim=True) if self.renormalize else kept)


class ProbsTopPOp(ProbsFilterOp):
    """Keep the top-p prefix (mass strictly before a token < top_p; PROBS count as summing to 1); renormalise."""

    KIND, PARAMS = "top_p", ("top_p",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        p = x.data.float()
        cut = K.top_p_cut(p, rt.param(self, "top_p"), _ones(p), sync_free=rt.sync_free)
        kept = torch.where(K.cut_mask(p, cut), p, 0.0)
        return TaggedTensor.probs(kept / kept.sum(-1, keepdim=True))


class ProbsMinPOp(ProbsFilterOp):
    """Keep tokens with ``p >= min_p * max(p)``; renormalise."""

    KIND, PARAMS = "min_p", ("min_p",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        p = x.data
        threshold = K.as_column(rt.param(self, "min_p"), p) * p.amax(-1, keepdim=True)
        kept = torch.where(p >= threshold, p, 0.0)
        return TaggedTensor.probs(kept / kept.sum(-1, keepdim=True))


# --------------------------------------------------------------------------- samplers


def _sample_probs(w: torch.Tensor, rt: Runtime) -> TaggedTensor:
    tokens, logprobs, mass = K.sample_weights(w, rt.uniforms(), sync_free=rt.sync_free)
    valid = _valid(logprobs)
    if rt.wants(SAMPLED):
        rt.emit(SAMPLED, TaggedTensor.probs(torch.where(w > 0, w, 0.0) / mass[:, None].float()))
    return _report(rt, tokens, logprobs, valid)


class ProbsSampleOp(Op):
    """Draw a token per row from probabilities (renormalised), by the CDF in the order."""

    IN, OUT = PROBS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return _sample_probs(x.data.float(), rt)


class LogitsSampleOp(Op):
    """Draw a token per row from ``softmax(logits)``, by the CDF in the order."""

    IN, OUT = LOGITS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return _sample_probs(torch.softmax(x.data.float(), dim=-1), rt)


def _greedy(x: torch.Tensor, log_total: torch.Tensor, rt: Runtime, log: bool) -> TaggedTensor:
    best, tokens = x.max(dim=-1)  # first maximum: the lowest id among ties
    top = torch.log(best.double()) if log else best.double()
    logprobs = top - log_total
    valid = torch.isfinite(logprobs) & torch.isfinite(best)
    if rt.wants(SAMPLED):
        one_hot = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        rt.emit(SAMPLED, TaggedTensor.probs(one_hot.scatter_(1, tokens[:, None], 1.0)))
    return _report(rt, tokens, logprobs, valid)


class LogitsGreedyOp(Op):
    """The arg-max (lowest id among ties); its log-probability under ``softmax(logits)``."""

    IN, OUT = LOGITS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        logits = x.data.float()
        return _greedy(logits, torch.logsumexp(logits, dim=-1).double(), rt, log=False)


class ProbsGreedyOp(Op):
    """The arg-max (lowest id among ties); its probability renormalised."""

    IN, OUT = PROBS, INDICES

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        p = x.data.float()
        return _greedy(p, torch.log(p.sum(-1).double()), rt, log=True)


# --------------------------------------------------------------------------- user functions


class FunctionOp(Op):
    """A user's function ``fn(tensor) -> tensor`` from one tensor type to another."""

    def __init__(
        self, fn: Callable[[torch.Tensor], torch.Tensor], accepts: TensorType, returns: TensorType, stage: str = ""
    ) -> None:
        super().__init__(stage)
        self.fn, self.IN, self.OUT = fn, accepts, returns

    @property
    def name(self) -> str:
        return f"FunctionOp[{getattr(self.fn, '__name__', type(self.fn).__name__)}]"

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        y = self.fn(x.data)
        expected = x.data.shape[:1] if self.OUT is INDICES else x.data.shape
        if not isinstance(y, torch.Tensor) or y.shape != expected:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise PipeError(f"stage {self.stage!r}: the function must return a tensor of shape {tuple(expected)}, got {got}")
        return TaggedTensor(y, self.OUT)


# --------------------------------------------------------------------------- fused sampler


def fusable(filters: Sequence[Filter]) -> bool:
    """Whether :class:`FusedSampleOp` can run this chain of filters exactly.

    Without top-k it always can (whole-vocabulary path). With top-k it works on
    the candidates, which needs the first top-k preceded only by min-p (min-p
    and top-k select by the same ranking, so they commute), and a joint
    (non-renormalising) top-k to come first.
    """
    kinds = [f.kind for f in filters]
    if "top_k" not in kinds:
        return True
    first = kinds.index("top_k")
    if any(kind != "min_p" for kind in kinds[:first]):
        return False
    return filters[first].renormalize or first == 0


class FusedSampleOp(_FusedOp):
    """Softmax (with temperature) if given logits, a chain of filters, then sampling, in one op.

    ``filters`` describe the chain in order; ``from_logits`` says whether the
    input is LOGITS (the softmax is part of the op) and ``temperature`` is the
    op holding the temperature default, if any.
    """

    OUT = INDICES

    def __init__(
        self, parts: Sequence[Op], filters: Sequence[Filter], from_logits: bool, temperature: Op | None = None
    ) -> None:
        super().__init__(parts)
        if not fusable(filters):
            raise PipeError(f"FusedSampleOp cannot run the filter chain {[f.kind for f in filters]} exactly")
        self.filters = tuple(filters)
        self.from_logits = from_logits
        self.temperature = temperature
        self.IN = LOGITS if from_logits else PROBS
        self.on_candidates = any(f.kind == "top_k" for f in filters)

    @property
    def name(self) -> str:
        words = (p.name.removesuffix("Op").removeprefix("Probs").removeprefix("Logits") for p in self.parts)
        return "Fused" + "".join(words) + "Op"

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        if self.on_candidates or rt.algorithm == "sort":
            return self._on_candidates(x.data, rt)
        return self._on_vocabulary(x.data, rt)

    def _temperature(self, rt: Runtime) -> K.Param | None:
        return None if self.temperature is None else rt.param(self.temperature, "temperature")

    def _on_vocabulary(self, x: torch.Tensor, rt: Runtime) -> TaggedTensor:
        """Whole-vocabulary path: softmax, then cuts found by mass crossings, no sort."""
        t = self._temperature(rt)
        if self.from_logits:
            w = torch.softmax(x.float() if t is None else x.float() / K.as_column(t, x), dim=-1)
        else:
            w = x.float()
        cut: K.Cut | None = None
        norm = _ones(w)  # the mass that counts as 1 for the next top-p
        shared = None
        for f in self.filters:
            if f.kind == "min_p":
                threshold = K.as_column(rt.param(f.op, "min_p"), w) * w.amax(-1, keepdim=True)
                w, shared = torch.where(w >= threshold, w, 0.0), None
                if cut is None:
                    norm = torch.full_like(norm, float("nan"))  # the masked total
                else:
                    drop = threshold.squeeze(1) > cut.value  # min-p's prefix is the shorter one
                    cut = K.Cut(
                        torch.where(drop, -1.0, cut.value),
                        torch.where(drop, 0, cut.count),
                        torch.where(drop, float("nan"), cut.mass),
                    )
                    norm = cut.mass
            else:
                shared = K.radix(w) if shared is None else shared
                new = K.top_p_cut(w, rt.param(f.op, "top_p"), norm, shared, rt.sync_free)
                cut = new if cut is None else K.shorter(new, cut)
                norm = cut.mass
        tokens, logprobs, mass = K.sample_weights(w, rt.uniforms(), cut, shared, rt.sync_free)
        valid = _valid(logprobs)
        if rt.wants(SAMPLED):
            keep = (w > 0) if cut is None else K.cut_mask(w, cut)
            rt.emit(SAMPLED, TaggedTensor.probs(torch.where(keep, w, 0.0) / mass[:, None].float()))
        return _report(rt, tokens, logprobs, valid)

    def _on_candidates(self, x: torch.Tensor, rt: Runtime) -> TaggedTensor:
        """Top-k path (and the ``"sort"`` algorithm's only path): each filter only shortens a prefix.

        The candidates (a partial selection of the ``k`` largest, or the
        whole row sorted) are in the order and every filter keeps a prefix of
        it, so the state is one length per row and one cumulative sum.
        Sync-free unless the algorithm is ``"cpu"``.
        """
        batch, vocab = x.shape
        limits: dict[int, K.Length] = {}
        width = vocab
        for i, f in enumerate(self.filters):
            if f.kind == "top_k":
                w_i, column = K.top_k_column(
                    rt.param(f.op, "top_k"), batch, vocab, x.device, rt.max_top_k, rt.sync_free
                )
                limits[i] = w_i if column is None else column
                width = min(width, w_i)
        t = self._temperature(rt)
        floor = float("-inf") if self.from_logits else 0.0
        if rt.sync_free:
            values, ids, exact = K.sync_free_candidates(x, width)
        else:
            (values, ids), exact = K.top_k_candidates(x, width, floor), True
        m = K.candidate_masses(values, t, self.from_logits)
        running = m.cumsum(-1)
        length: K.Length = width
        norm = None
        if self.filters and not self.filters[0].renormalize:
            norm = self._joint_norm(x, values, m, t)
        elif not self.from_logits and not self.on_candidates:
            norm = _ones(x)[:, None]  # a top-p on the whole row: PROBS count as summing to 1
        for i, f in enumerate(self.filters):
            if f.kind == "min_p":
                length, norm = K.shorten(length, K.min_p_length(m, rt.param(f.op, "min_p"))), None
            elif f.kind == "top_k":
                if not f.renormalize and norm is None:
                    norm = K.prefix_mass(running, length)  # a later top-p counts against the mass before this cut
                length = K.shorten(length, limits[i])
                norm = None if f.renormalize else norm
            else:
                total = K.prefix_mass(running, length) if norm is None else norm
                kept = K.top_p_length(m, running, rt.param(f.op, "top_p"), total)
                length, norm = K.shorten(length, kept), None
        pos, logprobs, mass = K.sample_prefix(m, running, length, rt.uniforms()[:, None])
        value = values.gather(1, pos)
        if exact:
            tokens = ids.gather(1, pos)
        else:  # topk's ids are arbitrary among ties: take the n-th equal token by id, the tie rule
            tokens = K.nth_equal_scan(x, value, pos - (values > value).sum(-1, keepdim=True))
        if rt.wants(SAMPLED):
            if exact:
                kept_masses = m.masked_fill(torch.arange(width, device=x.device) >= length, 0.0)
                dist = torch.zeros((batch, vocab), dtype=torch.float32, device=x.device)
                dist = dist.scatter_(1, ids, (kept_masses / mass).float())
            else:
                dist = self._kept_distribution(x, values, m, length, mass, t)
            rt.emit(SAMPLED, TaggedTensor.probs(dist))
        return _report(rt, tokens, logprobs, _valid(logprobs))

    def _kept_distribution(
        self,
        x: torch.Tensor,
        values: torch.Tensor,
        m: torch.Tensor,
        length: K.Length,
        mass: torch.Tensor,
        t: K.Param | None,
    ) -> torch.Tensor:
        """The distribution sampled from, over the whole row, from the candidates' values alone (no ids, no sync).

        The kept tokens are those above the last kept value, then the lowest
        ids equal to it; a token's mass is in the units of the candidates' ``m``.
        """
        last = values[:, length - 1 : length] if isinstance(length, int) else values.gather(1, length - 1)
        count = length - (values > last).sum(-1, keepdim=True)
        equal = x == last
        keep = (x > last) | (equal & (equal.cumsum(-1, dtype=torch.int32) <= count))
        if self.from_logits:
            scale = 1.0 if t is None else K.as_column(t, x, torch.float64)
            weights = torch.exp((x.double() - values[:, :1].double()) / scale) * m[:, :1]
        else:
            weights = x.double()
        keep &= weights > 0
        return (torch.where(keep, weights, 0.0) / mass).float()

    def _joint_norm(self, x: torch.Tensor, values: torch.Tensor, m: torch.Tensor, t: K.Param | None) -> torch.Tensor:
        """For the joint filter: the whole row's mass in the units of the candidate masses ``m``."""
        if not self.from_logits:
            return _ones(x)[:, None]  # PROBS count as summing to 1
        scale = 1.0 if t is None else K.as_column(t, x, torch.float64)
        whole = torch.logsumexp(x.double() / scale, dim=-1, keepdim=True)
        candidates = torch.logsumexp(values.double() / scale, dim=-1, keepdim=True)
        return torch.exp(whole - candidates)
