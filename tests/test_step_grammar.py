"""Grammar masks prepared on the worker after on_sampled, and processors used by two hosts in one process."""

from __future__ import annotations

import pytest
import torch
from test_tracker_support import byte_tokenizer, random_gpt2

from processors import BatchContext, ProcessorError

llguidance = pytest.importorskip("llguidance")

from processors import BadWordsLogitsProcessor, JSONLogitsProcessor, RegexLogitsProcessor  # noqa: E402
from sampling import Generator  # noqa: E402

PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def _ctx(generated: list[list[int]], prompt: int = 2, host: bool = True) -> BatchContext:
    rows = [[0] * prompt + g for g in generated]
    return BatchContext(
        input_ids=torch.tensor(rows, dtype=torch.long),
        prompt_length=prompt,
        generated=[list(g) for g in generated] if host else None,
    )


def test_masks_prepared_after_on_sampled_equal_masks_computed_on_the_spot():
    tok = byte_tokenizer()
    width = len(tok) + 7  # a model vocabulary wider than the tokenizer's
    early = RegexLogitsProcessor(PHONE, tok)  # hears each step's tokens through on_sampled
    late = RegexLogitsProcessor(PHONE, tok)  # reads them from the next context only
    texts = ["(555) 123-4567", "(012) 345-6789"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    steps = min(map(len, rows))
    generator = torch.Generator().manual_seed(0)
    for k in range(steps + 1):
        ctx = _ctx([r[:k] for r in rows])
        logits = torch.randn(len(rows), width, generator=generator)
        a = early.process(logits.clone(), ctx)
        b = late.process(logits.clone(), _ctx([r[:k] for r in rows], host=False))
        assert torch.equal(a, b), f"step {k}: the prepared mask differs from the one computed on the spot"
        assert torch.isfinite(a).any(-1).all()
        if k < steps:
            early.on_sampled(torch.tensor([r[k] for r in rows]), ctx)
    assert early.is_accepting() == late.is_accepting()


def test_a_token_the_grammar_refuses_is_reported_at_the_next_step_naming_the_row():
    tok = byte_tokenizer()
    proc = RegexLogitsProcessor(r"[0-9]+", tok)
    digit = tok("1", add_special_tokens=False)["input_ids"]
    letter = tok("a", add_special_tokens=False)["input_ids"]
    ctx = _ctx([[], []])
    proc.process(torch.zeros(2, len(tok)), ctx)
    proc.on_sampled(torch.tensor([digit[0], letter[0]]), ctx)
    with pytest.raises(ValueError, match=r"row 1 generated token"):
        proc.process(torch.zeros(2, len(tok)), _ctx([digit, letter]))


def test_grammar_processors_in_the_generator_then_in_model_generate():
    """Buffers a processor keeps must not be inference tensors (the Generator runs under inference_mode)."""
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=4)
    prompt = "call "
    for make in (
        lambda: RegexLogitsProcessor(r"[0-9]{3}-[0-9]{4}", tok),
        lambda: JSONLogitsProcessor({"type": "array", "items": {"type": "integer"}}, tok),
        lambda: BadWordsLogitsProcessor(["cat"], tok),
    ):
        out = Generator(model, tok, logits_processor=[make()]).generate([prompt], max_new_tokens=6)
        assert out[0].outputs[0].token_ids
        enc = tok([prompt], return_tensors="pt")
        hf = model.generate(
            **enc, logits_processor=[make()], do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id
        )
        # both hosts decode greedily under the same constraint: the same tokens
        generated = hf[0, enc["input_ids"].shape[1] :].tolist()
        assert generated[: len(out[0].outputs[0].token_ids)] == out[0].outputs[0].token_ids


def test_the_generator_reports_a_processor_that_undoes_the_grammar_naming_row_and_processor():
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=4)
    letter = tok("a", add_special_tokens=False)["input_ids"][0]

    def undo(input_ids, scores):  # a later processor that forces a letter into a digits-only row
        forced = torch.full_like(scores, float("-inf"))
        forced[:, letter] = 0.0
        return forced

    generator = Generator(model, tok, logits_processor=[RegexLogitsProcessor(r"[0-9]+", tok), undo])
    with pytest.raises(ProcessorError, match=r"0 \(RegexLogitsProcessor\).*row 0 generated token"):
        generator.generate(["x"], max_new_tokens=4)
