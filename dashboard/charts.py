"""Plotly figure builders: pure functions from the tables of :mod:`dashboard.views` to figures.

Nothing here reads files or calls Streamlit, so every figure is unit-tested
on small hand-made runs. Colours are fixed per stage across all figures: the
model's own distribution ("natural"), what the constraint left
("constrained"), and what the sampler drew from ("sampled").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.text import plot_text
from dashboard.views import token_label

__all__ = [
    "MASKED_NAMES",
    "STAGE_COLORS",
    "STAGE_NAMES",
    "stage_names",
    "compare_timelines",
    "distance_timeline",
    "removed_by_processor",
    "step_bars",
    "timelines",
    "token_heatmap",
]

STAGE_COLORS: dict[str, str] = {"natural": "#4C78A8", "constrained": "#F58518", "sampled": "#54A24B"}
STAGE_NAMES: dict[str, str] = {
    "natural": "model (natural)",
    "constrained": "after the constraint",
    "sampled": "sampled from",
}
#: What a marker on a masked token says, per stage that removed it.
MASKED_NAMES: dict[str, str] = {"constrained": "masked by the constraint", "sampled": "cut by the sampler"}
#: Line styles per stage, so that a later stage drawn over an equal earlier one leaves it visible.
_LINES: dict[str, dict[str, object]] = {
    "natural": dict(width=4, dash="solid"),
    "constrained": dict(width=2, dash="solid"),
    "sampled": dict(width=1.5, dash="dot"),
}
_EXTRA_COLORS = ("#B279A2", "#72B7B2", "#9D755D")
_BAR_GAP = 0.25
MASK_COLOR = "#E45756"
_FONT = dict(family="Inter, Segoe UI, sans-serif", size=12)
#: Token labels on axes: a monospace face at a larger size, where the ␣ and ↵ glyphs are full width.
_TOKEN_FONT = dict(family="DejaVu Sans Mono, Menlo, Consolas, monospace", size=14)


def _color(stage: str, i: int = 0) -> str:
    return STAGE_COLORS.get(stage, _EXTRA_COLORS[i % len(_EXTRA_COLORS)])


def stage_names(stages: Sequence[str], aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """What each recorded stage is called on screen (plain text): :data:`STAGE_NAMES`, except that in a run with a
    stage per processor the constrained stage takes its last processor's name (``after:penalties``), as ``Run.why``
    and the chart of mass removed by each processor call it."""
    back = {target: alias for alias, target in (aliases or {}).items()}
    return {s: back.get(s) or STAGE_NAMES.get(s, s) for s in stages}


def _name(stage: str, names: Mapping[str, str] | None = None) -> str:
    """A stage's on-screen name, escaped for plotly."""
    return plot_text((names or {}).get(stage) or STAGE_NAMES.get(stage, stage))


def _masked_name(stage: str, names: Mapping[str, str] | None = None) -> str:
    """The legend entry of the ✕ markers of tokens ``stage`` removed."""
    shown = (names or {}).get(stage) or STAGE_NAMES.get(stage, stage)
    if stage in MASKED_NAMES and shown == STAGE_NAMES[stage]:
        return MASKED_NAMES[stage]
    return f"masked at {plot_text(shown)}"


def _integer_steps(fig: go.Figure, steps: pd.Series | Sequence[int]) -> None:
    """Whole-number ticks on a step axis (no "0.5") when the steps are few."""
    values = list(steps)
    if values and max(values) - min(values) <= 20:
        fig.update_xaxes(dtick=1)


def _layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    fig.update_layout(
        title=dict(text=title, x=0, xanchor="left"),
        height=height,
        margin=dict(l=50, r=20, t=60, b=40),
        font=_FONT,
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1),
        plot_bgcolor="white",
    )
    fig.update_xaxes(showgrid=False, linecolor="#ccc")
    fig.update_yaxes(gridcolor="#eee", zerolinecolor="#ccc")
    return fig


