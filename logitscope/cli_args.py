"""What the subcommands of the ``logitscope`` command line share: argument types, the one-line failure, and
text made safe for a terminal.

Every mistake in the arguments ends in one line naming the argument and what
is allowed (exit status 2); ``logitscope CMD --help`` shows the usage.
Whatever a run file holds is printed through :func:`terminal_text`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "OneLineParser",
    "fail",
    "terminal_text",
    "json_text",
    "DEMO_MODEL_NAME",
    "model_arg",
    "positive_int",
    "port",
    "device",
    "require_torch",
    "no_loading_bar",
    "serving_options",
    "serving_port",
]

#: Characters a terminal acts on instead of showing: C0 and C1 controls and DEL (ESC and CSI start the
#: sequences that clear the screen, retitle the window or plant links), the bidirectional controls that
#: reorder what follows them, and the Unicode line and paragraph separators.
_ABOVE_C0 = "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[\x00-\x1f{_ABOVE_C0}]")
#: Those JSON leaves raw: an encoder writes C0 controls inside strings as escapes (a raw newline stands
#: between values).
_UNSAFE_IN_JSON = re.compile(f"[{_ABOVE_C0}]")


def terminal_text(text: Any) -> str:
    """``str(text)`` with every character a terminal would act on written as Python escapes it (``\\x1b``,
    ``\\n``, ``\\u202e``): text from a run file (titles, token text, names, error messages) is shown, never
    obeyed, and stays on its line."""
    return _UNSAFE.sub(lambda m: repr(m.group())[1:-1], str(text))


def json_text(text: str) -> str:
    """JSON text with the characters of :func:`terminal_text` that JSON leaves raw written as ``\\uXXXX``: the
    same JSON value, safe on a terminal (they can only stand inside its strings)."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``logitscope CMD: error: ...`` (status 2), without the
    usage (``--help`` shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {terminal_text(' '.join(message.split()))}\n")


def fail(parser: argparse.ArgumentParser, argument: str | None, message: Any) -> NoReturn:
    """Exit with one line: ``logitscope CMD: error: argument X: message`` (status 2); library messages that
    span lines (grammar carets) are joined, control characters escaped."""
    text = " ".join(str(message).split())
    text = f"argument {argument}: {text}" if argument else text
    parser.exit(2, f"{parser.prog}: error: {terminal_text(text)}\n")


#: The name ``--model demo`` gives the shipped demo model, in the runs it records or rescores.
DEMO_MODEL_NAME = "logitscope demo model"


def model_arg(text: str | None) -> tuple[str, str]:
    """``(folder, name)`` of a ``--model`` value: ``demo`` (or none) is the shipped demo model, named
    :data:`DEMO_MODEL_NAME` (so is its folder given as a path); anything else a local folder, named by its
    folder's name (``./demo`` is a folder). Imports torch (the demo model's package does)."""
    from logitscope.demo_model import DEMO_MODEL_PATH

    if text is None or text == "demo" or Path(text).resolve() == DEMO_MODEL_PATH:
        return str(DEMO_MODEL_PATH), DEMO_MODEL_NAME
    return text, Path(text).resolve().name


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


def require_torch(parser: argparse.ArgumentParser) -> None:
    """Exit in one line when torch is not installed (a viewer-only install): the command records."""
    try:
        import torch  # noqa: F401
    except ImportError:
        fail(
            parser,
            None,
            "recording needs torch, which is not installed (a viewer-only install opens runs with "
            "`logitscope dashboard`, `logitscope inspect` and `logitscope query`); install torch, then logitscope "
            "with its dependencies",
        )


def device(text: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``, and only one this torch build can use (unchecked without torch:
    :func:`require_torch` says what is missing, not the default of an option never given)."""
    try:
        import torch
    except ImportError:
        return text

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
        fail(parser, "--port" if args.port is not None else None, exc)
    say_port(args.port, chosen)
    return chosen
