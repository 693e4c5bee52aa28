"""Plotly figure builders: pure functions from the tables of :mod:`dashboard.views` to figures.

Nothing here reads files or calls Streamlit, so every figure is unit-tested
on small hand-made runs. Colours are fixed per stage across all figures: the
model's own distribution ("natural"), what the constraint left
("constrained"), and what the sampler drew from ("sampled"); a run's other
stages take theirs by their place in the run (:mod:`dashboard.chart_style`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.chart_style import BAR_GAP as _BAR_GAP
from dashboard.chart_style import LINES as _LINES
from dashboard.chart_style import (
    MASK_COLOR,
    MASKED_NAMES,
    NOT_STORED_COLOR,
    NOT_STORED_NAME,
    STAGE_COLORS,
    STAGE_NAMES,
    stage_colors,
    stage_names,
)
from dashboard.chart_style import TOKEN_FONT as _TOKEN_FONT
from dashboard.chart_style import color as _color
from dashboard.chart_style import integer_steps as _integer_steps
from dashboard.chart_style import layout as _layout
from dashboard.chart_style import layout_spec as _layout_spec
from dashboard.chart_style import masked_name as _masked_name
from dashboard.chart_style import name as _name
from dashboard.text import plot_text
from dashboard.views import token_label

__all__ = [
    "MASKED_NAMES",
    "MASK_COLOR",
    "NOT_STORED_NAME",
    "STAGE_COLORS",
    "STAGE_NAMES",
    "stage_colors",
    "stage_names",
    "compare_timelines",
    "distance_timeline",
    "removed_by_processor",
    "step_bars",
    "timelines",
    "token_heatmap",
]


#: The margins (px) the step's bars start with while playing: what plotly's automargin gives one line of token
#: labels and probabilities from 0 to 1 in the dashboard's fonts (71 px at the bottom, 71-78 at the left).
STEADY_MARGINS = {"l": 80, "b": 72}


def _marks(x: np.ndarray, y: np.ndarray, tokens: np.ndarray, mark: dict, hover: str, legend: set[str]) -> dict:
    """A row of ✕ (masked) or ? (not stored) markers, each labelled; ``mark`` gives word, colour, symbol, name.
    The first row of a name (not yet in ``legend``, which it joins) shows in the legend."""
    color = mark["color"]
    shown = mark["name"] not in legend
    legend.add(mark["name"])
    return dict(
        type="scatter",
        x=x,
        y=y,
        mode="markers+text",
        marker=dict(
            symbol=mark["symbol"], size=12, color=color, line=dict(width=2 if mark["word"] == "?" else 3, color=color)
        ),
        text=[mark["word"]] * len(x),
        textposition="top center",
        textfont=dict(color=color, size=11),
        name=mark["name"],
        legendgroup=mark["name"],
        showlegend=shown,
        customdata=tokens,
        hovertemplate="%{customdata}: " + hover,
    )


def step_bars(
    table: pd.DataFrame,
    stages: Sequence[str],
    *,
    value: Literal["prob", "logit"] = "prob",
    log_y: bool = False,
    title: str = "",
    names: Mapping[str, str] | None = None,
    run_stages: Sequence[str] | None = None,
    steady: bool = False,
) -> go.Figure:
    """Grouped bars of one step's tokens (from :func:`dashboard.views.step_table`), one colour per stage.

    Tokens sit at x = 0, 1, 2, ... (labelled with their text), each with one
    bar slot per stage. A token a stage removed has no bar there; an ✕ fills
    the slot of the first stage drawn where it is masked (so hiding the stage
    that masked it keeps the mark), at the height the model gave the token,
    labelled "masked" or "cut" (by the sampler) and named after the stage
    that removed it. A value top-k storage did not keep is marked "?" (not
    stored), apart from masked ones. The chosen token is marked with an arrow
    and a bold label. ``log_y`` applies to probabilities (logits are already
    a log scale). The sampled stage holds log-probabilities, not logits: it
    is left out when ``value`` is "logit". ``run_stages`` (default
    ``stages``), the run's stages, fixes each stage's colour.

    Step replay draws this figure at every click and every tick of Play, so
    it is built as a plain dict and handed to plotly without its property
    validation (30 ms a figure of the 40 it took; the tests validate the same
    figures in full). Step replay updates one plot in place with each new
    figure (:mod:`dashboard.live_chart`; ``st.plotly_chart`` would draw a new
    plot each time), and the layout spares plotly the work it can: tick labels are not measured, each
    against every other, for overflow past the chart's edge (the margins keep
    them inside; one that still passes it is cut there, not hidden), and with
    ``steady`` (Play) the margins start wide enough for the usual labels,
    so that plotly draws the figure once instead of again with the margins
    its labels push out, and the plot area stays put from step to step
    (labels that need more still widen them).
    """
    if value not in ("prob", "logit"):
        raise ValueError(f"value must be 'prob' or 'logit', got {value!r}")
    colors = stage_colors(run_stages or stages)
    stages = [s for s in stages if not (value == "logit" and s == "sampled")]
    labels = np.array([plot_text(label) for label in table["label"].tolist()], dtype=object)  # text, not plotly HTML
    ticks = [f"<b>▶ {label}</b>" if chosen else label for label, chosen in zip(labels, table["chosen"].tolist())]
    positions = np.arange(len(table), dtype=float)
    width = (1.0 - _BAR_GAP) / max(1, len(stages))
    centres = [-(1.0 - _BAR_GAP) / 2 + (j + 0.5) * width for j in range(len(stages))]
    traces: list[dict] = []
    drawn = [table[f"natural_{value}"].to_numpy(dtype=float)]
    drawn[0] = np.where(drawn[0] == -np.inf, np.nan, drawn[0])
    for j, stage in enumerate(stages):
        states = table[f"{stage}_state"].to_numpy()
        y = table[f"{stage}_{value}"].to_numpy(dtype=float)
        y = np.where((y == -np.inf) | (states == "masked"), np.nan, y)
        if value == "prob" and log_y:
            y = np.where(y > 0, y, np.nan)
        drawn.append(y)
        custom = np.stack(
            [
                labels,
                table[f"{stage}_prob"].to_numpy(dtype=float),
                table[f"{stage}_logit"].to_numpy(dtype=float),
                states,
            ],
            axis=1,
        )
        traces.append(
            dict(
                type="bar",
                x=positions,
                y=y,
                width=width,
                offset=centres[j] - width / 2,
                name=_name(stage, names),
                marker=dict(color=colors.get(stage, _color(stage))),
                customdata=custom,
                hovertemplate="%{customdata[0]}<br>"
                + _name(stage, names)
                + ": p=%{customdata[1]:.3~g}, logit=%{customdata[2]:.3f}<br>%{customdata[3]}<extra></extra>",
            )
        )
    # a mark sits at the model's value for the token; where that is unknown (or not drawable), at the bars' bottom
    log_scale = log_y and value == "prob"
    known = np.concatenate(drawn)
    known = known[np.isfinite(known) & ((known > 0) | (not log_scale))]
    bottom = float(known.min()) if known.size and (log_scale or value == "logit") else 0.0
    natural = drawn[0]
    natural = np.where(np.isfinite(natural) & ((natural > 0) | (not log_scale)), natural, bottom)
    slot = np.full(len(table), -1)
    for j, stage in enumerate(stages):
        if stage != "natural":
            slot = np.where((slot < 0) & (table[f"{stage}_state"] == "masked").to_numpy(), j, slot)
    removed_by = table["removed_by"].to_numpy()
    legend = {trace["name"] for trace in traces}
    for j in range(len(stages)):
        for by in dict.fromkeys(removed_by[(slot == j) & ~np.isin(removed_by, ["", "natural"])]):
            hit = (slot == j) & (removed_by == by)
            word, color = ("cut", "#666") if by == "sampled" else ("masked", MASK_COLOR)
            mark = dict(word=word, color=color, symbol="x-thin", name=_masked_name(by, names))
            hover = f"{word} (logit -inf)<extra>{_name(by, names)}</extra>"
            traces.append(_marks(positions[hit] + centres[j], natural[hit], labels[hit], mark, hover, legend))
    for j, stage in enumerate(stages):
        hit = (table[f"{stage}_state"] == "not stored").to_numpy()
        if hit.any():
            mark = dict(word="?", color=NOT_STORED_COLOR, symbol="circle-open", name=NOT_STORED_NAME)
            hover = f"not stored (top-k storage keeps each row's best tokens)<extra>{_name(stage, names)}</extra>"
            traces.append(_marks(positions[hit] + centres[j], natural[hit], labels[hit], mark, hover, legend))
    annotations = []
    chosen = np.nonzero(table["chosen"].to_numpy())[0]
    if chosen.size:
        i = int(chosen[0])
        finite = [float(v) for v in (table[f"{s}_{value}"].iloc[i] for s in stages) if v is not None and np.isfinite(v)]
        top = max(finite) if finite else 0.0
        annotations.append(
            dict(
                x=float(i),
                y=math.log10(top) if (log_y and value == "prob" and top > 0) else top,
                text="chosen",
                showarrow=True,
                arrowhead=2,
                ay=-30,
                font=dict(color="#222"),
            )
        )
    xaxis = dict(
        title=dict(text="token"),
        tickmode="array",
        tickvals=positions,
        ticktext=ticks,
        range=[-0.5, len(table) - 0.5],
        tickfont=_TOKEN_FONT,
        ticklabeloverflow="allow",
    )
    yaxis = dict(title=dict(text="probability" if value == "prob" else "logit"), ticklabeloverflow="allow")
    if log_scale:
        yaxis["type"] = "log"
    layout = _layout_spec(title, 420, xaxis, yaxis)
    layout.update(barmode="overlay", annotations=annotations)
    if steady:
        layout["margin"] = {**layout["margin"], **STEADY_MARGINS}
    return go.Figure(dict(data=traces, layout=layout), _validate=False)


def _present(stats: pd.DataFrame, column: str) -> bool:
    return column in stats.columns and bool(stats[column].notna().any())


def timelines(
    stats: pd.DataFrame,
    stages: Sequence[str],
    *,
    current: int | None = None,
    title: str = "",
    names: Mapping[str, str] | None = None,
) -> go.Figure:
    """Per-step panels from ``Run.stats``: entropy per stage, chosen-token probability per stage,
    mass the constraint removed, margin (best token vs best allowed, nats) and end-of-sequence probability.

    ``current`` draws a dotted line at that step. Panels whose values the
    storage cannot tell (top-k: entropy, removed mass, margin) say so; a run
    without a constraint has no removed-mass and margin panels.
    """

    def per_stage(metric: str) -> list[tuple[str, str | None]]:
        return [(f"{metric}_{s}", s) for s in stages]  # the stage is kept: stage names may hold "_"

    panels: list[tuple[str, list[tuple[str, str | None]]]] = [
        ("entropy (nats)", per_stage("entropy")),
        ("chosen token's probability", per_stage("p_chosen")),
        ("mass removed by the constraint", [("removed_mass", None)]),
        ("margin: best token − best allowed (nats)", [("margin", None)]),
        ("end-of-sequence probability", per_stage("p_eos")),
    ]
    if "constrained" not in stages:  # no constraint: nothing removed, no margin; no panels of flat zeros
        panels = [p for p in panels if p[1][0][1] is not None]
    fig = make_subplots(
        rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.045, subplot_titles=[p[0] for p in panels]
    )
    x = stats["position"]
    tokens = (
        stats["chosen_token"].fillna("").map(lambda t: plot_text(token_label(t)))
        if "chosen_token" in stats.columns
        else None
    )
    shown: set[str] = set()
    for row, (label, columns) in enumerate(panels, start=1):
        drawn = False
        for column, stage in columns:
            if not _present(stats, column):
                continue
            color = _color(stage, stages.index(stage)) if stage else "#555"
            name = _name(stage, names) if stage else label
            fig.add_scatter(
                x=x,
                y=stats[column],
                mode="lines+markers",
                marker=dict(size=4),
                line=dict(color=color, **_LINES.get(stage or "", dict(width=1.6))),
                name=name,
                legendgroup=name,
                showlegend=name not in shown and stage is not None,
                customdata=tokens,
                hovertemplate="step %{x} %{customdata}<br>" + name + ": %{y:.4g}<extra></extra>",
                row=row,
                col=1,
            )
            shown.add(name)
            drawn = True
        if not drawn:  # a note in the middle of the empty panel, in paper coordinates: the steps' range stays
            panel = fig.get_subplot(row, 1)
            fig.add_annotation(
                text="not known in this run's storage"
                if any(c in stats.columns for c, _ in columns)
                else "not recorded",
                xref="paper",
                yref="paper",
                x=sum(panel.xaxis.domain) / 2,
                y=sum(panel.yaxis.domain) / 2,
                showarrow=False,
                font=dict(color="#999"),
            )
    if current is not None:
        fig.add_vline(x=current, line_dash="dot", line_color="#333", row="all", col=1)
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    _integer_steps(fig, x)
    _layout(fig, title, 170 * len(panels))
    fig.update_layout(legend=dict(y=1.03), margin=dict(t=90))  # above the first panel's title
    return fig


def token_heatmap(
    heat: pd.DataFrame,
    chosen: Sequence[str | None],
    *,
    stage: str = "natural",
    title: str = "",
    names: Mapping[str, str] | None = None,
) -> go.Figure:
    """Tokens (rows) by steps (columns), coloured by ``stage``'s probability; ○ marks the chosen token.

    ``heat`` is a :attr:`dashboard.views.WindowView.heat` frame (index: token
    labels, columns: steps); ``chosen`` gives, per column, the chosen token's
    label (None when it is not among the rows).
    """
    steps = [int(c) for c in heat.columns]
    if len(chosen) != len(steps):
        raise ValueError(f"chosen must give one label per step ({len(steps)}), got {len(chosen)}")
    z = heat.to_numpy(dtype=float)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=steps,
            y=[plot_text(label) for label in heat.index],
            zmin=0.0,
            zmax=1.0,
            colorscale="Blues",
            colorbar=dict(title=dict(text="p"), thickness=12),
            hovertemplate="step %{x}<br>token %{y}<br>p=%{z:.4f}<extra>" + _name(stage, names) + "</extra>",
        )
    )
    xs = [s for s, c in zip(steps, chosen) if c is not None]
    ys = [plot_text(c) for c in chosen if c is not None]
    fig.add_scatter(
        x=xs,
        y=ys,
        mode="markers",
        name="chosen",
        marker=dict(symbol="circle-open", size=11, color=MASK_COLOR, line=dict(width=2)),  # open: marker.color
        hovertemplate="step %{x}: chose %{y}<extra></extra>",
    )
    fig.update_yaxes(autorange="reversed", type="category", tickfont=_TOKEN_FONT)
    fig.update_xaxes(title_text="step")
    _integer_steps(fig, steps)
    return _layout(fig, title, max(260, 22 * len(heat.index) + 120))


def compare_timelines(
    a: pd.DataFrame,
    b: pd.DataFrame,
    *,
    labels: tuple[str, str] = ("A", "B"),
    stage: str = "natural",
    divergence: int | None = None,
    title: str = "",
    names: Mapping[str, str] | None = None,
) -> go.Figure:
    """Two runs' chosen-token probability and entropy at ``stage``, step by step, with the divergence marked."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=[
            f"chosen token's probability ({_name(stage, names)})",
            f"entropy ({_name(stage, names)}, nats)",
        ],
    )
    styles = (dict(color="#4C78A8", dash="solid"), dict(color="#E45756", dash="dash"))
    for frame, label, style in zip((a, b), labels, styles):
        tokens = frame["chosen_token"].fillna("").map(lambda t: plot_text(token_label(t)))
        for row, column in ((1, f"p_chosen_{stage}"), (2, f"entropy_{stage}")):
            if column not in frame.columns:
                continue
            fig.add_scatter(
                x=frame["position"],
                y=frame[column],
                mode="lines+markers",
                marker=dict(size=4),
                line=dict(width=1.6, **style),
                name=label,
                legendgroup=label,
                showlegend=row == 1,
                customdata=tokens,
                hovertemplate="step %{x} %{customdata}<br>" + label + ": %{y:.4g}<extra></extra>",
                row=row,
                col=1,
            )
    if divergence is not None:
        fig.add_vline(x=divergence, line_dash="dot", line_color=MASK_COLOR, row="all", col=1)
        fig.add_annotation(
            text=f"diverge at step {divergence}",
            x=divergence,
            y=1.0,
            xref="x",
            yref="y domain",
            showarrow=False,
            xanchor="left",
            font=dict(color=MASK_COLOR),
        )
    fig.update_xaxes(title_text="step", row=2, col=1)
    _integer_steps(fig, list(a["position"]) + list(b["position"]))
    return _layout(fig, title, 460)


