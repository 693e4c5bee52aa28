"""The library on the demo model: what a user sees when sampling at temperature 1 over 20 seeds.

Each check runs the 20 seeds as one batched ``Generator.generate`` call (one
prompt per seed) and asserts on every decoded output; a run without the
processor shows that the processor is what makes the difference.
"""

from __future__ import annotations

import re

import pytest
import torch

from processors import (
    BadWordsLogitsProcessor,
    CFGLogitsProcessor,
    ForcedTextLogitsProcessor,
    JSONLogitsProcessor,
    LogitBiasLogitsProcessor,
    RegexLogitsProcessor,
    vocab_for,
)
from sampling import Generator, SamplingParams

SEEDS = range(20)
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ARITHMETIC = r"""
start: operand " " OP " " operand " = " NUMBER
operand: NUMBER | "(" NUMBER " " OP " " NUMBER ")"
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""
ARITHMETIC_LINE = re.compile(
    r"(?P<a>\d{1,3}|\(\d{1,3} [-+*] \d{1,3}\)) [-+*] (?P<b>\d{1,3}|\(\d{1,3} [-+*] \d{1,3}\)) = \d{1,3}"
)
RECORD = '{"name": "Alice Moreau", "age": 34, "city": "Lyon"}\n'


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The demo model's matrices are tiny: one thread beats two and never oversubscribes a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sample(model, tok, processors, prompt, max_new_tokens: int):
    """One completion per seed, at temperature 1, in one batched call."""
    generator = Generator(model, tok, logits_processor=processors)
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=max_new_tokens) for s in SEEDS]
    outputs = generator.generate([prompt] * len(params), params)
    return [out.outputs[0] for out in outputs]


def test_regex_every_seed_is_a_phone_number(demo):
    model, tok = demo
    done = sample(model, tok, [RegexLogitsProcessor(PHONE, tok)], "Call Maria at ", 20)
    assert [c.finish_reason for c in done] == ["stop"] * len(done)
    assert [c.text for c in done if not re.fullmatch(PHONE, c.text)] == []
    free = sample(model, tok, [], "Call Maria at ", 20)
    assert any(not re.fullmatch(PHONE, c.text) for c in free), "without the processor the model writes other text"


def test_json_every_seed_validates_against_the_schema(demo):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid", strict=True)
        name: str = pydantic.Field(max_length=30)
        age: int = pydantic.Field(ge=0, le=150)
        city: str = pydantic.Field(max_length=30)

    model, tok = demo
    proc = JSONLogitsProcessor(Person, tok, separators=(", ", ": "))
    done = sample(model, tok, [proc], RECORD, 48)
    assert [c.finish_reason for c in done] == ["stop"] * len(done), [c.text for c in done]
    people = [Person.model_validate_json(c.text) for c in done]
    assert len({p.name for p in people}) > 5, "sampling at temperature 1 still varies within the schema"
    free = sample(model, tok, [], RECORD, 48)
    assert any(not _valid(Person, c.text) for c in free), "without the processor outputs run on or add keys"


def _valid(model_class, text: str) -> bool:
    try:
        model_class.model_validate_json(text)
    except ValueError:
        return False
    return True


def test_cfg_every_seed_parses_as_an_arithmetic_line(demo):
    model, tok = demo
    done = sample(model, tok, [CFGLogitsProcessor(ARITHMETIC, tok)], "3 + 4 = 7\n", 40)
    assert [c.finish_reason for c in done] == ["stop"] * len(done)
    assert [c.text for c in done if not ARITHMETIC_LINE.fullmatch(c.text)] == []


def test_bad_words_never_appear_even_when_the_model_likes_them(demo):
    """A bias makes the model want "Alice" after '{"name": "', spelled with any of its pieces; text mode bans them all."""
    model, tok = demo
    vocab = vocab_for(tok)
    pieces = [t for t in range(vocab.size) if vocab.pieces[t] and b"Alice".startswith(vocab.pieces[t])]
    bias = LogitBiasLogitsProcessor({t: 6.0 for t in pieces}, tok)
    prompt = '{"name": "'
    free = sample(model, tok, [bias], prompt, 12)
    assert sum("Alice" in c.text for c in free) >= 10, [c.text for c in free]
    banned = sample(model, tok, [bias, BadWordsLogitsProcessor(["Alice"], tok)], prompt, 12)
    assert [c.text for c in banned if "Alice" in c.text] == []
    assert all(c.text.strip() for c in banned)


def test_forced_text_comes_out_exactly(demo):
    model, tok = demo
    done = sample(model, tok, [ForcedTextLogitsProcessor("Hello world!", tok)], "Call ", 20)
    assert [c.text for c in done] == ["Hello world!"] * len(done)
    assert [c.finish_reason for c in done] == ["stop"] * len(done)


# --------------------------------------------------------------- inside transformers' generate


def _hf_generate(model, tok, prompts, processors, max_new_tokens: int) -> list[str]:
    from transformers import LogitsProcessorList

    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(
        **batch,
        logits_processor=LogitsProcessorList(processors),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
    )
    return tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def test_inside_model_generate_regex_and_bad_words_hold(demo):
    model, tok = demo
    prompts = ["Call Maria at ", "You can reach Omar at ", "Call Maria at ", "Please call "]
    texts = _hf_generate(model, tok, prompts, [RegexLogitsProcessor(PHONE, tok)], 20)
    assert [t for t in texts if not re.fullmatch(PHONE, t)] == []

    vocab = vocab_for(tok)
    pieces = [t for t in range(vocab.size) if vocab.pieces[t] and b"Alice".startswith(vocab.pieces[t])]
    processors = [LogitBiasLogitsProcessor({t: 6.0 for t in pieces}, tok), BadWordsLogitsProcessor(["Alice"], tok)]
    texts = _hf_generate(model, tok, ['{"name": "'] * 8, processors, 12)
    assert [t for t in texts if "Alice" in t] == []


def test_inside_model_generate_json_is_valid(demo):
    import json

    model, tok = demo
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    texts = _hf_generate(model, tok, [RECORD] * 4, [JSONLogitsProcessor(schema, tok, separators=(", ", ": "))], 40)
    for text in texts:
        record = json.loads(text)
        assert set(record) == {"name", "age"} and isinstance(record["name"], str) and isinstance(record["age"], int)
