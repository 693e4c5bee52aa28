"""What reading vLLM's sampling stages costs: a vLLM run read with and without them, in one process.

    python benchmarks/bench_engine_stages.py [--steps 128] [--vocab 32768 131072] [--repeats 3]

A run of ``--steps`` float32 rows is recorded by the tracker from random
logits and written twice: once with the metadata logitscope's vLLM processor
writes (a request with penalties, temperature, min-p, top-k and top-p, so that
every stage is computed when the run is read), once without (the baseline: the
recorded stage alone). Per vocabulary size, the fastest of ``--repeats``:

- ``Run.load`` followed by ``stats()`` (the first question), both files;
- the dashboard's reader: ``RunReader.step`` at every step from a cold cache.

Printed: seconds of each, the ratio of the vLLM run's to the baseline's, and
the cost per step of computing the six stages. The two files take turns, so
that a shared machine's load hits them alike: read the ratios.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dashboard.reader import RunReader
from dashboard.synthetic import hand_made_run
from tracker import Run

REQUEST = {
    "sampler": "vllm",
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 50,
    "min_p": 0.01,
    "repetition_penalty": 1.2,
    "frequency_penalty": 0.3,
    "presence_penalty": 0.2,
}


def _files(folder: Path, steps: int, vocab: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    natural = (rng.standard_normal((steps, vocab)) * 3).astype(np.float32)
    chosen = rng.integers(0, vocab, steps)
    run = hand_made_run(natural, chosen, [f"t{i}" for i in range(vocab)], prompt=(1, 2, 3))
    plain, served = folder / f"plain-{vocab}.parquet", folder / f"served-{vocab}.parquet"
    run.to_parquet(plain)
    entries = [dict(g, sampling=[REQUEST]) for g in run.metadata.generations]
    Run(run._record_batches(), replace(run.metadata, generations=entries), run.vocab).to_parquet(served)
    return plain, served


def _load_and_ask(path: Path) -> float:
    start = time.perf_counter()
    Run.load(path).stats()
    return time.perf_counter() - start


def _replay(path: Path) -> float:
    reader = RunReader(path)
    track = reader.track(0, 0)
    start = time.perf_counter()
    for position in range(track.length):
        reader.step(track, position)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'vocab':>7} {'what':>18} {'recorded s':>11} {'with stages s':>14} {'ratio':>6} {'ms/step':>8}")
    with tempfile.TemporaryDirectory() as scratch:
        for vocab in args.vocab:
            plain, served = _files(Path(scratch), args.steps, vocab)
            for what, measure in (("load + stats()", _load_and_ask), ("replay every step", _replay)):
                base, staged = [], []
                for _ in range(args.repeats):
                    base.append(measure(plain))
                    staged.append(measure(served))
                b, s = min(base), min(staged)
                print(f"{vocab:>7} {what:>18} {b:>11.3f} {s:>14.3f} {s / b:>6.1f} {1e3 * (s - b) / args.steps:>8.2f}")


if __name__ == "__main__":
    main()
