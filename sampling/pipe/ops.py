"""The ops a pipe runs, and the one filter chain that every filter and sampler among them runs.

A filter (top-k, top-p, min-p) keeps a prefix of the order of
:mod:`~sampling.pipe.kernels`, so a chain of filters followed by a draw is
one computation (:class:`Chain`). With a top-k in the chain (or with the
``"sort"`` algorithm, or a vocabulary below :data:`~sampling.pipe.kernels.SORT_BELOW`)
it works on the ``k`` candidates of a partial selection (or the sorted row):
no softmax over the vocabulary. Otherwise it works on the whole vocabulary
with the sorting-free mass crossings. A filter op (:class:`FilterOp`) is a
chain of one whose kept tokens it materialises; a sampler (:class:`SampleOp`)
is a chain of none until the fusion rules fold the softmax and filters before
it into it. So a compiled pipe and its plain ops sample the same distribution
and map the same uniform number to the same token. The other ops are a line
of PyTorch each. Every sampler fills ``Runtime.logprobs`` and
``Runtime.valid`` (and, when dead rows are flagged rather than raised, gives
them token -1), and builds the ``"sampled"`` tap tensor only when a tap asks
for it. An op's ``name`` (shown by the pipe's repr) says what it does on
which tensor type, e.g. ``ProbsTopPOp``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

import sampling.pipe.kernels as K
from sampling.pipe.types import SAMPLED, Op, PipeError, Runtime, TaggedTensor, TensorType

LOGITS, PROBS, INDICES = TensorType.LOGITS, TensorType.PROBS, TensorType.INDICES


def _typed(name: str, input_type: TensorType) -> str:
    return ("Logits" if input_type is LOGITS else "Probs") + name


# --------------------------------------------------------------------------- the filter chain


def fusable(filters: Sequence[FilterOp]) -> bool:
    """Whether :class:`Chain` can run this chain of filters exactly.

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


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape[0], dtype=torch.float64, device=x.device)


def report_draw(rt: Runtime, tokens: torch.Tensor, logprobs: torch.Tensor, valid: torch.Tensor) -> TaggedTensor:
    """Hand a sampler's per-row results to the runtime; mark dead rows only when they are flagged.

    (When dead rows raise, the pipe raises before anyone sees their token.) Does not synchronise.
    """
    if rt.flag_dead:
        tokens = torch.where(valid, tokens, -1)
        logprobs = torch.where(valid, logprobs, float("nan"))
    rt.logprobs, rt.valid = logprobs.float().reshape(-1), valid.reshape(-1)
    return TaggedTensor.indices(tokens.reshape(-1))


