"""Measure the tracker against a straightforward one and against the floor, in one process.

    python benchmarks/bench_tracker.py [--steps 512] [--vocab 32768 131072] [--repeats 5]
    python benchmarks/bench_tracker.py --per-step-only --batch 1 8 --storage float32 float16 topk
    python benchmarks/bench_tracker.py --long [--steps 10000] [--vocab 131072]

``--long`` records one long run with the default memory bound (float32,
batch 1, 1 MB per step at 128k: past the 2 GiB bound it spills) and prints
the time per step in blocks of 1,000 steps, the chunk writes against the
chunks spilled, and the peak RSS against the bound plus two chunks. It is
the memory- and disk-heavy one (10,000 steps: about 2.2 GiB of RSS and 8 GiB
of spill files, removed at the end): run it once.

Per vocabulary size, over ``--steps`` steps of ``--batch`` rows (default 1) with a processor that
masks half the vocabulary (called transformers-style, ``tracker(ids, logits)``):

- per-step overhead over the bare processor of: the logitscope tracker (float32
  storage; a new tracker, and one reused after ``clear()``), a straightforward
  tracker (blocking ``.cpu().numpy().copy()`` of both rows into Python lists),
  and the floor (copying the same two rows into a preallocated ``[steps * 2,
  V]`` buffer: untouched, and pre-touched). Fresh memory costs more than the
  copies: the first run of a new tracker, or of the straightforward one, pays
  for it; later runs reuse what earlier ones freed (the tracker through its
  buffer pool, the straightforward one through malloc), so both are shown;
- the tracker's read at the end (``finish()``: building the Arrow run), per step;
- bytes per step for each storage mode (Arrow bytes of the recorded run), and
  how fast a run is written: spill files (Arrow IPC) and Parquet;
- ``get_top_tokens(k=10)`` over all positions and ``to_dataframe(min_value=0.01)``
  against a straightforward per-position implementation (softmax per row,
  sort, decode), first call on a fresh run and repeated calls.

The variants take turns in segments of 32 steps, so that a shared machine's
load hits them alike; each one's cost is its whole run's time per step minus
the bare processor's, the median of ``--repeats`` runs, as wall time, as the
decode thread's CPU time (work moved to a background thread, such as touching
the next chunk's pages or a sealed chunk's statistics, is not the step's) and
as page faults the decode thread took per step. The ratios against the
straightforward tracker (goal: at most 1.0x) close each table. Read the
ratios: absolute times move with the machine's load. At batch 8 and 128k
tokens each variant holds 4 GiB per 512 steps: pass ``--steps 128`` there.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from processors import LogitsProcessor  # noqa: E402
from tracker import LogitTrackingProcessor, Run, Vocabulary  # noqa: E402
from tracker.format.spill import write_ipc  # noqa: E402
from tracker.recording.memory import SHARED_POOL  # noqa: E402

POOL = 8  # distinct logits rows cycled through (as a model would produce new ones)


class HalfMask(LogitsProcessor):
    """Masks a fixed random half of the vocabulary (returns a new tensor, like most processors).

    One numpy addition on one thread: a cheap, steady baseline to measure the
    tracker against (a multi-threaded torch kernel stalls for milliseconds
    when the machine is busy, burying the differences being measured).
    """

    def __init__(self, vocab: int) -> None:
        mask = torch.rand(vocab, generator=torch.Generator().manual_seed(1)) < 0.5
        self.bias = np.where(mask.numpy(), -np.inf, 0.0).astype(np.float32)

    def process(self, logits, ctx):
        return torch.from_numpy(logits.numpy() + self.bias)


def model_like_logits(vocab: int, seed: int) -> torch.Tensor:
    """``[POOL, 1, V]`` logits shaped like a model's: broad noise and a few strong candidates."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(POOL, vocab, generator=gen) * 2.0
    top = torch.randint(0, vocab, (POOL, 8), generator=gen)
    x.scatter_add_(1, top, torch.rand(POOL, 8, generator=gen) * 6 + 8)
    return x[:, None, :]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


SEGMENT = 32  # steps per timed segment


