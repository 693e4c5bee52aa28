"""Building a tokenizer's vocabulary (token id -> bytes, display, special flags) for real tokenizers.

    python benchmarks/bench_vocab.py                    # the tokenizers under .bench/tokenizers
    python benchmarks/bench_vocab.py --root DIR --repeat 5

Reads ``<root>/<name>/package/models/tokenizer.json`` for Llama-2, Llama-3,
Qwen3 and gpt-oss (see ``tests/test_tokfam_real.py`` for how to fetch them;
absent ones are skipped). The baseline, in the same process, is one batched
``tokenizer.batch_decode`` of every id alone: what a vocabulary built by
decoding would pay at least (and it would still get byte tokens and
in-context spaces wrong). Figures are medians in seconds, after a warm-up.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_generator import _median_time

from processors.vocab import Vocabulary

NAMES = ("llama2", "llama3", "qwen3", "gptoss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / ".bench" / "tokenizers")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    from transformers import PreTrainedTokenizerFast

    print(f"{'tokenizer':<10} {'ids':>8} {'vocabulary':>11} {'batch_decode':>13} {'ratio':>6}")
    for name in NAMES:
        folder = args.root / name / "package" / "models"
        if not (folder / "tokenizer.json").exists():
            print(f"{name:<10} (absent under {args.root})")
            continue
        tok = PreTrainedTokenizerFast.from_pretrained(str(folder), clean_up_tokenization_spaces=False)
        ours = _median_time(lambda: Vocabulary.from_tokenizer(tok), args.repeat)
        base = _median_time(lambda: tok.batch_decode([[i] for i in range(len(tok))]), args.repeat)
        print(f"{name:<10} {len(tok):>8,} {ours:>10.3f}s {base:>12.3f}s {ours / base:>6.2f}")


if __name__ == "__main__":
    main()