def removed_by_processor(
    stats: pd.DataFrame, *, title: str = "", run_stages: Sequence[str] | None = None
) -> go.Figure | None:
    """One line per processor: the natural probability mass it masked at each step (``removed_mass_after:*``),
    in its stage's colour. The last processor's stage is the run's "constrained" stage (``after:<last>`` is its
    alias); ``run_stages``, the run's stages, fixes the colours (default: natural, then one stage per processor).

    None when the run has no stage per processor.
    """
    columns = [c for c in stats.columns if c.startswith("removed_mass_after:")]
    if not columns:
        return None
    stages = [c[len("removed_mass_") :] for c in columns[:-1]] + ["constrained"]
    colors = stage_colors(run_stages or ["natural", *stages])
    fig = go.Figure()
    tokens = (
        stats["chosen_token"].fillna("").map(lambda t: plot_text(token_label(t)))
        if "chosen_token" in stats.columns
        else None
    )
    for column, stage in zip(columns, stages):
        name = column[len("removed_mass_") :]
        fig.add_scatter(
            x=stats["position"],
            y=stats[column],
            mode="lines+markers",
            marker=dict(size=4),
            line=dict(color=colors.get(stage, _color(stage)), width=1.8),
            name=name,
            customdata=tokens,
            hovertemplate="step %{x} %{customdata}<br>" + name + ": %{y:.4g}<extra></extra>",
        )
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="natural mass removed", rangemode="tozero")
    _integer_steps(fig, stats["position"])
    return _layout(fig, title, 320)


