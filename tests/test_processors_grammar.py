"""Regex, JSON and CFG processors on llguidance, with a tokenizer built here (no model needed)."""

from __future__ import annotations

import re

import pytest
import torch

from logitscope.samples import ARITHMETIC  # the grammar of the shipped sample run
from processors import BatchContext, CFGLogitsProcessor, JSONLogitsProcessor, RegexLogitsProcessor
from processors.grammar import llguidance_tokenizer

EOT = "<|endoftext|>"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few lines like the demo model's corpus."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    lines = [
        '{"name": "Alice Moreau", "age": 34, "city": "Lyon"}',
        '{"name": "Maria Rossi", "age": 27, "city": "Rome"}',
        "Call Maria at (555) 123-4567. Alice lives in Paris.",
        "12 + 7 = 19",
        "3 * 4 = 12",
    ] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT, pad_token=EOT)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def context(generated: list[list[int]], prompt: int = 2, eos: int = 0) -> BatchContext:
    rows = [[eos] * prompt + list(g) for g in generated]
    return BatchContext(input_ids=torch.tensor(rows, dtype=torch.long), prompt_length=prompt)


def allowed(proc, ctx: BatchContext, width: int) -> torch.Tensor:
    """[B, width] bool: the tokens the processor leaves finite."""
    out = proc.process(torch.zeros(ctx.batch_size, width), ctx)
    return torch.isfinite(out)


def accepts(proc, tok, text: str) -> bool:
    """Whether the processor lets a row generate ``text`` and then end."""
    proc.reset()
    try:
        mask = allowed(proc, context([ids(tok, text)]), len(tok))
    except ValueError:
        return False
    return bool(mask[0, tok.eos_token_id])


# --------------------------------------------------------------- constraints


@pytest.mark.parametrize(
    "text, ok",
    [("(555) 123-4567", True), ("(555) 123-456", False), ("555-123-4567", False), ("(555) 123-45678", False)],
)
def test_regex_accepts_exactly_the_full_matches(tok, text, ok):
    assert accepts(RegexLogitsProcessor(PHONE, tok), tok, text) is ok
    assert (re.fullmatch(PHONE, text) is not None) is ok


def test_regex_first_step_allows_only_tokens_starting_the_pattern(tok):
    proc = RegexLogitsProcessor(PHONE, tok)
    mask = allowed(proc, context([[]]), len(tok))[0]
    allowed_text = [tok.decode([t]) for t in mask.nonzero().flatten().tolist()]
    assert allowed_text and all(t.startswith("(") for t in allowed_text)
    assert not mask[tok.eos_token_id], "EOS must not be allowed before the pattern is complete"


def test_eos_is_allowed_exactly_when_the_grammar_accepts(tok):
    proc = RegexLogitsProcessor(r"[0-9]{1,3}", tok)
    eos = tok.eos_token_id
    for text, complete in [("", False), ("1", True), ("12", True), ("123", True)]:
        proc.reset()
        mask = allowed(proc, context([ids(tok, text)]), len(tok))[0]
        assert bool(mask[eos]) is complete, text
    # after three digits the grammar can only end
    assert allowed(proc, context([ids(tok, "123")]), len(tok))[0].nonzero().flatten().tolist() == [eos]


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"name": "Alice", "age": 34, "city": "Lyon"}', True),
        ('{"name":"Alice","age":34,"city":"Lyon"}', True),
        ('{"name": "Alice", "age": "34", "city": "Lyon"}', False),
        ('{"name": "Alice", "age": 34}', False),
        ('{"name": "Alice", "age": 34, "city": "Lyon", "job": "chef"}', False),
    ],
)
def test_json_schema_accepts_valid_documents_only(tok, text, ok):
    assert accepts(JSONLogitsProcessor(PERSON, tok, separators=None), tok, text) is ok


def test_json_separators_fix_the_whitespace(tok):
    proc = JSONLogitsProcessor(PERSON, tok)  # the default: (", ", ": ") and no other whitespace
    assert accepts(proc, tok, '{"name": "Alice", "age": 34, "city": "Lyon"}')
    assert not accepts(proc, tok, '{"name":"Alice","age":34,"city":"Lyon"}')
    assert not accepts(proc, tok, '{"name": "Alice", "age": 34, "city": "Lyon" }')
    compact = JSONLogitsProcessor(PERSON, tok, separators=(",", ":"))
    assert accepts(compact, tok, '{"name":"Alice","age":34,"city":"Lyon"}')
    assert accepts(
        JSONLogitsProcessor(PERSON, tok, separators=None), tok, '{ "name" :"Alice",\n "age": 34, "city": "Lyon"}'
    )


