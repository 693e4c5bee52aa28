"""Every processor of the library through every convention's adapters, and on every device and dtype.

The contract: ``from_X(to_X(processor))`` used by logitscope gives, step by
step over a left-padded batch, the logits that ``processor.process`` gives
directly; so does the processor called the way transformers calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from processors import (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    BatchContext,
    CFGLogitsProcessor,
    ForcedTextLogitsProcessor,
    JSONLogitsProcessor,
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    MinNewTokensLogitsProcessor,
    PenaltiesLogitsProcessor,
    ProcessorList,
    RegexLogitsProcessor,
    TemperatureLogitsProcessor,
    from_dynamo,
    from_trtllm,
    from_vllm,
    to_dynamo,
    to_trtllm,
    to_vllm,
)

EOT = "<|endoftext|>"
EXTRA = 5  # the model's vocabulary is wider than the tokenizer's
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    lines = ['{"name": "Alice", "age": 34}', "Call Maria at (555) 123-4567.", "12 + 7 = 19", "Hello world!"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=300, min_frequency=2, special_tokens=[EOT], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT, pad_token=EOT)


MAKERS: dict[str, Callable[[Any], LogitsProcessor]] = {
    "regex": lambda tok: RegexLogitsProcessor(r"\(\d{3}\) \d{3}-\d{4}", tok),
    "json": lambda tok: JSONLogitsProcessor(PERSON, tok),
    "cfg": lambda tok: CFGLogitsProcessor('start: N " + " N " = " N\nN: /[0-9]{1,2}/', tok),
    "bad_words_text": lambda tok: BadWordsLogitsProcessor(["Alice", "555"], tok),
    "bad_words_tokens": lambda tok: BadWordsLogitsProcessor(["Alice", "Maria"], tok, mode="tokens"),
    "bias": lambda tok: LogitBiasLogitsProcessor({"Hello": 3.0, 7: -2.0, 9: float("-inf")}, tok),
    "forced": lambda tok: ForcedTextLogitsProcessor("Hello world!", tok),
    "temperature": lambda tok: TemperatureLogitsProcessor(0.7),
    "min_new_tokens": lambda tok: MinNewTokensLogitsProcessor(3, tok.eos_token_id),
    "allowed": lambda tok: AllowedTokenIdsLogitsProcessor([0, 5, 6, 7, 40, 41]),
    "penalties": lambda tok: PenaltiesLogitsProcessor(
        repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2
    ),
}

ADAPTERS: dict[str, Callable[[Callable[[], LogitsProcessor]], LogitsProcessor]] = {
    "vllm": lambda make: from_vllm(factory=lambda: to_vllm(make(), with_prompt=True), with_prompt=True),
    "dynamo": lambda make: from_dynamo(factory=lambda: to_dynamo(make())),
    "trtllm": lambda make: from_trtllm(to_trtllm(make())),
    "trtllm_batched": lambda make: from_trtllm(to_trtllm(make()).batched, batched=True),
}

PROMPTS = [[17, 23, 5, 9], [31, 8], [12, 4, 19]]


def _batch(prompts: list[list[int]], outputs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p + o for p, o in zip(prompts, outputs)])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + len(o)) for p, o in zip(prompts, outputs)])
    return ids, mask, width


def _run(tok, name: str, step: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor], seed: int):
    """Drive a direct processor and ``step`` side by side for 8 steps; tokens follow the direct output."""
    direct = MAKERS[name](tok)
    direct.reset()
    gen = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(8):
        ids, mask, width = _batch(PROMPTS, outputs, tok.pad_token_id)
        logits = torch.randn(len(PROMPTS), len(tok) + EXTRA, generator=gen) * 3
        want = direct.process(logits.clone(), BatchContext(input_ids=ids, prompt_length=width, attention_mask=mask))
        got = step(ids, mask, width, logits.clone())
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{name}, step {len(outputs[0])}: {m}")
        for row, token in enumerate(want.argmax(-1).tolist()):
            outputs[row].append(token)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
@pytest.mark.parametrize("name", list(MAKERS))
def test_round_trip_through_each_convention_gives_the_same_logits(tok, name, adapter):
    wrapped = ProcessorList([ADAPTERS[adapter](lambda: MAKERS[name](tok))])
    for generation in range(2):
        wrapped.reset()
        _run(
            tok,
            name,
            lambda ids, mask, width, logits: wrapped.process(
                logits, BatchContext(input_ids=ids, prompt_length=width, attention_mask=mask)
            ),
            seed=generation,
        )


@pytest.mark.parametrize("name", [n for n in MAKERS if n != "penalties"])
def test_called_like_transformers_gives_the_same_logits(tok, name):
    """transformers passes ``(input_ids, scores)`` only; the prompt boundary is inferred."""
    proc = MAKERS[name](tok)
    for generation in range(2):
        _run(tok, name, lambda ids, mask, width, logits: proc(ids, logits), seed=generation)


def test_penalties_called_like_transformers_count_padding_as_prompt(tok):
    """Without an attention mask, padding is part of the prompt (as in transformers' own processor)."""
    proc = MAKERS["penalties"](tok)
    ids, mask, width = _batch(PROMPTS, [[], [], []], tok.pad_token_id)
    logits = torch.randn(3, len(tok)) + 1
    got = proc(ids, logits.clone())
    want = MAKERS["penalties"](tok).process(logits.clone(), BatchContext(input_ids=ids, prompt_length=width))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(MAKERS))
def test_half_precision_keeps_its_dtype_and_bans_the_same_tokens(tok, name, dtype):
    full, half = MAKERS[name](tok), MAKERS[name](tok)
    gen = torch.Generator().manual_seed(0)
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(6):
        ids, mask, width = _batch(PROMPTS, outputs, tok.pad_token_id)
        ctx = BatchContext(input_ids=ids, prompt_length=width, attention_mask=mask)
        logits = (torch.randn(len(PROMPTS), len(tok) + EXTRA, generator=gen) * 3).to(dtype)
        want = full.process(logits.float(), ctx)
        got = half.process(logits.clone(), ctx)
        assert got.dtype == dtype
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
        for row, token in enumerate(want.argmax(-1).tolist()):
            outputs[row].append(token)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(MAKERS))
def test_cuda_gives_the_cpu_result_in_every_dtype(tok, name, dtype):
    cpu, cuda = MAKERS[name](tok), MAKERS[name](tok)
    gen = torch.Generator().manual_seed(0)
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(6):
        ids, mask, width = _batch(PROMPTS, outputs, tok.pad_token_id)
        logits = (torch.randn(len(PROMPTS), len(tok) + EXTRA, generator=gen) * 3).to(dtype)
        want = cpu.process(logits.clone(), BatchContext(input_ids=ids, prompt_length=width, attention_mask=mask))
        got = cuda.process(
            logits.cuda(),
            BatchContext(input_ids=ids.cuda(), prompt_length=width, attention_mask=mask.cuda()),
        )
        assert got.device.type == "cuda" and got.dtype == dtype
        assert torch.equal(torch.isfinite(got.cpu()), torch.isfinite(want))
        torch.testing.assert_close(got.cpu(), want, rtol=1e-2, atol=1e-2)
        for row, token in enumerate(want.float().argmax(-1).tolist()):
            outputs[row].append(token)
