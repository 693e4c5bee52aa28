"""``python -m dashboard.launch run APP ...``: Streamlit's command line, with the app's heavy imports done early.

The first page of a new session otherwise pays for importing pandas, pyarrow
and plotly (through ``tracker.reading.run`` and the chart and view modules) inside the
script run. Here they are imported before the server starts, so that the
first visitor finds them loaded. (Not on a background thread beside the
server: a session's script importing the same packages at the same moment
could see a module half initialised.) Only modules free of Streamlit calls
are imported early; the pages import the rest as usual.

What was imported is then frozen out of the garbage collector's sight
(``gc.freeze``): the modules' hundreds of thousands of objects live as long
as the process, and Python's full collections, which otherwise walk them
all (about 0.1 s each here), then skip them.
"""

from __future__ import annotations

import gc
import importlib

#: Imported before the server starts (none of them calls Streamlit).
EARLY = (
    "tracker.reading.run",
    "tracker.reading.compare",
    "dashboard.reader",
    "dashboard.discover",
    "dashboard.views",
    "dashboard.charts",
    "dashboard.text",
    "streamlit.emojis",  # the page icon is checked against its catalogue: 0.4-1.4 s to import on the first page
)


def warm() -> None:
    """Import :data:`EARLY`."""
    for name in EARLY:
        importlib.import_module(name)


def main() -> None:
    warm()
    from streamlit.web.cli import main as streamlit_main

    gc.collect()  # what the imports left behind goes first; what lives on is frozen
    gc.freeze()
    streamlit_main(prog_name="streamlit")  # as ``python -m streamlit`` does; exits with the server


if __name__ == "__main__":
    main()
