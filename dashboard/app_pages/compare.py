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
if summary_b.vocab_size != picked.summary.vocab_size:
    st.error(
        f"**{text.md_text(summary_b.label)}** has a vocabulary of {summary_b.vocab_size:,} tokens and "
        f"**{text.md_text(picked.summary.label)}** of {picked.summary.vocab_size:,}: only runs of one vocabulary "
        "compare (the same tokenizer). Pick another run under *Compare with*.",
        icon=":material/error:",
    )
    st.stop()

left, right = st.columns(2)
name_a = picked.summary.title or picked.summary.label
left.markdown(f"**A · {text.md_text(name_a)}**  \ngeneration {picked.generation}, sequence {picked.sequence}")
left.caption("A is the run, generation and sequence picked in the sidebar.")
right.markdown(f"**B · {text.md_text(summary_b.title or summary_b.label)}**")
if not st.session_state.get("run_b"):
    right.caption("Pick a second run in the sidebar (*Compare with*), or another generation or sequence of this run:")
try:
    generation_b, sequence_b = widgets.pick_generation_sequence(other, prefix="b_", container=right)
    track_a = data.track(picked.path, picked.generation, picked.sequence)
    track_b = data.track(other, generation_b, sequence_b)
    longest = max(track_a.length, track_b.length)
    size = min(data.window_steps(picked.path), data.window_steps(other))
    start = 0
    if longest > size:
        start = st.slider("First step shown", 0, longest - 1, step=size, key="compare_start")
    view_a = data.window(
        picked.path, picked.generation, picked.sequence, min(start, track_a.length), min(track_a.length, start + size)
    )
    view_b = data.window(other, generation_b, sequence_b, min(start, track_b.length), min(track_b.length, start + size))
    prompt_a = data.prompt(picked.path, picked.generation, picked.sequence)
    prompt_b = data.prompt(other, generation_b, sequence_b)
    pieces_a = data.pieces(picked.path, picked.generation, picked.sequence)
    pieces_b = data.pieces(other, generation_b, sequence_b)
    diff = data.comparison(
        picked.path, picked.generation, picked.sequence, other, generation_b, sequence_b, start, start + size
    )
except BadRunError as exc:
    widgets.show_bad_run(exc.path, exc.reason)
    st.stop()

split = views.first_divergence(track_a.chosen, track_b.chosen)
if split is None:
    st.success(f"The two sequences are the same: {track_a.length} identical tokens.")
elif split >= min(track_a.length, track_b.length):
    st.info(f"The two sequences agree on their first {split} tokens; then one of them ends.")
else:
    st.warning(
        f"The two sequences agree on their first {split} tokens and diverge at step {split}: "
        f"A chose {text.md_text(views.token_label(pieces_a[split]))}, B chose {text.md_text(views.token_label(pieces_b[split]))}."
    )
left, right = st.columns(2)
left.html(text.divergent_text_html(prompt_a, pieces_a, split))
right.html(text.divergent_text_html(prompt_b, pieces_b, split))

common = [s for s in picked.summary.stages.split(", ") if s in summary_b.stages.split(", ")]
stage = widgets.pick_stage("Distribution", common, key="compare_stage")
st.plotly_chart(
    charts.compare_timelines(
        view_a.stats, view_b.stats, labels=("A", "B"), stage=stage, divergence=split, title="Step by step, aligned"
    ),
    key="compare_chart",
    width="stretch",
)
columns = ("chosen_id", "chosen_token", f"p_chosen_{stage}", f"entropy_{stage}")
st.dataframe(views.aligned(view_a.stats, view_b.stats, columns), hide_index=True, width="stretch")

st.subheader("How far apart the distributions are")
if diff.note:
    st.caption(diff.note)
measure = st.radio(
    "Distance",
    ["js", "tv", "kl"],
    horizontal=True,
    key="compare_measure",
    format_func={"js": "Jensen–Shannon", "tv": "total variation", "kl": "KL(A‖B)"}.get,
)
st.plotly_chart(
    charts.distance_timeline(
        diff.steps, diff.stages, measure=measure, divergence=split, title="Distance between A and B, step by step"
    ),
    key="distance_chart",
    width="stretch",
)
st.caption("Tokens whose probability changed most from A to B at each step")
tokens = diff.tokens.assign(token=diff.tokens["token"].map(views.token_label, na_action="ignore"))
st.dataframe(tokens, hide_index=True, width="stretch")
