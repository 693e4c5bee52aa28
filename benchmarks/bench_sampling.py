"""Time logitscope's compiled LogitsPipe against transformers' sampling warpers, on CPU, in one run.

    python benchmarks/bench_sampling.py [--repeats N] [--threads 2]

Baseline: ``TemperatureLogitsWarper`` + ``TopKLogitsWarper`` + ``TopPLogitsWarper``
(from ``transformers.generation.logits_process``), ``softmax`` and
``torch.multinomial``: what ``model.generate(do_sample=True)`` runs per step.
Pipe: ``LogitsPipe([Temperature(), Softmax(), TopK(), TopP(), Sample()])``
(top-p alone: without ``TopK``), compiled, called with one uniform per row.

Two settings, at batch 1 and 32 and vocabulary 32k and 128k:
``top-k set`` (temperature 0.7, top-k 50, top-p 0.9; goal >= 10x) and
``top-p only`` (temperature 0.7, top-p 0.9; goal >= 2x). Logits are standard
normal times 3. After a warm-up, each point alternates blocks of baseline and
pipe calls (10 calls per block at batch 1, so a call runs warm as in a decode
loop; 1 at batch 32), so a noisy machine slows both alike, and reports the
medians over blocks and their ratio, then the ratio of the fastest blocks
(noise only ever adds time). The load average is printed: other processes
on the machine make 2-thread timings erratic for both sides, since every
parallel op waits for both threads to be scheduled.
Speed is reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sampling.pipe import LogitsPipe, Sample, Softmax, Temperature, TopK, TopP

POINTS = [(1, 32_000), (1, 128_000), (32, 32_000), (32, 128_000)]
SETTINGS = {
    "top-k set": dict(temperature=0.7, top_k=50, top_p=0.9),
    "top-p only": dict(temperature=0.7, top_p=0.9),
}


def transformers_chain(temperature: float, top_p: float, top_k: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' warpers, softmax and multinomial, as ``generate`` runs them."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    warpers.append(TopPLogitsWarper(top_p))
    chain = LogitsProcessorList(warpers)

    def run(logits: torch.Tensor) -> torch.Tensor:
        ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
        probs = torch.softmax(chain(ids, logits), dim=-1)
        return torch.multinomial(probs, 1).squeeze(1)

    return run


def logitscope_pipe(temperature: float, top_p: float, top_k: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The compiled pipe with the same parameters."""
    stages = [Temperature(temperature), Softmax(), *([TopK(top_k)] if top_k else []), TopP(top_p), Sample()]
    pipe = LogitsPipe(stages)

    def run(logits: torch.Tensor) -> torch.Tensor:
        u = torch.rand(logits.shape[0], dtype=torch.float64)
        return pipe(logits, u=u)

    return run


def _block(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_pair(
    a: Callable[[], object], b: Callable[[], object], repeats: int, calls: int
) -> tuple[list[float], list[float]]:
    """Seconds per call of ``a`` and of ``b``, one per block of ``calls`` calls, the two alternating."""
    _block(a, 3), _block(b, 3)
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(_block(a, calls))
        tb.append(_block(b, calls))
    return ta, tb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per point (fewer at large points)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, load average {load}")
    print(f"{'setting':<11} {'batch':>5} {'vocab':>7} {'transformers':>13} {'pipe':>10} {'ratio':>7}  goal        best-of ratio")
    for name, params in SETTINGS.items():
        goal = 10 if "top_k" in params else 2
        base = transformers_chain(**params)
        pipe = logitscope_pipe(**params)
        for batch, vocab in POINTS:
            logits = torch.randn(batch, vocab, generator=gen) * 3
            small = batch * vocab <= 1_000_000
            repeats = args.repeats if small else max(5, args.repeats // 3)
            ta, tb = time_pair(lambda: base(logits), lambda: pipe(logits), repeats, 10 if small else 1)
            t_base, t_pipe = statistics.median(ta), statistics.median(tb)
            ratio = t_base / t_pipe
            mark = "ok" if ratio >= goal else "MISSED"
            print(
                f"{name:<11} {batch:>5} {vocab:>7} {t_base * 1e3:>10.3f} ms {t_pipe * 1e3:>7.3f} ms "
                f"{ratio:>6.1f}x  {f'>={goal}x':<5} {mark:<6} {min(ta) / min(tb):>7.1f}x"
            )


if __name__ == "__main__":
    main()
