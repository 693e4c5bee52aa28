"""What every figure shares: each stage's colour, name and line style, fonts and the common layout.

Colours are fixed per stage: the model's own distribution ("natural"), what
the constraint left ("constrained"), what the sampler drew from
("sampled"); a run's other stages (one per processor) take the extra colours
by their place among the run's stages (:func:`stage_colors`), so a stage has
one colour in every figure, whichever stages a figure draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go

from dashboard.text import plot_text

__all__ = [
    "MASKED_NAMES",
    "MASK_COLOR",
    "NOT_STORED_COLOR",
    "NOT_STORED_NAME",
    "STAGE_COLORS",
    "STAGE_NAMES",
    "color",
    "layout",
    "layout_spec",
    "stage_colors",
    "stage_names",
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
LINES: dict[str, dict[str, object]] = {
    "natural": dict(width=4, dash="solid"),
    "constrained": dict(width=2, dash="solid"),
    "sampled": dict(width=1.5, dash="dot"),
}
EXTRA_COLORS = ("#B279A2", "#72B7B2", "#9D755D")
BAR_GAP = 0.25
MASK_COLOR = "#E45756"
#: The mark and legend entry of a value top-k storage did not keep (unknown, not masked).
NOT_STORED_COLOR, NOT_STORED_NAME = "#8C8C8C", "not stored (top-k)"
FONT = dict(family="Inter, Segoe UI, sans-serif", size=12)
#: Token labels on axes: a monospace face at a larger size, where the ␣ and ↵ glyphs are full width.
TOKEN_FONT = dict(family="DejaVu Sans Mono, Menlo, Consolas, monospace", size=14)


def color(stage: str, i: int = 0) -> str:
    """The colour of ``stage``, the ``i``-th of its run's stages."""
    return STAGE_COLORS.get(stage, EXTRA_COLORS[i % len(EXTRA_COLORS)])


def stage_colors(stages: Sequence[str]) -> dict[str, str]:
    """Each of a run's stages (in the run's order) with its colour, the same in every figure."""
    return {stage: color(stage, i) for i, stage in enumerate(stages)}


def stage_names(stages: Sequence[str], aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """What each recorded stage is called on screen (plain text): :data:`STAGE_NAMES`, except that in a run with a
    stage per processor the constrained stage takes its last processor's name (``after:penalties``), as ``Run.why``
    and the chart of mass removed by each processor call it."""
    back = {target: alias for alias, target in (aliases or {}).items()}
    return {s: back.get(s) or STAGE_NAMES.get(s, s) for s in stages}


def name(stage: str, names: Mapping[str, str] | None = None) -> str:
    """A stage's on-screen name, escaped for plotly."""
    return plot_text((names or {}).get(stage) or STAGE_NAMES.get(stage, stage))


def masked_name(stage: str, names: Mapping[str, str] | None = None) -> str:
    """The legend entry of the ✕ markers of tokens ``stage`` removed."""
    shown = (names or {}).get(stage) or STAGE_NAMES.get(stage, stage)
    if stage in MASKED_NAMES and shown == STAGE_NAMES[stage]:
        return MASKED_NAMES[stage]
    return f"masked at {plot_text(shown)}"


def integer_steps(fig: go.Figure, steps: pd.Series | Sequence[int]) -> None:
    """Whole-number ticks on a step axis (no "0.5") when the steps are few."""
    values = list(steps)
    if values and max(values) - min(values) <= 20:
        fig.update_xaxes(dtick=1)


#: Axis styles every figure shares.
X_AXIS = dict(showgrid=False, linecolor="#ccc")
Y_AXIS = dict(gridcolor="#eee", zerolinecolor="#ccc")


def _shared(title: str, height: int) -> dict:
    return dict(
        title=dict(text=title, x=0, xanchor="left"),
        height=height,
        margin=dict(l=50, r=20, t=60, b=40),
        font=FONT,
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1),
        plot_bgcolor="white",
    )


def layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    """The shared title, size, fonts, legend and axis styles, on every axis of ``fig``."""
    fig.update_layout(_shared(title, height))
    fig.update_xaxes(X_AXIS)
    fig.update_yaxes(Y_AXIS)
    return fig


def layout_spec(title: str, height: int, xaxis: dict, yaxis: dict) -> dict:
    """:func:`layout` as a plain layout dict for a figure of one x and one y axis, each merged with its style."""
    return {**_shared(title, height), "xaxis": {**X_AXIS, **xaxis}, "yaxis": {**Y_AXIS, **yaxis}}
