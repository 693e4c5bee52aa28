"""The generated text as HTML: each token coloured by a per-step value, alternatives on hover.

Pure functions from the tables of :mod:`dashboard.views` to HTML strings
(shown with ``st.html``). Token text is escaped; hover text uses the
``title`` attribute, which every browser shows without scripts.

Tokens are shown once, one way, on every page: the vocabulary's display
text (a byte that is no character yet as ``⟨F0⟩``, see
:func:`processors.vocab.display_bytes`) made visible by
:func:`~dashboard.views.token_label` (``␣`` for spaces), never a ``repr``
of it. The raw bytes stay in the run's vocabulary.

One token draws at most :data:`~tracker.reading.display.TOKEN_CHARS` characters
(:func:`~tracker.reading.display.clip_text`): a vocabulary entry may be a
megabyte long.

Every text that comes from a run file (token text, prompts, titles,
processor and sampling descriptions, run ids) is shown as text: in HTML
escaped with :func:`html.escape`, in Markdown with :func:`md_text`, in plotly
labels with :func:`plot_text`; long texts go in ``st.code`` (no Markdown).
"""

from __future__ import annotations

import html
import math
import re
import string
from collections.abc import Sequence

import numpy as np
import pandas as pd

from dashboard.views import COLOR_METRICS, WindowView, format_probability, token_label
from tracker.reading.display import clip_text

__all__ = [
    "intensity",
    "legend_html",
    "md_text",
    "plot_text",
    "token_hovers",
    "token_text_html",
    "text_so_far_html",
    "divergent_text_html",
    "md_shown",
    "numbers_html",
]

_MD_ESCAPES = str.maketrans({c: "\\" + c for c in string.punctuation})
_LINE_BREAKS = str.maketrans({"\n": " ", "\r": " ", "\t": " "})
#: What GitHub-flavoured Markdown turns into a link by itself (``https://``, ``www.``, ``name@host``): it looks
#: for these in the text after escapes are undone, so escaping cannot stop it; an invisible word joiner
#: (U+2060) inside each one does.
_AUTOLINK = re.compile(r"(?<=:)(?=//)|(?i:(?<=\bwww)(?=\.))|(?<=@)")
WORD_JOINER = "\u2060"


def md_text(value: object) -> str:
    """``value`` as literal Markdown text on one line: every ASCII punctuation mark backslash-escaped.

    CommonMark shows a backslash-escaped punctuation mark as itself, so no
    emphasis, link, image, code span, HTML or Streamlit directive
    (``:red[...]``, ``:material/...:``, ``$...$``) can start inside it. A
    bare URL or e-mail address stays plain text too, not a link: an
    invisible :data:`WORD_JOINER` goes after its ``:``, ``www`` or ``@``.
    """
    return _AUTOLINK.sub(WORD_JOINER, str(value).translate(_LINE_BREAKS)).translate(_MD_ESCAPES)


_MD_ESCAPED = re.compile("\\\\([" + re.escape(string.punctuation) + "])")


def md_shown(value: str) -> str:
    """What Markdown shows of ``value``: each backslash-escaped ASCII punctuation mark as the mark itself (the
    text :func:`md_text` was given; a backslash before anything else stays, as Markdown shows it)."""
    return _MD_ESCAPED.sub(r"\1", value)


def plot_text(value: object) -> str:
    """``value`` for a plotly label or hover text: plotly reads a few HTML tags there, so ``<``, ``>``, ``&`` are escaped."""
    return html.escape(str(value), quote=False)


_WARM = (228, 87, 86)  # low probability / far down the list: red
_COOL = (76, 120, 168)  # mass removed by the constraint: blue
_STYLE = (
    "font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 14px; line-height: 1.9; "
    "white-space: pre-wrap; word-break: break-word;"
)


