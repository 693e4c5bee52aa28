"""The dashboard shows what the tracker says: runs of the demo model, read back through the pages."""

from __future__ import annotations

import html
import re

import pytest
from streamlit.testing.v1 import AppTest
from test_dashboard_app import _app, _ok

from dashboard import data
from tracker import Run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo):
    """forced: the Generator writes "日本日本日本日本" (three byte tokens per character) and EOS; nihon and
    nichi write "日本" and "日日";
    unfinished: transformers' generate with the tracker and no ``finish``, so the last token is unknown."""
    from transformers import LogitsProcessorList

    from processors import ForcedTextLogitsProcessor
    from sampling import Generator, SamplingParams
    from tracker import LogitTrackingProcessor, add_tracking

    model, tokenizer = demo
    folder = tmp_path_factory.mktemp("truth")
    forced = add_tracking(Generator(model, tokenizer, ForcedTextLogitsProcessor("日本日本日本日本", tokenizer)))
    forced.generate(["My cat "], SamplingParams(max_new_tokens=40))
    forced.logits_processor.to_parquet(folder / "forced.parquet")
    for name, text in (("nihon", "日本"), ("nichi", "日日")):  # they part at the second byte of the second character
        pair = add_tracking(Generator(model, tokenizer, ForcedTextLogitsProcessor(text, tokenizer)))
        pair.generate(["My cat "], SamplingParams(max_new_tokens=10))
        pair.logits_processor.to_parquet(folder / f"{name}.parquet")
    tracker = LogitTrackingProcessor(tokenizer=tokenizer)
    encoded = tokenizer(["Call "], return_tensors="pt")
    model.generate(**encoded, logits_processor=LogitsProcessorList([tracker]), do_sample=False, max_new_tokens=4)
    tracker.to_parquet(folder / "unfinished.parquet")
    return folder


def _shown_tokens(at: AppTest) -> list[str]:
    """The generated tokens of the overview's text, as a reader sees them (an empty piece shows as "·")."""
    spans = re.findall(r'<span class="tok"[^>]*>(.*?)</span>', at.html[0].value, re.S)
    return [html.unescape(s) for s in spans]


def test_the_overview_read_window_by_window_shows_the_runs_text(runs, monkeypatch):
    path = runs / "forced.parquet"
    run = Run.load(path)
    assert run.sequence() == "日本日本日本日本"
    reader = data.reader(str(path))
    # 16 steps a window: step 16 is the middle byte of the third character
    monkeypatch.setattr(data, "WINDOW_BYTES", reader.metadata.vocab_size * 4 * len(reader.stages) * 16)
    at = _app(runs, "overview")
    at.sidebar.selectbox(key="run").set_value(str(path)).run()
    _ok(at)
    first = _shown_tokens(at)
    at.slider(key="overview_start").set_value(16).run()
    _ok(at)
    second = _shown_tokens(at)
    assert len(first) == 16 and len(first) + len(second) == len(run.stats())
    shown = "".join(t for t in first + second if t != "·")
    assert shown == run.sequence()  # no "�" at either side of the window's edge


def test_a_last_token_never_handed_to_the_tracker_is_shown_as_unknown(runs):
    path = runs / "unfinished.parquet"
    stats = Run.load(path).stats()
    assert stats["chosen_id"].isna().tolist() == [False, False, False, True]
    at = _app(runs, "replay")
    at.sidebar.selectbox(key="run").set_value(str(path)).run()
    at.slider(key="step_slider").set_value(2).run()
    assert re.sub(r"\\(.)", r"\1", at.metric[0].value) == stats["chosen_token"].iloc[2].replace(" ", "␣")
    at.slider(key="step_slider").set_value(3).run()
    _ok(at)
    chosen = at.metric[0]
    assert chosen.label == "Chosen token" and chosen.value == "—"  # not "∅", the label of an empty token
    assert "never said" in chosen.help


def test_compare_names_the_tokens_where_two_runs_part_as_the_table_does(runs):
    a, b = Run.load(runs / "nihon.parquet").stats(), Run.load(runs / "nichi.parquet").stats()
    assert (a["chosen_id"] == b["chosen_id"]).tolist() == [True] * 4 + [False, False, True]
    at = _app(runs, "compare")
    at.sidebar.selectbox(key="run").set_value(str(runs / "nihon.parquet")).run()
    at.sidebar.selectbox(key="run_b").set_value(str(runs / "nichi.parquet")).run()
    _ok(at)
    said = re.sub(r"\\(.)", r"\1", at.warning[0].value)
    token_a, token_b = a["chosen_token"].iloc[4], b["chosen_token"].iloc[4]  # bytes that are no character yet
    assert token_a != token_b
    assert f"diverge at step 4: A chose {token_a}, B chose {token_b}." in said
    table = at.dataframe[0].value
    assert table[["chosen_token_a", "chosen_token_b"]].iloc[4].tolist() == [token_a, token_b]
