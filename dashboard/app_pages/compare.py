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
for note in dict.fromkeys(n for n in (picked.summary.note, summary_b.note) if n):  # e.g. a spill folder's rows
    st.warning(text.md_text(note))
if summary_b.error is not None:
    widgets.show_bad_run(summary_b.label, summary_b.error)
    st.stop()
if summary_b.vocab_size != picked.summary.vocab_size:
    st.error(
        f"**{text.md_text(summary_b.label)}** has a vocabulary of {summary_b.vocab_size:,} tokens and "
        f"**{text.md_text(picked.summary.label)}** of {picked.summary.vocab_size:,}: only runs of one vocabulary "
        "compare (the same tokenizer). Pick another run under *Compare with*."
    )
    st.stop()

left, right = st.columns(2)
name_a = picked.summary.title or picked.summary.label
left.markdown(f"**A · {text.md_text(name_a)}**  \ngeneration {picked.generation}, sequence {picked.sequence}")
left.caption("A is the run, generation and sequence picked in the sidebar.")
right.markdown(f"**B · {text.md_text(summary_b.title or summary_b.label)}**")
if not st.session_state.get("run_b"):
    right.caption("Pick a second run in the sidebar (*Compare with*), or another generation or sequence of this run:")


def _b_in_a_s_run() -> None:
    """With no second run picked, B is another sequence of A's run: B's pick when it is one (not A's, and in
    this run), else the sequence after A's (the next sequence, else the next generation's first, wrapping
    round); a run holding only A's sequence asks for a second run. Never A against itself ("identical")."""
    run = data.reader(picked.path)
    order = [(g, s) for g in run.generations() for s in run.sequences(g)]
    a = (picked.generation, picked.sequence)
    b = tuple(st.session_state.get(k, st.session_state.get(f"kept:{k}")) for k in ("b_generation", "b_sequence"))
    if b in order and b != a:
        return
    if len(order) < 2:
        st.info("This run holds one sequence: pick a second run under *Compare with* in the sidebar.")
        st.stop()
    after = order.index(a) + 1 if a in order else 0
    st.session_state["b_generation"], st.session_state["b_sequence"] = order[after % len(order)]


try:
    if not st.session_state.get("run_b"):
        _b_in_a_s_run()
    generation_b, sequence_b = widgets.pick_generation_sequence(other, prefix="b_", container=right)
    track_a = data.track(picked.path, picked.generation, picked.sequence)
    track_b = data.track(other, generation_b, sequence_b)
    longest = max(track_a.length, track_b.length)
    size = min(data.window_steps(picked.path), data.window_steps(other))
    start = 0
    if longest > size:
        widgets.keep("compare_start", 0, range(0, longest, size))
        start = st.slider("First step shown", 0, longest - 1, step=size, key="compare_start")
    # a sequence that ends before the window has no steps in it: the other is shown alone
    view_a = (
        data.window(picked.path, picked.generation, picked.sequence, start, min(track_a.length, start + size))
        if start < track_a.length
        else None
    )
    view_b = (
        data.window(other, generation_b, sequence_b, start, min(track_b.length, start + size))
        if start < track_b.length
        else None
    )
    prompt_a = data.prompt(picked.path, picked.generation, picked.sequence)
    prompt_b = data.prompt(other, generation_b, sequence_b)
    pieces_a = data.pieces(picked.path, picked.generation, picked.sequence)
    pieces_b = data.pieces(other, generation_b, sequence_b)
    diff = (
        data.comparison(
            picked.path, picked.generation, picked.sequence, other, generation_b, sequence_b, start, start + size
        )
        if view_a is not None and view_b is not None
        else None
    )
except BadRunError as exc:
    widgets.show_bad_run(exc.path, exc.reason)
    st.stop()


def _tokens(n: int) -> str:
    return f"{n:,} token" if n == 1 else f"{n:,} tokens"


def _chosen(path: str, track, step: int) -> str:
    """The token chosen at ``step`` as every page names it (a byte that is no character yet as ⟨E6⟩, EOS by name)."""
    token = int(track.chosen[step])
    return text.md_text(views.token_label(data.reader(path).vocab.display[token])) if token >= 0 else "—"


