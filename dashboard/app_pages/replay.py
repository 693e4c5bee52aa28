"""Step replay: scrub or play the steps; at each, the top tokens natural against constrained against sampled."""

import re

import streamlit as st

from dashboard import charts, data, live_chart, text, views, widgets
from dashboard.reader import BadRunError

PLAY_SECONDS = 0.2  # Play: five steps a second (each tick reruns only the step's fragment below)

picked = widgets.selected()
if picked is None:
    st.stop()
st.title(f"Step replay · {text.md_text(picked.summary.title or picked.summary.label)}")
if picked.summary.note:
    st.warning(text.md_text(picked.summary.note))
try:
    track = data.track(picked.path, picked.generation, picked.sequence)
    pieces = data.pieces(picked.path, picked.generation, picked.sequence)
    prompt = data.prompt(picked.path, picked.generation, picked.sequence)
except BadRunError as exc:
    widgets.show_bad_run(picked.summary.label, exc.reason)
    st.stop()
last = track.length - 1
if last < 0:
    st.info("This sequence has no recorded steps.")
    st.stop()

# A new run or sequence starts at step 0 (or a link's ?step=N on the first visit), paused.
where = (picked.path, picked.generation, picked.sequence)
if st.session_state.get("replay_for") != where:
    linked = st.query_params.get("step", "0") if "replay_for" not in st.session_state else "0"
    number = re.fullmatch(r"[0-9]{1,9}", linked)  # ASCII digits only: str.isdigit() takes "²", int() does not
    if number is None:
        st.warning(f"The link's step, {text.md_text(repr(linked))}, is not a number: showing step 0.")
    st.session_state.update(replay_for=where, step=int(linked) if number else 0, playing=False)
st.session_state["step"] = min(int(st.session_state.get("step", 0)), last)
st.session_state["step_slider"] = st.session_state["step"]


def _play(start: bool) -> None:
    """Play or pause, as the button said when it was drawn: a click the server sees twice (a tick of the timer
    can interrupt the rerun the click asked for, which then runs again with the click) still pauses."""
    if start and not st.session_state.get("playing", False) and st.session_state["step"] >= last:
        st.session_state["step"] = 0  # playing from the end starts over
    st.session_state["playing"] = start


def _move(delta: int) -> None:
    st.session_state["step"] = max(0, min(last, st.session_state["step"] + delta))
    st.session_state["step_slider"] = st.session_state["step"]  # only the fragment reruns: the slider follows here
    if st.session_state.get("playing"):
        st.session_state["stop_timer"] = True  # the fragment's timer goes with a rerun of the whole page
    st.session_state["playing"] = False


def _slid() -> None:
    st.session_state["step"] = st.session_state["step_slider"]


run_stages = data.stages(picked.path)
stages = run_stages
names = charts.stage_names(stages, data.stage_aliases(picked.path))
if len(stages) > 3:  # a stage per processor: pick the ones to draw
    widgets.keep("replay_stages", stages, stages)
    stages = st.multiselect("Stages", stages, key="replay_stages", format_func=names.get) or stages
controls = st.columns([1, 2, 2, 2])
playing = bool(st.session_state.get("playing", False))
one_step = last == 0  # nothing to play or move to
controls[0].button(
    "⏸ Pause" if playing else "▶ Play",
    key="play",
    on_click=_play,
    args=(not playing,),
    width="stretch",
    disabled=one_step,
)
widgets.keep("replay_value", "prob", ["prob", "logit"])
value = controls[1].radio(
    "Show",
    ["prob", "logit"],
    horizontal=True,
    key="replay_value",
    format_func={"prob": "probability", "logit": "logit"}.get,
)
widgets.keep("replay_scale", "linear", ["linear", "log"])
scale = controls[2].radio(
    "Scale",
    ["linear", "log"],
    horizontal=True,
    key="replay_scale",
    disabled=value == "logit",
    help="A log scale shows the small probabilities; logits are already on one.",
)
widgets.keep("replay_k", 10, range(3, 31))
k = controls[3].slider("Tokens shown", 3, 30, key="replay_k")


