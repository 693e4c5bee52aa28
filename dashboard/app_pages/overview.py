"""Overview of one sequence: the text coloured step by step, timelines of the statistics, a heatmap of candidates."""

import numpy as np
import streamlit as st

from dashboard import charts, data, text, widgets
from dashboard.reader import BadRunError
from dashboard.views import COLOR_METRICS

picked = widgets.selected()
if picked is None:
    st.stop()
title = picked.summary.title or picked.summary.label
st.title(f"Overview · {text.md_text(title)}")
if picked.summary.note:
    st.warning(text.md_text(picked.summary.note))
try:
    track = data.track(picked.path, picked.generation, picked.sequence)
    size = data.window_steps(picked.path)
    start = 0
    if track.length > size:
        widgets.keep("overview_start", 0, range(0, track.length, size))
        start = st.slider(
            "First step shown",
            0,
            track.length - 1,
            step=size,
            key="overview_start",
            help="Long runs are read a window at a time, so that nothing reads the whole file.",
        )
        st.caption(f"Steps {start}–{min(track.length, start + size) - 1} of {track.length:,}.")
    stop = min(track.length, start + size)
    view = data.window(picked.path, picked.generation, picked.sequence, start, stop)
    prompt = data.prompt(picked.path, picked.generation, picked.sequence)
except BadRunError as exc:
    widgets.show_bad_run(picked.summary.label, exc.reason)
    st.stop()

stages = data.stages(picked.path)
names = charts.stage_names(stages, data.stage_aliases(picked.path))
options = [
    label
    for label, (column, _) in COLOR_METRICS.items()
    if column in view.stats.columns and (column != "removed_mass" or "constrained" in stages)
]
widgets.keep("overview_metric", options[0], options)
metric = st.radio("Colour tokens by", options, horizontal=True, key="overview_metric")
column = COLOR_METRICS[metric][0]
st.html(
    text.token_text_html(
        view.tokens,
        view.stats[column].to_numpy(),
        column,
        hovers=text.token_hovers(view, stages),
        prompt=prompt if start == 0 else "",
    )
)
st.html(text.legend_html(metric))
st.caption("Hover a token to see the model's alternatives at that step.")

left, right, third, fourth = st.columns(4)
left.metric("Steps", f"{track.length:,}")
if "constrained" in stages:
    removed = view.stats["removed_mass"].mean() if "removed_mass" in view.stats else float("nan")
    right.metric(  # short labels, the details in the help: a label that does not fit is cut with "…"
        "Mass removed",
        "—" if removed != removed else f"{removed:.1%}",
        help="The mean, over the steps shown, of the model's probability mass the constraint masked",
    )
else:
    right.metric("Constraint", "none")
surprisal = view.stats["surprisal_natural"].mean() if "surprisal_natural" in view.stats else float("nan")
third.metric(
    "Perplexity",
    "—" if surprisal != surprisal else f"{np.exp(surprisal):.2f}",
    help="Of the steps shown, under the model: exp of the mean surprisal (−log p, natural) of the chosen tokens",
)
prompt_ppl = data.prompt_perplexity(picked.path, picked.generation, picked.sequence)
fourth.metric(
    "Prompt perplexity",
    "—" if prompt_ppl != prompt_ppl else f"{prompt_ppl:.2f}",
    help="Recorded with LogitTrackingProcessor(..., prompt_logprobs=True)",
)
st.plotly_chart(
    charts.timelines(view.stats, stages, title="Step by step", names=names), key="timelines", width="stretch"
)
by_processor = charts.removed_by_processor(view.stats, title="Mass removed by each processor", run_stages=stages)
if by_processor is not None:
    st.plotly_chart(by_processor, key="removed_by_processor", width="stretch")
widgets.keep("heat_stage", stages[0], stages)
heat_stage = widgets.pick_stage("Heatmap of", stages, key="heat_stage", names=names)
st.plotly_chart(
    charts.token_heatmap(
        view.heat[heat_stage],
        view.heat_chosen,
        stage=heat_stage,
        title="Top candidates by step (○ chosen)",
        names=names,
    ),
    key="heatmap",
    width="stretch",
)
