"""Run browser: every run under the path with its prompt, model, processors, sampling, length and date."""

import pandas as pd
import streamlit as st

from dashboard import widgets
from dashboard.text import md_text

st.title("Runs")
st.caption(
    "Every run found under the path. Pick one in the sidebar to see its overview and replay it step by step; "
    "pick a second under *Compare with* to line the two up."
)


def _use_path() -> None:
    st.session_state["root_refused"] = widgets.choose_root(st.session_state["root_input"])


st.text_input(
    "Runs folder or file",
    value=widgets.root_path(),
    key="root_input",
    on_change=_use_path,
    help="Inside the folder the dashboard serves"
    + ("" if widgets.any_path_allowed() else " (start it with --allow-any-path to browse elsewhere)"),
)
if st.session_state.get("root_refused"):
    st.error(md_text(st.session_state["root_refused"]))
summaries = list(st.session_state.get("summaries", {}).values())
if not summaries:
    st.info(f"No runs found under {md_text(widgets.root_path())}.")
    st.stop()

good = [s for s in summaries if s.error is None]
# Fits a 1,400 px window beside the sidebar, length and date first after the text: long texts are cut (hover
# shows them whole); the model, generations, storage and size of the picked run are in its details below.
table = pd.DataFrame(
    {
        "run": [s.title or s.label for s in good],
        "prompt": [s.prompt for s in good],
        "steps": [s.steps for s in good],
        "date": [s.created_at.replace("T", " ")[:16] for s in good],
        "file": [s.label for s in good],
        "processors": [s.processors for s in good],
        "sampling": [s.sampling for s in good],
        "sequences": [s.sequences for s in good],
    }
)
widths = {"run": 150, "prompt": 170, "steps": 60, "date": 130, "file": 110, "processors": 120, "sampling": 110}
st.dataframe(
    table,
    hide_index=True,
    width="stretch",
    column_config={
        **{name: st.column_config.Column(width=width) for name, width in widths.items()},
        "sequences": st.column_config.NumberColumn(width=75, help="Sequences of a generation (the most in any one)"),
    },
)
for bad in (s for s in summaries if s.error is not None):
    widgets.show_bad_run(bad.label, bad.error)

picked = st.session_state.get("summaries", {}).get(st.session_state.get("run"))
if picked is not None and picked.error is None:
    st.subheader(md_text(picked.title or picked.label))
    if picked.note:
        st.warning(md_text(picked.note))
    left, right = st.columns(2)
    left.markdown("**Prompt**")
    left.code(picked.prompt, language=None, wrap_lines=True)
    left.markdown(
        f"**Model** {md_text(picked.model or 'unknown')}  \n**Stages** {md_text(picked.stages)}  \n"
        f"**Storage** {md_text(picked.storage)}, vocabulary {picked.vocab_size:,}  \n"
        f"**Size** {picked.size_bytes / 2**20:.2f} MB  \n"
        f"**Holds** {picked.generations:,} generation(s) of up to {picked.sequences:,} sequence(s), "
        f"up to {picked.steps:,} steps"
    )
    right.markdown("**Processors**")
    right.code(picked.processors, language=None, wrap_lines=True)
    right.markdown(
        f"**Sampling** {md_text(picked.sampling or 'not recorded')}  \n"
        f"**Recorded** {md_text(picked.created_at)}  \n**Run id** {md_text(picked.run_id)}"
    )
