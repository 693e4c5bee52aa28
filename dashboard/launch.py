"""``python -m dashboard.launch run APP ...``: Streamlit's command line, with the app's heavy imports done early.

The first page of a new session otherwise pays for importing torch, pandas,
pyarrow and plotly (through ``tracker`` and the chart and view modules) inside
the script run. Here a background thread imports them while the server
starts, so that the first visitor finds them loaded. Only modules free of
Streamlit calls are imported early; the pages import the rest as usual.
"""

from __future__ import annotations

import importlib
import threading

#: Imported in the background while the server starts (none of them calls Streamlit).
EARLY = ("tracker", "dashboard.reader", "dashboard.discover", "dashboard.views", "dashboard.charts", "dashboard.text")


def warm() -> None:
    """Import :data:`EARLY`."""
    for name in EARLY:
        importlib.import_module(name)


def main() -> None:
    threading.Thread(target=warm, name="logitscope-warm-imports", daemon=True).start()
    from streamlit.web.cli import main as streamlit_main

    streamlit_main(prog_name="streamlit")  # as ``python -m streamlit`` does; exits with the server


if __name__ == "__main__":
    main()
