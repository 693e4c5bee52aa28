"""Added tokens in every family: a plain added word and a chat marker read as the tokenizer's own decode reads them.

A WordPiece decoder puts a space before an added word, and a Llama-2 style
normaliser stores a normalised added token as ``"▁<note>"``: the text such a
token adds in the middle of a text is ``" <note>"``, so the run's text, the
token's display and a forced text must say so too. A special chat marker
spells nothing (as ``decode(skip_special_tokens=True)``) and is shown by name.
"""

from __future__ import annotations

import pytest
import torch
from tokfam_tokenizers import FAMILIES, build

from processors import BatchContext, ForcedTextLogitsProcessor, vocab_for
from tracker import LogitTrackingProcessor

MARKER = "<|im_start|>"


@pytest.fixture(scope="module", params=FAMILIES)
def tok(request):
    tok = build(request.param)
    tok.add_tokens(["<note>"])
    tok.add_special_tokens({"additional_special_tokens": [MARKER]})
    return tok


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def added_id(tok, content: str) -> int:
    """The id of an added token (a normalised one goes by its normalised string, so not by ``content``)."""
    (token,) = [i for i, t in tok.added_tokens_decoder.items() if t.content == content]
    return token


def in_context(tok, context: list[int], ids: list[int]) -> str:
    before = tok.decode(context, skip_special_tokens=True)
    after = tok.decode(list(context) + list(ids), skip_special_tokens=True)
    assert after.startswith(before), (before, after)
    return after[len(before) :]


def test_an_added_word_spells_what_decode_shows_in_context(tok):
    vocab = vocab_for(tok)
    context = ids_of(tok, "We went to")
    note, marker = added_id(tok, "<note>"), added_id(tok, MARKER)
    text = in_context(tok, context, [note])
    assert text.strip() == "<note>"
    assert vocab.token_bytes(note) == text.encode() and vocab.display[note] == text
    assert vocab.token_bytes(marker) == b"" and vocab.display[marker] == MARKER
    words = ids_of(tok, " Hello") + [note] + ids_of(tok, " world")
    assert vocab.decode(words) == in_context(tok, context, words)


def test_a_run_through_an_added_word_reads_as_decode_does(tok):
    vocab = vocab_for(tok)
    prompt = ids_of(tok, "We went to")
    note, marker = added_id(tok, "<note>"), added_id(tok, MARKER)
    chosen = ids_of(tok, " Hello") + [note, marker] + ids_of(tok, " world")
    tracker = LogitTrackingProcessor(tokenizer=tok)
    rows = [list(prompt)]
    for token in chosen:
        ctx = BatchContext(input_ids=torch.tensor(rows), prompt_length=len(prompt))
        tracker.process(torch.randn(1, len(tok)), ctx)
        rows[0].append(token)
    tracker.finish(torch.tensor(rows))
    assert tracker.sequence() == in_context(tok, prompt, chosen)
    frame = tracker.to_dataframe(token_ids=True)
    shown = frame[frame["chosen"]].sort_values("position")["token"].tolist()
    assert shown == [vocab.display[t] for t in chosen]
    assert MARKER in shown


def test_forced_text_through_an_added_word_generates_that_text(tok):
    text = " Hello <note> world"
    proc = ForcedTextLogitsProcessor(text, tok)
    prompt = ids_of(tok, "We went to")
    assert in_context(tok, prompt, proc.token_ids) == text