def _minor_faults() -> int:
    """Page faults this thread took so far (0 where the platform does not say)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    except (ImportError, AttributeError, OSError):
        return 0


def per_step_overheads(
    vocab: int, steps: int, repeats: int, batch: int = 1, storage: str = "float32"
) -> dict[str, dict[str, float]]:
    """Per-step cost over the bare processor of each variant, each running ``steps`` steps of ``batch`` rows.

    The steps run in segments of :data:`SEGMENT`, the variants taking turns
    segment by segment, so that all of them see the same moments of a busy
    machine; a variant's cost is its whole run's time per step (chunk
    allocations and all) minus the bare processor's, the median of its runs.
    Three figures per variant: wall time, the decode thread's CPU time (what
    work moved to a background thread no longer costs the step; less moved by
    other processes' load), and page faults the decode thread took per step.
    """
    SHARED_POOL.clear()  # the first run of this vocabulary size starts from fresh memory
    proc = HalfMask(vocab)
    logits = model_like_logits(vocab, seed=vocab).expand(POOL, batch, vocab).contiguous()
    ids_all = torch.arange(steps + 8).view(1, -1).expand(batch, -1) % vocab
    views = [ids_all[:, : 4 + t] for t in range(steps)]
    options = {"storage": storage, "top_k": 20, "memory_limit": None}
    warm_tracker = LogitTrackingProcessor(HalfMask(vocab), **options)

    def bare(t: int) -> None:
        proc(views[t], logits[t % POOL])

    def straightforward(natural: list, constrained: list) -> Callable[[int], None]:
        def step(t: int) -> None:
            x = logits[t % POOL]
            natural.append(x.cpu().numpy().copy())
            out = proc(views[t], x)
            constrained.append(out.cpu().numpy().copy())

        return step

    def floor(buffer: np.ndarray) -> Callable[[int], None]:
        def step(t: int) -> None:
            x = logits[t % POOL]
            np.copyto(buffer[2 * t], x.numpy())
            out = proc(views[t], x)
            np.copyto(buffer[2 * t + 1], out.numpy())

        return step

    def tracked(tracker: LogitTrackingProcessor) -> Callable[[int], None]:
        def step(t: int) -> None:
            tracker(views[t], logits[t % POOL])

        return step

    runs: dict[str, dict[str, list[float]]] = {}
    finish: list[float] = []
    for repeat in range(repeats):
        wall: dict[str, float] = {}
        cpu: dict[str, float] = {}
        faults: dict[str, int] = {}
        fresh_tracker = LogitTrackingProcessor(HalfMask(vocab), **options)
        warm_tracker.clear()
        later = "first run" if repeat == 0 else "later runs"
        variants = {
            "bare processor": bare,
            # Its rows live in Python lists; once a run's lists are freed the allocator hands their
            # memory to the next run, so its first run (fresh memory) is told apart from later ones.
            f"straightforward ({later})": straightforward([], []),
            "floor (fresh buffer)": floor(np.empty((2 * steps, batch, vocab), dtype=np.float32)),
            "floor (warm buffer)": floor(np.full((2 * steps, batch, vocab), 1.0, dtype=np.float32)),  # touched
            f"tracker, new ({later})": tracked(fresh_tracker),
            "tracker (after clear)": tracked(warm_tracker),
        }
        for first in range(0, steps, SEGMENT):
            segment = range(first, min(first + SEGMENT, steps))
            for name, step in variants.items():
                faults_before, cpu_start, start = _minor_faults(), time.thread_time(), time.perf_counter()
                for t in segment:
                    step(t)
                wall[name] = wall.get(name, 0.0) + time.perf_counter() - start
                cpu[name] = cpu.get(name, 0.0) + time.thread_time() - cpu_start
                faults[name] = faults.get(name, 0) + _minor_faults() - faults_before
        for name in wall:
            figures = runs.setdefault(name, {"wall": [], "cpu": [], "faults": []})
            figures["wall"].append(wall[name] / steps)
            figures["cpu"].append(cpu[name] / steps)
            figures["faults"].append(faults[name] / steps)
        finish.append(timed(lambda t=fresh_tracker: t.finish(ids_all[:, : 4 + steps])) / steps)
        del variants, fresh_tracker
    median = {name: {key: float(np.median(v)) for key, v in figures.items()} for name, figures in runs.items()}
    base = median.pop("bare processor")
    out = {
        name: {"wall": m["wall"] - base["wall"], "cpu": m["cpu"] - base["cpu"], "faults": m["faults"]}
        for name, m in median.items()
    }
    out["tracker read: finish() -> Arrow run"] = {"wall": float(np.median(finish)), "cpu": float("nan"), "faults": 0}
    return out


def print_overheads(overheads: dict[str, dict[str, float]]) -> None:
    """The per-step table, then the tracker's cost as a ratio of the straightforward tracker's (goal: <= 1.0x)."""
    fresh, warm = overheads["floor (fresh buffer)"]["wall"], overheads["floor (warm buffer)"]["wall"]
    print(
        f"{'per-step overhead (median)':<38}{'wall us':>10}{'/ floor (fresh)':>17}{'/ floor (warm)':>16}"
        f"{'thread CPU us':>15}{'faults/step':>13}"
    )
    for name, value in overheads.items():
        print(
            f"{name:<38}{value['wall'] * 1e6:>10.1f}{value['wall'] / fresh:>17.2f}{value['wall'] / warm:>16.2f}"
            f"{value['cpu'] * 1e6:>15.1f}{value['faults']:>13.1f}"
        )
    pairs = [
        ("tracker, new (first run)", "straightforward (first run)"),
        ("tracker, new (later runs)", "straightforward (later runs)"),
        ("tracker (after clear)", "straightforward (later runs)"),
    ]
    for ours, theirs in pairs:
        if ours in overheads and theirs in overheads:
            wall = overheads[ours]["wall"] / overheads[theirs]["wall"]
            cpu = overheads[ours]["cpu"] / overheads[theirs]["cpu"]
            print(f"ratio {ours} / {theirs}: wall {wall:.2f}x, decode-thread CPU {cpu:.2f}x (goal: <= 1.0x)")


def storage_costs(vocab: int, steps: int, folder: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes per step of each storage mode, and write speeds (MB/s) of spill files and Parquet."""
    logits = model_like_logits(vocab, seed=vocab + 1)
    ids_all = torch.arange(steps + 8).view(1, -1) % vocab
    sizes, speeds = {}, {}
    for storage in ("float32", "float16", "bfloat16", "topk"):
        tracker = LogitTrackingProcessor(HalfMask(vocab), storage=storage, top_k=20, memory_limit=None)
        for t in range(steps):
            tracker(ids_all[:, : 4 + t], logits[t % POOL])
        table = tracker.to_arrow()
        sizes[storage if storage != "topk" else "topk (k=20)"] = table.nbytes / steps
        if storage in ("float32", "float16"):
            batches = tracker.recorder.batches()
            nbytes = sum(b.nbytes for b in batches)
            elapsed = timed(lambda: write_ipc(folder / "spill.arrow", batches, batches[0].schema))
            speeds[f"spill (Arrow IPC), {storage}"] = nbytes / elapsed / 1e6
            for compression in (None, "zstd"):
                elapsed = timed(lambda: tracker.to_parquet(folder / "run.parquet", compression=compression))
                speeds[f"to_parquet {compression or 'uncompressed'}, {storage}"] = table.nbytes / elapsed / 1e6
    return sizes, speeds


