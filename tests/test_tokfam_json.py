"""JSON that finishes: on the demo model at temperature 1, every seed's document ends with EOS and validates.

With llguidance's flexible whitespace a sampled model could keep emitting
whitespace and never close the object; the default separators leave it no
such loop. Checked inside logitscope's Generator and inside
``model.generate``, 20 seeds each, 60 new tokens at most.
"""

from __future__ import annotations

import json

import torch
from test_processors_demo import one_thread  # noqa: F401  (autouse: the demo model runs best on one thread)

from processors import JSONLogitsProcessor
from sampling import Generator, SamplingParams

SEEDS = range(20)
BUDGET = 60
PROMPT = '{"name": "Alice Moreau", "age": 34}\n'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _valid(text: str) -> bool:
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        set(record) == {"name", "age"}
        and isinstance(record["name"], str)
        and len(record["name"]) <= 30
        and isinstance(record["age"], int)
        and 0 <= record["age"] <= 150
    )


def test_generator_json_ends_with_eos_and_validates_for_every_seed(demo):
    model, tok = demo
    generator = Generator(model, tok, logits_processor=[JSONLogitsProcessor(SCHEMA, tok)])
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=BUDGET) for s in SEEDS]
    done = [out.outputs[0] for out in generator.generate([PROMPT] * len(params), params)]
    assert [c.finish_reason for c in done] == ["stop"] * len(done), [c.text for c in done]
    assert all(c.token_ids[-1] in generator.eos_token_ids for c in done)
    assert [c.text for c in done if not _valid(c.text)] == []


def test_model_generate_json_ends_with_eos_and_validates_for_every_seed(demo):
    from transformers import LogitsProcessorList

    model, tok = demo
    eos = tok.eos_token_id
    texts, ended = [], []
    for seed in SEEDS:
        batch = tok([PROMPT], return_tensors="pt")
        torch.manual_seed(seed)
        out = model.generate(
            **batch,
            logits_processor=LogitsProcessorList([JSONLogitsProcessor(SCHEMA, tok)]),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=BUDGET,
            pad_token_id=tok.pad_token_id,
        )
        new = out[0, batch["input_ids"].shape[1] :].tolist()
        ended.append(eos in new)
        texts.append(tok.decode(new, skip_special_tokens=True))
    assert all(ended), [t for t, e in zip(texts, ended) if not e]
    assert [t for t in texts if not _valid(t)] == []


def test_the_flexible_policy_is_still_available(demo):
    _, tok = demo
    assert JSONLogitsProcessor(SCHEMA, tok, separators=None).separators is None