class Chain:
    """Softmax (with temperature) for logits, then ``filters`` in order, evaluated on one call's input.

    Then :meth:`keep` says which tokens survive and :meth:`sample` draws one
    per row. Does not synchronise under a sync-free algorithm; under ``"cpu"``
    reads the device as the kernels it calls say.
    """

    def __init__(
        self,
        x: torch.Tensor,
        rt: Runtime,
        filters: Sequence[FilterOp],
        from_logits: bool,
        temperature: Op | None = None,
    ) -> None:
        self.x, self.rt, self.filters, self.from_logits = x, rt, tuple(filters), from_logits
        self.t = None if temperature is None else rt.param(temperature, "temperature")
        self.has_top_k = any(f.kind == "top_k" for f in self.filters)
        self.on_candidates = self.has_top_k or rt.algorithm == "sort" or x.shape[-1] < K.SORT_BELOW
        if self.on_candidates:
            self._candidates()
        else:
            self._vocabulary()

    def _vocabulary(self) -> None:
        """Whole-vocabulary path: softmax, then cuts found by mass crossings, no sort."""
        x, rt = self.x, self.rt
        w = x.float() if self.t is None or not self.from_logits else x.float() / K.as_column(self.t, x)
        w = torch.softmax(w, dim=-1) if self.from_logits else w
        cut: K.Cut | None = None
        pivot = rt.algorithm == "pivot"  # bisection instead of the radix select: no histogram to share
        # the mass that counts as 1 for the next top-p: PROBS count as summing to 1; a float32 softmax is
        # measured by its own total (NaN: the row's histogram total), which may miss 1 by 1e-5
        norm = torch.full_like(_ones(w), float("nan")) if self.from_logits else _ones(w)
        shared = None
        for f in self.filters:
            if f.kind == "min_p":
                threshold = K.as_column(rt.param(f, "min_p"), w) * w.amax(-1, keepdim=True)
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
                shared = K.radix(w) if shared is None and not pivot else shared
                new = K.top_p_cut(w, rt.param(f, "top_p"), norm, shared, rt.sync_free, pivot)
                cut = new if cut is None else K.shorter(new, cut)
                norm = cut.mass
        self.w, self.cut, self.shared = w, cut, shared

    def _candidates(self) -> None:
        """Top-k path (and the ``"sort"`` algorithm's only path): each filter only shortens a prefix.

        The candidates (a partial selection of the ``k`` largest, or the
        whole row sorted) are in the order and every filter keeps a prefix of
        it, so the state is one length per row and one cumulative sum.
        """
        x, rt = self.x, self.rt
        batch, vocab = x.shape
        limits: dict[int, K.Length] = {}
        width = vocab
        for i, f in enumerate(self.filters):
            if f.kind == "top_k":
                k = rt.param(f, "top_k")
                w_i, column = K.top_k_column(k, batch, vocab, x.device, rt.max_top_k, rt.sync_free)
                limits[i] = w_i if column is None else column
                width = min(width, w_i)
        if rt.sync_free:
            values, ids, exact = K.sync_free_candidates(x, width)
        else:
            (values, ids), exact = K.top_k_candidates(x, width, float("-inf") if self.from_logits else 0.0), True
        m = K.candidate_masses(values, self.t, self.from_logits)
        running = m.cumsum(-1)
        length: K.Length = width
        norm = None
        if self.filters and not self.filters[0].renormalize:
            norm = self._joint_norm(values, m)
        elif not self.from_logits and not self.has_top_k:
            norm = _ones(x)[:, None]  # a top-p on the whole row: PROBS count as summing to 1
        for i, f in enumerate(self.filters):
            if f.kind == "min_p":
                length, norm = K.shorten(length, K.min_p_length(m, rt.param(f, "min_p"))), None
            elif f.kind == "top_k":
                if not f.renormalize and norm is None:
                    norm = K.prefix_mass(running, length)  # a later top-p counts against the mass before this cut
                length = K.shorten(length, limits[i])
                norm = None if f.renormalize else norm
            else:
                total = K.prefix_mass(running, length) if norm is None else norm
                kept = K.top_p_length(m, running, rt.param(f, "top_p"), total)
                length, norm = K.shorten(length, kept), None
        self.values, self.ids, self.exact, self.m, self.running, self.length = values, ids, exact, m, running, length

    def _scale(self) -> torch.Tensor | float:
        return 1.0 if self.t is None else K.as_column(self.t, self.x, torch.float64)

    def _joint_norm(self, values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """For the joint filter: the whole row's mass in the units of the candidate masses ``m``."""
        if not self.from_logits:
            return _ones(self.x)[:, None]  # PROBS count as summing to 1
        scale = self._scale()
        whole = torch.logsumexp(self.x.double() / scale, dim=-1, keepdim=True)
        return torch.exp(whole - torch.logsumexp(values.double() / scale, dim=-1, keepdim=True))

    def keep(self) -> torch.Tensor:
        """``bool [B, V]``: the tokens the chain keeps (a token of weight 0 may be marked kept)."""
        if not self.on_candidates:
            return (self.w > 0) if self.cut is None else K.cut_mask(self.w, self.cut)
        x, values, length = self.x, self.values, self.length
        if self.exact:
            inside = torch.arange(values.shape[-1], device=x.device) < length
            return torch.zeros_like(x, dtype=torch.bool).scatter_(1, self.ids, inside.expand_as(self.ids))
        # topk's ids are arbitrary among ties: keep every token above the last kept value, then the lowest ids equal to it
        last = values[:, length - 1 : length] if isinstance(length, int) else values.gather(1, length - 1)
        count = length - (values > last).sum(-1, keepdim=True)
        equal = x == last
        return (x > last) | (equal & (equal.cumsum(-1, dtype=torch.int32) <= count))

    def sample(self) -> TaggedTensor:
        """Draw one token per row by the CDF in the order (see :mod:`~sampling.pipe.kernels`)."""
        rt = self.rt
        if not self.on_candidates:
            pivot = rt.algorithm == "pivot"
            tokens, logprobs, mass = K.sample_weights(self.w, rt.uniforms(), self.cut, self.shared, rt.sync_free, pivot)
            if rt.wants(SAMPLED):
                rt.emit(SAMPLED, TaggedTensor.probs(torch.where(self.keep(), self.w, 0.0) / mass[:, None].float()))
            return report_draw(rt, tokens, logprobs, logprobs > float("-inf"))
        x, values, m = self.x, self.values, self.m
        pos, logprobs, mass = K.sample_prefix(m, self.running, self.length, rt.uniforms()[:, None])
        value = values.gather(1, pos)
        if self.exact:
            tokens = self.ids.gather(1, pos)
        else:  # topk's ids are arbitrary among ties: take the n-th equal token by id, the tie rule
            tokens = K.nth_equal_scan(x, value, pos - (values > value).sum(-1, keepdim=True))
        if rt.wants(SAMPLED):
            if self.exact:
                kept = m.masked_fill(torch.arange(m.shape[-1], device=x.device) >= self.length, 0.0)
                dist = torch.zeros(x.shape, dtype=torch.float32, device=x.device).scatter_(
                    1, self.ids, (kept / mass).float()
                )
            else:  # from the candidates' values alone, in the units of m
                weights = x.double()
                if self.from_logits:
                    weights = torch.exp((weights - values[:, :1].double()) / self._scale()) * m[:, :1]
                dist = (torch.where(self.keep(), weights, 0.0) / mass).float()
            rt.emit(SAMPLED, TaggedTensor.probs(dist))
        return report_draw(rt, tokens, logprobs, logprobs > float("-inf"))


# --------------------------------------------------------------------------- logits and softmax


class TemperatureOp(Op):
    """``logits / temperature``. Does not synchronise."""

    IN, OUT, PARAMS = LOGITS, LOGITS, ("temperature",)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return TaggedTensor.logits(x.data / K.as_column(rt.param(self, "temperature"), x.data))


class SoftmaxOp(Op):
    """Logits to probabilities (float32). Does not synchronise."""

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

    @property
    def name(self) -> str:
        words = (p.name.removesuffix("Op").removeprefix("Probs").removeprefix("Logits") for p in self.parts)
        return "Fused" + "".join(words) + "Op"


class TemperatureSoftmaxOp(_FusedOp):
    """``softmax(logits / temperature)`` in one op. Does not synchronise."""

    IN, OUT, PARAMS = LOGITS, PROBS, ("temperature",)

    @property
    def name(self) -> str:
        return "TemperatureSoftmaxOp"

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        t = rt.param(self.parts[0], "temperature")
        return TaggedTensor.probs(torch.softmax(x.data.float() / K.as_column(t, x.data), dim=-1))


# --------------------------------------------------------------------------- filters and samplers


class FilterOp(Op):
    """Top-k, top-p or min-p (``kind``): the tokens its chain of one keeps, on ``input_type``.

    On LOGITS (top-k only) the others become -inf; on PROBS they become 0 and
    the rest is renormalised unless ``renormalize`` is off (the joint
    filter's top-k). Synchronises as :class:`Chain` does (only under the
    ``"cpu"`` algorithm).
    """

    def __init__(
        self,
        kind: Literal["top_k", "top_p", "min_p"],
        input_type: TensorType,
        stage: str = "",
        ends_stage: bool = True,
        *,
        renormalize: bool = True,
        **defaults: Any,
    ) -> None:
        super().__init__(stage, ends_stage, **defaults)
        self.kind, self.renormalize, self.PARAMS = kind, renormalize, (kind,)
        self.IN = self.OUT = input_type

    @property
    def name(self) -> str:
        word = {"top_k": "TopK", "top_p": "TopP", "min_p": "MinP"}[self.kind]
        return _typed(("" if self.renormalize else "Joint") + word + "Op", self.IN)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        keep = Chain(x.data, rt, [self], from_logits=self.IN is LOGITS).keep()
        if self.IN is LOGITS:
            return TaggedTensor.logits(x.data.masked_fill(~keep, float("-inf")))
        kept = torch.where(keep, x.data, 0.0)
        return TaggedTensor.probs(kept / kept.sum(-1, keepdim=True) if self.renormalize else kept)


class SampleOp(_FusedOp):
    """Softmax (with temperature) if given LOGITS, a chain of filters, then one draw per row by the CDF in the order.

    A ``Sample`` processor legalizes into a sampler with no filters; the
    fusion rules build samplers that replace the ops before them (kept as
    ``parts``): ``filters`` describe the chain in order, and ``temperature``
    is the op holding the temperature default, if any. Synchronises as
    :class:`Chain` does.
    """

    OUT = INDICES

    def __init__(
        self,
        input_type: TensorType,
        stage: str = "",
        *,
        parts: Sequence[Op] = (),
        filters: Sequence[FilterOp] = (),
        temperature: Op | None = None,
    ) -> None:
        if parts:
            super().__init__(parts)
        else:
            Op.__init__(self, stage)
            self._parts = (self,)
        if not fusable(filters):
            raise PipeError(f"a sampler cannot run the filter chain {[f.kind for f in filters]} exactly")
        self.IN, self.filters, self.temperature = input_type, tuple(filters), temperature

    @property
    def name(self) -> str:
        return _typed("SampleOp", self.IN) if self._parts == (self,) else super().name

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        return Chain(x.data, rt, self.filters, self.IN is LOGITS, self.temperature).sample()


class GreedyOp(Op):
    """The arg-max (lowest id among ties); its log-probability under ``softmax(logits)``, or renormalised probabilities.

    Does not synchronise.
    """

    OUT = INDICES

    def __init__(self, input_type: TensorType, stage: str = "") -> None:
        super().__init__(stage)
        self.IN = input_type

    @property
    def name(self) -> str:
        return _typed("GreedyOp", self.IN)

    def __call__(self, x: TaggedTensor, rt: Runtime) -> TaggedTensor:
        w = x.data.float()
        best, tokens = w.max(dim=-1)  # first maximum: the lowest id among ties
        if self.IN is LOGITS:
            logprobs = best.double() - torch.logsumexp(w, dim=-1).double()
        else:
            logprobs = torch.log(best.double()) - torch.log(w.sum(-1).double())
        if rt.wants(SAMPLED):
            one_hot = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            rt.emit(SAMPLED, TaggedTensor.probs(one_hot.scatter_(1, tokens[:, None], 1.0)))
        return report_draw(rt, tokens, logprobs, torch.isfinite(logprobs) & torch.isfinite(best))


class FunctionOp(Op):
    """A user's function ``fn(tensor) -> tensor`` from one tensor type to another (synchronises if ``fn`` does)."""

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
            raise PipeError(
                f"stage {self.stage!r}: the function must return a tensor of shape {tuple(expected)}, got {got}"
            )
        return TaggedTensor(y, self.OUT)
