"""Byte tokens shown once, one way: ``⟨F0⟩`` for a lone byte, the character once complete, on every page and chart."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tracker
from dashboard import charts, text, views
from dashboard.synthetic import hand_made_run
from processors.vocab import Vocabulary, decode_text, display_bytes

#: " b", then 🎉 in three tokens, a token spelling a literal backslash-x, then a lone F0 left unfinished
PIECES = [b"a", b" b", b"\xf0", b"\x9f\x8e", b"\x89", b"\\x41", b"<eos>"]
CHOSEN = np.array([1, 2, 3, 4, 5, 2])
TEXT = " b🎉\\x41�"


@pytest.fixture(scope="module")
def run() -> tracker.Run:
    natural = np.full((len(CHOSEN), len(PIECES)), -2.0, dtype=np.float32)
    natural[np.arange(len(CHOSEN)), CHOSEN] = 1.0
    made = hand_made_run(natural, CHOSEN, [f"t{i}" for i in range(len(PIECES))], eos_token_id=6)
    vocab = Vocabulary.from_parts(PIECES, [False] * 6 + [True])
    return tracker.Run(made.to_arrow().to_batches(), made.metadata, vocab)


def test_display_bytes_marks_each_byte_that_is_no_character():
    assert display_bytes(b"\xf0") == "⟨F0⟩"
    assert display_bytes(b" \xf0\x9f") == " ⟨F0⟩⟨9F⟩"
    assert display_bytes("🎉".encode()) == "🎉"
    assert display_bytes(b"\\xf0") == "\\xf0"  # a literal backslash stays what it is
    assert decode_text(b"ok \xf0\x9f\x8e") == "ok �"  # an unfinished character at the end: one U+FFFD


def test_the_runs_text_and_the_pages_pieces_agree(run):
    assert run.sequence() == TEXT
    pieces = views.token_pieces(run.vocab, CHOSEN)
    assert "".join(pieces) == TEXT
    assert pieces[1:4] == ["", "", "🎉"]  # the character appears once, with its last byte


def test_token_columns_hovers_and_charts_show_each_token_once_unescaped(run):
    stats = run.stats()
    assert stats["chosen_token"].tolist() == [" b", "⟨F0⟩", "⟨9F⟩⟨8E⟩", "⟨89⟩", "\\x41", "⟨F0⟩"]
    window = views.window_view(run, 0, 0, alternatives=2, heat_tokens=3)
    hovers = text.token_hovers(window, ["natural"])
    assert hovers[1].startswith("step 1: chose ⟨F0⟩") and hovers[4].startswith("step 4: chose \\x41")
    assert not any("'" in h.split("\n")[0] for h in hovers), "no repr quotes"
    figure = json.loads(charts.timelines(stats, ["natural"]).to_json())
    shown = json.dumps(figure["data"], ensure_ascii=False)
    assert "⟨F0⟩" in shown and "\\\\\\\\x" not in shown and "'⟨F0⟩'" not in shown


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_overview_windows_show_a_character_split_across_their_edge_whole(run, tmp_path, size):
    """The overview reads a window of steps at a time; 🎉 spans steps 1-3, so most window sizes cut through it."""
    from dashboard import data

    path = str(tmp_path / "run.parquet")
    run.to_parquet(path)
    whole = views.token_pieces(run.vocab, CHOSEN)
    shown = []
    for start in range(0, len(CHOSEN), size):
        window = data.window(path, 0, 0, start, min(len(CHOSEN), start + size))
        assert window.tokens == whole[start : start + size]
        shown += window.tokens
    assert "".join(shown) == run.sequence() == TEXT


def test_compare_names_the_tokens_where_two_runs_part_even_a_byte_or_eos(run, tmp_path):
    """The pieces of a lone byte and of EOS are empty (they add no text yet): the message names the tokens."""
    from test_dashboard_app import _app, _ok, _plain

    # as a tokenizer's vocabulary has it: EOS spells nothing and is shown by name
    vocab = Vocabulary.from_parts(
        PIECES[:6] + [b""], [False] * 6 + [True], display=[display_bytes(p) for p in PIECES[:6]] + ["<eos>"]
    )
    tracker.Run(run._record_batches(), run.metadata, vocab).to_parquet(tmp_path / "a.parquet")
    other = np.array([1, 6])  # " b", then EOS where the first run chose the first byte of 🎉
    natural = np.full((len(other), len(PIECES)), -2.0, dtype=np.float32)
    natural[np.arange(len(other)), other] = 1.0
    made = hand_made_run(natural, other, [f"t{i}" for i in range(len(PIECES))], eos_token_id=6)
    tracker.Run(made.to_arrow().to_batches(), made.metadata, vocab).to_parquet(tmp_path / "b.parquet")
    at = _app(tmp_path, "compare")
    at.sidebar.selectbox(key="run").set_value(str(tmp_path / "a.parquet")).run()
    at.sidebar.selectbox(key="run_b").set_value(str(tmp_path / "b.parquet")).run()
    _ok(at)
    assert "diverge at step 1: A chose ⟨F0⟩, B chose <eos>." in _plain(at.warning[0].value)


def test_the_notebook_text_is_the_runs_text_with_each_token_named_on_hover(run):
    import html
    import re

    markup = run.view()._repr_html_()
    spans = re.findall(r'<span class="ls-tok"[^>]*title="([^"]*)">(.*?)</span>', markup)
    shown = [html.unescape(text) for _, text in spans]
    assert shown == [" b", "·", "·", "🎉", "\\x41", "�"]  # a token that adds no text yet shows as ·
    assert "".join(t for t in shown if t != "·") == run.sequence() == TEXT
    hovers = [html.unescape(title).split(",")[0] for title, _ in spans]
    assert hovers[1:4] == ["step 1: ⟨F0⟩", "step 2: ⟨9F⟩⟨8E⟩", "step 3: ⟨89⟩"]
