"""Time logitscope's compiled LogitsPipe against transformers' sampling warpers, in one run.

    python benchmarks/bench_sampling.py [--repeats N] [--threads 2] [--algorithms cpu,sort,radix]
    python benchmarks/bench_sampling.py --device cuda [--repeats N] [--algorithms auto,sort,pivot] [--json FILE]

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
Last, the cost of a ``"sampled"`` tap (top-p only, batch 32, vocabulary
128k): untapped against tapped calls of one pipe, since the distribution
sampled from is built only when a tap asks for it.
Speed is reported, never asserted.

With ``--device cuda`` it runs :func:`pipe_grid` instead (also imported by
``benchmarks/bench_gpu.py``): top-p alone (temperature 0.7, top-p 0.9),
top-k + top-p (temperature 0.7, top-k 50, top-p 0.9) and min-p (temperature
0.7, min-p 0.05) at batch 1, 32, 256 and vocabulary 32k, 128k, goal >= 2x
everywhere. Each call is timed with CUDA events (blocks of 20 calls, the two
sides alternating, medians over blocks); the pipe is called with its uniform
numbers drawn on the device and ``on_dead="flag"``, with ``auto`` (what a
user gets: ``sort`` on a GPU) and
each sync-free algorithm named (default ``sort`` and ``pivot``; ``radix``
on request). Blocks are added (up to ``--max-repeats``) until the ratio's
spread, the interquartile range of the per-block ratios over their median,
is under 10%; the median ratio and that spread are reported. Host synchronisations per call are counted
for both sides with ``torch.cuda.set_sync_debug_mode("warn")`` (transformers'
``torch.multinomial`` may synchronise; the pipe's goal is 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sampling.pipe import SAMPLED, LogitsPipe, MinP, Sample, Softmax, Tap, Temperature, TopK, TopP

POINTS = [(1, 32_000), (1, 128_000), (32, 32_000), (32, 128_000)]
SETTINGS = {
    "top-k set": dict(temperature=0.7, top_k=50, top_p=0.9),
    "top-p only": dict(temperature=0.7, top_p=0.9),
}
GRID_SETTINGS = {
    "top-p": dict(temperature=0.7, top_p=0.9),
    "top-k+top-p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "min-p": dict(temperature=0.7, min_p=0.05),
}
GRID_GOAL = 2.0


def transformers_chain(
    temperature: float, top_p: float | None = None, top_k: int | None = None, min_p: float | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' warpers, softmax and multinomial, as ``generate`` runs them (on the logits' device)."""
    warpers: list[Any] = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p))
    chain = LogitsProcessorList(warpers)

    def run(logits: torch.Tensor) -> torch.Tensor:
        ids = torch.zeros((logits.shape[0], 1), dtype=torch.long, device=logits.device)
        probs = torch.softmax(chain(ids, logits), dim=-1)
        return torch.multinomial(probs, 1).squeeze(1)

    return run


