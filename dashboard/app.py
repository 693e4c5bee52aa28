"""The dashboard's entry point: ``streamlit run dashboard/app.py [-- PATH]`` (or ``logitscope dashboard PATH``).

Four pages under ``st.navigation``: the run browser, a run's overview, the
step replay, and the comparison of two runs. The sidebar (run, second run,
generation, sequence) is drawn here so that it is the same on every page. A
folder of sample runs opens on the headline example (``paths.HEADLINE_RUN``).
"""

from pathlib import Path

import streamlit as st

from dashboard import data, widgets
from dashboard.paths import HEADLINE_RUN

HERE = Path(__file__).resolve().parent

# No ":material/...:" icons anywhere: Streamlit fetches a Material Symbols favicon from fonts.gstatic.com, and
# the dashboard makes no outside request. An emoji favicon is drawn in the page (a data: URL).
st.set_page_config(page_title="logitscope", page_icon="📊", layout="wide")
navigation = st.navigation(
    [
        st.Page(HERE / "app_pages" / "runs.py", title="Runs", default=True),
        st.Page(HERE / "app_pages" / "overview.py", title="Overview"),
        st.Page(HERE / "app_pages" / "replay.py", title="Step replay"),
        st.Page(HERE / "app_pages" / "compare.py", title="Compare"),
    ]
)
if "run" not in st.session_state and not st.query_params.get("run"):
    # a folder of sample runs opens on the headline example rather than the alphabetically first run
    try:
        headline = [s.path for s in data.runs(widgets.root_path()) if s.label == HEADLINE_RUN and s.error is None]
    except OSError:
        headline = []  # the sidebar says what is missing or unreadable
    if headline:
        st.session_state["run"] = headline[0]
widgets.sidebar()
if navigation.url_path != "replay":
    widgets.follow_link("step", None)  # only the step replay has a step to link to
navigation.run()
