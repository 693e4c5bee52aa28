"""The ``logitscope`` command line: a thin layer over sampling, the tracker, the demo model and the dashboard.

    logitscope demo                      # record sample runs with the demo model, open the dashboard
    logitscope dashboard [PATH]          # the dashboard on a run or a folder of runs
    logitscope inspect PATH [--steps 0:5]  # a run in the terminal
    logitscope run --prompt "Call " --regex "\\(\\d{3}\\) \\d{3}-\\d{4}" --out r.parquet
    logitscope rescore r.parquet --model PATH --dtype bfloat16 --out b.parquet
    logitscope compare r.parquet b.parquet  # KL, top-1 agreement, perplexities

Every mistake in the arguments ends in one line naming the argument and what
is allowed (exit status 2); ``--help`` shows a subcommand's usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from logitscope import __version__, cli_rescore, cli_serve, inspect_run, query_cli, table_cli
from logitscope.cli_args import OneLineParser, model_arg, require_torch
from logitscope.cli_args import device as _device
from logitscope.cli_args import fail as _fail
from logitscope.cli_args import no_loading_bar as _no_loading_bar
from logitscope.cli_args import positive_int as _positive_int

STORAGE_MODES = ("float32", "float16", "bfloat16", "topk")
CONSTRAINTS = ("--regex", "--json-schema", "--grammar", "--bad-words")


# ---------------------------------------------------------------- run


def _prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        text = _read_text(parser, "--prompt-file", args.prompt_file)
        prompts += [line.rstrip("\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        _fail(parser, "--prompt", "give at least one --prompt or a --prompt-file with one prompt per line")
    return prompts


def _params(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            n=args.n,
            stop=tuple(args.stop or ()),
        )
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        _fail(parser, f"--{name.replace('_', '-')}", exc)


def _read_text(parser: argparse.ArgumentParser, argument: str, file: str) -> str:
    path = Path(file)
    if path.is_dir() or not path.exists():  # a pipe (<(...), /dev/stdin) is read like a file
        _fail(parser, argument, f"'{path}' is a folder; give a file" if path.is_dir() else f"no file at '{path}'")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        _fail(parser, argument, f"'{path}' is not UTF-8 text")
    except OSError as exc:
        _fail(parser, argument, f"cannot read '{path}' ({exc.strerror})")


def _constraints(args: argparse.Namespace, parser: argparse.ArgumentParser, tokenizer: Any) -> list[Any]:
    """The processors the flags ask for, in order: the grammar (regex, JSON schema or Lark), then banned words."""
    from processors import BadWordsLogitsProcessor, CFGLogitsProcessor, JSONLogitsProcessor, RegexLogitsProcessor

    made: list[Any] = []
    argument = ""
    try:
        if args.regex is not None:
            argument = "--regex"
            made.append(RegexLogitsProcessor(args.regex, tokenizer))
        if args.json_schema is not None:
            argument = "--json-schema"
            text = _read_text(parser, argument, args.json_schema)
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                _fail(parser, argument, f"'{args.json_schema}' is not JSON ({exc})")
            made.append(JSONLogitsProcessor(schema, tokenizer))
        if args.grammar is not None:
            argument = "--grammar"
            text = _read_text(parser, argument, args.grammar)
            made.append(CFGLogitsProcessor(text, tokenizer, syntax=args.grammar_syntax or "lark"))
        if args.bad_words:
            argument = "--bad-words"
            made.append(BadWordsLogitsProcessor(args.bad_words, tokenizer))
    except (ValueError, TypeError) as exc:
        _fail(parser, argument, exc)
    return made


def _generator(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from sampling import Generator
    from sampling.generator import load_model, load_tokenizer

    path, _ = model_arg(args.model)
    try:
        # the constraints first, with the tokenizer alone: a bad pattern is said before the model loads
        constraints = _constraints(args, parser, load_tokenizer(path))
        with _no_loading_bar():
            model, tokenizer = load_model(path, device=args.device)
    except FileNotFoundError as exc:
        _fail(parser, "--model", exc)
    return Generator(model, tokenizer, constraints or None)


def _print_outputs(outputs, as_json: bool, out=None) -> None:
    out = sys.stdout if out is None else out
    for request in outputs:
        for c in request.outputs:
            if as_json:
                record = {
                    "prompt": request.prompt,
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "token_ids": c.token_ids,
                    "logprobs": c.logprobs,
                }
                print(json.dumps(record, ensure_ascii=False), file=out)
            else:
                label = f"[{request.request_index}]" + (f"[{c.index}]" if len(request.outputs) > 1 else "")
                print(f"{label} {request.prompt}{c.text}", file=out)
                print(f"    ({len(c.token_ids)} tokens, finished: {c.finish_reason})", file=out)


def _generate(gen, prompts: list[str], params, batch_size: int) -> tuple[list, int]:
    """The outputs, and the decode steps taken (each batch's longest sequence, added up)."""
    from tqdm import tqdm

    outputs, steps = [], 0
    # a bar only where it can redraw itself: without a terminal it would print a line per update
    quiet = len(prompts) <= batch_size or not sys.stderr.isatty()
    with tqdm(total=len(prompts), desc="generating", unit="prompt", disable=quiet, file=sys.stderr) as bar:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            # request indices count across the whole run, not per batch
            done = [replace(out, request_index=start + i) for i, out in enumerate(gen.generate(chunk, params))]
            outputs += done
            steps += max(len(c.token_ids) for out in done for c in out.outputs)
            bar.update(len(chunk))
    return outputs, steps


def _check_out_file(parser: argparse.ArgumentParser, out: str, force: bool) -> Path | str:
    from tracker.format.fs import is_url, resolve

    if is_url(out):  # s3://bucket/run.parquet: one look-up now, the write when the run is done
        try:
            fs, where = resolve(out, "--out")
            taken = fs.get_file_info(where).type != pafs.FileType.NotFound
        except (ValueError, OSError) as exc:
            _fail(parser, "--out", str(exc))
        if taken and not force:
            _fail(parser, "--out", f"'{out}' exists; give --force to replace it, or another file name")
        return out
    path = Path(out)
    if path.is_dir():
        _fail(parser, "--out", f"'{path}' is a folder; give a file name such as run.parquet")
    if path.exists() and not force:
        _fail(parser, "--out", f"'{path}' exists; give --force to replace it, or another file name")
    if not path.parent.is_dir():
        _fail(parser, "--out", f"no folder '{path.parent}' to write '{path.name}' into")
    try:  # the folder may exist and still refuse files (permissions, a read-only or virtual file system)
        tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".check").close()
    except OSError as exc:
        _fail(parser, "--out", f"cannot write '{path.name}' into the folder '{path.parent}' ({exc.strerror})")
    return path


