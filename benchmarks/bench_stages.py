"""What a stage per processor costs: the tracker with and without ``processor_stages``, in one process.

    python benchmarks/bench_stages.py [--steps 256] [--vocab 32768 131072] [--repeats 3] [--threads 1]

Per vocabulary size and storage mode, over ``--steps`` steps of batch 1, a
``ProcessorList`` of two processors (a logit bias masking a tenth of the
vocabulary and a repetition penalty) is called through the tracker (the
logitscope protocol, ``tracker.process(logits, ctx)``):

- the bare list (no tracker), the tracker recording ``natural`` and
  ``constrained``, and the tracker recording one stage per processor
  (``natural, after:logit_bias, constrained``); each tracker's cost is its
  time per step minus the bare list's, the fastest of ``--repeats`` runs, and
  the ratio of the two trackers' costs is printed;
- bytes recorded per step (the recorder's row size) for both.

The variants take turns, so that a shared machine's load hits them alike:
read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import time

import torch

from processors import BatchContext, LogitBiasLogitsProcessor, PenaltiesLogitsProcessor, ProcessorList
from tracker import LogitTrackingProcessor


def _processors(vocab: int) -> ProcessorList:
    banned = {int(i): float("-inf") for i in torch.randperm(vocab)[: vocab // 10].tolist()}
    return ProcessorList([LogitBiasLogitsProcessor(banned), PenaltiesLogitsProcessor(repetition_penalty=1.2)])


def _run(processor, rows: torch.Tensor, tokens: torch.Tensor) -> float:
    """Seconds per step of ``processor.process`` over the rows (the tracker told each step's token)."""
    prompt = tokens[:4]
    start = time.perf_counter()
    for step in range(rows.shape[0]):
        ctx = BatchContext(input_ids=torch.cat([prompt, tokens[4 : 4 + step]])[None, :], prompt_length=4)
        processor.process(rows[step : step + 1].clone(), ctx)
        if isinstance(processor, LogitTrackingProcessor):
            processor.on_sampled(tokens[4 + step : 5 + step], ctx)
    return (time.perf_counter() - start) / rows.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"{'vocab':>7} {'storage':>8} {'bare us':>8} {'2 stages us':>12} {'per-proc us':>12} {'ratio':>6} "
        f"{'bytes/step':>11} {'per-proc bytes':>15}"
    )
    for vocab in args.vocab:
        rows = torch.randn(args.steps, vocab) * 3
        tokens = torch.randint(0, vocab, (args.steps + 4,))
        for storage in ("float32", "float16", "topk"):
            best = {"bare": float("inf"), "plain": float("inf"), "stages": float("inf")}
            sizes = {}
            for _ in range(args.repeats):
                for name in best:
                    processors = _processors(vocab)
                    if name == "bare":
                        target = processors
                    else:
                        target = LogitTrackingProcessor(
                            processors, storage=storage, memory_limit=None, processor_stages=name == "stages"
                        )
                    best[name] = min(best[name], _run(target, rows, tokens))
                    if name != "bare":
                        sizes[name] = target.storage.row_bytes(target.recorder.stages, vocab)
                        target.clear()
            plain, stages = (best[k] - best["bare"] for k in ("plain", "stages"))
            print(
                f"{vocab:>7} {storage:>8} {best['bare'] * 1e6:>8.0f} {plain * 1e6:>12.0f} {stages * 1e6:>12.0f} "
                f"{stages / max(plain, 1e-9):>6.2f} {sizes['plain']:>11,} {sizes['stages']:>15,}"
            )


if __name__ == "__main__":
    main()
