"""A model with a real-size vocabulary for the benchmarks: the demo model's tokenizer widened to 128,256 tokens
and a small GPT-2 with random weights over it, written to a folder that transformers and vLLM load.

    python benchmarks/wide_model.py OUT_DIR [--vocab 131072] [--layers 2] [--width 64]

The tokenizer is the demo model's byte-level BPE with its vocabulary extended by synthetic tokens up to the
size asked (Llama 3's 128,256 by default): encoding gives the demo model's tokens, every id decodes, and the
logits the model produces are as wide as a real large tokenizer's. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

LLAMA3_VOCAB = 128_256


def build_wide_model(out: str | Path, vocab: int = LLAMA3_VOCAB, layers: int = 2, width: int = 64) -> Path:
    """Write the widened tokenizer and a random GPT-2 (``layers`` blocks of ``width``) into ``out``; returns it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from logitscope.demo_model import DEMO_MODEL_PATH

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads((DEMO_MODEL_PATH / "tokenizer.json").read_text())
    table = spec["model"]["vocab"]
    if vocab < len(table):
        raise ValueError(f"vocab must be at least the demo tokenizer's {len(table)} tokens, got {vocab}")
    for i in range(len(table), vocab):
        table[f"\u0120w{i}"] = i  # a byte-level piece (" w<i>") that decodes like any other token
    (out / "tokenizer.json").write_text(json.dumps(spec))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_MODEL_PATH / name, out / name)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=256,
        n_embd=width,
        n_layer=layers,
        n_head=max(1, width // 32),
        tie_word_embeddings=True,
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    print(build_wide_model(args.out, args.vocab, args.layers, args.width))


if __name__ == "__main__":
    main()
