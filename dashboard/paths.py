"""Where things are: the app script, the shipped sample runs, and the variable naming the runs to show.

Kept free of Streamlit so that the command line can use it cheaply.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["APP", "ENV_ANY_PATH", "ENV_PATH", "ANY_PATH_FLAG", "REPO_ROOT", "default_runs_path"]

#: The Streamlit entry script.
APP = Path(__file__).resolve().parent / "app.py"
#: The folder holding the ``dashboard`` package (the repository root in a checkout or editable install).
REPO_ROOT = APP.parent.parent
#: Environment variable naming the runs to show (set by ``logitscope dashboard``).
ENV_PATH = "LOGITSCOPE_RUNS"
#: Environment variable that, set to ``1``, lets the path box open folders outside the served one.
ENV_ANY_PATH = "LOGITSCOPE_ALLOW_ANY_PATH"
#: The same as a script argument: ``streamlit run app.py -- PATH --allow-any-path``.
ANY_PATH_FLAG = "--allow-any-path"


def default_runs_path() -> Path:
    """The shipped ``sample_runs/`` folder, beside the ``dashboard`` package in the repository."""
    return REPO_ROOT / "sample_runs"
