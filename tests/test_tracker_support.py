"""Helpers for the tracker tests: a byte-level BPE tokenizer and a random GPT-2 built here, no network.

The other ``test_tracker_*`` modules import these; the tests below check the
helpers themselves.
"""

from __future__ import annotations

import functools

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from processors import LogitsProcessor

CORPUS = [
    "the cat sat on the mat with a catfish and a cathedral",
    'héllo wörld ☃ 12345 {"name": "Ada", "age": 36}',
    "call 555-0199 now; 2 + 2 = 4 and 12 * 3 = 36",
]


@functools.cache
def byte_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer trained on a tiny corpus (one special token, id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 30, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left"
    )


def random_gpt2(vocab_size: int, seed: int = 0, init: float = 0.5) -> GPT2LMHeadModel:
    """A tiny random GPT-2 whose distributions are far from flat (large initialisation)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=128,
        initializer_range=init,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


class MaskThird(LogitsProcessor):
    """Masks every third token (a new tensor, like most processors)."""

    def process(self, logits, ctx):
        out = logits.clone()
        out[:, ::3] = float("-inf")
        return out


class FailsOnThirdCall:
    """A transformers-style processor that masks odd ids, and raises on its third call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the grammar broke")
        out = scores.clone()
        out[:, 1::2] = float("-inf")
        return out


def record_until_the_processor_raises(tracker, tok, seed: int) -> None:
    """Feed ``tracker`` (wrapping a :class:`FailsOnThirdCall`) random logits for two prompts until it raises,
    as a ``generate()`` would: two steps recorded whole, the third with only the model's row and no token."""
    import pytest

    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(tok(["the cat", "héllo"], padding=True)["input_ids"])
    with pytest.raises(RuntimeError, match="the grammar broke"):
        for _ in range(4):
            out = tracker(ids, torch.randn(2, len(tok), generator=gen) * 3)
            ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)


def json_from_a_fresh_process(module: str, function: str, argument: str, env: dict[str, str]) -> object:
    """``function(argument)`` of the test module ``module``, run in a fresh interpreter with ``env``; its JSON
    result (for measuring what a process's own memory does, free of what earlier tests left behind)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    code = (
        f"import json, sys; sys.path.insert(0, sys.argv[1]); from {module} import {function};"
        f"print(json.dumps({function}(sys.argv[2])))"
    )
    env = {**env, "PYTHONPATH": str(here.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(here), argument], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def spill_six_steps(tracker, rng) -> None:
    """Record six steps of random logits (one row, 6 tokens) through ``tracker``'s own protocol and wait until
    its chunks are on disk (with ``memory_limit=0`` they all spill)."""
    import numpy as np

    from processors import BatchContext

    ids = torch.zeros(1, 1, dtype=torch.long)
    for _ in range(6):
        ctx = BatchContext(input_ids=ids, prompt_length=1)
        tracker.process(torch.from_numpy(rng.standard_normal((1, 6)).astype(np.float32)), ctx)
        token = torch.tensor([1])
        tracker.on_sampled(token, ctx)
        ids = torch.cat([ids, token[:, None]], dim=1)
    tracker.recorder.flush()  # chunks go to disk on a background writer: wait for it


def test_byte_tokenizer_round_trips_text():
    tok = byte_tokenizer()
    text = "the catfish said héllo ☃"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == 0


def test_random_gpt2_is_not_flat():
    model = random_gpt2(64)
    with torch.no_grad():
        probs = model(torch.tensor([[1, 2, 3]])).logits[0, -1].softmax(-1)
    assert float(probs.max()) > 3.0 / 64
