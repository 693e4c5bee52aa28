"""Widgets every page shares: where the runs are, which run, generation and sequence, and error messages.

Selections live in ``st.session_state`` under fixed keys (``root``, ``run``,
``run_b``, ``generation``, ``sequence``), set by widgets drawn on every page
(the sidebar), so they survive moving between pages; a page's own controls
survive it through :func:`keep`. The address's query string (``?run=``,
``?compare=``) follows the picks.

The served folder is the one the server was started on (``streamlit run
app.py -- PATH``, or ``$LOGITSCOPE_RUNS`` as ``logitscope dashboard PATH``
sets it); a viewer may move the page to another folder only inside it
(:func:`dashboard.paths.inside`: places compared, symlinks resolved, never
text), unless the server was started with ``--allow-any-path``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from dashboard import charts, data
from dashboard.discover import RunSummary
from dashboard.paths import (
    ANY_PATH_FLAG,
    APP,
    ENV_ANY_PATH,
    ENV_PATH,
    default_runs_path,
    inside,
)
from dashboard.reader import BadRunError
from dashboard.text import md_text
from tracker.format.fs import is_url

__all__ = [
    "Selected",
    "follow_link",
    "keep",
    "pick_stage",
    "any_path_allowed",
    "choose_root",
    "root_path",
    "served_root",
    "sidebar",
    "selected",
    "pick_generation_sequence",
    "show_bad_run",
]


@dataclass(frozen=True)
class Selected:
    """A sequence picked in a run: what the pages show."""

    path: str
    generation: int
    sequence: int
    summary: RunSummary


def _script_args() -> list[str]:
    """The arguments after ``--`` of ``streamlit run app.py -- ...`` (none when run otherwise)."""
    argv = sys.argv
    return list(argv[1:]) if argv and Path(argv[0]).resolve() == APP else []


def served_root() -> str:
    """The folder (or file) the server shows: ``streamlit run app.py -- PATH``, else $LOGITSCOPE_RUNS, else sample_runs/."""
    given = [a for a in _script_args() if a != ANY_PATH_FLAG]
    return given[0] if given else os.environ.get(ENV_PATH) or str(default_runs_path())


def any_path_allowed() -> bool:
    """Whether the server was started to let the path box leave the served folder."""
    return ANY_PATH_FLAG in _script_args() or os.environ.get(ENV_ANY_PATH) == "1"


def root_path() -> str:
    """Where the runs are: the session's choice (see :func:`choose_root`), else :func:`served_root`."""
    if "root" not in st.session_state:
        st.session_state["root"] = served_root()
    return str(st.session_state["root"])


def choose_root(candidate: str) -> str | None:
    """Show the runs under ``candidate`` (relative paths are taken inside the served folder).

    Returns None when done, else why not: a place outside what is served
    (:func:`dashboard.paths.inside`: parsed and normalised, symlinks resolved)
    is refused unless :func:`any_path_allowed`.
    """
    text = candidate.strip()
    if not text:
        return "give a folder or a run file"
    served = served_root()
    if any_path_allowed():
        base = Path(served).expanduser()
        base = base if base.is_dir() else base.parent
        local = Path(text).expanduser()
        st.session_state["root"] = text if is_url(text) or local.is_absolute() else str(base / local)
        return None
    where = inside(text, served)
    if where is None:
        what = "what this dashboard serves" if is_url(served) else "the folder this dashboard serves"
        return (
            f"'{text}' is outside {what} ('{served}'); start it with "
            "`logitscope dashboard PATH --allow-any-path` to browse elsewhere"
        )
    st.session_state["root"] = where
    return None


def _unreadable(root: str, exc: OSError) -> str:
    """What to say when the runs' folder cannot be listed."""
    if isinstance(exc, FileNotFoundError):
        return str(exc)
    where = exc.filename or root
    if isinstance(exc, PermissionError):
        return f"'{where}' cannot be read: permission denied (pick a folder this server may read)"
    return f"'{where}' cannot be read: {exc.strerror or exc}"


_KEPT = "kept:"


