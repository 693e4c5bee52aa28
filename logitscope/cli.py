"""The ``logitscope`` command line: a thin layer over sampling and the demo model.

    logitscope run --prompt "Call " --temperature 0.8 --seed 1
    logitscope demo
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

DEMO_PROMPTS = (
    '{"name": "',
    "Call ",
    "12 + 7 = ",
    "The weather in Lyon",
)


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


def _print_outputs(outputs, as_json: bool, out=sys.stdout) -> None:
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
    from sampling import SamplingParams

    gen = _generator(None, args.device)
    print("logitscope demo: the shipped demo model (a small GPT-2) continues a few prompts.\n")
    for title, params in (
        ("greedy", SamplingParams(max_new_tokens=40)),
        ("temperature 0.8, top-p 0.95, seed 0", SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_new_tokens=40)),
    ):
        print(f"--- {title}")
        _print_outputs(gen.generate(list(DEMO_PROMPTS), params), as_json=False)
        print()
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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

    demo = sub.add_parser("demo", help="generate a few prompts with the demo model")
    demo.add_argument("--device", default="cpu", help="cpu or cuda")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # logitscope never downloads: models come from local folders.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"run": cmd_run, "demo": cmd_demo}
    return commands[args.command](args, parser)


if __name__ == "__main__":
    sys.exit(main())
