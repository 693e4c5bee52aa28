"""One contract, run over every processor convention.

A reference processor depends on everything a convention can know (the
logits, the tokens generated so far, the last token) and keeps per-sequence
state. Each convention is exercised both ways:

- ``to_X(ref)`` called the way host X calls it must give ``ref``'s logits;
- ``from_X(to_X(ref))`` used by logitscope (a BatchContext over a padded batch)
  must give ``ref``'s logits too,

over several steps of a batch of rows with different prompt lengths, and again
after a new generation starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from processors import (
    BatchContext,
    LogitsProcessor,
    ProcessorError,
    ProcessorList,
    as_processor,
    from_dynamo,
    from_transformers,
    from_trtllm,
    from_vllm,
    to_dynamo,
    to_transformers,
    to_trtllm,
    to_vllm,
)

VOCAB = 37


class Reference(LogitsProcessor):
    """Scales the logits, adds a term from the generated tokens, bans one token.

    The banned token is the last generated token + 1, or token 0 before the
    first (a vLLM processor without the prompt cannot see the prompt).

    It also counts its calls since the last reset, to check that adapters
    reset per-sequence state when a new generation starts.
    """

    def __init__(self) -> None:
        self.calls = 0

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        self.calls += 1
        gen = ctx.generated_ids
        term = 0.01 * gen.sum(dim=1, keepdim=True).to(logits.dtype) + 0.1 * ctx.num_generated
        out = logits * 0.5 + term
        if ctx.num_generated:
            out[torch.arange(out.shape[0]), (gen[:, -1] + 1) % logits.shape[-1]] = float("-inf")
        else:
            out[:, 0] = float("-inf")
        return out

    def reset(self) -> None:
        self.calls = 0


def expected(logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """What Reference must produce, computed row by row in float64."""
    rows = []
    for row, _prompt, out in zip(logits.double(), prompts, outputs):
        r = row * 0.5 + 0.01 * sum(out) + 0.1 * len(out)
        r[(out[-1] + 1) % row.shape[0] if out else 0] = float("-inf")
        rows.append(r)
    return torch.stack(rows).float()


@dataclass
class Host:
    """Drives a processor the way one convention's host does, for a batch."""

    name: str
    make: Callable[[LogitsProcessor], object]
    call: Callable[[object, list[list[int]], list[list[int]], torch.Tensor], torch.Tensor]
    new_generation: Callable[[object], None]


def _padded(prompts: list[list[int]], outputs: list[list[int]]) -> tuple[torch.Tensor, int]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p + o for p, o in zip(prompts, outputs)])
    return ids, width


def _call_transformers(proc, prompts, outputs, logits):
    ids, _ = _padded(prompts, outputs)
    return proc(ids, logits.clone())


def _call_vllm(procs, prompts, outputs, logits):
    return torch.stack([f(list(o), logits[i].clone()) for i, (f, o) in enumerate(zip(procs, outputs))])


def _call_vllm_prompt(procs, prompts, outputs, logits):
    return torch.stack(
        [f(tuple(p), list(o), logits[i].clone()) for i, (f, p, o) in enumerate(zip(procs, prompts, outputs))]
    )


def _call_dynamo(procs, prompts, outputs, logits):
    out = logits.clone()
    for i, (f, p, o) in enumerate(zip(procs, prompts, outputs)):
        assert f(p + o, out[i]) is None
    return out


def _call_trtllm(proc, prompts, outputs, logits):
    out = logits.clone()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        view = out[i].view(1, 1, -1)
        assert proc(f"req-{i}", view, [p + o], None, None) is None
    return out


def _call_trtllm_batched(proc, prompts, outputs, logits):
    out = logits.clone()
    views = [out[i].view(1, 1, -1) for i in range(len(prompts))]
    proc.batched([f"req-{i}" for i in range(len(prompts))], views, [[p + o] for p, o in zip(prompts, outputs)])
    return out


def _per_row(factory):
    """Per-request conventions: one callable per row, as vLLM and Dynamo make them."""
    return lambda ref: [factory(ref) for _ in range(3)]


HOSTS = [
    Host("transformers", to_transformers, _call_transformers, lambda p: None),
    Host("vllm", _per_row(lambda r: to_vllm(_clone(r))), _call_vllm, lambda p: None),
    Host("vllm_prompt", _per_row(lambda r: to_vllm(_clone(r), with_prompt=True)), _call_vllm_prompt, lambda p: None),
    Host("dynamo", _per_row(lambda r: to_dynamo(_clone(r))), _call_dynamo, lambda p: None),
    Host("trtllm", to_trtllm, _call_trtllm, lambda p: None),
    Host("trtllm_batched", to_trtllm, _call_trtllm_batched, lambda p: None),
]


def _clone(ref: LogitsProcessor) -> LogitsProcessor:
    return type(ref)()


