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