def test_json_schema_from_pydantic_model_and_string(tok):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str
        age: int
        city: str

    import json

    for schema in (Person, json.dumps(PERSON)):
        proc = JSONLogitsProcessor(schema, tok)
        assert accepts(proc, tok, '{"name": "Alice", "age": 34, "city": "Lyon"}')
        assert not accepts(proc, tok, '{"name": "Alice", "age": 34.5, "city": "Lyon"}')


@pytest.mark.parametrize(
    "text, ok", [("12 + 7 = 19", True), ("3 * 4 = 12", True), ("12 + 7 =", False), ("12 / 7 = 1", False)]
)
def test_lark_grammar(tok, text, ok):
    assert accepts(CFGLogitsProcessor(ARITHMETIC, tok), tok, text) is ok


def test_gbnf_grammar(tok):
    proc = CFGLogitsProcessor('root ::= [0-9]+ " + " [0-9]+', tok, syntax="gbnf")
    assert accepts(proc, tok, "12 + 7")
    assert not accepts(proc, tok, "12 +")


# --------------------------------------------------------------- per-row state


def test_each_row_has_its_own_matcher(tok):
    proc = RegexLogitsProcessor(r"(ab|cd)[0-9]", tok)
    a, c = ids(tok, "a"), ids(tok, "c")
    mask = allowed(proc, context([a, c]), len(tok))
    b_tokens = [t for t in range(len(tok)) if tok.decode([t]) == "b"]
    d_tokens = [t for t in range(len(tok)) if tok.decode([t]) == "d"]
    assert mask[0, b_tokens].all() and not mask[0, d_tokens].any()
    assert mask[1, d_tokens].all() and not mask[1, b_tokens].any()


def test_finished_rows_are_allowed_eos_only(tok):
    """A row that ended keeps getting padding (here EOS) from the host; it must stay valid."""
    proc = RegexLogitsProcessor(r"[0-9]{1,3}", tok)
    eos = tok.eos_token_id
    one = ids(tok, "1")
    step = context([one + [eos, eos], one + ids(tok, "2") + ids(tok, "3")])
    mask = allowed(proc, step, len(tok))
    assert mask[0].nonzero().flatten().tolist() == [eos]
    assert mask[1].nonzero().flatten().tolist() == [eos]


def test_rows_ended_by_the_host_with_a_pad_token_that_is_not_eos(tok):
    """Hosts stop rows for their own reasons (stop strings, length) and pad them; such rows are left alone."""
    from transformers import PreTrainedTokenizerFast

    padded = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=EOT, pad_token="x")
    pad, eos = padded.pad_token_id, padded.eos_token_id
    assert pad != eos
    proc = RegexLogitsProcessor(r"[0-9]{1,3}", padded)
    digit = ids(tok, "1")
    step = context([digit + [pad, pad, pad], digit * 3 + [eos]])
    mask = allowed(proc, step, len(tok))
    assert mask[0].nonzero().flatten().tolist() == [eos]
    assert mask[1].nonzero().flatten().tolist() == [eos]
    assert proc.allowed_token_mask(step).shape == (2, len(tok))
    proc.reset()
    with pytest.raises(ValueError, match="the text was already complete"):
        allowed(proc, context([digit * 4]), len(tok))


def test_state_follows_the_context_step_by_step_and_repeated_calls_change_nothing(tok):
    proc = RegexLogitsProcessor(PHONE, tok)
    tokens = ids(tok, "(555) 123-4567")
    for k in range(len(tokens) + 1):
        first = allowed(proc, context([tokens[:k]]), len(tok))
        again = allowed(proc, context([tokens[:k]]), len(tok))
        assert torch.equal(first, again)
        if k < len(tokens):
            assert first[0, tokens[k]], f"step {k}: the next token of a valid text must be allowed"
    assert first[0, tok.eos_token_id]


def test_reset_and_a_shorter_context_start_a_new_generation(tok):
    proc = RegexLogitsProcessor(r"[0-9]{1,3}", tok)
    allowed(proc, context([ids(tok, "123")]), len(tok))
    fresh = allowed(proc, context([[]]), len(tok))
    assert not fresh[0, tok.eos_token_id]
    allowed(proc, context([ids(tok, "123")]), len(tok))
    proc.reset()
    assert torch.equal(allowed(proc, context([[]]), len(tok)), fresh)


def test_a_disallowed_generated_token_is_reported(tok):
    proc = RegexLogitsProcessor(PHONE, tok)
    with pytest.raises(ValueError, match=r"row 0 generated token \d+"):
        proc.process(torch.zeros(1, len(tok)), context([ids(tok, "abc")]))


def test_batch_size_change_mid_generation_is_an_error(tok):
    proc = RegexLogitsProcessor(PHONE, tok)
    allowed(proc, context([ids(tok, "(5")]), len(tok))
    with pytest.raises(ValueError, match="started with 1 rows but the batch now has 2"):
        allowed(proc, context([ids(tok, "(55"), ids(tok, "(55")]), len(tok))


