"""Widgets every page shares: where the runs are, which run, generation and sequence, and error messages.

Selections live in ``st.session_state`` under fixed keys (``root``, ``run``,
``run_b``, ``generation``, ``sequence``), set by widgets drawn on every page
(the sidebar), so they survive moving between pages.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from dashboard import data
from dashboard.discover import RunSummary
from dashboard.paths import APP, ENV_PATH, default_runs_path
from dashboard.reader import BadRunError

__all__ = ["Selected", "root_path", "sidebar", "selected", "pick_generation_sequence", "show_bad_run"]



@dataclass(frozen=True)
class Selected:
    """A sequence picked in a run: what the pages show."""

    path: str
    generation: int
    sequence: int
    summary: RunSummary


def root_path() -> str:
    """Where the runs are: the session's choice, else ``streamlit run app.py -- PATH``, else $LOGITSCOPE_RUNS, else sample_runs/."""
    if "root" not in st.session_state:
        argv = sys.argv
        from_cli = len(argv) > 1 and Path(argv[0]).resolve() == APP
        st.session_state["root"] = argv[1] if from_cli else os.environ.get(ENV_PATH) or str(default_runs_path())
    return str(st.session_state["root"])


def _keep_choice(key: str, options: list[Any], default_index: int = 0) -> None:
    """Reset a selectbox's remembered value when it is no longer among its options."""
    if options and st.session_state.get(key) not in options:
        st.session_state[key] = options[default_index]


def _label(summary: RunSummary) -> str:
    name = summary.title or summary.label
    return f"⚠ {summary.label} (cannot be read)" if summary.error else f"{name}  ·  {summary.label}"


def pick_generation_sequence(path: str, prefix: str = "", container: Any = st) -> tuple[int, int]:
    """Generation and sequence selectboxes for the run at ``path`` (keys ``{prefix}generation/sequence``)."""
    run = data.reader(path)
    generations = run.generations()
    _keep_choice(f"{prefix}generation", generations)
    left, right = container.columns(2)
    generation = left.selectbox("Generation", generations, key=f"{prefix}generation")
    sequences = run.sequences(generation)
    _keep_choice(f"{prefix}sequence", sequences)
    sequence = right.selectbox("Sequence", sequences, key=f"{prefix}sequence")
    return int(generation), int(sequence)


def sidebar() -> None:
    """The run pickers (one run, and optionally a second to compare), then generation and sequence."""
    root = root_path()
    with st.sidebar:
        st.markdown("### logitscope")
        try:
            summaries = data.runs(root)
        except FileNotFoundError as exc:
            st.error(str(exc))
            summaries = []
        by_path = {s.path: s for s in summaries}
        paths = list(by_path)
        st.session_state["summaries"] = by_path
        if not paths:
            st.caption(f"No runs under `{root}`.")
            return
        readable = [p for p in paths if by_path[p].error is None]
        linked = [p for p in paths if by_path[p].label == st.query_params.get("run")]
        if linked and "run" not in st.session_state:
            st.session_state["run"] = linked[0]  # a link may name the run: ?run=json_record.parquet
        _keep_choice("run", paths, paths.index(readable[0]) if readable else 0)
        st.selectbox("Run", paths, key="run", format_func=lambda p: _label(by_path[p]))
        compared = [p for p in paths if by_path[p].label == st.query_params.get("compare")]
        if compared and "run_b" not in st.session_state:
            st.session_state["run_b"] = compared[0]  # and the second: ?compare=hot.parquet
        _keep_choice("run_b", [""] + paths)
        st.selectbox("Compare with", [""] + paths, key="run_b", format_func=lambda p: "—" if not p else _label(by_path[p]))
        summary = by_path[st.session_state["run"]]
        if summary.error is None:
            try:
                pick_generation_sequence(summary.path)
            except BadRunError as exc:
                st.error(exc.reason)
        st.caption(f"Runs from `{root}`")


def show_bad_run(label: str, reason: str) -> None:
    """A plain message for a path that is not a readable run (never a traceback)."""
    st.error(f"**{label}** cannot be shown: {reason}.", icon=":material/error:")


def selected() -> Selected | None:
    """The picked run and sequence, or None after telling the user why there is none."""
    by_path: dict[str, RunSummary] = st.session_state.get("summaries", {})
    path = st.session_state.get("run")
    if not by_path or path not in by_path:
        st.info(f"No runs found under `{root_path()}`. Record some with `logitscope demo`, or give a path: "
                "`logitscope dashboard PATH`.")
        return None
    summary = by_path[path]
    if summary.error is not None:
        show_bad_run(summary.label, summary.error)
        return None
    return Selected(path, int(st.session_state.get("generation", 0)), int(st.session_state.get("sequence", 0)), summary)
