"""Rebuild the shipped ``sample_runs/`` from the demo model: ``python -m logitscope.make_sample_runs [--out DIR]``.

Every recipe of :mod:`logitscope.samples` is recorded again (the runs are
deterministic: fixed prompts and seeds) and written over the old files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dashboard.paths import default_runs_path
from logitscope.samples import record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m logitscope.make_sample_runs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(default_runs_path()), help="folder to write (default: sample_runs/)")
    args = parser.parse_args(argv)

    from logitscope.demo_model import load_demo_model

    model, tokenizer = load_demo_model()
    total = 0
    for done in record(args.out, model, tokenizer):
        size = done.path.stat().st_size
        total += size
        print(f"{done.path}  {size / 1024:.0f} KiB  {done.recipe.title}")
    print(f"{total / 2**20:.2f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