def _check_dependent_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse options given without the option they only make sense with."""
    if args.out is None and (args.storage is not None or args.title is not None or args.force):
        given = "--storage" if args.storage is not None else "--title" if args.title is not None else "--force"
        _fail(parser, given, "is only used with --out RUN.parquet")
    if args.storage_top_k is not None and args.storage != "topk":
        _fail(parser, "--storage-top-k", f"{args.storage_top_k} is only used with --storage topk")
    if args.grammar_syntax is not None and args.grammar is None:
        _fail(parser, "--grammar-syntax", f"{args.grammar_syntax!r} is only used with --grammar FILE")


def _check_inputs(gen, prompts: list[str], params, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The Generator's checks of the prompts and parameters (empty prompt, too long for the model), before any run."""
    try:
        gen.check_inputs(prompts, params)
    except (ValueError, TypeError) as exc:
        index = re.match(r"prompts\[(\d+)\]", str(exc))  # the --prompt prompts come first, then the file's
        _fail(parser, "--prompt-file" if index and int(index[1]) >= len(args.prompt or []) else "--prompt", exc)


def _save_run(tracker, out: Path | str, args: argparse.Namespace, params, interrupted: bool = False) -> None:
    extra: dict[str, Any] = {"title": args.title} if args.title else {}
    if interrupted:
        extra["interrupted"] = True
    tracker.annotate(sampling=params.to_dict(), **extra)
    tracker.to_parquet(out)


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require_torch(parser)
    prompts = _prompts(args, parser)
    params = _params(args, parser)
    _check_dependent_options(args, parser)
    out = None if args.out is None else _check_out_file(parser, args.out, args.force)
    gen = _generator(args, parser)
    _check_inputs(gen, prompts, params, args, parser)
    if out is not None:
        from tracker import add_tracking

        model_name = model_arg(args.model)[1]
        add_tracking(gen, storage=args.storage or "float32", top_k=args.storage_top_k or 20, model=model_name)
    from sampling import DeadRowError

    try:
        outputs, steps = _generate(gen, prompts, params, args.batch_size)
    except DeadRowError:
        if not (flags := [flag for flag in CONSTRAINTS if getattr(args, flag[2:].replace("-", "_"))]):
            raise  # no constraint of the user's: not an argument error
        _fail(parser, flags[-1], f"{' with '.join(flags)} leave no allowed token at some step; loosen them")
    except KeyboardInterrupt:
        if out is None:
            raise
        # Ctrl-C: keep what was recorded (a run cut short reads as one; the last sequences end where it stopped)
        _save_run(gen.logits_processor, out, args, params, interrupted=True)
        print(f"interrupted: wrote the steps recorded so far to {out}", file=sys.stderr)
        return 130
    _print_outputs(outputs, args.json)
    if out is not None:
        _save_run(gen.logits_processor, out, args, params)
        lengths = [len(c.token_ids) for o in outputs for c in o.outputs]
        counts = f"{steps} steps, {len(lengths)} sequence{'s' * (len(lengths) > 1)}, {sum(lengths)} tokens"
        print(f"wrote {out} ({counts}); open it with: logitscope dashboard {out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="logitscope",
        description="See what happens to a language model's next-token distribution at every step.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="generate from a model, print the generations, and record them with --out",
        description="Generate from a model and print the generations; with --out, record every "
        "step into a run that `logitscope dashboard` opens.",
    )
    run.add_argument(
        "--model", default=None, help="a local model folder, or demo: the shipped demo model (default: demo)"
    )
    run.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    run.add_argument("--prompt-file", default=None, metavar="FILE", help="a text file with one prompt per line")
    run.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default: 64)"
    )
    run.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="divide the logits by it before sampling; 0 means greedy (default: greedy when no sampling option "
        "is given, else 1: --top-k, --top-p or --min-p alone sample at temperature 1)",
    )
    run.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="keep the K most likely tokens (default: off)"
    )
    run.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="keep the smallest set of tokens with probability mass >= P (default: off)",
    )
    run.add_argument(
        "--min-p",
        type=float,
        default=None,
        metavar="P",
        help="keep tokens with probability >= P times the best one's (default: off)",
    )
    run.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: a fresh one each run)")
    run.add_argument("--n", type=int, default=1, help="samples per prompt (default: 1)")
    run.add_argument("--stop", action="append", help="a stop string (repeatable)")
    run.add_argument("--batch-size", type=_positive_int, default=8, help="prompts decoded together (default: 8)")
    run.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda, cuda:N or mps")
    run.add_argument("--json", action="store_true", help="print one JSON record per generation")
    grammar = run.add_mutually_exclusive_group()
    grammar.add_argument(
        "--regex", default=None, metavar="PATTERN", help="constrain the output to a regular expression"
    )
    grammar.add_argument(
        "--json-schema", default=None, metavar="FILE", help="constrain the output to the JSON schema in FILE"
    )
    grammar.add_argument("--grammar", default=None, metavar="FILE", help="constrain the output to the grammar in FILE")
    run.add_argument(
        "--grammar-syntax", choices=("lark", "gbnf"), default=None, help="syntax of --grammar (default: lark)"
    )
    run.add_argument(
        "--bad-words", action="append", metavar="WORD", help="a word the output must not contain (repeatable)"
    )
    run.add_argument(
        "--out", default=None, metavar="RUN.parquet", help="record every step into this run file (a new one)"
    )
    run.add_argument("--force", action="store_true", help="let --out replace a file that exists (default: refuse)")
    run.add_argument(
        "--storage",
        choices=STORAGE_MODES,
        default=None,
        help="how --out keeps the distributions: the whole vocabulary as float32 (default), float16 or "
        "bfloat16, or only the best tokens (topk)",
    )
    run.add_argument(
        "--storage-top-k",
        type=_positive_int,
        default=None,
        metavar="K",
        help="tokens kept per step with --storage topk (default: 20)",
    )
    run.add_argument("--title", default=None, help="the run's title in the dashboard (with --out)")

    run.set_defaults(handler=cmd_run, command_parser=run)
    cli_serve.add_parsers(sub)
    inspect_run.add_parser(sub)
    cli_rescore.add_parsers(sub)
    query_cli.add_parser(sub)
    table_cli.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # logitscope never downloads: models come from local folders.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)
    try:
        status = int(args.handler(args, args.command_parser))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM while serving): stop quietly, no traceback
        return 130
    except BrokenPipeError:  # `logitscope inspect run.parquet | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141  # 128 + SIGPIPE, what a tool killed by the closed pipe returns


if __name__ == "__main__":
    sys.exit(main())
