"""Starting the dashboard as a local Streamlit server (what ``logitscope dashboard`` and ``demo`` call).

The server is bound to 127.0.0.1: runs can hold prompts and outputs that are
nobody else's business. The path to show travels in ``$LOGITSCOPE_RUNS``, and
the folder holding the ``dashboard`` package is put on ``PYTHONPATH`` so the
app imports this copy whatever the current folder.

Streamlit's own first-run behaviour is switched off here rather than left to
the user's configuration: no e-mail prompt (it blocks a terminal and makes a
server without one exit), no usage statistics, no welcome text, no lines of
its own in the terminal (only its warnings and errors), and so none
of its advertising in the terminal or the "Help agents write better apps"
pop-up in the page (``logger.hideWelcomeMessage`` gates both; so does
headless mode). The server always runs headless; logitscope opens the
browser itself, and only where one can be opened. Streamlit's collection of
garbage after every script run is switched off too (:data:`FAST_OPTIONS`):
it cost more than the rest of a click.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import webbrowser
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dashboard.paths import APP, ENV_ANY_PATH, ENV_PATH, REPO_ROOT
from tracker.format.fs import is_url

__all__ = [
    "DEFAULT_PORT",
    "PortTakenError",
    "Server",
    "can_open_browser",
    "choose_port",
    "port_is_free",
    "say_port",
    "serve",
    "start",
    "streamlit_command",
    "streamlit_env",
]

#: The port tried first when none is asked for; the next free ones follow (see :func:`choose_port`).
DEFAULT_PORT = 8501
#: How many ports after :data:`DEFAULT_PORT` are tried before giving up.
PORTS_TRIED = 20

#: Streamlit options set for every server, as environment variables too, so that a
#: config file or an old credentials file cannot bring the prompts back.
QUIET_OPTIONS = {
    "browser.gatherUsageStats": "false",
    "server.showEmailPrompt": "false",
    "logger.hideWelcomeMessage": "true",
    "logger.level": "warning",  # its warnings and errors, not "Uvicorn server started on ..."
    "client.toolbarMode": "minimal",
}
#: Options for speed. Streamlit collects garbage (a full ``gc.collect()``) after every script run, a
#: fragment's included: 0.1-0.25 s in this process (torch, pandas, pyarrow and plotly loaded), more than
#: the rest of a Step replay click. Python's own collector still runs; the run's arrays go by reference
#: counting as before.
FAST_OPTIONS = {"runner.postScriptGC": "false"}


def _env_name(option: str) -> str:
    """Streamlit's environment variable for a config option: ``server.showEmailPrompt`` ->
    ``STREAMLIT_SERVER_SHOW_EMAIL_PROMPT``, ``runner.postScriptGC`` -> ``STREAMLIT_RUNNER_POST_SCRIPT_GC``
    (a capital after a lower-case letter or digit starts a word)."""
    section, name = option.split(".")
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()
    return f"STREAMLIT_{section.upper()}_{snake}"


def can_open_browser() -> bool:
    """Whether a web browser can be opened here: a display on Linux, and a browser Python knows of."""
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return False
    try:
        webbrowser.get()
    except webbrowser.Error:
        return False
    return True


def streamlit_command(port: int, *, headless: bool = True) -> list[str]:
    """The ``streamlit run`` command line for the app on ``127.0.0.1:port``, with no prompt and no telemetry."""
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an int in [1, 65535], got {port!r}")
    command = [
        sys.executable,
        "-m",
        "dashboard.launch",
        "run",
        str(APP),  # streamlit run, imports warmed early
        "--server.address",
        "127.0.0.1",
        "--server.port",
        str(port),
        "--server.headless",
        "true" if headless else "false",
        "--browser.serverAddress",
        "127.0.0.1",
    ]
    for option, value in {**QUIET_OPTIONS, **FAST_OPTIONS}.items():
        command += [f"--{option}", value]
    return command


def streamlit_env(path: str | Path, *, allow_any_path: bool = False) -> dict[str, str]:
    """The environment for the server: the runs' path, whether its path box may leave that path,
    and this checkout first on ``PYTHONPATH``."""
    root = str(REPO_ROOT)
    existing = os.environ.get("PYTHONPATH", "")
    env = {
        **os.environ,
        **{_env_name(option): value for option, value in {**QUIET_OPTIONS, **FAST_OPTIONS}.items()},
        ENV_PATH: str(path) if is_url(path) else str(Path(path).resolve()),
        "PYTHONPATH": root + (os.pathsep + existing if existing else ""),
    }
    env.pop(ENV_ANY_PATH, None)
    if allow_any_path:
        env[ENV_ANY_PATH] = "1"
    return env


class PortTakenError(OSError):
    """The port asked for (or every port tried) is taken on 127.0.0.1; the message says how to choose another."""


def port_is_free(port: int) -> bool:
    """Whether the server could listen on ``127.0.0.1:port`` now: a bind test, as the server binds
    (``SO_REUSEADDR``, so a port left in TIME_WAIT counts as free, one with a listener as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def choose_port(asked: int | None) -> int:
    """The port to serve on, checked before anything is recorded or started.

    A port the user asked for (``--port N``) is used as it is, or refused
    with :class:`PortTakenError` when taken: they meant that one. Without
    one, :data:`DEFAULT_PORT` or the next free port after it (up to
    :data:`PORTS_TRIED` of them).
    """
    if asked is not None:
        if not port_is_free(asked):
            raise PortTakenError(
                f"port {asked} on 127.0.0.1 is taken (another program listens there); choose another with --port N"
            )
        return asked
    for port in range(DEFAULT_PORT, DEFAULT_PORT + PORTS_TRIED):
        if port_is_free(port):
            return port
    last = DEFAULT_PORT + PORTS_TRIED - 1
    raise PortTakenError(f"ports {DEFAULT_PORT}-{last} on 127.0.0.1 are all taken; choose a free one with --port N")


def say_port(asked: int | None, port: int) -> None:
    """Tell the user when the server is not on the default port they expect (it was taken)."""
    if asked is None and port != DEFAULT_PORT:
        print(f"port {DEFAULT_PORT} is taken: serving on port {port} (choose one with --port N)", flush=True)


def _stop(child: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    """Stop the server (SIGTERM, then SIGKILL after ``timeout`` s) and return its exit status."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return int(child.returncode)


def _wait_until_up(child: subprocess.Popen[Any], port: int, timeout: float = 60.0) -> bool:
    """Poll the server's health endpoint until it answers (True), it exits or ``timeout`` s pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and child.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


class Server:
    """A running dashboard server (see :func:`start`): ``url``, ``open_browser()``, ``wait()``."""

    def __init__(self, child: subprocess.Popen[Any], port: int) -> None:
        self.child = child
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.stopping = threading.Event()  # set by SIGTERM or Ctrl-C: the server is being stopped

    def open_browser(self) -> None:
        """Open the page in a browser, once the server answers, where a browser can be opened."""
        if can_open_browser() and _wait_until_up(self.child, self.port):
            webbrowser.open(self.url)

    def wait(self) -> int:
        """Block until the server exits; its exit status (0 when this process was asked to stop)."""
        status = int(self.child.wait())
        return 0 if self.stopping.is_set() else status


def _dies_with_parent() -> Any:
    """For the server's process (Linux): have the kernel send it SIGTERM when this process dies, even by SIGKILL
    or a crash, where no ``finally`` runs (``prctl(PR_SET_PDEATHSIG)``); elsewhere None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None

    def set_signal() -> None:  # runs in the child, between fork and exec
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG

    return set_signal


@contextmanager
def start(path: str | Path, port: int, *, allow_any_path: bool = False) -> Iterator[Server]:
    """Start the (headless) server on ``path`` at ``127.0.0.1:port``; it is stopped when the block ends.

    Within the block, SIGTERM and Ctrl-C stop the server and set
    ``server.stopping`` (no exception is raised), so that stopping this
    process (a service manager, ``kill``) also stops the server instead of
    leaving it holding the port; on Linux the server also gets SIGTERM when
    this process dies without running its ``finally`` (SIGKILL, a crash). The page's path
    box stays inside ``path`` unless ``allow_any_path``.
    """
    command = streamlit_command(port, headless=True)
    env = streamlit_env(path, allow_any_path=allow_any_path)
    # Streamlit's own terminal lines go to its stdout ("Stopping...", once for the terminal's Ctrl-C and once
    # for this process's SIGTERM): logitscope says what the user needs; the server's warnings and errors
    # (its log, on stderr) still show.
    child = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_dies_with_parent()
    )

    server = Server(child, port)

    def on_signal(_signum: int, _frame: Any) -> None:
        # Stop the server and say so; raise nothing. An exception raised from a signal handler lands wherever
        # the main thread is: inside a finalizer (``__del__``, a weakref callback) the interpreter prints and
        # drops it and the block goes on as if no signal had come; elsewhere it may escape a cleanup. The block
        # ends by itself: :meth:`Server.wait` returns once the server has stopped, and work done beside the
        # server checks ``stopping``.
        server.stopping.set()
        if child.poll() is None:
            child.terminate()

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        yield server
    finally:
        _stop(child)  # on a signal, an error or the normal end alike: never leave the server behind
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def announce(path: str | Path, port: int) -> None:
    print(
        f"logitscope dashboard: http://127.0.0.1:{port}  (runs from {path if is_url(path) else Path(path).resolve()}; Ctrl-C to stop)",
        flush=True,
    )


def serve(path: str | Path, port: int, *, open_browser: bool = True, allow_any_path: bool = False) -> int:
    """Run the dashboard on ``path`` until it exits or this process gets Ctrl-C or SIGTERM.

    The server always runs headless; the browser, when asked for and when one
    can be opened here, is opened by this process once the server answers.
    The page's path box stays inside ``path`` unless ``allow_any_path``.
    Returns the server's exit status (0 when stopped by a signal).
    """
    announce(path, port)
    try:
        with start(path, port, allow_any_path=allow_any_path) as server:
            if open_browser:
                server.open_browser()
            return server.wait()
    except KeyboardInterrupt:
        return 0
