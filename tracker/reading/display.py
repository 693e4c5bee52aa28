"""Notebook display: a run, a sequence or a step as self-contained HTML (escaped text and inline SVG).

Jupyter and VS Code call ``_repr_html_`` on the last value of a cell, so
``run``, ``run.view(generation, sequence)`` and ``run.step(position)`` show
as coloured text and tables without a server; ``run.show(step=3)`` draws
the step's chart at once. Every piece of run text (tokens, prompts, model
and processor names) is escaped: a token ``<script>`` shows as text.

Tokens are coloured by the probability the constrained stage (natural when
there is none) gave the chosen token: red for unlikely, green for likely;
hovering shows the step's best alternatives.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracker.reading.why import step_probabilities

__all__ = ["SequenceView", "StepView", "format_probability", "run_html", "sequence_html", "step_html", "step_svg"]
__all__ += ["token_label", "clip_text", "TOKEN_CHARS"]

_STAGE_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#9d755d")
_MAX_TABLE_STEPS = 64
_MAX_RUN_SEQUENCES = 8
_STYLE = (
    "<style>.ls-text span.ls-tok{border-radius:3px;padding:0 1px;white-space:pre-wrap}"
    ".ls-text .ls-prompt{color:#777;white-space:pre-wrap}.ls-table{border-collapse:collapse;font-size:12px}"
    ".ls-table td,.ls-table th{padding:1px 6px;border-bottom:1px solid #ddd;text-align:left}"
    ".ls-table tr.ls-chosen{font-weight:bold}</style>"
)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


#: The most characters one token's text shows (a vocabulary entry from a file may be a megabyte long: drawn
#: whole, in a chart's labels or a table, it would stall the page); the rest is counted, not shown.
TOKEN_CHARS = 100


def clip_text(text: str, limit: int = TOKEN_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how many more there are."""
    return text if len(text) <= limit else f"{text[:limit]}…(+{len(text) - limit:,} characters)"


def token_label(text: str) -> str:
    """A token's text made visible: spaces as ``␣``, newlines as ``↵``, tabs as ``⇥``, empty as ``∅``; past
    :data:`TOKEN_CHARS` characters, clipped (:func:`clip_text`)."""
    if text == "":
        return "∅"
    shown = text[:TOKEN_CHARS].replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")
    return shown + clip_text(text)[TOKEN_CHARS:]  # what is left out, counted


def _colour(p: float) -> str:
    if p != p:
        return "#eeeeee"
    return f"hsl({120.0 * min(max(p, 0.0), 1.0):.0f},70%,82%)"


def format_probability(p: float) -> str:
    """A probability for a person: three decimals, or two significant digits below 0.001 (never a bare 0.000 for a
    token the model gave 2e-4); exactly 0 as ``0``, unknown (NaN) as ``—``."""
    if p != p:
        return "—"
    if p == 0:
        return "0"
    return f"{p:.1e}" if abs(p) < 1e-3 else f"{p:.3f}"


def _display_names(run: Any) -> dict[str, str]:
    back = {v: k for k, v in run.metadata.stage_aliases.items()}
    return {s: back.get(s, s) for s in run.metadata.stages}


def sequence_html(run: Any, generation: int = -1, sequence: int = 0, *, alternatives: int = 5) -> str:
    """The prompt and the generated text, each token coloured and with its alternatives on hover, then a compact table."""
    stats = run.stats(sequence=sequence, generation=generation)
    stage = run._constrained_stage()
    top = run.get_top_tokens(k=alternatives, sequence=sequence, generation=generation)
    prompt_ids, _ = run._prompt_values(generation, sequence)
    parts = [_STYLE, '<div class="ls-text" style="font-family:monospace;line-height:1.8">']
    if prompt_ids:
        parts.append(f'<span class="ls-prompt" title="prompt">{_e(run.vocab.decode_shown(prompt_ids))}</span>')
    chosen = stats["chosen_token"].tolist()
    probs = stats[f"p_chosen_{stage}"].to_numpy(dtype=np.float64)
    both = stage != "natural"
    # the text each token adds (a character split across tokens shows whole, with its last byte); the
    # token itself (a lone byte as ⟨F0⟩, EOS by name) is named in the hover, as on the dashboard
    ids = stats["chosen_id"].fillna(-1).astype("int64").tolist()
    pieces = run.vocab.text_pieces(ids[: ids.index(-1)] if -1 in ids else ids)
    for i, (token, p) in enumerate(zip(chosen, probs)):
        if not isinstance(token, str):  # None or NaN: the chosen token is unknown from here on
            break
        lines = [f"step {i}: {token_label(token)}, p = {format_probability(p)}"]
        if i < len(top):
            lines.append(_alternatives_heading(run, stage))
            lines += [_alternative(t, both) for t in top[i]["tokens"]]
        shown = _e(pieces[i]) if pieces[i] else "·"
        parts.append(
            f'<span class="ls-tok" style="background:{_colour(p)}" title="{_e(chr(10).join(lines))}">{shown}</span>'
        )
    parts.append("</div>")
    parts.append(_compact_table(top[:_MAX_TABLE_STEPS], chosen, probs, _alternatives_heading(run, stage), both))
    if len(top) > _MAX_TABLE_STEPS:
        parts.append(f"<p>… {len(top) - _MAX_TABLE_STEPS} more steps (see <code>get_top_tokens</code>)</p>")
    return "".join(parts)


