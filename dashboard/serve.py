"""Starting the dashboard as a local Streamlit server (what ``logitscope dashboard`` and ``demo`` call).

The server is bound to 127.0.0.1: runs can hold prompts and outputs that are
nobody else's business. The path to show travels in ``$LOGITSCOPE_RUNS``, and
the repository root is put on ``PYTHONPATH`` so the app imports this checkout
whatever the current folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dashboard.paths import APP, ENV_ANY_PATH, ENV_PATH, REPO_ROOT

__all__ = ["streamlit_command", "streamlit_env", "serve"]


def streamlit_command(port: int, *, headless: bool = True) -> list[str]:
    """The ``streamlit run`` command line for the app on ``127.0.0.1:port``."""
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an int in [1, 65535], got {port!r}")
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", "127.0.0.1",
        "--server.port", str(port),
        "--server.headless", "true" if headless else "false",
        "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",
        "--browser.serverAddress", "127.0.0.1",
    ]


def streamlit_env(path: str | Path, *, allow_any_path: bool = False) -> dict[str, str]:
    """The environment for the server: the runs' path, whether its path box may leave that path,
    and this checkout first on ``PYTHONPATH``."""
    root = str(REPO_ROOT)
    existing = os.environ.get("PYTHONPATH", "")
    env = {
        **os.environ,
        ENV_PATH: str(Path(path).resolve()),
        "PYTHONPATH": root + (os.pathsep + existing if existing else ""),
    }
    env.pop(ENV_ANY_PATH, None)
    if allow_any_path:
        env[ENV_ANY_PATH] = "1"
    return env


def serve(path: str | Path, port: int, *, open_browser: bool = True, allow_any_path: bool = False) -> int:
    """Run the dashboard on ``path`` until interrupted (Ctrl-C); returns Streamlit's exit status.

    The page's path box stays inside ``path`` unless ``allow_any_path``.
    """
    command = streamlit_command(port, headless=not open_browser)
    print(f"logitscope dashboard: http://127.0.0.1:{port}  (runs from {Path(path).resolve()}; Ctrl-C to stop)")
    try:
        return subprocess.call(command, env=streamlit_env(path, allow_any_path=allow_any_path))
    except KeyboardInterrupt:
        return 0