def distance_timeline(
    steps: pd.DataFrame,
    stages: Sequence[str],
    *,
    measure: Literal["tv", "kl", "js"] = "js",
    divergence: int | None = None,
    title: str = "",
    names: Mapping[str, str] | None = None,
) -> go.Figure:
    """Per step, the distance between two runs' distributions (``tracker.compare``'s ``steps``), one line per stage."""
    labels = {"tv": "total variation", "kl": "KL(A‖B), nats", "js": "Jensen–Shannon, nats"}
    fig = go.Figure()
    for i, stage in enumerate(stages):
        column = f"{measure}_{stage}"
        if column not in steps.columns:
            continue
        y = steps[column].replace([np.inf], np.nan)
        fig.add_scatter(
            x=steps["step"],
            y=y,
            mode="lines+markers",
            marker=dict(size=4),
            name=_name(stage, names),
            line=dict(color=_color(stage, i), **_LINES.get(stage, dict(width=1.6))),
            hovertemplate="step %{x}<br>" + _name(stage, names) + ": %{y:.4g}<extra></extra>",
        )
    if divergence is not None:
        fig.add_vline(x=divergence, line_dash="dot", line_color=MASK_COLOR)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text=labels[measure], rangemode="tozero")
    _integer_steps(fig, steps["step"])
    return _layout(fig, title, 320)
