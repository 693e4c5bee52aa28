"""The ``logitscope`` command line: a thin layer over sampling, the demo model and the dashboard.

    logitscope demo                      # record sample runs with the demo model, open the dashboard
    logitscope dashboard [PATH]          # the dashboard on a run or a folder of runs
    logitscope run --prompt "Call " --temperature 0.8 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence


def _prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            parser.error(f"argument --prompt-file: no file at '{path}'")
        prompts += [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        parser.error("give at least one --prompt or a --prompt-file with one prompt per line")
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
        parser.error(f"argument --{name.replace('_', '-')}: {exc}")


def _generator(model: str | None, device: str):
    from sampling import Generator

    if model is None:
        from logitscope.demo_model import DEMO_MODEL_PATH

        model = str(DEMO_MODEL_PATH)
    return Generator.from_pretrained(model, device=device)


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


def _generate(gen, prompts: list[str], params, batch_size: int) -> list:
    from tqdm import tqdm

    outputs = []
    with tqdm(total=len(prompts), desc="generating", unit="prompt", disable=len(prompts) <= 1, file=sys.stderr) as bar:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            # request indices count across the whole run, not per batch
            outputs += [replace(out, request_index=start + i) for i, out in enumerate(gen.generate(chunk, params))]
            bar.update(len(chunk))
    return outputs


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    prompts = _prompts(args, parser)
    params = _params(args, parser)
    try:
        gen = _generator(args.model, args.device)
    except FileNotFoundError as exc:
        parser.error(f"argument --model: {exc}")
    outputs = _generate(gen, prompts, params, args.batch_size)
    _print_outputs(outputs, args.json)
    return 0


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import tempfile

    from logitscope.samples import record
    from logitscope.demo_model import load_demo_model

    out = Path(args.out) if args.out is not None else Path(tempfile.mkdtemp(prefix="logitscope-demo-"))
    model, tokenizer = load_demo_model(device=args.device)
    print("logitscope demo: the shipped demo model (a small GPT-2) generates a few runs, each recorded")
    print(f"by the tracker (what the model wanted, what the constraint did, what was sampled) into {out}\n")
    for done in record(out, model, tokenizer):
        print(f"--- {done.recipe.title}: {done.recipe.description}")
        for generation in done.texts:
            for text in generation:
                print(f"    {text!r}")
    print()
    if args.no_serve:
        print(f"Open them with: logitscope dashboard {out}")
        return 0
    from dashboard.serve import serve

    return serve(out, args.port, open_browser=not args.no_browser)


def cmd_dashboard(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dashboard.paths import default_runs_path
    from dashboard.serve import serve

    path = Path(args.path) if args.path is not None else default_runs_path()
    if not path.exists():
        where = "argument PATH" if args.path is not None else "the default sample_runs/"
        parser.error(f"{where}: no run or folder at '{path}' (record runs with `logitscope demo`)")
    return serve(path, args.port, open_browser=not args.no_browser, allow_any_path=args.allow_any_path)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {value}")
    return value


def _serving_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--port", type=_port, default=8501, help="local port (default: 8501); the server listens on 127.0.0.1 only")
    command.add_argument("--no-browser", action="store_true", help="start the server without opening a browser")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logitscope",
        description="See what happens to a language model's next-token distribution at every step.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="generate from a model and print the generations")
    run.add_argument("--model", default=None, help="a local model folder (default: the shipped demo model)")
    run.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    run.add_argument("--prompt-file", default=None, help="a text file with one prompt per line")
    run.add_argument("--max-new-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=None, help="0 means greedy (default: greedy)")
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--min-p", type=float, default=None)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--n", type=int, default=1, help="samples per prompt")
    run.add_argument("--stop", action="append", help="a stop string (repeatable)")
    run.add_argument("--batch-size", type=_positive_int, default=8, help="prompts decoded together")
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument("--json", action="store_true", help="print one JSON record per generation")

    demo = sub.add_parser("demo", help="record sample runs with the demo model and open the dashboard on them")
    demo.add_argument("--device", default="cpu", help="cpu or cuda")
    demo.add_argument("--out", default=None, help="folder for the runs (default: a new temporary folder)")
    demo.add_argument("--no-serve", action="store_true", help="record the runs and exit, without starting the dashboard")
    _serving_options(demo)

    dashboard = sub.add_parser("dashboard", help="open the dashboard on a run or a folder of runs")
    dashboard.add_argument("path", nargs="?", default=None, help="a run file or a folder of runs (default: the shipped sample_runs/)")
    dashboard.add_argument("--allow-any-path", action="store_true",
                           help="let the page's path box open any folder the server can read (default: only inside PATH)")
    _serving_options(dashboard)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # logitscope never downloads: models come from local folders.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"run": cmd_run, "demo": cmd_demo, "dashboard": cmd_dashboard}
    return commands[args.command](args, parser)


if __name__ == "__main__":
    sys.exit(main())