def keep(key: str, default: Any, options: Collection[Any] | None = None) -> None:
    """Give the widget drawn next under ``key`` the value the user last chose in it, or ``default``.

    Streamlit forgets the state of a widget that a run does not draw (a
    page's controls while the user is on another page); a copy kept under
    another key brings it back. A value no longer among ``options`` (for a
    list, one holding something that is not) goes back to ``default``. Draw
    the widget with no default of its own: it starts from this value.
    """
    value = st.session_state[key] if key in st.session_state else st.session_state.get(_KEPT + key, default)
    if options is not None:
        valid = all(v in options for v in value) if isinstance(value, list) else value in options
        value = value if valid else default
    if key not in st.session_state or st.session_state[key] != value:
        st.session_state[key] = value
    st.session_state[_KEPT + key] = value


def _keep_choice(key: str, options: list[Any], default_index: int = 0) -> None:
    """Keep a selectbox's value across pages, reset when it is no longer among its options."""
    if options:
        keep(key, options[default_index], options)


def follow_link(name: str, value: str | None) -> None:
    """Make the page's query parameter ``name`` say ``value`` (drop it for None): a link names what is shown."""
    if value is None:
        if name in st.query_params:
            del st.query_params[name]
    elif st.query_params.get(name) != value:
        st.query_params[name] = value


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


#: Runs the sidebar's pickers list at most (a dataset of 10,000 runs is picked from the Runs page's pages).
MAX_PICKER = 200


def _pickable(paths: list[str]) -> list[str]:
    """The runs the pickers offer: all of them, or past :data:`MAX_PICKER` the first ones, the runs the
    Runs page shows now and the runs picked (which stay pickable)."""
    if len(paths) <= MAX_PICKER:
        return paths
    wanted = set(paths[:MAX_PICKER]) | set(st.session_state.get("runs_shown", []))
    wanted |= {st.session_state.get("run"), st.session_state.get("run_b")}
    linked = {st.query_params.get("run"), st.query_params.get("compare")} - {None}
    return [p for p in paths if p in wanted or (linked and p.rstrip("/").rsplit("/", 1)[-1] in linked)]


def sidebar() -> None:
    """The run pickers (one run, and optionally a second to compare), then generation and sequence."""
    root = root_path()
    with st.sidebar:
        st.markdown("### logitscope")
        try:
            summaries = data.runs(root)
        except OSError as exc:  # missing, unreadable (PermissionError), or another file-system error
            st.error(md_text(_unreadable(root, exc)))
            summaries = []
        by_path = {s.path: s for s in summaries}
        paths = _pickable(list(by_path))
        st.session_state["summaries"] = by_path
        if not paths:
            st.caption(f"No runs under {md_text(root)}.")
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
        st.selectbox(
            "Compare with", [""] + paths, key="run_b", format_func=lambda p: "—" if not p else _label(by_path[p])
        )
        summary = by_path[st.session_state["run"]]
        follow_link("run", summary.label)  # the address follows the picks (a link applies once, on opening)
        follow_link("compare", by_path[st.session_state["run_b"]].label if st.session_state["run_b"] else None)
        if summary.error is None:
            try:
                pick_generation_sequence(summary.path)
            except BadRunError as exc:
                st.error(exc.reason)
        st.caption(f"Runs from {md_text(root)}")


def pick_stage(label: str, stages: list[str], key: str, names: dict[str, str] | None = None) -> str:
    """A row of buttons choosing one of ``stages``, each shown by its display name (``names``, see
    :func:`dashboard.charts.stage_names`)."""
    shown = names or charts.stage_names(stages)
    return st.radio(label, stages, horizontal=True, key=key, format_func=lambda s: md_text(shown.get(s, s)))


def show_bad_run(label: str, reason: str) -> None:
    """A plain message for a path that is not a readable run (never a traceback)."""
    st.error(f"**{md_text(label)}** cannot be shown: {md_text(reason)}.")


def selected() -> Selected | None:
    """The picked run and sequence, or None after telling the user why there is none."""
    by_path: dict[str, RunSummary] = st.session_state.get("summaries", {})
    path = st.session_state.get("run")
    if not by_path or path not in by_path:
        st.info(
            f"No runs found under {md_text(root_path())}. Record some with `logitscope demo`, or give a path: "
            "`logitscope dashboard PATH`."
        )
        return None
    summary = by_path[path]
    if summary.error is not None:
        show_bad_run(summary.label, summary.error)
        return None
    return Selected(path, int(st.session_state.get("generation", 0)), int(st.session_state.get("sequence", 0)), summary)
