"""Time logitscope's Generator against ``model.generate`` on the same prompts and settings.

    python benchmarks/bench_generator.py [--repeats 5] [--new-tokens 64] [--threads 2]

Both decode the same number of tokens (end-of-sequence ignored) from the demo
model, greedy and sampled (temperature 0.7, top-k 50, top-p 0.9), at batch 1
and 8, in one process. The table gives medians and the ratio
``model.generate time / Generator time`` (above 1: the Generator is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from logitscope.demo_model import load_demo_model
from sampling import Generator, SamplingParams

PROMPTS = [
    '{"name": "',
    "Call ",
    "12 + 7 = ",
    "The weather in Lyon",
    "Her phone number is ",
    "3 * 4 = ",
    "Alice",
    "Dogs",
]


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 is steadier on a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_demo_model()
    tokenizer.padding_side = "left"
    gen = Generator(model, tokenizer)
    n = args.new_tokens

    settings = {
        "greedy": (SamplingParams(max_new_tokens=n, ignore_eos=True), {"do_sample": False}),
        "t0.7 k50 p0.9": (
            SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=0, max_new_tokens=n, ignore_eos=True),
            {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9},
        ),
    }
    print(f"demo model, {n} new tokens, torch threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'setting':<16}{'batch':>6}{'generate (ms)':>16}{'Generator (ms)':>16}{'ratio':>8}")
    for name, (params, hf_kwargs) in settings.items():
        for batch in (1, 8):
            prompts = PROMPTS[:batch]
            enc = tokenizer(prompts, return_tensors="pt", padding=True)

            def ours():
                gen.generate(prompts, params)

            def theirs():
                with torch.inference_mode():
                    model.generate(
                        **enc,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        pad_token_id=tokenizer.pad_token_id,
                        **hf_kwargs,
                    )

            t_hf = _median_time(theirs, args.repeats)
            t_ours = _median_time(ours, args.repeats)
            print(f"{name:<16}{batch:>6}{t_hf * 1e3:>16.1f}{t_ours * 1e3:>16.1f}{t_hf / t_ours:>8.2f}")


if __name__ == "__main__":
    main()