def test_tokens_beyond_the_tokenizer_are_never_allowed(tok):
    proc = RegexLogitsProcessor(r"[a-z]*", tok)
    mask = allowed(proc, context([[]]), len(tok) + 45)
    assert mask[0, : len(tok)].any()
    assert not mask[0, len(tok) :].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_keep_their_type_and_the_same_mask(tok, dtype):
    proc = RegexLogitsProcessor(PHONE, tok)
    first, second = ids(tok, "(555) 123-4567"), ids(tok, "(12")
    ctx = context([first[: len(second)], second])
    logits = torch.randn(2, len(tok)).to(dtype)
    out = proc.process(logits.clone(), ctx)
    reference = proc.process(logits.float(), ctx)
    assert out.dtype == dtype
    assert torch.equal(torch.isfinite(out), torch.isfinite(reference))
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept]), "allowed logits must be left unchanged"


def test_processor_works_in_place_and_says_so(tok):
    proc = RegexLogitsProcessor(PHONE, tok)
    logits = torch.zeros(1, len(tok))
    assert proc.process(logits, context([[]])) is logits
    assert proc.inplace is True
    assert "in place" in (RegexLogitsProcessor.__doc__ or "")


def test_tokenizer_setup_is_cached_per_tokenizer(tok):
    assert llguidance_tokenizer(tok) is llguidance_tokenizer(tok)
    other = tiny_tokenizer()
    assert llguidance_tokenizer(other) is not llguidance_tokenizer(tok)


def test_deepcopy_shares_the_grammar_but_not_the_state(tok):
    import copy

    proc = RegexLogitsProcessor(r"[0-9]{1,3}", tok)
    allowed(proc, context([ids(tok, "12")]), len(tok))
    clone = copy.deepcopy(proc)
    assert clone._template is proc._template
    assert torch.equal(
        allowed(clone, context([[]]), len(tok)),
        allowed(RegexLogitsProcessor(r"[0-9]{1,3}", tok), context([[]]), len(tok)),
    )


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda tok: RegexLogitsProcessor("(555", tok),
            r"(?s)pattern: the regex '\(555' cannot be compiled: .*unclosed group",
        ),
        (lambda tok: RegexLogitsProcessor("", tok), "pattern must be a non-empty regular expression"),
        (
            lambda tok: JSONLogitsProcessor({"type": "array", "uniqueItems": True}, tok),
            r"(?s)schema: the JSON schema cannot be compiled: .*uniqueItems",
        ),
        (lambda tok: JSONLogitsProcessor('{"type": ', tok), "schema: the string is not valid JSON"),
        (lambda tok: JSONLogitsProcessor(PERSON, tok, separators=(";", ":")), "separators must be an"),
        (
            lambda tok: CFGLogitsProcessor("start: number", tok),
            '(?s)grammar: the lark grammar cannot be compiled: .*unknown name: "number"',
        ),
        (
            lambda tok: CFGLogitsProcessor("root ::= [0-9", tok, syntax="gbnf"),
            "grammar: the gbnf grammar cannot be compiled",
        ),
        (
            lambda tok: CFGLogitsProcessor("start: /a/", tok, syntax="ebnf"),
            "syntax must be 'lark' or 'gbnf', got 'ebnf'",
        ),
    ],
)
def test_bad_input_fails_at_construction_with_the_engines_message(tok, make, message):
    with pytest.raises(ValueError, match=message):
        make(tok)


def test_lenient_json_ignores_unsupported_keywords(tok):
    proc = JSONLogitsProcessor({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, tok, lenient=True)
    assert accepts(proc, tok, "[1, 2]")


def test_schema_of_the_wrong_type(tok):
    with pytest.raises(
        TypeError, match="schema must be a JSON-schema dict, a JSON string or a pydantic model class, got int"
    ):
        JSONLogitsProcessor(42, tok)


def test_a_run_keeps_the_whole_schema_and_grammar_it_was_constrained_by(tok):
    """The processor's text a run keeps (and the dashboard shows) is the whole constraint, not a cut of it."""
    import json

    from tracker import LogitTrackingProcessor

    schema = {**PERSON, "properties": {**PERSON["properties"], "city": {"enum": ["Lyon", "Oslo", "Lima"]}}}
    compact = JSONLogitsProcessor(schema, tok, separators=[",", ":"], lenient=True)
    for proc, parts in (
        (JSONLogitsProcessor(schema, tok), [repr(json.dumps(schema))]),
        (compact, [repr(json.dumps(schema)), "separators=(',', ':')", "lenient=True"]),
        (CFGLogitsProcessor(ARITHMETIC, tok), [repr(ARITHMETIC)]),
    ):
        kept = LogitTrackingProcessor(proc, tokenizer=tok).run.metadata.processors
        for part in parts:
            assert part in kept
