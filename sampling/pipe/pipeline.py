"""``LogitsPipe``: a declarative list of processors, legalized into ops, checked, fused, and run.

>>> LogitsPipe([TopK(50), Sample()])
LogitsPipe([TopK(50) -> Sample], ops=[LogitsTopKOp -> LogitsSampleOp], compiled=[FusedTopKSampleOp])
>>> pipe = LogitsPipe([Temperature(), Softmax(), TopK(), TopP(), Sample()])
>>> tokens = pipe(logits, temperature=0.7, top_k=50, top_p=0.9)
>>> result = pipe.sample(logits, temperature=0.7, top_k=50, top_p=0.9, top_logprobs=5)

Runtime parameters (``temperature``, ``top_k``, ``top_p``, ``min_p``) are
keyword arguments of the call, each a scalar (validated) or a ``[B]`` tensor
(one value per row); a processor's own value is the default. Randomness
comes from ``u`` (one float64 uniform in [0, 1) per row; the
:mod:`sampling.functional` streams pass it) or else from ``generator``.

**Algorithms and synchronisation.** ``algorithm="auto"`` (the default) runs
the CPU algorithms on CPU tensors and the sync-free ones on any other device
(``"sort"`` for small batches, ``"pivot"`` for large ones, chosen by the
batch size); ``"sort"``, ``"pivot"`` and ``"radix"`` may be forced anywhere (see
:mod:`sampling.pipe.kernels`). Every algorithm maps the same uniform to the
same token. A call with a sync-free algorithm does not synchronise when it
cannot raise: ``on_dead="flag"``, a per-row ``top_k`` tensor given with
``max_top_k`` (a host-side bound of its values) and ``u`` on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

from sampling.pipe.fusion import DEFAULT_CHECKS, FusionRule, ValidityCheck, check_types, default_rules, fuse
from sampling.pipe.kernels import ALGORITHMS, Algorithm, resolve_algorithm
from sampling.pipe.stages import Stage
from sampling.pipe.types import (
    INPUT,
    SAMPLED,
    CompileError,
    DeadRowError,
    LegalizationError,
    Op,
    PipeError,
    RawLogprobs,
    Runtime,
    SampleResult,
    TaggedTensor,
    Tap,
    TapFn,
    TensorType,
    check_param,
)


def _join(names: Iterable[str]) -> str:
    return " -> ".join(names)


def dead_row_error(x: TaggedTensor, dead: torch.Tensor, tensors: Iterable[str] = ()) -> DeadRowError:
    """A :class:`DeadRowError` naming the dead rows of ``x`` and why.

    ``tensors`` names the parameters the call gave as per-row tensors, whose
    values are not checked (a temperature of 0 there also leaves a row dead).
    Synchronises: reads which rows are dead and whether they hold NaN or +inf (only once a call is to raise).
    """
    index = dead.nonzero().flatten()
    picked = x.data.index_select(0, index)
    nan, posinf = torch.isnan(picked).any(-1).tolist(), torch.isposinf(picked).any(-1).tolist()
    holds = ["NaN" if n else "+inf" if i else "" for n, i in zip(nan, posinf)]
    by_kind = {kind: [r for r, h in zip(index.tolist(), holds) if h == kind] for kind in ("NaN", "+inf", "")}
    parts = [f"rows {rows} hold {kind} {x.type.name.lower()}" for kind, rows in by_kind.items() if kind and rows]
    if by_kind[""]:
        what = "every logit is -inf or +inf" if x.type is TensorType.LOGITS else "every probability is 0 or inf"
        parts.append(f"rows {by_kind['']} have no allowed token ({what}, or a stage removed every token)")
    if tensors := sorted(tensors):
        parts.append(
            f"the per-row tensors {tensors} are not checked value by value: a temperature <= 0, a NaN or a "
            "value outside its range there also leaves a row with nothing to sample"
        )
    return DeadRowError("cannot sample: " + "; ".join(parts) + " (pass on_dead='flag' for a validity flag)")


def raw_logprobs(x: TaggedTensor, tokens: torch.Tensor, top: int) -> RawLogprobs:
    """The raw log-probabilities of ``tokens`` (and the ``top`` best) under ``x`` (LOGITS or PROBS). Does not synchronise."""
    data = x.data.float()
    if x.type is TensorType.PROBS:
        data = torch.log(data / data.sum(-1, keepdim=True))
    else:
        data = data - torch.logsumexp(data, dim=-1, keepdim=True)
    dead = tokens < 0
    chosen = data.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    ranks = (data > chosen[:, None]).sum(-1) + 1
    top_logprobs, top_ids = torch.topk(data, min(top, data.shape[-1]), dim=-1)
    return RawLogprobs(chosen.masked_fill(dead, float("nan")), ranks.masked_fill(dead, 0), top_ids, top_logprobs)


class LogitsPipe:
    """A pipe of processors (:mod:`sampling.pipe.stages`) over ``[B, V]`` logits or probabilities.

    Args:
        processors: the steps, in order.
        compile: fuse ops now (see :mod:`sampling.pipe.fusion`); otherwise the
            plain ops run until :meth:`compile` is called.
        input_type: LOGITS or PROBS; by default LOGITS unless the first
            processor only accepts PROBS.
        fusion_rules: rules added to the default ones.
        validity_checks: checks added to the default ones.
        algorithm: ``"auto"``, ``"cpu"``, ``"sort"``, ``"pivot"`` or ``"radix"``
            (see the module docstring): ``"auto"`` picks by the input's device
            and batch size.

    Raises :class:`~sampling.pipe.types.PipeError` (a ``ValueError``) naming
    the processor's position, class and the problem. The repr shows the
    processors with the values they carry, the ops, and the compiled ops.
    """

    def __init__(
        self,
        processors: Sequence[Stage],
        *,
        compile: bool = True,
        input_type: TensorType | None = None,
        fusion_rules: Sequence[FusionRule] = (),
        validity_checks: Sequence[ValidityCheck] = (),
        algorithm: Algorithm = "auto",
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise PipeError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
        self.algorithm = algorithm
        processors = list(processors)
        if not processors:
            raise PipeError("a pipe needs at least one processor, got none")
        for i, p in enumerate(processors):
            if not isinstance(p, Stage):
                raise TypeError(f"processor {i} must be a sampling.pipe Stage, got {type(p).__name__}")
        if input_type is None:
            input_type = TensorType.LOGITS if TensorType.LOGITS in processors[0].ACCEPTS else TensorType.PROBS
        if input_type not in (TensorType.LOGITS, TensorType.PROBS):
            raise PipeError(f"input_type must be LOGITS or PROBS, got {input_type}")
        self.processors = tuple(processors)
        self.input_type = input_type
        self.stage_names = self._name_stages()
        self.ops = self._legalize()
        self.checks = [*DEFAULT_CHECKS, *validity_checks]
        for check in self.checks:
            check(self.ops, input_type)
        self.compiled_ops: list[Op] | None = None
        if compile:
            self.compile(fusion_rules)

    # ------------------------------------------------------------------ construction

    def _name_stages(self) -> tuple[str, ...]:
        names: list[str] = []
        for i, p in enumerate(self.processors):
            base = p.default_name
            if base in (INPUT, SAMPLED):
                raise PipeError(f"processor {i} ({type(p).__name__}): the stage name {base!r} is reserved")
            name, n = base, 1
            while name in names:
                n += 1
                name = f"{base}_{n}"
            names.append(name)
        return tuple(names)

    def _legalize(self) -> list[Op]:
        ops: list[Op] = []
        current = self.input_type
        for i, (p, stage) in enumerate(zip(self.processors, self.stage_names)):
            try:
                if current is TensorType.INDICES:
                    raise LegalizationError(f"{type(p).__name__} follows a sampler; nothing may come after INDICES")
                new = p.legalize(current, stage)
            except LegalizationError as e:
                raise LegalizationError(f"Failed to legalize processor {i} ({type(p).__name__}): {e}") from e
            ops.extend(new)
            current = new[-1].OUT
        return ops

    def compile(self, fusion_rules: Sequence[FusionRule] = (), *, defaults: bool = True) -> None:
        """Fuse the ops with the default rules (unless ``defaults=False``) and ``fusion_rules``."""
        fused = fuse(self.ops, [*(default_rules() if defaults else []), *fusion_rules])
        try:
            check_types(fused, self.input_type)
        except CompileError as e:
            raise CompileError(f"Compilation failed: a fusion rule broke the chain of types: {e}") from e
        self.compiled_ops = fused

    # ------------------------------------------------------------------ description

    @property
    def output_type(self) -> TensorType:
        return self.ops[-1].OUT

    @property
    def param_names(self) -> tuple[str, ...]:
        """The runtime parameters this pipe reads."""
        return tuple(sorted({name for op in self.ops for name in op.PARAMS}))

    @property
    def tap_stages(self) -> tuple[str, ...]:
        """The stage names a :class:`~sampling.pipe.taps.Tap` may observe."""
        extra = (SAMPLED,) if self.output_type is TensorType.INDICES else ()
        return (INPUT, *self.stage_names, *extra)

    def __repr__(self) -> str:
        compiled = _join(op.name for op in self.compiled_ops) if self.compiled_ops is not None else ""
        return (
            f"LogitsPipe([{_join(repr(p) for p in self.processors)}], "
            f"ops=[{_join(op.name for op in self.ops)}], compiled=[{compiled}])"
        )

    # ------------------------------------------------------------------ running

    def __call__(
        self,
        x: torch.Tensor | TaggedTensor,
        *,
        u: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        taps: Iterable[Tap] | None = None,
        on_dead: Literal["raise", "flag"] = "raise",
        max_top_k: int | None = None,
        **params: Any,
    ) -> torch.Tensor:
        """Run the pipe; returns the last stage's tensor (token ids ``[B]`` for a sampling pipe).

        A dead row (nothing to sample, or NaN) raises :class:`DeadRowError`.
        Synchronises under ``on_dead="raise"`` (reads whether a row is dead)
        and under the ``"cpu"`` algorithm; otherwise does not synchronise
        (see the module docstring); ``on_dead="flag"`` gives a dead row token -1.
        """
        return self._run(x, u, generator, taps, params, max_top_k, on_dead)[2]

    def sample(
        self,
        x: torch.Tensor | TaggedTensor,
        *,
        u: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        taps: Iterable[Tap] | None = None,
        on_dead: Literal["raise", "flag"] = "raise",
        raw: bool = False,
        top_logprobs: int = 0,
        max_top_k: int | None = None,
        **params: Any,
    ) -> SampleResult:
        """Sample one token per row and say how likely it was (see :class:`SampleResult`).

        ``on_dead="flag"`` returns ``valid`` False (token -1) for dead rows
        instead of raising, and then does not synchronise under a sync-free
        algorithm. ``raw=True`` or ``top_logprobs=n`` adds log-probabilities
        under the pipe's input (:class:`RawLogprobs`), at the cost of a
        log-softmax. ``max_top_k``: a host-side upper bound of a per-row
        ``top_k`` tensor's values (rows above it are cut to it, unchecked), so
        that the candidates' width is known without reading the tensor.
        """
        if self.output_type is not TensorType.INDICES:
            raise PipeError(f"sample() needs a pipe that ends in a sampler, this one ends in {self.output_type.name}")
        if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or top_logprobs < 0:
            raise PipeError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
        tagged, rt, tokens = self._run(x, u, generator, taps, params, max_top_k, on_dead)
        assert rt.logprobs is not None and rt.valid is not None
        extra = raw_logprobs(tagged, tokens, top_logprobs) if raw or top_logprobs else None
        return SampleResult(tokens, rt.logprobs, rt.valid, extra)

    def _run(
        self,
        x: torch.Tensor | TaggedTensor,
        u: torch.Tensor | None,
        generator: torch.Generator | None,
        taps: Iterable[Tap] | None,
        params: dict[str, Any],
        max_top_k: int | None,
        on_dead: str,
    ) -> tuple[TaggedTensor, Runtime, torch.Tensor]:
        """Check a call's arguments (no tensor value is read), run the ops, and read whether a row is dead.

        The ops are the compiled ones if any, except that a tap on a stage that a
        fused op hides runs the plain ops, which emit every stage (and draw the
        same tokens). Reads the device only with ``on_dead="raise"``.
        """
        if on_dead not in ("raise", "flag"):
            raise PipeError(f"on_dead must be 'raise' or 'flag', got {on_dead!r}")
        if isinstance(x, TaggedTensor):
            if x.type is not self.input_type:
                raise PipeError(f"this pipe takes {self.input_type.name}, got a tensor tagged {x.type.name}")
            tagged = x
        elif isinstance(x, torch.Tensor):
            tagged = TaggedTensor(x, self.input_type)
        else:
            raise TypeError(f"x must be a torch.Tensor or a TaggedTensor, got {type(x).__name__}")
        data = tagged.data
        if data.ndim != 2 or data.shape[-1] == 0:
            raise PipeError(f"x must be [batch, vocab] with vocab > 0, got shape {tuple(data.shape)}")
        batch = data.shape[0]
        checked = {}
        for name, value in params.items():
            if name not in self.param_names:
                raise PipeError(f"unknown parameter {name!r}; this pipe takes {list(self.param_names)}")
            if value is not None:
                checked[name] = check_param(name, value, batch)
        if u is not None:
            if not isinstance(u, torch.Tensor) or u.shape != (batch,):
                shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
                raise PipeError(f"u must be a [batch] tensor of uniform numbers ({batch},), got {shape}")
            u = u.to(device=data.device, dtype=torch.float64)
        if max_top_k is not None and (not isinstance(max_top_k, int) or isinstance(max_top_k, bool) or max_top_k < 1):
            raise PipeError(f"max_top_k must be an int >= 1 (a bound of the per-row top_k), got {max_top_k!r}")
        algorithm = resolve_algorithm(self.algorithm, data.device)
        taps_by_stage: dict[str, tuple[TapFn, ...]] = {}
        allowed = self.tap_stages
        for i, tap in enumerate(taps or ()):
            if not isinstance(tap, tuple) or len(tap) != 2:
                raise PipeError(f"taps[{i}] must be a Tap(stage, fn), got {tap!r}")
            stage, fn = tap
            if stage not in allowed:
                raise PipeError(f"taps[{i}]: unknown stage {stage!r}; this pipe has stages {list(allowed)}")
            if not callable(fn):
                raise PipeError(f"taps[{i}]: fn must be callable, got {type(fn).__name__}")
            taps_by_stage[stage] = (*taps_by_stage.get(stage, ()), fn)
        rt = Runtime(batch, data.device, checked, u, generator, taps_by_stage, on_dead == "flag", algorithm, max_top_k)
        ops = self.compiled_ops if self.compiled_ops is not None else self.ops
        if any(part.ends_stage and rt.wants(part.stage) for op in ops for part in op.parts[:-1]):
            ops = self.ops
        y = tagged
        rt.emit(INPUT, y)
        for i, op in enumerate(ops):
            try:
                y = op(y, rt)
            except (PipeError, DeadRowError):
                raise
            except Exception as e:
                raise PipeError(f"op {i} ({op.name}, stage {op.stage!r}) failed: {e}") from e
            if op.ends_stage and rt.wants(op.stage):
                rt.emit(op.stage, y)
        if on_dead == "raise" and rt.valid is not None and not bool(rt.valid.all()):
            raise dead_row_error(
                tagged, ~rt.valid, tensors=[k for k, v in rt.params.items() if isinstance(v, torch.Tensor)]
            )
        return tagged, rt, y.data