def _alternatives_heading(run: Any, stage: str) -> str:
    """What the alternatives list: ordered by the larger of the two probabilities, both shown."""
    if stage == "natural":
        return "best alternatives: p"
    return f"best alternatives: p {_display_names(run)[stage]} / natural"


def _alternative(token: dict[str, Any], both: bool) -> str:
    """One alternative as ``label p`` or, when there is a constraint, ``label p_constrained / p_natural``."""
    text = f"{token_label(token['token'])} {format_probability(token['structured_prob'])}"
    return text + (f" / {format_probability(token['unstructured_prob'])}" if both else "")


def _compact_table(
    top: list[dict[str, Any]], chosen: list[str | None], probs: np.ndarray, heading: str, both: bool
) -> str:
    rows = [f'<table class="ls-table"><tr><th>step</th><th>chosen</th><th>p</th><th>{_e(heading)}</th></tr>']
    for i, entry in enumerate(top):
        others = ", ".join(_e(_alternative(t, both)) for t in entry["tokens"] if not t["is_chosen"])
        known = i < len(chosen) and isinstance(chosen[i], str)  # None or NaN: the chosen token is unknown
        name = _e(token_label(chosen[i])) if known else "—"
        rows.append(
            f"<tr><td>{entry['position']}</td><td>{name}</td><td>{format_probability(probs[i])}</td><td>{others}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _step_rows(run: Any, position: int, generation: int, sequence: int, k: int, include_finished: bool = False):
    """The k tokens with the highest probability in any stage at one step: ids and ``{stage: probs}``."""
    rows, chosen, i = step_probabilities(
        run, position, sequence=sequence, generation=generation, include_finished=include_finished
    )
    best = np.fmax.reduce(np.stack(list(rows.values())), axis=0)  # NaN (unknown) in every stage: NaN, no warning
    best = np.where(np.isnan(best), -1.0, best)
    ids = np.argsort(-best, kind="stable")[: min(k, best.size)]
    ids = ids[best[ids] > 0]
    return ids, rows, chosen, i


def step_svg(
    run: Any, position: int, *, generation: int = -1, sequence: int = 0, k: int = 10, include_finished: bool = False
) -> str:
    """The replay chart of one step as inline SVG: the ``k`` best tokens, one bar per stage."""
    ids, rows, chosen, _ = _step_rows(run, position, generation, sequence, k, include_finished)
    names = _display_names(run)
    stages = list(rows)
    bar, gap, label_w, width = 9, 6, 150, 300
    peak = max(
        [float(np.nanmax(rows[s][ids])) for s in stages if ids.size and not np.isnan(rows[s][ids]).all()] or [1.0]
    )
    scale = width / max(peak, 1e-12)  # the longest bar fills the width
    height = len(ids) * (bar * len(stages) + gap) + 24 + 16 * len(stages)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + width + 60}" height="{height}" '
        'font-family="monospace" font-size="11">'
    ]
    y = 4
    for token in ids.tolist():
        text = token_label(run.vocab.display[token]) + ("  ◀ chosen" if token == chosen else "")
        weight = ' font-weight="bold"' if token == chosen else ""
        out.append(f'<text x="0" y="{y + bar * len(stages) / 2 + 4:.0f}"{weight}>{_e(text)}</text>')
        for s, stage in enumerate(stages):
            p = rows[stage][token]
            w = 0.0 if p != p else p * scale
            out.append(
                f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar - 1}" fill="{_STAGE_COLOURS[s % 7]}">'
                f"<title>{_e(names[stage])}: {format_probability(p)}</title></rect>"
            )
            out.append(
                f'<text x="{label_w + w + 3:.1f}" y="{y + bar - 1}" font-size="9">{format_probability(p)}</text>'
            )
            y += bar
        y += gap
    y += 10
    for s, stage in enumerate(stages):
        out.append(
            f'<rect x="{label_w}" y="{y}" width="10" height="10" fill="{_STAGE_COLOURS[s % 7]}"/>'
            f'<text x="{label_w + 14}" y="{y + 9}">{_e(names[stage])}</text>'
        )
        y += 16
    out.append("</svg>")
    return "".join(out)


