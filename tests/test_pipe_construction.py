"""Building a pipe: legalization per tensor type, checks at construction, names, errors, repr."""

from __future__ import annotations

import pytest
import torch

from sampling.pipe import (
    Apply,
    CompileError,
    Greedy,
    LegalizationError,
    LogitsPipe,
    MinP,
    Op,
    PipeError,
    Sample,
    Softmax,
    Stage,
    Temperature,
    TensorType,
    TopK,
    TopP,
)
from sampling.pipe.fusion import check_nothing_after_indices, check_single_softmax, check_types
from sampling.pipe.ops import SampleOp, SoftmaxOp, TemperatureOp

LOGITS, PROBS, INDICES = TensorType.LOGITS, TensorType.PROBS, TensorType.INDICES


def test_repr_shows_each_processor_with_its_values_then_the_ops_then_what_runs():
    pipe = LogitsPipe([Temperature(0.7), Softmax(), TopK(50, joint=True), TopP(0.9, name="nucleus"), Sample()])
    text = repr(pipe)
    shown = ("Temperature(0.7)", "Softmax", "TopK(50, joint=True)", "TopP(0.9, name='nucleus')", "Sample")
    stages = [text.index(s) for s in shown]
    assert stages == sorted(stages), text  # in order, each with its values
    ops = [text.index(op.name, text.index("ops=")) for op in pipe.ops]
    assert ops == sorted(ops) and ops[0] > stages[-1], text
    plain = LogitsPipe([TopK(), Sample()], compile=False)
    assert "compiled=[]" in repr(plain)  # nothing compiled yet
    plain.compile()
    assert "compiled=[]" not in repr(plain)


@pytest.mark.parametrize(
    "stages, input_type, ops",
    [
        ([TopK(), Sample()], LOGITS, ["LogitsTopKOp", "LogitsSampleOp"]),
        ([TopK(), Sample()], PROBS, ["ProbsTopKOp", "ProbsSampleOp"]),
        (
            [Softmax(), TopK(joint=True), TopP(), Sample()],
            LOGITS,
            ["SoftmaxOp", "ProbsJointTopKOp", "ProbsTopPOp", "ProbsSampleOp"],
        ),
        ([Greedy()], LOGITS, ["LogitsGreedyOp"]),
        ([Greedy()], PROBS, ["ProbsGreedyOp"]),
        ([MinP(), Sample()], PROBS, ["ProbsMinPOp", "ProbsSampleOp"]),
    ],
)
def test_processors_legalize_by_the_tensor_type_they_receive(stages, input_type, ops):
    pipe = LogitsPipe(stages, input_type=input_type, compile=False)
    assert [op.name for op in pipe.ops] == ops
    assert pipe.output_type is INDICES


def test_input_type_is_inferred_from_the_first_processor():
    assert LogitsPipe([TopK(), Sample()]).input_type is LOGITS
    assert LogitsPipe([TopP(), Sample()]).input_type is PROBS


def test_legalization_errors_name_position_class_and_types():
    with pytest.raises(
        LegalizationError,
        match=r"^Failed to legalize processor 2 \(TopP\): TopP can only be applied to PROBS, got LOGITS$",
    ) as info:
        LogitsPipe([Temperature(), TopK(), TopP(), Sample()])
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, LegalizationError)
    with pytest.raises(
        LegalizationError, match=r"processor 1 \(Temperature\): Temperature can only be applied to LOGITS, got PROBS"
    ):
        LogitsPipe([Softmax(), Temperature(), Sample()])
    with pytest.raises(
        LegalizationError, match=r"processor 1 \(Softmax\): Softmax can only be applied to LOGITS, got PROBS"
    ):
        LogitsPipe([Softmax(), Softmax(), Sample()])
    with pytest.raises(
        LegalizationError, match=r"processor 1 \(TopK\): TopK follows a sampler; nothing may come after INDICES"
    ):
        LogitsPipe([Sample(), TopK()])
    with pytest.raises(LegalizationError, match=r"processor 0 \(TopK\): TopK\(joint=True\) needs PROBS"):
        LogitsPipe([TopK(joint=True), Sample()])


