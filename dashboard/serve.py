"""Starting the dashboard as a local Streamlit server (what ``logitscope dashboard`` and ``demo`` call).

The server is bound to 127.0.0.1: runs can hold prompts and outputs that are
nobody else's business. The path to show travels in ``$LOGITSCOPE_RUNS``, and
the folder holding the ``dashboard`` package is put on ``PYTHONPATH`` so the
app imports this copy whatever the current folder.

Streamlit's own first-run behaviour is switched off here rather than left to
the user's configuration: no e-mail prompt (it blocks a terminal and makes a
server without one exit), no usage statistics, no welcome text, and so none
of its advertising in the terminal or the "Help agents write better apps"
pop-up in the page (``logger.hideWelcomeMessage`` gates both; so does
headless mode). The server runs headless when no browser can be opened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import webbrowser
from pathlib import Path
from typing import Any

from dashboard.paths import APP, ENV_PATH, REPO_ROOT

__all__ = ["can_open_browser", "streamlit_command", "streamlit_env", "serve"]

#: Streamlit options set for every server, as environment variables too, so that a
#: config file or an old credentials file cannot bring the prompts back.
QUIET_OPTIONS = {
    "browser.gatherUsageStats": "false",
    "server.showEmailPrompt": "false",
    "logger.hideWelcomeMessage": "true",
    "client.toolbarMode": "minimal",
}


def _env_name(option: str) -> str:
    """Streamlit's environment variable for a config option: ``server.showEmailPrompt`` -> ``STREAMLIT_SERVER_SHOW_EMAIL_PROMPT``."""
    section, name = option.split(".")
    snake = "".join(f"_{c}" if c.isupper() else c for c in name).upper()
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
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", "127.0.0.1",
        "--server.port", str(port),
        "--server.headless", "true" if headless else "false",
        "--browser.serverAddress", "127.0.0.1",
    ]
    for option, value in QUIET_OPTIONS.items():
        command += [f"--{option}", value]
    return command


def streamlit_env(path: str | Path) -> dict[str, str]:
    """The environment for the server: the runs' path, the quiet options, and this copy first on ``PYTHONPATH``."""
    root = str(REPO_ROOT)
    existing = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        **{_env_name(option): value for option, value in QUIET_OPTIONS.items()},
        ENV_PATH: str(Path(path).resolve()),
        "PYTHONPATH": root + (os.pathsep + existing if existing else ""),
    }


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


def serve(path: str | Path, port: int, *, open_browser: bool = True) -> int:
    """Run the dashboard on ``path`` until it exits or this process gets Ctrl-C or SIGTERM.

    The Streamlit server is a child process; it is stopped with this one, so
    that it never keeps holding the port. Returns the server's exit status (0
    when stopped by a signal).
    """
    headless = not (open_browser and can_open_browser())
    command = streamlit_command(port, headless=headless)
    print(f"logitscope dashboard: http://127.0.0.1:{port}  (runs from {Path(path).resolve()}; Ctrl-C to stop)", flush=True)
    child = subprocess.Popen(command, env=streamlit_env(path), stdin=subprocess.DEVNULL)

    def on_signal(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        return int(child.wait())
    except KeyboardInterrupt:
        _stop(child)
        return 0
    finally:
        _stop(child)  # also when anything else goes wrong here: never leave the server behind
        for sig, handler in previous.items():
            signal.signal(sig, handler)