def intensity(column: str, value: float) -> float:
    """How strongly to colour a token, in [0, 1]: 0 is unremarkable, 1 is the most remarkable.

    Probabilities: ``1 - p`` (unlikely tokens stand out); ranks: ``log2(1+r)
    / log2(101)`` capped at 1; removed mass: the mass itself. NaN gives 0.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return 0.0
    if column.startswith("p_chosen"):
        return float(min(1.0, max(0.0, 1.0 - value)))
    if column.startswith("rank_chosen"):
        return float(min(1.0, math.log2(1.0 + max(0.0, value)) / math.log2(101.0)))
    return float(min(1.0, max(0.0, value)))


def _background(column: str, t: float) -> str:
    r, g, b = _COOL if column == "removed_mass" else _WARM
    return f"rgba({r},{g},{b},{0.85 * t:.3f})"


def token_hovers(window: WindowView, stages: Sequence[str]) -> list[str]:
    """Per step: the chosen token with each stage's probability, then the model's top alternatives."""
    stats = window.stats
    groups = {int(p): g for p, g in window.alternatives.groupby("position")} if len(window.alternatives) else {}
    out = []
    for i, position in enumerate(stats["position"].tolist()):
        token = stats["chosen_token"].iloc[i]
        parts = [
            f"step {position}: chose {token_label(token)}"
            if isinstance(token, str)  # None or NaN where the chosen token is unknown
            else f"step {position}: chosen token unknown"
        ]
        probs = [
            f"{s} {format_probability(stats[f'p_chosen_{s}'].iloc[i])}"
            for s in stages
            if f"p_chosen_{s}" in stats.columns and not pd.isna(stats[f"p_chosen_{s}"].iloc[i])
        ]
        if probs:
            parts.append("p: " + ", ".join(probs))
        if "removed_mass" in stats.columns and not pd.isna(stats["removed_mass"].iloc[i]):
            parts.append(f"constraint removed {stats['removed_mass'].iloc[i]:.1%} of the mass")
        alt = groups.get(int(position))
        if alt is not None:
            parts.append("model's top tokens:")
            for _, entry in alt.iterrows():
                masked = "constrained_prob" in alt.columns and entry["constrained_prob"] == 0
                note = "  (masked)" if masked else ""
                parts.append(f"  {token_label(entry['token'])}  {format_probability(entry['natural_prob'])}{note}")
        out.append("\n".join(parts))
    return out


def token_text_html(
    pieces: Sequence[str],
    values: Sequence[float] | np.ndarray,
    column: str,
    *,
    hovers: Sequence[str] | None = None,
    prompt: str = "",
    current: int | None = None,
) -> str:
    """The prompt (grey) then each token on a background whose strength is :func:`intensity`.

    ``column`` is the stats column the values come from (see
    :data:`dashboard.views.COLOR_METRICS`); ``current`` outlines one token.
    """
    if len(values) != len(pieces) or (hovers is not None and len(hovers) != len(pieces)):
        raise ValueError(
            f"pieces, values and hovers must have the same length, got {len(pieces)}, {len(values)}, "
            f"{None if hovers is None else len(hovers)}"
        )
    spans = [f'<span style="color:#888">{html.escape(prompt)}</span>'] if prompt else []
    for i, (piece, value) in enumerate(zip(pieces, values)):
        t = intensity(column, float(value))
        style = f"background:{_background(column, t)}; border-radius:3px; padding:1px 0;"
        if current == i:
            style += " outline:2px solid #222;"
        title = f' title="{html.escape(hovers[i])}"' if hovers is not None else ""
        text = html.escape(clip_text(piece)) if piece else "·"
        spans.append(f'<span class="tok" data-step="{i}" style="{style}"{title}>{text}</span>')
    return f'<div class="logitscope-text" style="{_STYLE}">{"".join(spans)}</div>'


def legend_html(label: str) -> str:
    """A small colour legend for a :data:`~dashboard.views.COLOR_METRICS` entry."""
    column, high = COLOR_METRICS[label]
    stops = "".join(
        f'<span style="display:inline-block;width:22px;height:12px;background:{_background(column, t)}"></span>'
        for t in np.linspace(0, 1, 6)
    )
    low = (
        "likely"
        if column.startswith("p_chosen")
        else ("top choice" if column.startswith("rank") else "nothing removed")
    )
    high_text = "unlikely" if column.startswith("p_chosen") else high
    return f'<div style="font-size:12px;color:#555">{html.escape(low)} {stops} {html.escape(high_text)}</div>'


def text_so_far_html(prompt: str, before: Sequence[str], current: str | None, *, tail_chars: int = 4000) -> str:
    """The prompt (grey), the tokens before the step, and the step's chosen token boxed.

    Long texts keep their last ``tail_chars`` characters (a 10,000-step run
    would not fit a page).
    """
    text = "".join(clip_text(piece) for piece in before)
    cut = ""
    if len(prompt) + len(text) > tail_chars:
        keep = max(0, tail_chars - len(prompt))
        cut, text = "… ", text[-keep:] if keep else ""
    parts = [f'<span style="color:#888">{html.escape(prompt)}</span>', html.escape(cut), html.escape(text)]
    if current is not None:
        parts.append(
            '<span style="background:#FFE9A8; outline:2px solid #F58518; border-radius:3px">'
            f"{html.escape(clip_text(current)) if current else '·'}</span>"
        )
    return f'<div class="logitscope-text" style="{_STYLE}">{"".join(parts)}</div>'


def divergent_text_html(prompt: str, pieces: Sequence[str], divergence: int | None) -> str:
    """A text whose tokens from ``divergence`` on are highlighted (where two runs part ways)."""
    pieces = [clip_text(piece) for piece in pieces]
    agree = pieces if divergence is None else pieces[:divergence]
    rest = [] if divergence is None else pieces[divergence:]
    parts = [f'<span style="color:#888">{html.escape(prompt)}</span>', html.escape("".join(agree))]
    if rest:
        parts.append(
            f'<span style="background:rgba(228,87,86,0.25); border-radius:3px">{html.escape("".join(rest))}</span>'
        )
    return f'<div class="logitscope-text" style="{_STYLE}">{"".join(parts)}</div>'


#: The numbers' row as ``st.metric`` draws it in a row of ``st.columns`` (Streamlit 1.67): a 1rem gap between
#: columns, a 14 px label line 24 px high, a 36 px value with 4 px below it; the page's font and colours.
_ROW = "display:flex; gap:1rem; margin-top:1rem; width:100%;"
_CELL = "flex:{weight:.6g} 1 0; min-width:0;"
_LABEL = (
    "font-size:14px; line-height:24px; min-height:24px; white-space:nowrap; overflow:hidden; text-overflow:ellipsis;"
)
_VALUE = "font-size:36px; padding-bottom:4px; white-space:nowrap; overflow:hidden; text-overflow:ellipsis;"


def numbers_html(numbers: Sequence[tuple[str, str, str | None]], widths: Sequence[float]) -> str:
    """A row of labelled numbers as one block of HTML, drawn as ``st.metric`` in ``st.columns(widths)`` draws them.

    ``numbers`` are ``(label, value, help)`` in the Markdown ``st.metric`` takes (:func:`md_text`); each is shown
    as that Markdown shows it, escaped, with its help on hover. Step replay draws its numbers this way while
    playing: one element for the browser to redraw each step instead of a column and a metric per number.
    """
    if len(numbers) != len(widths):
        raise ValueError(f"numbers and widths must be as long, got {len(numbers)} numbers and {len(widths)} widths")
    cells = []
    for (label, value, note), weight in zip(numbers, widths):
        hover = f' title="{html.escape(note)}"' if note else ""
        cells.append(
            f'<div style="{_CELL.format(weight=weight)}">'
            f'<div style="{_LABEL}"{hover}>{html.escape(md_shown(label))}</div>'
            f'<div style="{_VALUE}">{html.escape(md_shown(value))}</div></div>'
        )
    return f'<div class="logitscope-numbers" style="{_ROW}">{"".join(cells)}</div>'
