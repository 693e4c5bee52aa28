"""Compare two sequences (two runs, or two generations or sequences of one run) aligned by step."""

import streamlit as st

from dashboard import charts, data, text, views, widgets
from dashboard.reader import BadRunError

picked = widgets.selected()
if picked is None:
    st.stop()
st.title("Compare")
by_path = st.session_state.get("summaries", {})
other = st.session_state.get("run_b") or picked.path
summary_b = by_path[other]
if summary_b.error is not None:
    widgets.show_bad_run(summary_b.label, summary_b.error)
    st.stop()
if not st.session_state.get("run_b"):
    st.caption("Pick a second run in the sidebar (*Compare with*), or another generation or sequence of this run below.")

label_a = f"A: {picked.summary.title or picked.summary.label} (g{picked.generation}, s{picked.sequence})"
st.markdown(f"**{label_a}**")
st.markdown(f"**B: {summary_b.title or summary_b.label}**")
try:
    generation_b, sequence_b = widgets.pick_generation_sequence(other, prefix="b_")
    label_b = f"B: {summary_b.title or summary_b.label} (g{generation_b}, s{sequence_b})"
    track_a = data.track(picked.path, picked.generation, picked.sequence)
    track_b = data.track(other, generation_b, sequence_b)
    longest = max(track_a.length, track_b.length)
    size = min(data.window_steps(picked.path), data.window_steps(other))
    start = 0
    if longest > size:
        start = st.slider("First step shown", 0, longest - 1, step=size, key="compare_start")
    view_a = data.window(picked.path, picked.generation, picked.sequence, min(start, track_a.length), min(track_a.length, start + size))
    view_b = data.window(other, generation_b, sequence_b, min(start, track_b.length), min(track_b.length, start + size))
    prompt_a = data.prompt(picked.path, picked.generation, picked.sequence)
    prompt_b = data.prompt(other, generation_b, sequence_b)
except BadRunError as exc:
    widgets.show_bad_run(exc.path, exc.reason)
    st.stop()

split = views.first_divergence(track_a.chosen, track_b.chosen)
pieces_a = data.pieces(picked.path, picked.generation, picked.sequence)
pieces_b = data.pieces(other, generation_b, sequence_b)
if split is None:
    st.success(f"The two sequences are the same: {track_a.length} identical tokens.")
elif split >= min(track_a.length, track_b.length):
    st.info(f"The two sequences agree on their first {split} tokens; then one of them ends.")
else:
    token_a, token_b = pieces_a[split], pieces_b[split]
    st.warning(f"The two sequences agree on their first {split} tokens and diverge at step {split}: "
               f"A chose {token_a!r}, B chose {token_b!r}.")
left, right = st.columns(2)
left.markdown(f"**{label_a}**")
left.html(text.divergent_text_html(prompt_a, pieces_a, split))
right.markdown(f"**{label_b}**")
right.html(text.divergent_text_html(prompt_b, pieces_b, split))
stage = "natural"
st.plotly_chart(
    charts.compare_timelines(view_a.stats, view_b.stats, labels=("A", "B"), stage=stage, divergence=split,
                             title="Step by step, aligned"),
    key="compare_chart",
    width="stretch",
)
table = views.aligned(view_a.stats, view_b.stats)
st.dataframe(table, hide_index=True, width="stretch")
