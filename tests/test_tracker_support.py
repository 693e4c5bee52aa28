"""Helpers for the tracker tests: a byte-level BPE tokenizer and a random GPT-2 built here, no network.

The other ``test_tracker_*`` modules import these; the tests below check the
helpers themselves.
"""

from __future__ import annotations

import functools

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

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