def logitscope_pipe(
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    algorithm: str = "auto",
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The compiled pipe with the same parameters; uniforms drawn on the logits' device, dead rows flagged."""
    stages: list[Any] = [Temperature(temperature), Softmax()]
    stages += [MinP(min_p)] if min_p is not None else []
    stages += [TopK(top_k)] if top_k is not None else []
    stages += [TopP(top_p)] if top_p is not None else []
    pipe = LogitsPipe([*stages, Sample()], algorithm=algorithm)  # type: ignore[arg-type]

    def run(logits: torch.Tensor) -> torch.Tensor:
        u = torch.rand(logits.shape[0], dtype=torch.float64, device=logits.device)
        return pipe(logits, u=u, on_dead="flag")

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


def _cuda_block(fn: Callable[[], object], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


SPREAD_GOAL = 0.10
"""A ratio is reported as settled when the interquartile range of its per-block values is this share of its median."""


def spread(values: Sequence[float]) -> float:
    """The interquartile range of ``values`` over their median (0 for fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / abs(statistics.median(values))


def paired_ratio(
    block_a: Callable[[], float],
    block_b: Callable[[], float],
    repeats: int,
    max_repeats: int | None = None,
    goal: float = SPREAD_GOAL,
) -> dict[str, Any]:
    """Alternate timed blocks of ``a`` and ``b`` until the ratio a/b settles.

    ``block_*`` time one block and return seconds per call. At least
    ``repeats`` pairs, more (up to ``max_repeats``, default 3x) while the
    per-pair ratios' :func:`spread` is above ``goal``. Returns the medians
    ``a``, ``b`` (seconds), the median ``ratio``, its ``spread`` and the
    number of ``pairs``.
    """
    limit = max_repeats if max_repeats is not None else 3 * repeats
    ta: list[float] = []
    tb: list[float] = []
    while len(ta) < repeats or (len(ta) < limit and spread([x / y for x, y in zip(ta, tb)]) > goal):
        ta.append(block_a())
        tb.append(block_b())
    ratios = [x / y for x, y in zip(ta, tb)]
    return dict(
        a=statistics.median(ta),
        b=statistics.median(tb),
        ratio=statistics.median(ratios),
        spread=spread(ratios),
        pairs=len(ratios),
    )


def syncs_per_call(fn: Callable[[], object], calls: int = 5) -> float:
    """Host synchronisations per call of ``fn`` on CUDA, counted by torch's sync debug mode."""
    fn()  # warm: first calls may allocate or build
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught) / calls


def pipe_grid(
    device: str | torch.device = "cuda",
    batches: Sequence[int] = (1, 32, 256),
    vocabs: Sequence[int] = (32_000, 128_000),
    repeats: int = 15,
    algorithms: Sequence[str] = ("auto", "sort", "pivot"),
    settings: dict[str, dict[str, Any]] | None = None,
    max_repeats: int | None = None,
    on_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None,
) -> list[dict[str, Any]]:
    """The pipe against transformers' warpers at every (setting, batch, vocabulary, algorithm).

    Returns one dict per point: ``setting, algorithm, batch, vocab,
    transformers_ms, pipe_ms`` (medians per call), ``ratio`` (median of the
    per-block transformers / pipe ratios, the higher the better; goal
    :data:`GRID_GOAL`), ``spread`` (see :func:`paired_ratio`), ``pairs``,
    ``pipe_syncs`` and ``transformers_syncs`` per call (counted on CUDA only,
    else NaN). Logits are standard normal times 3, float32. On CUDA calls are
    timed with CUDA events in blocks of 20; elsewhere with ``perf_counter``.
    ``on_row`` is called with the rows so far after each new one.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, params in (settings or GRID_SETTINGS).items():
        base = transformers_chain(**params)
        for batch in batches:
            for vocab in vocabs:
                logits = torch.randn(batch, vocab, generator=gen, device=device) * 3
                for algorithm in algorithms:
                    pipe = logitscope_pipe(**params, algorithm=algorithm)
                    a, b = (lambda: base(logits)), (lambda: pipe(logits))
                    calls = 20 if cuda else (10 if batch * vocab <= 1_000_000 else 1)
                    block = _cuda_block if cuda else _block
                    block(a, 3), block(b, 3)
                    m = paired_ratio(lambda: block(a, calls), lambda: block(b, calls), repeats, max_repeats)
                    if cuda:
                        syncs_pipe, syncs_base = syncs_per_call(b), syncs_per_call(a)
                    else:
                        syncs_pipe = syncs_base = float("nan")
                    rows.append(
                        dict(
                            setting=name,
                            algorithm=algorithm,
                            batch=batch,
                            vocab=vocab,
                            transformers_ms=m["a"] * 1e3,
                            pipe_ms=m["b"] * 1e3,
                            ratio=m["ratio"],
                            spread=m["spread"],
                            pairs=m["pairs"],
                            pipe_syncs=syncs_pipe,
                            transformers_syncs=syncs_base,
                        )
                    )
                    on_row(rows)
    return rows


def format_grid(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`pipe_grid`'s rows as a table, with the goal checked."""
    lines = [
        f"{'setting':<12} {'algorithm':<9} {'batch':>5} {'vocab':>7} {'transformers':>13} {'pipe':>10} "
        f"{'ratio':>7} {'spread':>7}  {'goal':<11} syncs/call (pipe, transformers)"
    ]
    for r in rows:
        mark = "ok" if r["ratio"] >= GRID_GOAL else "MISSED"
        lines.append(
            f"{r['setting']:<12} {r['algorithm']:<9} {r['batch']:>5} {r['vocab']:>7} {r['transformers_ms']:>10.3f} ms "
            f"{r['pipe_ms']:>7.3f} ms {r['ratio']:>6.2f}x {r['spread']:>6.1%}  >={GRID_GOAL:g}x {mark:<6} "
            f"{r['pipe_syncs']:.1f}, {r['transformers_syncs']:.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per point (fewer at large points)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (the CPU goals) or cuda (the pipe grid)")
    parser.add_argument(
        "--algorithms",
        default=None,
        help="the pipe's algorithms, comma-separated (cuda default: auto,sort,pivot; cpu default: auto, which runs cpu)",
    )
    parser.add_argument("--max-repeats", type=int, default=None, help="cuda: most blocks per point (default 3x)")
    parser.add_argument("--json", default=None, help="cuda: also write the grid's rows to this JSON file")
    args = parser.parse_args()
    if args.device != "cpu":
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit(
                f"--device {args.device}: CUDA is not available on this machine (torch {torch.__version__})"
            )
        name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
        print(f"torch {torch.__version__}, {name}")
        algorithms = [a for a in (args.algorithms or "auto,sort,pivot").split(",") if a]

        def save(rows: list[dict[str, Any]]) -> None:
            if args.json:  # after every point, so that a run stopped midway leaves what it measured
                with open(args.json + ".tmp", "w") as f:
                    json.dump(dict(device=name, torch=torch.__version__, rows=rows), f, indent=1)
                os.replace(args.json + ".tmp", args.json)

        rows = pipe_grid(
            args.device, repeats=args.repeats, algorithms=algorithms, max_repeats=args.max_repeats, on_row=save
        )
        print(format_grid(rows))
        return
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, load average {load}")
    print(
        f"{'setting':<18} {'batch':>5} {'vocab':>7} {'transformers':>13} {'pipe':>10} {'ratio':>7}  goal        best-of ratio"
    )
    cpu_algorithms = [a for a in (args.algorithms or "auto").split(",") if a]
    for (name, params), algorithm in ((item, a) for item in SETTINGS.items() for a in cpu_algorithms):
        goal = 10 if "top_k" in params else 2
        base = transformers_chain(**params)
        pipe = logitscope_pipe(**params, algorithm=algorithm)
        name = name if algorithm == "auto" else f"{name} [{algorithm}]"
        for batch, vocab in POINTS:
            logits = torch.randn(batch, vocab, generator=gen) * 3
            small = batch * vocab <= 1_000_000
            repeats = args.repeats if small else max(5, args.repeats // 3)
            ta, tb = time_pair(lambda: base(logits), lambda: pipe(logits), repeats, 10 if small else 1)
            t_base, t_pipe = statistics.median(ta), statistics.median(tb)
            ratio = t_base / t_pipe
            mark = "ok" if ratio >= goal else "MISSED"
            print(
                f"{name:<18} {batch:>5} {vocab:>7} {t_base * 1e3:>10.3f} ms {t_pipe * 1e3:>7.3f} ms "
                f"{ratio:>6.1f}x  {f'>={goal}x':<5} {mark:<6} {min(ta) / min(tb):>7.1f}x"
            )
    tap_cost(gen, args.repeats)


def tap_cost(gen: torch.Generator, repeats: int, batch: int = 32, vocab: int = 128_000) -> None:
    """What a ``"sampled"`` tap costs: the pipe builds the ``[B, V]`` distribution only when one asks for it."""
    pipe = LogitsPipe([Temperature(0.7), Softmax(), TopP(0.9), Sample()])
    logits = torch.randn(batch, vocab, generator=gen) * 3
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    taps = [Tap(SAMPLED, lambda t: None)]
    untapped, tapped = time_pair(lambda: pipe(logits, u=u), lambda: pipe(logits, u=u, taps=taps), repeats, 1)
    t_plain, t_tap = statistics.median(untapped), statistics.median(tapped)
    print(
        f"sampled tap (top-p only, batch {batch}, vocab {vocab}): untapped {t_plain * 1e3:.3f} ms, "
        f"tapped {t_tap * 1e3:.3f} ms ({t_tap / t_plain:.2f}x; the tap's distribution is {batch * vocab * 4 / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