def _steps(seed: int, n_steps: int = 4):
    """Prompts of different lengths and a random token and logits per step."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[int(t) for t in torch.randint(1, VOCAB, (n,), generator=g)] for n in (5, 2, 3)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(n_steps):
        logits = torch.randn(len(prompts), VOCAB, generator=g) * 3
        yield prompts, [list(o) for o in outputs], logits
        for o in outputs:
            o.append(int(torch.randint(1, VOCAB, (), generator=g)))


@pytest.mark.parametrize("host", HOSTS, ids=lambda h: h.name)
def test_to_convention_matches_reference(host: Host) -> None:
    ref = Reference()
    proc = host.make(ref)
    for generation in range(2):  # the second generation checks reset handling
        for prompts, outputs, logits in _steps(seed=generation):
            got = host.call(proc, prompts, outputs, logits)
            torch.testing.assert_close(got, expected(logits, prompts, outputs), rtol=1e-6, atol=1e-6)


FROM = {
    "transformers": lambda ref: from_transformers(to_transformers(ref)),
    "vllm": lambda ref: from_vllm(factory=lambda: to_vllm(Reference())),
    "vllm_shared": lambda ref: from_vllm(to_vllm(ref)),
    "vllm_prompt": lambda ref: from_vllm(factory=lambda: to_vllm(Reference(), with_prompt=True), with_prompt=True),
    "dynamo": lambda ref: from_dynamo(factory=lambda: to_dynamo(Reference())),
    "trtllm": lambda ref: from_trtllm(to_trtllm(ref)),
    "trtllm_batched": lambda ref: from_trtllm(to_trtllm(ref).batched, batched=True),
}
# vLLM and Dynamo make one callable per request: "factory" gives each row its
# own. "vllm_shared" serves every row with one callable, which is right here
# only because Reference's output depends on nothing but the row it is given.


@pytest.mark.parametrize("name", list(FROM), ids=str)
def test_round_trip_through_logitscope(name: str) -> None:
    proc = ProcessorList([FROM[name](Reference())])
    for generation in range(2):
        proc.reset()
        for prompts, outputs, logits in _steps(seed=10 + generation):
            ids, width = _padded(prompts, outputs)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + len(o)) for p, o in zip(prompts, outputs)])
            ctx = BatchContext(input_ids=ids, prompt_length=width, attention_mask=mask)
            got = proc.process(logits.clone(), ctx)
            torch.testing.assert_close(got, expected(logits, prompts, outputs), rtol=1e-6, atol=1e-6)


def test_native_functions_of_each_convention() -> None:
    """Hand-written functions in each convention, adapted, do what they say."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0, 4, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    ctx = BatchContext(input_ids=ids, prompt_length=3, attention_mask=mask)

    def vllm_fn(output_ids, row):
        return row + len(output_ids)

    def vllm_prompt_fn(prompt_ids, output_ids, row):
        return row + 10 * len(prompt_ids) + output_ids[-1]

    def dynamo_fn(input_ids, row):
        row[input_ids[-1]] = float("-inf")

    def trtllm_fn(req_id, row, token_ids, stream_ptr, client_id):
        assert row.shape == (1, 1, VOCAB) and stream_ptr is None
        row[0, 0, token_ids[0][0]] += 100.0

    torch.testing.assert_close(from_vllm(vllm_fn).process(logits.clone(), ctx), logits + 1)
    got = from_vllm(vllm_prompt_fn, with_prompt=True).process(logits.clone(), ctx)
    torch.testing.assert_close(got, logits + torch.tensor([[20 + 6], [30 + 10]], dtype=torch.float32))
    got = from_dynamo(dynamo_fn).process(logits.clone(), ctx)
    assert got[0, 6] == float("-inf") and got[1, 10] == float("-inf")
    assert torch.isfinite(got).sum() == 2 * VOCAB - 2
    got = from_trtllm(trtllm_fn).process(logits.clone(), ctx)
    # the first token of row 0 is its first real token (4), not the padding
    torch.testing.assert_close(got[0, 4], logits[0, 4] + 100)
    torch.testing.assert_close(got[1, 7], logits[1, 7] + 100)