@st.fragment(run_every=PLAY_SECONDS if playing else None)
def _stepper() -> None:
    """The step's view; while playing, each run of this fragment moves one step on. Back, Next and the
    slider live here too, so that a click redraws this step's view, not the page (its reads are cached)."""
    if st.session_state.pop("stop_timer", False):
        st.rerun()
    if st.session_state.get("playing"):
        if st.session_state["step"] < last:
            st.session_state["step"] += 1
            st.session_state["step_slider"] = st.session_state["step"]
        if st.session_state["step"] >= last:
            st.session_state["playing"] = False
            st.rerun()
    moves = st.columns([1, 1, 8], vertical_alignment="bottom")
    moves[0].button("◀ Back", key="back", on_click=_move, args=(-1,), width="stretch", disabled=one_step)
    moves[1].button("Next ▶", key="next", on_click=_move, args=(1,), width="stretch", disabled=one_step)
    if one_step:
        moves[2].caption("This sequence has one step: step 0.")
    else:
        moves[2].slider("Step", 0, last, key="step_slider", on_change=_slid, help="Drag, or use Play, Back and Next.")
    position = int(st.session_state["step"])
    playing_now = bool(st.session_state.get("playing"))
    if not playing_now:  # while playing, the address follows at the pause: a new one each tick costs the browser
        widgets.follow_link("step", str(position))  # a link to this page shows this step
    try:
        table, summary = data.step(picked.path, picked.generation, picked.sequence, position, int(k))
    except BadRunError as exc:
        widgets.show_bad_run(picked.summary.label, exc.reason)
        return
    text_so_far = text.text_so_far_html(prompt, pieces[:position], pieces[position])
    shown = [s for s in stages if s in summary.p_chosen]
    removed = summary.removed_mass
    numbers = [
        (
            "Chosen token",
            text.md_text(views.token_label(summary.chosen_token)) if summary.chosen_id >= 0 else "—",
            None if summary.chosen_id >= 0 else "Not recorded: the host never said which token came last",
        ),
        *((f"p, {text.md_text(names[s])}", views.format_probability(summary.p_chosen[s]), None) for s in shown),
        (
            "Allowed tokens",
            f"{summary.allowed:,} / {summary.vocab_size:,}",
            "The tokens vLLM's sampler left to draw from" if summary.masked_by == "sampled" else None,
        ),
        (
            "Removed mass",
            "—" if removed != removed else f"{removed:.1%}",
            "The model's probability mass on tokens vLLM's sampler cut (penalties, temperature, min-p, top-k, "
            "top-p; each stage's share in the overview's statistics)"
            if summary.masked_by == "sampled"
            else "The model's probability mass on tokens the constraint masked",
        ),
    ]
    # each number as wide as its text (or its label, in smaller type) needs: a long token is not cut short
    widths = [
        min(16, max(4, len(shown_as.replace("\\", "")), 0.4 * len(label) + (3 if note else 1)))
        for label, shown_as, note in numbers
    ]
    # one container holds what differs between playing and paused, so that the chart after it keeps its place in
    # the page (and so its plot) when Play starts or stops
    with st.container():
        if playing_now:
            # the text and the numbers as one element, the numbers drawn as the metrics are: five times a second
            # the browser redraws one block of HTML instead of a row of columns holding a metric each
            st.html(text_so_far + text.numbers_html(numbers, widths))
        else:
            st.html(text_so_far)
            for cell, (label, shown_as, note) in zip(st.columns(widths), numbers):
                cell.metric(label, shown_as, help=note)
        if summary.processor_error:
            st.warning("The wrapped processor raised at this step: only the model's distribution was recorded.")
    # a plot that stays in the page and is updated in place (st.plotly_chart draws each new figure from nothing)
    live_chart.plotly_chart(
        charts.step_bars(
            table,
            stages,
            value=value,
            log_y=scale == "log",
            title=f"Step {summary.step}: top {min(k, len(table))} tokens by stage",  # top-k storage may hold fewer
            names=names,
            run_stages=run_stages,
            steady=playing_now,
        ),
        key="step_bars",
    )
    if value == "logit" and "sampled" in stages:
        st.caption(
            f"*{text.md_text(names['sampled'])}* is not drawn as logits: the run records what the sampler drew "
            "from as log-probabilities. Show probability to see it."
        )
    if (table[[f"{s}_state" for s in stages]] == "not stored").any(axis=None):
        st.caption("? marks a value this run's top-k storage did not keep: unknown, not masked.")
    if playing_now:
        return  # the table waits for a pause: no one reads it at five steps a second, and the browser draws less
    with st.expander("The numbers"):
        # tokens labelled as in the chart (a space as ␣, a newline as ↵)
        st.dataframe(table.drop(columns=["token"]).rename(columns={"label": "token"}), hide_index=True, width="stretch")


_stepper()