def test_validity_checks_catch_what_user_ops_can_build():
    """A user's function may turn PROBS back into LOGITS; a second Softmax is still refused."""
    with pytest.raises(CompileError, match=r"at most one Softmax, found 2 \(ops \[0, 2\]\)"):
        LogitsPipe([Softmax(), Apply(torch.log, accepts=PROBS, returns=LOGITS), Softmax(), Sample()])
    ops = [SoftmaxOp("softmax"), SampleOp(PROBS, "sample"), SampleOp(PROBS, "again")]
    with pytest.raises(
        CompileError, match=r"op 1 \(ProbsSampleOp\) outputs INDICES, so it must be last; 1 op\(s\) follow it"
    ):
        check_nothing_after_indices(ops, LOGITS)
    with pytest.raises(CompileError, match=r"op 1 \(TemperatureOp\) takes LOGITS, but op 0 \(SoftmaxOp\) gives PROBS"):
        check_types([SoftmaxOp(), TemperatureOp()], LOGITS)
    check_single_softmax(ops, LOGITS)  # one softmax is fine


def test_a_user_check_runs_at_construction():
    def no_min_p(ops, input_type):
        if any(op.name == "ProbsMinPOp" for op in ops):
            raise CompileError("this deployment forbids min-p")

    with pytest.raises(CompileError, match="forbids min-p"):
        LogitsPipe([Softmax(), MinP(0.1), Sample()], validity_checks=[no_min_p])


def test_bad_pipes_and_processors_get_clear_errors():
    with pytest.raises(PipeError, match="at least one processor"):
        LogitsPipe([])
    with pytest.raises(TypeError, match="processor 1 must be a sampling.pipe Stage, got builtin_function_or_method"):
        LogitsPipe([Softmax(), torch.softmax])
    with pytest.raises(PipeError, match=r"input_type must be LOGITS or PROBS, got INDICES"):
        LogitsPipe([Sample()], input_type=INDICES)
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got 1.5"):
        TopP(1.5)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0, got 0"):
        Temperature(0)
    with pytest.raises(ValueError, match=r"top_k must be an int > 0, got 2.5"):
        TopK(2.5)
    with pytest.raises(ValueError, match=r"min_p must be a number in \(0, 1\], got 0"):
        MinP(0)
    with pytest.raises(ValueError, match="joint must be a bool"):
        TopK(5, joint="yes")
    with pytest.raises(PipeError, match=r"processor 1 \(Apply\): the stage name 'sampled' is reserved"):
        LogitsPipe([Softmax(), Apply(torch.sqrt, accepts=PROBS, name="sampled"), Sample()])


def test_stage_names_are_unique():
    pipe = LogitsPipe([Softmax(), TopP(0.9), TopP(0.5, name="narrow"), TopP(0.8), Sample()])
    assert pipe.stage_names == ("softmax", "top_p", "narrow", "top_p_2", "sample")
    assert pipe.tap_stages == ("input", "softmax", "top_p", "narrow", "top_p_2", "sample", "sampled")


def test_a_users_own_stage_and_function():
    class Shift(Stage):
        """Add a constant to every logit (a no-op for sampling, visible in the ops)."""

        ACCEPTS = (LOGITS,)

        def ops_for(self, input_type, stage):
            class ShiftOp(Op):
                IN, OUT = LOGITS, LOGITS

                def __call__(self, x, rt):
                    return type(x)(x.data + 3.0, x.type)

            return [ShiftOp(stage)]

    def ban_zero(logits):
        return logits.index_fill(1, torch.tensor([0]), float("-inf"))

    pipe = LogitsPipe([Shift(), Apply(ban_zero), Softmax(), Sample()])
    assert repr(pipe).startswith(
        "LogitsPipe([Shift -> Apply[ban_zero] -> Softmax -> Sample], ops=[ShiftOp -> FunctionOp[ban_zero]"
    )
    assert pipe.stage_names[:2] == ("shift", "ban_zero")
    logits = torch.zeros(200, 3)
    tokens = pipe(logits, u=torch.rand(200, dtype=torch.float64))
    assert set(tokens.tolist()) == {1, 2}

    wrong = LogitsPipe([Apply(lambda x: x[:, :2]), Sample()])
    with pytest.raises(PipeError, match=r"the function must return a tensor of shape \(1, 3\), got \(1, 2\)"):
        wrong(torch.zeros(1, 3))
