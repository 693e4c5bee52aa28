"""Fusion: default rules, priority, cascading (the window steps back), guards, and a user's rules."""

from __future__ import annotations

import pytest
import torch

from sampling.pipe import (
    CompileError,
    FusionRule,
    LogitsPipe,
    MinP,
    Op,
    Sample,
    Softmax,
    TaggedTensor,
    Temperature,
    TensorType,
    TopK,
    TopP,
    default_rules,
)
from sampling.pipe.compiler import fuse
from sampling.pipe.ops import ProbsSampleOp, ProbsTopKOp, ProbsTopPOp, TemperatureOp

LOGITS, PROBS = TensorType.LOGITS, TensorType.PROBS


def _compiled(*stages, **kw) -> list[str]:
    return [op.name for op in LogitsPipe(list(stages), **kw).compiled_ops]


@pytest.mark.parametrize(
    "stages, compiled",
    [
        ([Temperature(), Softmax(), Sample()], ["FusedTemperatureSoftmaxSampleOp"]),
        ([Temperature(), Softmax()], ["TemperatureSoftmaxOp"]),
        ([Softmax(), TopP(), Sample()], ["FusedSoftmaxTopPSampleOp"]),
        ([Temperature(), Softmax(), MinP(), TopK(), TopP(), Sample()], ["FusedTemperatureSoftmaxMinPTopKTopPSampleOp"]),
        ([Temperature(), Softmax(), TopP(), MinP(), Sample()], ["FusedTemperatureSoftmaxTopPMinPSampleOp"]),
        ([Temperature(), Softmax(), TopK(joint=True), TopP(), Sample()], ["FusedTemperatureSoftmaxJointTopKTopPSampleOp"]),
        # min-p before a joint top-k cannot run on candidates (top-p would need min-p's mass over the vocabulary)
        ([Temperature(), Softmax(), MinP(), TopK(joint=True), TopP(), Sample()], ["TemperatureSoftmaxOp", "ProbsMinPOp", "FusedJointTopKTopPSampleOp"]),
        # top-p before top-k cannot either (it needs the whole distribution's mass)
        ([Softmax(), TopP(), TopK(), Sample()], ["SoftmaxOp", "ProbsTopPOp", "FusedTopKSampleOp"]),
        ([Softmax(), TopP()], ["SoftmaxOp", "ProbsTopPOp"]),
        ([TopK(), Sample()], ["FusedTopKSampleOp"]),
    ],
)
def test_default_fusions(stages, compiled):
    assert _compiled(*stages) == compiled


def test_the_joint_rule_is_named_and_outranks_the_generic_ones():
    joint = [r for r in default_rules() if r.name == "joint_top_k_top_p"]
    assert joint and joint[0].prio == max(r.prio for r in default_rules())
    assert joint[0].pattern == (ProbsTopKOp, ProbsTopPOp, ProbsSampleOp)


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

    rule = FusionRule((TemperatureOp, TemperatureOp), lambda w: all("temperature" in op.defaults for op in w), HalfTemperatureOp, 60)
    stages = [Temperature(2.0), Temperature(0.25, name="again"), Softmax(), Sample()]
    fused = LogitsPipe(stages, fusion_rules=[rule])
    plain = LogitsPipe(stages, compile=False)
    assert [op.name for op in fused.compiled_ops] == ["HalfTemperatureOp", "FusedSoftmaxSampleOp"]
    x = torch.randn(64, 30)
    u = torch.rand(64, dtype=torch.float64)
    assert torch.equal(fused(x, u=u), plain(x, u=u))


def test_a_rule_that_breaks_the_types_is_refused():
    bad = FusionRule((TemperatureOp,), lambda w: True, lambda w: ProbsSampleOp(w[0].stage), 99)
    with pytest.raises(CompileError, match=r"Compilation failed: a fusion rule broke the chain of types: op 0 \(ProbsSampleOp\) takes PROBS"):
        LogitsPipe([Temperature(), Softmax(), Sample()], fusion_rules=[bad])


def test_compile_without_default_rules():
    pipe = LogitsPipe([Temperature(), Softmax(), TopK(), Sample()], compile=False)
    pipe.compile(defaults=False)
    assert [op.name for op in pipe.compiled_ops] == ["TemperatureOp", "SoftmaxOp", "ProbsTopKOp", "ProbsSampleOp"]
