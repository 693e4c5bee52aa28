"""Where things are: the app script, the shipped sample runs, and the variable naming the runs to show.

Kept free of Streamlit so that the command line can use it cheaply.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ANY_PATH_FLAG",
    "APP",
    "ENV_ANY_PATH",
    "ENV_PATH",
    "HEADLINE_RUN",
    "PACKAGED_RUNS",
    "REPO_ROOT",
    "default_runs_path",
]

#: The Streamlit entry script.
APP = Path(__file__).resolve().parent / "app.py"
#: The folder holding the ``dashboard`` package (the repository root in a checkout or editable install).
REPO_ROOT = APP.parent.parent
#: The sample run a folder of sample runs opens on (the JSON schema at the city: the README's picture).
HEADLINE_RUN = "json_record.parquet"
#: Environment variable naming the runs to show (set by ``logitscope dashboard``).
ENV_PATH = "LOGITSCOPE_RUNS"
#: Environment variable that, set to ``1``, lets the path box open folders outside the served one.
ENV_ANY_PATH = "LOGITSCOPE_ALLOW_ANY_PATH"
#: The same as a script argument: ``streamlit run app.py -- PATH --allow-any-path``.
ANY_PATH_FLAG = "--allow-any-path"


#: Where an installed wheel holds the sample runs: the build copies the repository's
#: ``sample_runs/`` into the ``logitscope`` package (see ``setup.py``).
PACKAGED_RUNS = REPO_ROOT / "logitscope" / "sample_runs"


def default_runs_path() -> Path:
    """The shipped sample runs: ``sample_runs/`` in a checkout (or editable install), else the installed copy."""
    checkout = REPO_ROOT / "sample_runs"
    if (REPO_ROOT / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout
    return PACKAGED_RUNS
