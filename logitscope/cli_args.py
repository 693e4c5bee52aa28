"""What the subcommands of the ``logitscope`` command line share: argument types and the one-line failure.

Every mistake in the arguments ends in one line naming the argument and what
is allowed, after the usage of the subcommand concerned (exit status 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

__all__ = ["fail", "refuse", "positive_int", "port", "device", "no_loading_bar", "serving_options", "serving_port"]


def fail(parser: argparse.ArgumentParser, argument: str | None, message: Any) -> NoReturn:
    """Exit with the subcommand's usage and one line: ``argument X: message`` (status 2)."""
    text = " ".join(str(message).split())  # library messages may span lines (grammar carets): keep one line
    parser.error(f"argument {argument}: {text}" if argument else text)


def refuse(parser: argparse.ArgumentParser, argument: str | None, message: Any) -> NoReturn:
    """Exit with one line, ``logitscope CMD: error: argument X: message`` (status 2), without the usage:
    for a well-formed argument the world refuses (a taken port, a pattern the grammar engine rejects)."""
    text = " ".join(str(message).split())
    parser.exit(2, f"{parser.prog}: error: {f'argument {argument}: {text}' if argument else text}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number in [1, 65535], got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {value}")
    return value


def device(text: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``, and only one this torch build can use."""
    try:
        import torch
    except ImportError:
        raise argparse.ArgumentTypeError(
            "recording needs torch, which is not installed (a viewer-only install opens runs with "
            "`logitscope dashboard` and `logitscope inspect`); install torch, then logitscope with its dependencies"
        ) from None

    allowed = "cpu, cuda, cuda:N or mps"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use {allowed}") from None
    if device.type == "cpu":
        return text
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise argparse.ArgumentTypeError(f"{text!r} is not available ({why}); use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: there are {torch.cuda.device_count()} CUDA devices")
        return text
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} is not available on this machine; use cpu")
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not supported; use {allowed}")


@contextmanager
def no_loading_bar() -> Iterator[None]:
    """Hide transformers' "Loading weights" bar (it prints twice when there is no terminal)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def serving_options(command: argparse.ArgumentParser) -> None:
    """``--port`` and ``--no-browser``, as ``demo`` and ``dashboard`` take them."""
    command.add_argument(
        "--port",
        type=port,
        default=None,
        help="local port; a taken one is refused (default: 8501, or the next free port when 8501 is taken); "
        "the server listens on 127.0.0.1 only",
    )
    command.add_argument(
        "--no-browser", action="store_true", help="do not open a browser (none is opened where none can be)"
    )


def serving_port(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The port to serve on, checked before anything is recorded: ``--port N`` as asked or a one-line
    refusal when it is taken; without it, 8501 or the next free port (said when not 8501)."""
    from dashboard.serve import PortTakenError, choose_port, say_port

    try:
        chosen = choose_port(args.port)
    except PortTakenError as exc:
        refuse(parser, "--port" if args.port is not None else None, exc)
    say_port(args.port, chosen)
    return chosen
