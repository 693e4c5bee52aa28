"""SQL across 1,000 runs (``tracker.open_dataset``) against loading each run with ``Run.load`` and pandas.

    python benchmarks/bench_query.py                           # 1,000 runs x 100 steps, top-20 of 32,000 tokens
    python benchmarks/bench_query.py --runs 100 --keep /tmp/q  # smaller; keep the dataset for `logitscope query`

The dataset: ``--distinct`` runs recorded by the real tracker
(:func:`dashboard.synthetic.hand_made_run`: random logits, a constraint that
masks a random share of the vocabulary at each step, top-k storage, so the
statistics are recorded with the rows), each written ``runs / distinct``
times under fresh run ids with :meth:`tracker.Run.to_dataset`. Then, in this
process, two questions, answered both ways and checked to agree:

- "steps where removed mass > 0.5": ``SELECT run_id, generation, sequence, step FROM steps WHERE
  removed_mass > 0.5``;
- "mean entropy per run": ``SELECT run_id, avg(entropy_natural) FROM steps GROUP BY run_id``.

*open_dataset* times a fresh :func:`tracker.open_dataset` (the runs listed
from their footers) and both questions (the first builds the ``steps`` view
from each run's id and statistics columns); *Run.load + pandas* loads each
run's folder, calls ``stats`` and answers with pandas. Figures are the best
of ``--repeats``; the ratio is baseline over open_dataset.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dashboard.synthetic import hand_made_run  # noqa: E402
from tracker import Run, open_dataset  # noqa: E402

REMOVED = "SELECT run_id, generation, sequence, step FROM steps WHERE removed_mass > 0.5"
ENTROPY = "SELECT run_id, avg(entropy_natural) AS entropy FROM steps GROUP BY run_id"


def make_dataset(root: Path, runs: int, distinct: int, steps: int, vocab: int, k: int) -> list[str]:
    """Write ``runs`` top-k runs into ``root`` (``distinct`` recorded, the rest copies under new ids)."""
    rng = np.random.default_rng(0)
    tokens = [f"t{i}" for i in range(vocab)]
    ids = []
    for d in range(distinct):
        natural = (rng.standard_normal((steps, vocab), dtype=np.float32) * 3).astype(np.float32)
        keep = rng.random((steps, vocab)) < rng.uniform(0.05, 0.95, size=(steps, 1))
        keep[np.arange(steps), rng.integers(0, vocab, steps)] = True  # something is always allowed
        constrained = np.where(keep, natural, -np.inf).astype(np.float32)
        chosen = constrained.argmax(axis=1)
        run = hand_made_run(natural, chosen, tokens, constrained=constrained, storage="topk", top_k=k, prompt=(d,))
        for copy in range(d, runs, distinct):
            clone = Run(run._record_batches(), replace(run.metadata, run_id=f"run-{copy:05d}"), run.vocab)
            clone.to_dataset(root)
            ids.append(clone.run_id)
    return sorted(ids)


def by_sql(root: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    data = open_dataset(root)
    return data.sql(REMOVED).to_pandas(), data.sql(ENTROPY).to_pandas()


def by_pandas(root: Path, ids: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    frames = []
    for run_id in ids:
        run = Run.load(root / f"run_id={run_id}")
        for g in run.generations():
            frames.append(run.stats(sequence=None, generation=g).assign(run_id=run_id))
    stats = pd.concat(frames, ignore_index=True)
    removed = stats.loc[stats["removed_mass"] > 0.5, ["run_id", "generation", "sequence", "position"]]
    entropy = stats.groupby("run_id", as_index=False)["entropy_natural"].mean()
    return removed.rename(columns={"position": "step"}), entropy.rename(columns={"entropy_natural": "entropy"})


def best(repeats: int, work):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - start)
    return min(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--distinct", type=int, default=4, help="runs recorded; the others are copies")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", default=None, metavar="FOLDER", help="write the dataset here and keep it")
    args = parser.parse_args(argv)

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-query-"))
    try:
        start = time.perf_counter()
        ids = make_dataset(root, args.runs, min(args.distinct, args.runs), args.steps, args.vocab, args.k)
        size = sum(p.stat().st_size for p in root.rglob("*.parquet"))
        print(
            f"{len(ids)} runs x {args.steps} steps, top-{args.k} of {args.vocab:,} tokens: "
            f"{size / 1e6:.0f} MB written in {time.perf_counter() - start:.1f} s"
        )
        sql_s, (removed, entropy) = best(args.repeats, lambda: by_sql(root))
        pandas_s, (removed_pd, entropy_pd) = best(args.repeats, lambda: by_pandas(root, ids))
        key = ["run_id", "generation", "sequence", "step"]
        assert removed.sort_values(key).to_numpy().tolist() == removed_pd.sort_values(key).to_numpy().tolist()
        merged = entropy.merge(entropy_pd, on="run_id")
        assert len(merged) == len(ids) and np.allclose(merged["entropy_x"], merged["entropy_y"], rtol=1e-9)
        print(f"{len(removed):,} steps with removed mass > 0.5; mean entropy of {len(entropy):,} runs")
        print(f"open_dataset (list, build steps, both questions): {sql_s:8.2f} s")
        print(f"Run.load + stats + pandas, run by run:            {pandas_s:8.2f} s")
        print(f"ratio: {pandas_s / sql_s:.1f}x")
        data = open_dataset(root)
        data.sql(ENTROPY)
        warm_s, _ = best(args.repeats, lambda: (data.sql(REMOVED), data.sql(ENTROPY)))
        print(f"both questions again on an open dataset:         {warm_s * 1e3:8.1f} ms")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