# ---------------------------------------------------------------- analysis baselines


def straightforward_top_tokens(natural, constrained, chosen, vocab_text, k=10):
    results = []
    for pos in range(len(natural)):
        u = torch.softmax(torch.tensor(natural[pos]), dim=-1).numpy()
        s = torch.softmax(torch.tensor(constrained[pos]), dim=-1).numpy()
        text_so_far = "".join(vocab_text[i] for i in chosen[:pos])
        top = np.argsort(np.maximum(u, s))[-k:][::-1]
        tokens = [
            {
                "token": vocab_text[i],
                "unstructured_prob": float(u[i]),
                "structured_prob": float(s[i]),
                "unstructured_logit": float(natural[pos][i]),
                "structured_logit": float(constrained[pos][i]),
                "is_chosen": int(i) == chosen[pos],
            }
            for i in top
        ]
        results.append({"position": pos, "text_so_far": text_so_far, "tokens": tokens})
    return results


def straightforward_dataframe(natural, constrained, chosen, vocab_text, min_value=0.01):
    rows = []
    for pos in range(len(natural)):
        u = torch.softmax(torch.tensor(natural[pos]), dim=-1).numpy()
        s = torch.softmax(torch.tensor(constrained[pos]), dim=-1).numpy()
        best = np.maximum(u, s)
        order = np.argsort(best)[::-1]  # most likely first, as a reader wants them
        for i in order[: int((best >= min_value).sum())]:
            rows.append(
                {
                    "position": pos,
                    "token": vocab_text[i],
                    "natural": u[i],
                    "constrained": s[i],
                    "chosen": int(i) == chosen[pos],
                }
            )
    return pd.DataFrame(rows)