split = views.first_divergence(track_a.chosen, track_b.chosen)
shorter = min(track_a.length, track_b.length)
parted = split if split is not None and split < shorter else None  # where the charts mark the divergence
if split is None:
    st.success(f"The two sequences are the same: {_tokens(track_a.length)}, identical.")
elif parted is None:
    ends, goes_on = ("A", "B") if track_a.length < track_b.length else ("B", "A")
    st.info(
        f"The two sequences agree on all {_tokens(shorter)} of {ends}; then {ends} ends (after step {shorter - 1}) "
        f"and {goes_on} goes on to step {longest - 1}."
    )
else:
    agree = f"agree on their first {_tokens(split)} and diverge at step {split}" if split else "diverge at step 0"
    st.warning(
        f"The two sequences {agree}: A chose {_chosen(picked.path, track_a, split)}, "
        f"B chose {_chosen(other, track_b, split)}."
    )
left, right = st.columns(2)
left.html(text.divergent_text_html(prompt_a, pieces_a, split))
right.html(text.divergent_text_html(prompt_b, pieces_b, split))

for label, track, view in (("A", track_a, view_a), ("B", track_b, view_b)):
    if view is None:
        ended = f"it ends at step {track.length - 1}" if track.length else "it has no recorded steps"
        st.info(f"{label} has no steps from step {start} on: {ended}.")
if view_a is None and view_b is None:
    st.stop()
stats_a = view_a.stats if view_a is not None else view_b.stats.iloc[0:0]  # type: ignore[union-attr]
stats_b = view_b.stats if view_b is not None else stats_a.iloc[0:0]
common = [s for s in data.stages(picked.path) if s in data.stages(other)]
names = charts.stage_names(common, data.stage_aliases(picked.path))
widgets.keep("compare_stage", common[0], common)
stage = widgets.pick_stage("Distribution", common, key="compare_stage", names=names)
st.plotly_chart(
    charts.compare_timelines(
        stats_a, stats_b, labels=("A", "B"), stage=stage, divergence=parted, title="Step by step, aligned", names=names
    ),
    key="compare_chart",
    width="stretch",
)
columns = ("chosen_id", "chosen_token", f"p_chosen_{stage}", f"entropy_{stage}")
st.dataframe(views.aligned(stats_a, stats_b, columns), hide_index=True, width="stretch")

st.subheader("How far apart the distributions are")
if other != picked.path:
    with st.expander("The whole runs: KL divergence, top-1 agreement and perplexities over every sequence"):
        st.caption(
            "KL(A‖B) in nats per step, A's distribution against B's; Δp is the chosen token's probability "
            "under B minus under A; perplexities over the recorded tokens (definitions: the guide's *Re-scoring*)."
        )
        if st.button("Compute", key="compare_run_statistics"):
            try:
                table, note = data.run_statistics(picked.path, other)
            except ValueError as exc:
                st.error(text.md_text(str(exc)))
            else:
                st.dataframe(table, hide_index=True, width="stretch")
                if note:
                    st.caption(text.md_text(note))
if diff is None:
    st.caption("Only steps both sequences have are compared: pick an earlier *First step shown*.")
    st.stop()
if diff.note:
    st.caption(diff.note)
widgets.keep("compare_measure", "js", ["js", "tv", "kl"])
measure = st.radio(
    "Distance",
    ["js", "tv", "kl"],
    horizontal=True,
    key="compare_measure",
    format_func={"js": "Jensen–Shannon", "tv": "total variation", "kl": "KL(A‖B)"}.get,
)
st.plotly_chart(
    charts.distance_timeline(
        diff.steps,
        diff.stages,
        measure=measure,
        divergence=parted,
        title="Distance between A and B, step by step",
        names=names,
    ),
    key="distance_chart",
    width="stretch",
)
st.caption("Tokens whose probability changed most from A to B at each step")
tokens = diff.tokens.assign(token=diff.tokens["token"].map(views.token_label, na_action="ignore"))
st.dataframe(tokens, hide_index=True, width="stretch")
