"""Run browser: every run under the path with its prompt, model, processors, sampling, length and date."""

import pandas as pd
import streamlit as st

from dashboard import data, widgets
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
#: Rows of the table at once: a dataset of 10,000 runs is shown a page at a time.
PAGE_ROWS = 100
if len(good) > 1:
    filters = st.columns([1, 1, 1, 1])
    model = filters[0].text_input("Model", key="runs_model", placeholder="any model")
    title = filters[1].text_input("Title", key="runs_title", placeholder="any title")
    processor = filters[2].text_input("Processor", key="runs_processor", placeholder="any processor")
    dates = sorted({s.created_at[:10] for s in good if s.created_at})
    since = filters[3].selectbox(
        "Recorded on or after", [""] + dates, key="runs_since", format_func=lambda d: d or "any date"
    )
    good = [
        s
        for s in good
        if model.lower() in s.model.lower()
        and title.lower() in (s.title or s.label).lower()
        and processor.lower() in s.processors.lower()
        and (not since or s.created_at[:10] >= since)
    ]
pages = max(1, -(-len(good) // PAGE_ROWS))
page = 1
if pages > 1:
    page = int(st.number_input(f"Page (of {pages:,}; {len(good):,} runs)", 1, pages, 1, key="runs_page"))
shown = good[(page - 1) * PAGE_ROWS : page * PAGE_ROWS]
if st.session_state.get("runs_shown") != [s.path for s in shown]:
    st.session_state["runs_shown"] = [s.path for s in shown]  # the sidebar's pickers offer them next


def _open_picked() -> None:
    if st.session_state.get("runs_pick"):
        st.session_state["run"] = st.session_state["runs_pick"]


if len(summaries) > PAGE_ROWS:  # the sidebar's picker is long: pick from this page's runs here
    by_path = st.session_state.get("summaries", {})
    st.selectbox(
        "Open a run of this page",
        [""] + [s.path for s in shown],
        key="runs_pick",
        on_change=_open_picked,
        format_func=lambda p: "—" if not p else f"{by_path[p].title or by_path[p].label}  ·  {by_path[p].label}",
    )
# Fits a 1,400 px window beside the sidebar, length and date first after the text: long texts are cut (hover
# shows them whole); the model, generations, storage and size of the picked run are in its details below.
table = pd.DataFrame(
    {
        "run": [s.title or s.label for s in shown],
        "prompt": [s.prompt for s in shown],
        "steps": [s.steps for s in shown],
        "date": [s.created_at.replace("T", " ")[:16] for s in shown],
        "file": [s.label for s in shown],
        "processors": [s.processors for s in shown],
        "sampling": [s.sampling for s in shown],
        "sequences": [s.sequences for s in shown],
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
    origin = data.reader(picked.path).metadata.extra.get("rescored_from")
    if isinstance(origin, dict):
        how = data.reader(picked.path).metadata.extra.get("rescore") or {}
        st.info(
            md_text(
                f"Rescored from run {origin.get('run_id')}"
                + (f" ({origin['title']})" if origin.get("title") else "")
                + (f", recorded by {origin['model']}" if origin.get("model") else "")
                + f": the same tokens through {how.get('model', 'another model')}"
                + (f" in {how['dtype']}" if how.get("dtype") else "")
            )
            + ". Compare the two under *Compare*.",
        )
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