def analysis_times(vocab: int, steps: int, repeats: int = 3, statistics: str = "auto") -> dict[str, float]:
    """Query times on a float32 run; ``statistics`` as the tracker's (on a CPU, ``"auto"`` computes them on a
    background thread as chunks are sealed; the read after ``finish()`` computes what it had not reached)."""
    proc = HalfMask(vocab)
    logits = model_like_logits(vocab, seed=vocab + 2)
    pieces = [f"t{i}".encode() for i in range(vocab)]
    vocab_obj = Vocabulary.from_parts(pieces)
    vocab_text = list(vocab_obj.display)
    tracker = LogitTrackingProcessor(proc, memory_limit=None, statistics=statistics)
    ids = torch.tensor([[1, 2, 3]])
    natural, constrained, chosen = [], [], []
    gen = torch.Generator().manual_seed(0)
    for t in range(steps):
        x = logits[t % POOL] + torch.randn(1, vocab, generator=gen) * 0.1
        natural.append(x[0].numpy().copy())
        out = tracker(ids, x)
        constrained.append(out[0].numpy().copy())
        token = int(torch.multinomial(torch.softmax(out[0], 0), 1, generator=gen))
        chosen.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    start = time.perf_counter()
    tracker.finish(ids)  # builds the run: statistics the background thread has not reached are computed now
    live = tracker.run
    batches, metadata, maxima = live._record_batches(), live.metadata, live._maxima
    read = time.perf_counter() - start

    def fresh_run() -> Run:
        # the tracker's run as a first query finds it: its rows, and the group maxima its background thread kept
        return Run(batches, metadata, vocab_obj, maxima=maxima)

    def first_call(method: str, **kwargs: object) -> float:
        return min(timed(lambda: getattr(fresh_run(), method)(**kwargs)) for _ in range(repeats))

    out = {}
    out["get_top_tokens: straightforward"] = min(
        timed(lambda: straightforward_top_tokens(natural, constrained, chosen, vocab_text)) for _ in range(2)
    )
    out["get_top_tokens: first call"] = first_call("get_top_tokens", k=10)
    run = fresh_run()
    run.get_top_tokens(k=10)
    out["get_top_tokens: repeated call"] = min(timed(lambda: run.get_top_tokens(k=10)) for _ in range(3))
    out["to_dataframe: straightforward"] = min(
        timed(lambda: straightforward_dataframe(natural, constrained, chosen, vocab_text)) for _ in range(2)
    )
    out["to_dataframe: first call"] = first_call("to_dataframe", min_value=0.01)
    run.to_dataframe(min_value=0.01)
    out["to_dataframe: repeated call"] = min(timed(lambda: run.to_dataframe(min_value=0.01)) for _ in range(3))
    ours = run.to_dataframe(min_value=0.01)
    reference = straightforward_dataframe(natural[:8], constrained[:8], chosen, vocab_text)
    assert len(ours[ours.position < 8]) == len(reference), "the two to_dataframe implementations disagree"
    out["the run's batches, read once after finish()"] = read
    return out


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def long_run(vocab: int, steps: int) -> None:
    """One run of ``steps`` steps with the tracker's default bound: flat time per step, linear spill, bounded RSS."""
    import warnings

    from tracker.recording.recorder import SpillWarning

    tracker = LogitTrackingProcessor(HalfMask(vocab))  # the defaults: float32, memory_limit 2 GiB
    recorder = tracker.recorder
    logits = model_like_logits(vocab, seed=vocab + 3)
    ids_all = torch.arange(steps + 8).view(1, -1) % vocab
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS (VmHWM) to the current RSS
        f.write("5")
    base_rss = _status_kib("VmRSS") * 1024
    times = np.empty(steps)
    rows_peak = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpillWarning)
        for t in range(steps):
            start = time.perf_counter()
            tracker(ids_all[:, : 4 + t], logits[t % POOL])
            times[t] = time.perf_counter() - start
            if t % 16 == 0:
                rows_peak = max(rows_peak, recorder.host_bytes)
        start = time.perf_counter()
        tracker.finish(ids_all[:, : 4 + steps])
        recorder.flush()
        finish = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024 - base_rss
    chunk = recorder._chunks[0].capacity * recorder.storage.row_bytes(recorder.stages, vocab)
    folder = recorder.spill_path
    files = sorted(folder.glob("chunk-*.arrow")) if folder is not None else []
    on_disk = sum(f.stat().st_size for f in files)
    block = min(1000, max(1, steps // 10))
    print(
        f"{steps} steps, vocabulary {vocab}, float32, memory_limit {recorder.memory_limit / 2**30:.1f} GiB, "
        f"chunk {chunk / 2**20:.1f} MiB"
    )
    print(f"{'steps':<16}{'ms per step':>12}")
    means = [times[a : a + block].mean() for a in range(0, steps, block)]
    for i, value in enumerate(means):
        print(f"{i * block:>6}-{min(steps, (i + 1) * block) - 1:<9}{value * 1e3:>12.3f}")
    print(f"last {block} / first {block} steps: {means[-1] / means[0]:.2f}x (goal: at most 1.5x)")
    print(f"finish() and the last chunks to disk: {finish:.2f} s")
    print(
        f"chunks: {len(recorder._chunks)}, spilled {recorder.chunks_spilled}, chunk writes {recorder.chunk_writes}, "
        f"files {len(files)} (goal: writes == spilled)"
    )
    print(f"spilled_bytes {recorder.spilled_bytes / 2**30:.2f} GiB, on disk {on_disk / 2**30:.2f} GiB")
    limit = (recorder.memory_limit or 0) + 2 * chunk
    print(
        f"peak RSS over the process's start: {peak / 2**30:.2f} GiB; bound + 2 chunks {limit / 2**30:.2f} GiB "
        f"({'within' if peak <= limit else 'OVER'})"
    )
    print(
        f"rows held in memory at most {rows_peak / 2**30:.3f} GiB (sampled every 16 steps; "
        f"bound + 2 chunks {limit / 2**30:.3f} GiB); the rest of the RSS "
        "is the process's own (the logits pool, the spill writer's batches, allocator caches)"
    )
    for warning in caught[:1]:
        print(f"notice: {warning.message}")
    tracker.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 512; 10,000 with --long)")
    parser.add_argument(
        "--vocab", type=int, nargs="+", default=None, help="vocabulary sizes (default 32768 131072; 131072 with --long)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (the median is shown)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="rows per step (default 1)")
    parser.add_argument(
        "--storage",
        nargs="+",
        default=["float32"],
        choices=["float32", "float16", "bfloat16", "topk"],
        help="the tracker's storage (top-k keeps 20); the straightforward tracker always copies whole rows",
    )
    parser.add_argument("--per-step-only", action="store_true", help="only the per-step table and ratios")
    parser.add_argument("--analysis-only", action="store_true", help="only the first/repeated query times")
    parser.add_argument("--long", action="store_true", help="one long run with the default memory bound")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.long:
        for vocab in args.vocab or [131072]:
            long_run(vocab, args.steps or 10_000)
        return
    args.steps = args.steps or 512
    args.vocab = args.vocab or [32768, 131072]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.steps} steps, torch threads {torch.get_num_threads()}, median of {args.repeats}, "
        f"{os.cpu_count()} CPUs, load average {load:.1f}"
    )
    for vocab in args.vocab:
        for batch in args.batch if not args.analysis_only else []:
            for storage in args.storage:
                print(f"\n=== vocabulary {vocab}, batch {batch}, storage {storage} ===")
                print_overheads(per_step_overheads(vocab, args.steps, args.repeats, batch, storage))
        if args.per_step_only:
            continue
        if not args.analysis_only:
            with tempfile.TemporaryDirectory() as folder:
                sizes, speeds = storage_costs(vocab, min(args.steps, 64), Path(folder))
            print(f"{'storage':<38}{'bytes per step':>16}")
            for name, value in sizes.items():
                print(f"{name:<38}{value:>16,.0f}")
            print(f"{'writing to disk':<38}{'MB/s':>16}")
            for name, value in speeds.items():
                print(f"{name:<38}{value:>16,.0f}")
        for statistics in ("auto", "record"):
            times = analysis_times(vocab, args.steps, args.repeats, statistics)
            when = "off the decode thread, the CPU default" if statistics == "auto" else "recorded with the rows"
            print(f"{'analysis over all positions':<38}{'ms':>10}{'speed-up':>10}   (statistics {when})")
            read = times.pop("the run's batches, read once after finish()")
            for name, value in times.items():
                base = times[name.split(":")[0] + ": straightforward"]
                print(f"{name:<38}{value * 1e3:>10.1f}{base / value:>10.1f}")
            print(f"{'finish(): the run built, once':<38}{read * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
