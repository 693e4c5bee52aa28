"""``logitscope rescore`` and ``logitscope compare``: a recorded run through another model, and two runs summed up.

    logitscope rescore run.parquet --model ./my-model --dtype bfloat16 --out rescored.parquet
    logitscope compare run.parquet rescored.parquet [--json]

Thin: the work is :func:`tracker.recording.rescore.rescore` and :func:`tracker.reading.divergence.compare_runs`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from logitscope.cli_args import device as _device
from logitscope.cli_args import fail, model_arg, no_loading_bar, require_torch
from logitscope.cli_args import positive_int as _positive_int

__all__ = ["add_parsers"]

DTYPES = ("bfloat16", "float16", "float32")


def _load_run(parser: argparse.ArgumentParser, argument: str, path: str) -> Any:
    from tracker.format.layout import RunFileError
    from tracker.reading.run import Run

    try:
        return Run.load(path)
    except (FileNotFoundError, RunFileError, ValueError) as exc:
        fail(parser, argument, exc)


def _out_file(parser: argparse.ArgumentParser, out: str, force: bool) -> Path:
    path = Path(out)
    if path.is_dir():
        fail(parser, "--out", f"'{path}' is a folder; give a file name such as rescored.parquet")
    if not path.parent.is_dir():
        fail(parser, "--out", f"no folder '{path.parent}' to write '{path.name}' into")
    if path.exists() and not force:
        fail(parser, "--out", f"'{path}' exists; give --force to replace it")
    return path


def cmd_rescore(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require_torch(parser)
    import torch

    from sampling.generator import load_model

    if args.model is None:
        fail(
            parser, "--model", "give the model to rescore with: a local model folder, or demo (the shipped demo model)"
        )
    out = _out_file(parser, args.out, args.force)
    run = _load_run(parser, "RUN", args.run)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    folder, name = model_arg(args.model)
    try:
        with no_loading_bar():
            model, tokenizer = load_model(folder, device=args.device, dtype=dtype)
    except (FileNotFoundError, OSError, ValueError) as exc:
        fail(parser, "--model", exc)
    try:
        rescored = run.rescore(
            model,
            tokenizer,
            batch_size=args.batch_size,
            method=args.method,
            name=name,
        )
    except ValueError as exc:
        fail(parser, "--model", exc)
    rescored.to_parquet(out)  # atomic: a temporary file, flushed, then renamed
    rows = rescored.num_rows
    print(
        f"wrote {out} ({rows} rows rescored); compare them with: logitscope compare {args.run} {out}", file=sys.stderr
    )
    return 0


def cmd_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tracker.reading.divergence import compare_runs

    run_a = _load_run(parser, "A", args.a)
    run_b = _load_run(parser, "B", args.b)
    try:
        result = compare_runs(run_a, run_b, include_finished=args.include_finished)
    except ValueError as exc:
        fail(parser, "B", exc)
    print(result.to_json() if args.json else result.summary())
    return 0


def add_parsers(sub: Any) -> None:
    """Add ``rescore`` and ``compare`` to the ``logitscope`` subcommands."""
    rescore = sub.add_parser(
        "rescore",
        help="run a recorded run's tokens through another model (or precision) into a new run",
        description="Feed every generation of RUN (its prompts and chosen tokens) through the model at --model "
        "and record that model's distribution at every step into a new run (the same tokens, the other model's "
        "logits). The model is loaded from a local folder only.",
    )
    rescore.add_argument("run", metavar="RUN", help="a run file (.parquet) or run folder")
    rescore.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local model folder (with config.json), or demo: the shipped demo model (a folder named demo: ./demo)",
    )
    rescore.add_argument(
        "--dtype", choices=DTYPES, default=None, help="load the model in this dtype (default: its own)"
    )
    rescore.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda, cuda:N or mps")
    rescore.add_argument(
        "--batch-size", type=_positive_int, default=8, metavar="N", help="sequences per forward pass (default: 8)"
    )
    rescore.add_argument(
        "--method",
        choices=("forward", "stepwise"),
        default="forward",
        help="forward: one pass per batch of sequences (default); stepwise: one pass per step with a KV cache, "
        "bit for bit what a decode loop computes",
    )
    rescore.add_argument("--out", required=True, metavar="FILE", help="the new run's file (.parquet)")
    rescore.add_argument("--force", action="store_true", help="replace --out if it exists")
    compare = sub.add_parser(
        "compare",
        help="KL divergence, top-1 agreement and perplexities of two runs over the same tokens",
        description="Compare every sequence of run A with run B's (a run and its rescoring): KL(A‖B) per step "
        "(mean, median, 90/99/99.9th percentile, max), top-1 agreement, the chosen token's probability change, "
        "and each run's perplexity.",
    )
    compare.add_argument("a", metavar="A", help="the reference run")
    compare.add_argument("b", metavar="B", help="the run compared with it")
    compare.add_argument("--json", action="store_true", help="print the statistics as one JSON object")
    compare.add_argument(
        "--include-finished", action="store_true", help="also compare the steps fed after a sequence ended"
    )
    for name, command in (("rescore", rescore), ("compare", compare)):
        command.set_defaults(handler=globals()[f"cmd_{name}"], command_parser=command)
