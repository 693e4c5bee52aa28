"""The tracker in a real model loop, against the model untracked and a straightforward tracker, in one process.

    python benchmarks/bench_tracker.py [--vocab 128256] [--batch 1 16] [--tokens 128] [--rounds 5]
                                       [--host-memory as-built | no-pool | faulted | neither]
    python benchmarks/bench_tracker.py --analysis-only [--vocab 32768 131072] [--steps 512]
    python benchmarks/bench_tracker.py --long [--steps 10000] [--vocab 131072]

The model loop: transformers' ``model.generate`` (greedy, ``--tokens`` new tokens per row) of a GPT-2 with
random weights over a ``--vocab``-token vocabulary (2 layers of 64: the output projection and the logits are
most of a step, as in a real large-vocabulary model; built here, nothing downloaded), with a processor masking
half the vocabulary in every variant:

- ``untracked``: the processor alone;
- ``straightforward``: a tracker that copies the rows before and after the processor to numpy
  (``.cpu().numpy().copy()``) into Python lists;
- ``float32`` / ``float16`` / ``bfloat16`` / ``topk``: ``LogitTrackingProcessor`` around the processor, in
  that storage (top-k keeps 20), with its stopping criteria (so the last token is recorded too).

The variants take turns within each round (the order rotating), so a busy machine's load hits them alike.
Printed per batch size: each variant's median time per generated token, and its ratio to ``untracked`` and to
``straightforward`` of the same round (medians, with the range). ``--analysis-only`` times the first and
repeated queries against a straightforward per-position implementation; ``--long`` records one long run with
the default memory bound (it spills) and reports the time per step in blocks, the spill and the peak RSS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from processors import LogitsProcessor  # noqa: E402
from tracker import LogitTrackingProcessor, Run, Vocabulary  # noqa: E402

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


class Straightforward:
    """A straightforward tracker: the rows before and after the processor, copied to numpy, kept in lists."""

    def __init__(self, processor) -> None:
        self.processor, self.natural, self.constrained = processor, [], []

    def __call__(self, input_ids, scores):
        self.natural.append(scores.cpu().numpy().copy())
        out = self.processor(input_ids, scores)
        self.constrained.append(out.cpu().numpy().copy())
        return out


def wide_gpt2(vocab: int, layers: int = 2, width: int = 64):
    """A random GPT-2 over ``vocab`` tokens (see ``benchmarks/wide_model.py`` for the same on disk)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=512, n_embd=width, n_layer=layers, n_head=max(1, width // 32))
    return GPT2LMHeadModel(config).eval()


def model_loop(vocab: int, batch: int, tokens: int, rounds: int, storages: list[str]) -> dict[str, list[float]]:
    """Seconds per generated token of each variant, per round (see the module docstring)."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    model = wide_gpt2(vocab)
    prompt = torch.randint(1, vocab, (batch, 8), generator=torch.Generator().manual_seed(2))
    mask = HalfMask(vocab)
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)

    def generate(processor, stopping=None) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                prompt, logits_processor=LogitsProcessorList([processor]), stopping_criteria=stopping, **kwargs
            )
        return (time.perf_counter() - start) / tokens

    def tracked(storage: str) -> float:
        tracker = LogitTrackingProcessor(mask, storage=storage, top_k=20, memory_limit=None)
        elapsed = generate(tracker, StoppingCriteriaList([tracker.stopping_criteria()]))
        assert tracker.run.num_rows == batch * tokens
        return elapsed

    variants = {
        "untracked": lambda: generate(mask),
        "straightforward": lambda: generate(Straightforward(mask)),
        **{storage: (lambda s=storage: tracked(s)) for storage in storages},
    }
    for fn in variants.values():  # warm-up
        fn()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(variants[name]())
    return times


def print_loop(times: dict[str, list[float]]) -> None:
    base, plain = times["untracked"], times["straightforward"]
    print(f"{'variant':<16}{'ms/token':>10}{'/ untracked':>13}{'range':>13}{'/ straightforward':>19}{'range':>13}")
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base)]
        against = [v / p for v, p in zip(values, plain)]
        print(
            f"{name:<16}{np.median(values) * 1e3:>10.2f}{np.median(ratios):>13.3f}"
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}{np.median(against):>19.3f}"
            f"{f'{min(against):.2f}-{max(against):.2f}':>13}"
        )


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
    """Query times on a float32 run; ``statistics`` as the tracker's (on a CPU, ``"auto"`` computes them when
    read, ``"record"`` as the rows are recorded)."""
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
    tracker.finish(ids)  # builds the run
    live = tracker.run
    batches, metadata = live._record_batches(), live.metadata
    read = time.perf_counter() - start

    def fresh_run() -> Run:
        return Run(batches, metadata, vocab_obj)  # the tracker's run as a first query finds it

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


def host_memory(variant: str) -> None:
    """Replace the recorder's host-memory machinery for this process (``--host-memory``)."""
    from tracker.recording import memory

    if variant in ("faulted", "neither"):
        memory._allocate = lambda nbytes: np.empty(nbytes, dtype=np.uint8)
    if variant in ("no-pool", "neither"):
        memory.HostPool.take = lambda self, nbytes: memory.HostBuffer(memory._allocate(nbytes), nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=None, help="vocabulary sizes (default 128256)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="rows per step")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per row and variant")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every variant (medians shown)")
    parser.add_argument("--storage", nargs="+", default=["float32", "float16", "bfloat16", "topk"])
    parser.add_argument("--steps", type=int, default=None, help="--analysis-only / --long: steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="--analysis-only: runs of each query")
    parser.add_argument("--analysis-only", action="store_true", help="only the first/repeated query times")
    parser.add_argument("--long", action="store_true", help="one long run with the default memory bound")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (one: no barrier waits on a busy machine)"
    )
    parser.add_argument(
        "--host-memory",
        choices=["as-built", "no-pool", "faulted", "neither"],
        default="as-built",
        help="switch off the recorder's buffer pool (no-pool), its populated mappings (faulted: pages faulted in "
        "as rows are written), or both, to measure what each is worth",
    )
    args = parser.parse_args()
    host_memory(args.host_memory)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, load average {load:.1f}")
    if args.long:
        for vocab in args.vocab or [131072]:
            long_run(vocab, args.steps or 10_000)
        return
    if args.analysis_only:
        for vocab in args.vocab or [32768, 131072]:
            for statistics in ("auto", "record"):
                times = analysis_times(vocab, args.steps or 512, args.repeats, statistics)
                print(
                    f"{'analysis, vocabulary ' + str(vocab):<38}{'ms':>10}{'speed-up':>10}   (statistics {statistics})"
                )
                read = times.pop("the run's batches, read once after finish()")
                for name, value in times.items():
                    base = times[name.split(":")[0] + ": straightforward"]
                    print(f"{name:<38}{value * 1e3:>10.1f}{base / value:>10.1f}")
                print(f"{'finish(): the run built, once':<38}{read * 1e3:>10.1f}")
        return
    for vocab in args.vocab or [128256]:
        for batch in args.batch:
            print(
                f"\n=== model.generate, vocabulary {vocab}, batch {batch}, {args.tokens} tokens, {args.rounds} rounds ==="
            )
            print_loop(model_loop(vocab, batch, args.tokens, args.rounds, args.storage))


if __name__ == "__main__":
    main()
