"""``logitscope demo`` and ``logitscope dashboard``: the commands that serve the dashboard (``demo`` records the
sample runs with the demo model first).

    logitscope demo [--out FOLDER] [--no-serve]   # record sample runs, then open the dashboard on them
    logitscope dashboard [PATH]                   # the dashboard on a run or a folder of runs

The server itself is :mod:`dashboard.serve`.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from logitscope.cli_args import device as _device
from logitscope.cli_args import fail as _fail
from logitscope.cli_args import require_torch, terminal_text
from logitscope.cli_args import serving_options as _serving_options
from logitscope.cli_args import serving_port as _serving_port

__all__ = ["add_parsers", "cmd_demo", "cmd_dashboard"]


def _demo_text(text: str) -> str:
    """A sample's text for the terminal: the end-of-text marker that starts some prompts is not shown."""
    from logitscope.samples import EOT

    return text.replace(EOT, "")


def _out_folder(parser: argparse.ArgumentParser, out: Path, force: bool) -> None:
    """Refuse ``--out`` when it is a file, or holds runs the demo would replace (without ``--force``), as
    ``run --out`` refuses a file that exists."""
    from logitscope.samples import RECIPES

    if out.exists() and not out.is_dir():
        _fail(parser, "--out", f"'{out}' is a file; give a folder (new, or one to add the runs to)")
    taken = [f"{r.name}.parquet" for r in RECIPES if (out / f"{r.name}.parquet").exists()]
    if taken and not force:
        shown = ", ".join(taken[:3]) + (", ..." if len(taken) > 3 else "")
        _fail(
            parser,
            "--out",
            f"'{out}' holds runs the demo would replace ({shown}); give --force to replace them, or another folder",
        )


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import tempfile

    require_torch(parser)
    if args.out is not None:
        out = Path(args.out)
        _out_folder(parser, out, args.force)
        temporary = False
    elif args.no_serve:
        _fail(
            parser,
            "--no-serve",
            "give --out FOLDER to keep the runs (without it they go to a temporary folder "
            "that is removed when the dashboard stops)",
        )
    else:
        out = Path(tempfile.mkdtemp(prefix="logitscope-demo-"))
        temporary = True
    try:
        return _demo(args, out, parser)
    finally:
        if temporary:
            shutil.rmtree(out, ignore_errors=True)


def _demo(args: argparse.Namespace, out: Path, parser: argparse.ArgumentParser) -> int:
    if args.no_serve:
        _record_demo(args, out)
        print(f"Open them with: logitscope dashboard {out}")
        return 0
    from dashboard.serve import announce, start

    port = _serving_port(args, parser)
    try:
        # the server starts while the runs are recorded (they are written whole, one by one);
        # the page opens once they are all there
        with start(out, port) as server:
            _record_demo(args, out, server.stopping)
            if server.stopping.is_set():  # SIGTERM or Ctrl-C while recording: the server is stopped already
                return 0
            announce(out, port)
            if not args.no_browser:
                server.open_browser()
            return server.wait()
    except KeyboardInterrupt:
        return 0


def _record_demo(args: argparse.Namespace, out: Path, stopping: Any = None) -> None:
    from logitscope.demo_model import load_demo_model
    from logitscope.samples import record

    model, tokenizer = load_demo_model(device=args.device)
    print("logitscope demo: the shipped demo model (a small GPT-2) generates a few runs, each recorded")
    print(f"by the tracker (what the model wanted, what the constraint did, what was sampled) into {out}\n")
    for done in record(out, model, tokenizer):
        if stopping is not None and stopping.is_set():  # asked to stop: the next recipe is not recorded
            return
        print(f"--- {done.recipe.title}: {done.recipe.description}")
        for generation in done.texts:
            for text in generation:
                print(f"    {_demo_text(text)!r}")
    print(flush=True)


def cmd_dashboard(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dashboard.paths import default_runs_path
    from dashboard.serve import serve
    from tracker.format.fs import is_url

    if args.path is not None and is_url(args.path):  # a store: s3://bucket/runs (its runs are listed on the page)
        return serve(args.path, args.port, open_browser=not args.no_browser, allow_any_path=args.allow_any_path)
    path = Path(args.path) if args.path is not None else default_runs_path()
    if not path.exists():
        if args.path is not None:
            _fail(parser, "PATH", f"no run or folder at '{path}'; give a .parquet run or a folder of runs")
        _fail(
            parser,
            None,
            f"the shipped sample runs are missing from '{path}'; give a PATH "
            "(record runs with `logitscope demo --out FOLDER`)",
        )
    _say_what_is_served(parser, path)
    return serve(
        path, _serving_port(args, parser), open_browser=not args.no_browser, allow_any_path=args.allow_any_path
    )


def _say_what_is_served(parser: argparse.ArgumentParser, path: Path) -> None:
    """Refuse a file that is not a readable run (one line, why); note a folder holding no run yet (its runs
    are listed as they are written, so it is served)."""
    from dashboard.discover import find_runs, summarize

    if path.is_file():
        error = summarize(path).error
        if error is not None:
            _fail(parser, "PATH", f"'{path}' is not a readable run: {error}")
    elif not find_runs(path):
        print(
            terminal_text(
                f"note: '{path}' holds no runs yet (run files .parquet/.arrow, run folders); the Runs page lists "
                "them as they are written"
            ),
            flush=True,
        )


def add_parsers(sub: Any) -> None:
    """Add ``demo`` and ``dashboard`` to the ``logitscope`` subcommands."""
    demo = sub.add_parser("demo", help="record sample runs with the demo model and open the dashboard on them")
    demo.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda, cuda:N or mps")
    demo.add_argument(
        "--out",
        default=None,
        metavar="FOLDER",
        help="folder for the runs (default: a temporary folder, removed when the dashboard stops)",
    )
    demo.add_argument(
        "--no-serve", action="store_true", help="record the runs into --out and exit, without starting the dashboard"
    )
    demo.add_argument(
        "--force", action="store_true", help="let --out replace demo runs already there (default: refuse)"
    )
    _serving_options(demo)

    dashboard = sub.add_parser("dashboard", help="open the dashboard on a run or a folder of runs")
    dashboard.add_argument(
        "path",
        nargs="?",
        default=None,
        metavar="PATH",
        help="a run file or a folder of runs (default: the shipped sample runs)",
    )
    dashboard.add_argument(
        "--allow-any-path",
        action="store_true",
        help="let the page's path box open any folder the server can read (default: only inside PATH)",
    )
    _serving_options(dashboard)

    for name, command in (("demo", demo), ("dashboard", dashboard)):
        command.set_defaults(handler=globals()[f"cmd_{name}"], command_parser=command)
