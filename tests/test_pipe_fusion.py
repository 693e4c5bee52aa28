"""Fusion: compiled pipes give what their plain ops give; priority, cascading, guards, and a user's rules."""

from __future__ import annotations

import pytest
import torch

from sampling.pipe import (
    SAMPLED,
    CompileError,
    FusionRule,
    LogitsPipe,
    MinP,
    Op,
    Sample,
    Softmax,
    TaggedTensor,
    Tap,
    Temperature,
    TensorType,
    TopK,
    TopP,
)
from sampling.pipe.fusion import fuse
from sampling.pipe.ops import SampleOp, TemperatureOp

LOGITS, PROBS = TensorType.LOGITS, TensorType.PROBS


PARAMS = dict(temperature=0.8, min_p=0.02, top_k=12, top_p=0.7)


def _run(pipe: LogitsPipe, x: torch.Tensor, u: torch.Tensor):
    """The pipe's output, and for a sampling pipe its log-probabilities and the "sampled" tap."""
    params = {k: v for k, v in PARAMS.items() if k in pipe.param_names}
    if pipe.output_type is not TensorType.INDICES:
        return pipe(x, **params), None, None
    seen = []
    out = pipe.sample(x, u=u, taps=[Tap(SAMPLED, seen.append)], **params)
    return out.tokens, out.logprobs, seen[0].data


@pytest.mark.parametrize("algorithm", ["cpu", "sort", "radix"])
@pytest.mark.parametrize(
    "stages",
    [
        [Temperature(), Softmax(), Sample()],
        [Temperature(), Softmax()],
        [Softmax(), TopP(), Sample()],
        [Temperature(), Softmax(), MinP(), TopK(), TopP(), Sample()],
        [Temperature(), Softmax(), TopP(), MinP(), Sample()],
        [Temperature(), Softmax(), TopK(joint=True), TopP(), Sample()],
        [Temperature(), Softmax(), MinP(), TopK(joint=True), TopP(), Sample()],
        [Softmax(), TopP(), TopK(), Sample()],
        [Softmax(), TopP()],
        [TopK(), Sample()],
        [TopK(), Temperature(), Softmax(), Sample()],
        [TopK(), TopK(name="again"), Sample()],
    ],
    ids=repr,
)
def test_a_compiled_pipe_gives_what_its_plain_ops_give(stages, algorithm):
    """Fusion changes how a pipe runs, never what it gives: tokens, log-probabilities, the distribution."""
    x = torch.randn(48, 2500, generator=torch.Generator().manual_seed(len(stages))) * 3
    u = torch.rand(48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fused = LogitsPipe(stages, algorithm=algorithm)
    plain = LogitsPipe(stages, algorithm=algorithm, compile=False)
    out, logprobs, sampled = _run(fused, x, u)
    plain_out, plain_logprobs, plain_sampled = _run(plain, x, u)
    if sampled is None:
        torch.testing.assert_close(out, plain_out, atol=1e-6, rtol=1e-5)
        return
    differ = int((out != plain_out).sum())
    assert differ == 0, f"{differ} of 48 tokens differ between the compiled pipe and its plain ops"
    torch.testing.assert_close(logprobs, plain_logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(sampled, plain_sampled, atol=1e-6, rtol=1e-5)


class _A(Op):
    IN, OUT = LOGITS, LOGITS

    def __call__(self, x, rt):
        return x


class _B(_A):
    pass


class _X(_A):
    pass


class _Fused(_A):
    def __init__(self, parts, label):
        super().__init__(parts[-1].stage)
        self.label = label

    @property
    def name(self):
        return self.label


def test_fusion_cascades_by_stepping_back_one_op():
    rules = [
        FusionRule((_A, _B), lambda w: True, lambda w: _Fused(w, "AB"), 1),
        FusionRule((_X, _Fused), lambda w: True, lambda w: _Fused(w, "X+" + w[1].name), 1),
    ]
    # (X, A) matches nothing; (A, B) fuses at position 1; the window steps back to 0 and (X, AB) fuses
    assert [op.name for op in fuse([_X(), _A(), _B()], rules)] == ["X+AB"]
    # without stepping back the second fusion would be missed
    assert [op.name for op in fuse([_X(), _A(), _B(), _A(), _B()], rules)] == ["X+AB", "AB"]


def test_higher_priority_rule_wins_and_guards_can_refuse():
    low = FusionRule((_A, _B), lambda w: True, lambda w: _Fused(w, "low"), 1)
    high = FusionRule((_A, _B), lambda w: True, lambda w: _Fused(w, "high"), 5)
    refused = FusionRule((_A, _B), lambda w: False, lambda w: _Fused(w, "never"), 9)
    assert [op.name for op in fuse([_A(), _B()], [low, high, refused])] == ["high"]
    assert [op.name for op in fuse([_A(), _B()], [refused])] == ["_A", "_B"]


def test_a_users_rule_runs_with_the_defaults_and_keeps_the_result():
    class HalfTemperatureOp(Op):
        """Two temperature stages in a row fused into one division (by their product)."""

        IN, OUT, PARAMS = LOGITS, LOGITS, ("temperature",)

        def __init__(self, window):
            super().__init__(window[-1].stage)
            self.window = window

        def __call__(self, x, rt):
            t1, t2 = (op.defaults["temperature"] for op in self.window)
            return TaggedTensor.logits(x.data / (t1 * t2))

    rule = FusionRule(
        (TemperatureOp, TemperatureOp), lambda w: all("temperature" in op.defaults for op in w), HalfTemperatureOp, 60
    )
    stages = [Temperature(2.0), Temperature(0.25, name="again"), Softmax(), Sample()]
    fused = LogitsPipe(stages, fusion_rules=[rule])
    plain = LogitsPipe(stages, compile=False)
    assert isinstance(fused.compiled_ops[0], HalfTemperatureOp)  # the user's rule ran before the defaults
    x = torch.randn(64, 30)
    u = torch.rand(64, dtype=torch.float64)
    assert torch.equal(fused(x, u=u), plain(x, u=u))


def test_a_rule_that_breaks_the_types_is_refused():
    bad = FusionRule((TemperatureOp,), lambda w: True, lambda w: SampleOp(PROBS, w[0].stage), 99)
    with pytest.raises(
        CompileError,
        match=r"Compilation failed: a fusion rule broke the chain of types: op 0 \(ProbsSampleOp\) takes PROBS",
    ):
        LogitsPipe([Temperature(), Softmax(), Sample()], fusion_rules=[bad])


def test_compile_without_default_rules():
    pipe = LogitsPipe([Temperature(), Softmax(), TopK(), Sample()], compile=False)
    pipe.compile(defaults=False)
    assert [type(op) for op in pipe.compiled_ops] == [type(op) for op in pipe.ops]  # nothing fused