def test_wrong_shape_and_none_are_named() -> None:
    ctx = BatchContext(input_ids=torch.zeros(2, 3, dtype=torch.long), prompt_length=3)
    logits = torch.randn(2, VOCAB)

    def short(input_ids, scores):
        return scores[:, :-1]

    with pytest.raises(
        ProcessorError, match=r"processor 0 \(short\) returned logits of shape \(2, 36\), expected \(2, 37\)"
    ):
        ProcessorList([short]).process(logits, ctx)

    def dynamo_style(input_ids, scores):
        scores[0] = 0

    with pytest.raises(ProcessorError, match="returned None.*from_dynamo"):
        ProcessorList([dynamo_style]).process(logits, ctx)

    def boom(input_ids, scores):
        raise KeyError("state")

    with pytest.raises(ProcessorError, match=r"processor 1 \(boom\) raised KeyError"):
        ProcessorList([lambda i, s: s, boom]).process(logits, ctx)

    with pytest.raises(ProcessorError, match="returned Tensor.*Dynamo-style"):
        from_dynamo(lambda ids, row: row).process(logits, ctx)
    with pytest.raises(TypeError, match="fn must be callable"):
        from_vllm(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exactly one of fn or factory"):
        from_dynamo(lambda ids, row: None, factory=lambda: None)


@pytest.mark.parametrize("convention", ["vllm", "dynamo"])
@pytest.mark.parametrize("shape", [(2, VOCAB), (1, 0), (0,), (2, 1, VOCAB)])
def test_one_row_conventions_refuse_logits_that_are_not_one_row(convention: str, shape: tuple[int, ...]) -> None:
    # a [2, V] batch read as one row of 2V tokens recorded the wrong vocabulary and masked row 1 whole
    from tracker import LogitTrackingProcessor

    tracker = LogitTrackingProcessor(None)
    fn = to_vllm(tracker) if convention == "vllm" else to_dynamo(tracker)
    with pytest.raises(ValueError, match=r"logits must be one request's row, shape \[vocab\] or \[1, vocab\]"):
        fn([1, 2], torch.randn(shape))
    with pytest.raises(TypeError, match="logits must be a torch.Tensor row"):
        fn([1, 2], [0.1] * VOCAB)
    assert tracker.run.num_rows == 0
    row = torch.randn(1, VOCAB)
    fn([1, 2], row.clone())  # [1, V] and [V] are both one row
    fn([1, 2, 3], row[0].clone())
    assert tracker.run.num_rows == 2 and tracker.run.metadata.vocab_size == VOCAB


def test_transformers_host_infers_prompt_and_new_generations() -> None:
    """Called as transformers does, a processor learns the prompt and sees restarts."""
    ref = Reference()
    logits = torch.randn(1, VOCAB)
    ref(torch.tensor([[1, 2, 3]]), logits.clone())
    ref(torch.tensor([[1, 2, 3, 4]]), logits.clone())
    assert ref.calls == 2
    # a shorter input is a new generation: state reset, new prompt boundary
    out = ref(torch.tensor([[5, 6]]), logits.clone())
    assert ref.calls == 1
    torch.testing.assert_close(out, expected(logits, [[5, 6]], [[]]))
    # an explicit reset followed by a longer prompt also starts afresh
    ref.reset()
    out = ref(torch.tensor([[5, 6, 7, 8, 9]]), logits.clone())
    torch.testing.assert_close(out, expected(logits, [[5, 6, 7, 8, 9]], [[]]))
    # and so does a new prompt longer than the whole last input, with no reset (a processor reused across
    # model.generate calls): its tokens are prompt, not generated
    out = ref(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), logits.clone())
    assert ref.calls == 1
    torch.testing.assert_close(out, expected(logits, [[1, 2, 3, 4, 5, 6, 7]], [[]]))
    # a new prompt exactly one token longer is told apart by its first columns (inputs on the CPU)
    out = ref(torch.tensor([[9, 9, 9, 9, 9, 9, 9, 9]]), logits.clone())
    assert ref.calls == 1
    torch.testing.assert_close(out, expected(logits, [[9, 9, 9, 9, 9, 9, 9, 9]], [[]]))


def test_trtllm_keeps_state_per_request() -> None:
    proc = to_trtllm(Reference())
    row = torch.randn(1, 1, VOCAB)
    proc("a", row.clone(), [[1, 2]])
    proc("b", row.clone(), [[3]])
    proc("a", row.clone(), [[1, 2, 9]])
    assert proc._requests["a"][0].calls == 2
    assert proc._requests["b"][0].calls == 1
    with pytest.raises(ValueError, match=r"logits must be \[beam, 1, vocab\]"):
        proc("a", torch.randn(VOCAB), [[1]])
    for bad in ("5", 2.5, 0, True):
        with pytest.raises(ValueError, match=f"max_requests must be an int >= 1, got {bad!r}"):
            to_trtllm(Reference(), max_requests=bad)


def test_a_wrapped_transformers_processor_is_described_with_its_settings() -> None:
    """A run keeps the processor's repr as its description: the wrapped processor's settings must be in it."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    text = repr(as_processor(RepetitionPenaltyLogitsProcessor(1.7)))
    assert "RepetitionPenaltyLogitsProcessor" in text and "penalty=1.7" in text
    assert repr(as_processor(lambda ids, scores: scores)) == "FromTransformers(<lambda>)"
