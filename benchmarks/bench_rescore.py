"""Re-scoring a run: one forward pass per batch of sequences against one forward pass per step, in one process.

    python benchmarks/bench_rescore.py [--steps 1000] [--sequences 8] [--repeats 3] [--device cpu] [--threads 0]

A run of ``--sequences`` rows of ``--steps`` steps each is recorded by the
tracker from logitscope's ``Generator`` (sampling, ``ignore_eos``), with a
model of the demo model's architecture and vocabulary (4 layers, 128 wide,
1,079 tokens). The demo model's own window holds 256 positions, so for
longer runs the model is the demo model with its position table extended (the
first 256 rows are the demo model's, the rest repeat its last row): the cost
per token is the demo model's. Then the run is rescored by that model with
``Run.rescore``:

- ``method="forward"``: one forward pass per batch of sequences over the
  whole sequence (teacher forcing);
- ``method="stepwise"``: the prompt, then one forward pass per step with a
  KV cache (what a decode loop does; bit for bit the recorded logits).

Both record through the same recorder; the fastest of ``--repeats`` is kept,
the two take turns (a shared machine's load hits both alike), and the ratio
stepwise / forward is printed.
"""

from __future__ import annotations

import argparse
import time

import torch

from logitscope.demo_model import load_demo_model
from sampling import Generator
from tracker import LogitTrackingProcessor

PROMPT = "The phone number of Alice is"


def _model(steps: int, device: str):
    """The demo model, its position table extended to hold the prompt and ``steps`` tokens when it must."""
    model, tokenizer = load_demo_model(device=device)
    need = len(tokenizer(PROMPT)["input_ids"]) + steps + 1
    old = model.transformer.wpe.weight
    if need > old.shape[0]:
        table = torch.nn.Embedding(need, old.shape[1]).to(device)
        with torch.no_grad():
            table.weight[: old.shape[0]] = old
            table.weight[old.shape[0] :] = old[-1]
        model.transformer.wpe = table
        model.config.n_positions = need
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per sequence (default: 1000)")
    parser.add_argument("--sequences", type=int, default=8, help="sequences (default: 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _model(args.steps, args.device)
    tracker = LogitTrackingProcessor(None, tokenizer=tokenizer, storage="float32")
    start = time.perf_counter()
    Generator(model, tokenizer, logits_processor=tracker).generate(
        [PROMPT] * args.sequences, max_new_tokens=args.steps, temperature=1.0, seed=0, ignore_eos=True
    )
    run = tracker.run
    print(f"recorded {args.sequences} x {args.steps} steps in {time.perf_counter() - start:.1f} s ({args.device})")
    best = {"forward": float("inf"), "stepwise": float("inf")}
    for _ in range(args.repeats):
        for method in best:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            again = run.rescore(model, tokenizer, method=method, batch_size=args.sequences, progress=False)
            again.to_arrow()  # every row on the host (drains any device staging)
            best[method] = min(best[method], time.perf_counter() - start)
    rows = args.sequences * args.steps
    for method, seconds in best.items():
        print(f"{method:>9}: {seconds:8.3f} s  ({rows / seconds:10.0f} rows/s)")
    print(f"stepwise / forward: {best['stepwise'] / best['forward']:.1f}x")


if __name__ == "__main__":
    main()