def step_html(
    run: Any, position: int, *, generation: int = -1, sequence: int = 0, k: int = 10, include_finished: bool = False
) -> str:
    """One step: the text so far, the top-``k`` table (probability per stage) and the chart.

    A position past the sequence's end (padding) raises ValueError unless ``include_finished`` is True.
    """
    ids, rows, chosen, i = _step_rows(run, position, generation, sequence, k, include_finished)
    names = _display_names(run)
    so_far = run.sequence(i, sequence=sequence, generation=generation, include_finished=True)
    head = "".join(f"<th>{_e(names[s])}</th>" for s in rows)
    table = [f'<table class="ls-table"><tr><th>token</th>{head}</tr>']
    for token in ids.tolist():
        cls = ' class="ls-chosen"' if token == chosen else ""
        cells = "".join(f"<td>{format_probability(rows[s][token])}</td>" for s in rows)
        table.append(f"<tr{cls}><td>{_e(token_label(run.vocab.display[token]))}</td>{cells}</tr>")
    table.append("</table>")
    chosen_text = _e(token_label(run.vocab.display[chosen])) if chosen >= 0 else "unknown"
    return (
        f"{_STYLE}<div><p><b>Step {position}</b> (generation {run._generation_id(generation)}, sequence {sequence}): "
        f'chose {chosen_text}</p><p style="font-family:monospace;white-space:pre-wrap">{_e(so_far)}</p>'
        f'<div style="display:flex;gap:24px;align-items:flex-start">{"".join(table)}'
        f"{step_svg(run, position, generation=generation, sequence=sequence, k=k, include_finished=include_finished)}"
        "</div></div>"
    )


def run_html(run: Any) -> str:
    """A run's header (id, model, storage, stages) and each sequence's coloured text (the first few)."""
    m = run.metadata
    names = _display_names(run)
    facts = [
        ("run", m.run_id),
        ("model", m.model or "unknown"),
        ("storage", m.storage + (f" (k={m.top_k})" if m.top_k else "")),
        ("stages", ", ".join(names[s] for s in m.stages)),
        ("processors", m.processors or "none"),
    ]
    parts = [_STYLE, '<div class="ls-run"><table class="ls-table">']
    parts += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts]
    parts.append("</table>")
    if not run.num_rows:
        return "".join(parts) + "<p>Nothing recorded yet.</p></div>"
    shown = 0
    for g in run.generations():
        for s in run.sequences(g):
            if shown == _MAX_RUN_SEQUENCES:
                parts.append("<p>… more sequences: <code>run.view(generation, sequence)</code></p></div>")
                return "".join(parts)
            parts.append(f"<h4>generation {g}, sequence {s}</h4>")
            parts.append(_text_only(run, g, s))
            shown += 1
    parts.append("</div>")
    return "".join(parts)


def _text_only(run: Any, generation: int, sequence: int) -> str:
    full = sequence_html(run, generation, sequence)
    return full[: full.index('<table class="ls-table">')] if '<table class="ls-table">' in full else full


@dataclass(frozen=True)
class SequenceView:
    """One sequence of a run, shown as HTML in a notebook."""

    run: Any
    generation: int = -1
    sequence: int = 0

    def _repr_html_(self) -> str:
        return sequence_html(self.run, self.generation, self.sequence)


@dataclass(frozen=True)
class StepView:
    """One step of a sequence, shown as HTML (table and chart) in a notebook; ``why()`` explains it."""

    run: Any
    position: int
    generation: int = -1
    sequence: int = 0
    k: int = 10
    include_finished: bool = False

    def _repr_html_(self) -> str:
        return step_html(
            self.run,
            self.position,
            generation=self.generation,
            sequence=self.sequence,
            k=self.k,
            include_finished=self.include_finished,
        )

    def why(self) -> Any:
        return self.run.why(
            self.position, sequence=self.sequence, generation=self.generation, include_finished=self.include_finished
        )


def show(view: Any) -> Any:
    """Display ``view`` in a notebook when IPython is there; return it either way."""
    try:
        from IPython.display import HTML, display
    except ImportError:
        return view
    display(HTML(view._repr_html_()))
    return view