def step_bars(
    table: pd.DataFrame,
    stages: Sequence[str],
    *,
    value: Literal["prob", "logit"] = "prob",
    log_y: bool = False,
    title: str = "",
    names: Mapping[str, str] | None = None,
) -> go.Figure:
    """Grouped bars of one step's tokens (from :func:`dashboard.views.step_table`), one colour per stage.

    Tokens sit at x = 0, 1, 2, ... (labelled with their text), each with one
    bar slot per stage. A token a stage removed has no bar there; an ✕ fills
    the slot, at the height the model gave the token, labelled "masked" (by
    the constraint) or "cut" (by the sampler). The chosen token is marked
    with an arrow and a bold label. ``log_y`` applies to probabilities
    (logits are already a log scale).
    """
    if value not in ("prob", "logit"):
        raise ValueError(f"value must be 'prob' or 'logit', got {value!r}")
    labels = [plot_text(label) for label in table["label"].tolist()]  # token text: shown as text, not plotly HTML
    ticks = [f"<b>▶ {label}</b>" if chosen else label for label, chosen in zip(labels, table["chosen"].tolist())]
    positions = np.arange(len(table), dtype=float)
    width = (1.0 - _BAR_GAP) / max(1, len(stages))
    centres = [-(1.0 - _BAR_GAP) / 2 + (j + 0.5) * width for j in range(len(stages))]
    fig = go.Figure()
    for j, stage in enumerate(stages):
        states = table[f"{stage}_state"].tolist()
        y = table[f"{stage}_{value}"].astype(float).replace(-np.inf, np.nan)
        y = y.where(table[f"{stage}_state"] != "masked")
        if value == "prob" and log_y:
            y = y.where(y > 0)
        custom = np.stack(
            [
                np.array(labels, dtype=object),
                table[f"{stage}_prob"].astype(float),
                table[f"{stage}_logit"].astype(float),
                np.array(states, dtype=object),
            ],
            axis=1,
        )
        fig.add_bar(
            x=positions,
            y=y,
            width=width,
            offset=centres[j] - width / 2,
            name=_name(stage, names),
            marker_color=_color(stage, j),
            customdata=custom,
            hovertemplate="%{customdata[0]}<br>"
            + _name(stage, names)
            + ": p=%{customdata[1]:.3~g}, logit=%{customdata[2]:.3f}<br>%{customdata[3]}<extra></extra>",
        )
    natural = table[f"natural_{value}"].astype(float).replace(-np.inf, np.nan).fillna(0.0)
    for j, stage in enumerate(stages):
        hit = (table["removed_by"] == stage).to_numpy()
        if j == 0 or not hit.any():
            continue
        word = "cut" if stage == "sampled" else "masked"
        color = MASK_COLOR if stage != "sampled" else "#666"
        fig.add_scatter(
            x=positions[hit] + centres[j],
            y=natural[hit],
            mode="markers+text",
            marker=dict(symbol="x-thin", size=12, line=dict(width=3, color=color), color=color),
            text=[word] * int(hit.sum()),
            textposition="top center",
            textfont=dict(color=color, size=11),
            name=_masked_name(stage, names),
            customdata=np.array(labels, dtype=object)[hit],
            hovertemplate="%{customdata}: " + word + " (logit -inf)<extra>" + _name(stage, names) + "</extra>",
        )
    chosen = np.nonzero(table["chosen"].to_numpy())[0]
    if chosen.size:
        i = int(chosen[0])
        finite = [float(v) for v in (table[f"{s}_{value}"].iloc[i] for s in stages) if v is not None and np.isfinite(v)]
        top = max(finite) if finite else 0.0
        fig.add_annotation(
            x=float(i),
            y=math.log10(top) if (log_y and value == "prob" and top > 0) else top,
            text="chosen",
            showarrow=True,
            arrowhead=2,
            ay=-30,
            font=dict(color="#222"),
        )
    axis = "probability" if value == "prob" else "logit"
    fig.update_layout(barmode="overlay", xaxis_title="token", yaxis_title=axis)
    fig.update_xaxes(
        tickmode="array", tickvals=positions, ticktext=ticks, range=[-0.5, len(table) - 0.5], tickfont=_TOKEN_FONT
    )
    if value == "prob" and log_y:
        fig.update_yaxes(type="log")
    return _layout(fig, title, 420)


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
        if not drawn:
            fig.add_annotation(
                text="not known in this run's storage"
                if any(c in stats.columns for c, _ in columns)
                else "not recorded",
                xref="x domain",
                yref="y domain",
                x=0.5,
                y=0.5,
                showarrow=False,
                font=dict(color="#999"),
                row=row,
                col=1,
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
        marker=dict(symbol="circle-open", size=11, line=dict(width=2, color=MASK_COLOR)),
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


def removed_by_processor(stats: pd.DataFrame, *, title: str = "") -> go.Figure | None:
    """One line per processor: the natural probability mass it masked at each step (``removed_mass_after:*``).

    None when the run has no stage per processor.
    """
    columns = [c for c in stats.columns if c.startswith("removed_mass_after:")]
    if not columns:
        return None
    fig = go.Figure()
    tokens = (
        stats["chosen_token"].fillna("").map(lambda t: plot_text(token_label(t)))
        if "chosen_token" in stats.columns
        else None
    )
    for i, column in enumerate(columns):
        name = column[len("removed_mass_") :]
        fig.add_scatter(
            x=stats["position"],
            y=stats[column],
            mode="lines+markers",
            marker=dict(size=4),
            line=dict(color=_EXTRA_COLORS[i % len(_EXTRA_COLORS)] if i else STAGE_COLORS["constrained"], width=1.8),
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
