"""A plotly chart that stays mounted across reruns and updates in place: Step replay's chart.

``st.plotly_chart`` names its element by a hash of the figure, so a figure
with new data is a new element: the browser throws the old plot away and
draws a new one from nothing, then draws it again when Streamlit applies its
theme (about 250 ms of the browser's main thread a step here, more than Play's
0.2 s a step). :func:`plotly_chart` draws the figure through a Streamlit custom
component instead (``components.v1``: an iframe keyed by a fixed ``key``), whose
page (``live_chart.html``) keeps one plot and hands each new figure to
``Plotly.react``, which updates it in place.

The component's folder holds that page and ``plotly.min.js`` copied from the
installed plotly package, so the browser asks the local server for everything
(no CDN). The folder is built once per plotly version in logitscope's cache
(``$LOGITSCOPE_CACHE``, else ``~/.cache/logitscope``, as for the run index);
where it cannot be built, the chart is drawn by ``st.plotly_chart`` as before.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import plotly
import plotly.graph_objects as go
import plotly.io as pio
import streamlit as st
from streamlit.components import v1 as components
from streamlit.errors import StreamlitAPIException

from tracker.format.dataset import CACHE_ENV

__all__ = ["COMPONENT", "PAGE", "PLOTLY_JS", "component_folder", "plotly_chart"]

#: The component's name (Streamlit prefixes it with this module's name).
COMPONENT = "live_chart"
#: The component's page, shipped as package data beside this module.
PAGE = Path(__file__).with_name("live_chart.html")
#: plotly.js as the installed plotly package ships it.
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"

_log = logging.getLogger(__name__)


def _cache_root() -> Path:
    """logitscope's cache folder, as the run index has it: ``$LOGITSCOPE_CACHE``, else ``~/.cache/logitscope``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "logitscope")


def component_folder(root: Path | None = None) -> Path:
    """The component's folder (``index.html`` and ``plotly.min.js``) under ``root`` (default: the cache), built
    when missing or incomplete. Its name holds a digest of the page and of plotly.js (version, size, time), so a
    new plotly or a new page gets a new folder; it is built beside its final place and renamed into it, so a
    server never serves a half-copied file. Raises ``OSError`` where the files cannot be read or the folder
    cannot be written."""
    root = Path(root) if root is not None else _cache_root()
    page = PAGE.read_bytes()
    stat = PLOTLY_JS.stat()
    digest = hashlib.sha256(page + f"{plotly.__version__}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    folder = root / f"live_chart-{digest[:16]}"
    if (folder / "index.html").is_file() and (folder / "plotly.min.js").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".live_chart-", dir=root))
    try:
        (building / "index.html").write_bytes(page)
        shutil.copyfile(PLOTLY_JS, building / "plotly.min.js")
        if folder.exists():  # a file of it missing: replaced whole
            shutil.rmtree(folder, ignore_errors=True)
        try:
            building.rename(folder)
        except OSError:  # another server built it first
            if not (folder / "plotly.min.js").is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder


@functools.cache
def _say_once(reason: str) -> None:
    _log.warning("the live chart cannot be served (%s): charts are drawn by st.plotly_chart", reason)


def _component():
    """The component, declared on the running server at each script run (a new server has a new registry;
    a folder removed meanwhile is built again), or None where its folder cannot be built."""
    try:
        return components.declare_component(COMPONENT, path=component_folder())
    except (OSError, StreamlitAPIException) as exc:
        _say_once(str(exc))
        return None


def plotly_chart(figure: go.Figure, *, key: str) -> None:
    """Draw ``figure`` across the column, as ``st.plotly_chart(figure, key=key, width="stretch")`` does, in a
    plot that stays in the page while ``key`` does: a new figure updates it in place. Falls back to
    ``st.plotly_chart`` where the component cannot be served."""
    draw = _component()
    if draw is None:
        st.plotly_chart(figure, key=key, width="stretch")
        return
    height = figure.layout.height or 450
    draw(spec=pio.to_json(figure, validate=False), height=int(height), key=key, default=None)
