"""The Streamlit app through streamlit.testing: every flow, asserting what the pages show."""

from __future__ import annotations

import base64
import html
import json
import re
from html.parser import HTMLParser

import numpy as np
import pyarrow.parquet as pq
import pytest
import streamlit as st
from dashboard_support import chart_specs
from streamlit.testing.v1 import AppTest

from dashboard import data
from dashboard.paths import APP, default_runs_path
from dashboard.synthetic import hand_made_run, write_large_run
from tracker import LogitTrackingProcessor, Run
from tracker.format.schema import META_RUN

TOKENS = ["a", " b", "c", "d", "e", "<eos>"]
EOS = 5
#: alpha: generation 0 / sequence 0 writes " b c d", sequence 1 " b c e"; generation 1 / sequence 0 writes "c c c".
ALPHA_CHOSEN = np.array([[[1, 2, 3, 5], [1, 2, 4, 5]], [[2, 2, 2, 5], [3, 3, 3, 5]]])
#: beta (no constraint): " b c e" then EOS, so it parts from alpha (0, 0) at step 2.
BETA_CHOSEN = np.array([1, 2, 4, 5])


def _logits(chosen: np.ndarray) -> np.ndarray:
    """Logits where the chosen token has probability ~0.6 and token "a" ~0.3 (the constraint masks "a")."""
    out = np.full(chosen.shape + (len(TOKENS),), -3.0, dtype=np.float32)
    np.put_along_axis(out, chosen[..., None], 1.0, axis=-1)
    out[..., 0] = 0.3
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    natural = _logits(ALPHA_CHOSEN)
    constrained = natural.copy()
    constrained[..., 0] = -np.inf
    alpha = hand_made_run(natural, ALPHA_CHOSEN, TOKENS, constrained=constrained, eos_token_id=EOS, title="Alpha")
    alpha.to_parquet(folder / "alpha.parquet")
    hand_made_run(_logits(BETA_CHOSEN), BETA_CHOSEN, TOKENS, eos_token_id=EOS, title="Beta").to_parquet(
        folder / "beta.parquet"
    )
    write_large_run(folder / "long.parquet", 240, 2048, rows_per_block=16)
    table = alpha.to_arrow()
    meta = dict(table.schema.metadata)
    newer = json.loads(meta[META_RUN])
    newer["schema_version"] = "2.0"
    meta[META_RUN] = json.dumps(newer).encode()
    pq.write_table(table.replace_schema_metadata(meta), folder / "future.parquet")
    whole = (folder / "alpha.parquet").read_bytes()
    (folder / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (folder / "notes.parquet").write_text("these are notes, not a run")
    Run.from_arrow(table.slice(0, 0)).to_parquet(folder / "empty.parquet")  # a filtered table written as a run
    return folder


def _app(root, page: str | None = None) -> AppTest:
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["root"] = str(root)
    if page is not None:
        at.switch_page(f"app_pages/{page}.py")
    return at.run()


def _plain(markdown: str) -> str:
    """Markdown as a reader sees it: backslash escapes (run text is escaped) dropped."""
    return re.sub(r"\\(.)", r"\1", markdown)


def _pick(at: AppTest, name: str, root) -> AppTest:
    return at.sidebar.selectbox(key="run").set_value(str(root / name)).run()


def _decoded(value):
    """Plotly's JSON with its typed arrays (``{"dtype", "bdata", "shape"}``) turned into lists."""
    if isinstance(value, dict) and "bdata" in value and "dtype" in value:
        array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        if "shape" in value:
            array = array.reshape([int(n) for n in str(value["shape"]).split(",")])
        return array.tolist()
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def _charts(at: AppTest) -> list[dict]:
    """The figures on the page, as plain data."""
    return [_decoded(json.loads(spec)) for spec in chart_specs(at)]


def _ok(at: AppTest) -> None:
    assert not at.exception, at.exception[0].message if at.exception else ""


def test_the_run_browser_lists_runs_with_their_details_and_names_bad_files(runs):
    at = _app(runs)
    _ok(at)
    table = at.dataframe[0].value
    assert table["run"].tolist() == ["Alpha", "Beta", "synthetic 240 steps x 2,048 tokens"]
    assert table["steps"].tolist() == [4, 4, 240] and table["sequences"].tolist() == [2, 1, 1]
    assert table["prompt"].tolist()[0] == "a" and table["date"].str.match(r"\d{4}-\d\d-\d\d \d\d:\d\d$").all()
    assert any(
        "**Holds** 2 generation(s) of up to 2 sequence(s), up to 4 steps" in _plain(m.value) for m in at.markdown
    )
    assert table["processors"].tolist()[1] == "none" and "temperature=0.0" in table["sampling"].tolist()[0]
    errors = " ".join(_plain(e.value) for e in at.error)
    assert "**future.parquet** cannot be shown" in errors and "schema version '2.0'" in errors
    assert "**truncated.parquet** cannot be shown: the file is truncated" in errors
    assert "**notes.parquet** cannot be shown" in errors
    assert "**empty.parquet** cannot be shown: it holds no recorded steps (0 rows)" in errors
    assert at.sidebar.selectbox(key="run").value == str(runs / "alpha.parquet")
    assert _plain(at.subheader[0].value) == "Alpha"


@pytest.mark.parametrize(
    "name, message",
    [
        ("truncated.parquet", "the file is truncated"),
        ("future.parquet", "run schema version '2.0'"),
        ("notes.parquet", "not a Parquet/Arrow file"),
        ("empty.parquet", "it holds no recorded steps (0 rows)"),
    ],
)
@pytest.mark.parametrize("page", ["overview", "replay", "compare"])
def test_opening_a_bad_file_shows_a_message_never_a_traceback(runs, page, name, message):
    at = _pick(_app(runs, page), name, runs)
    _ok(at)
    assert (
        len(at.error) == 1
        and message in _plain(at.error[0].value)
        and f"**{name}** cannot be shown" in _plain(at.error[0].value)
    )
    assert not at.get("plotly_chart")


def test_a_path_with_no_runs_says_so(tmp_path):
    at = _app(tmp_path / "nothing-here", "replay")
    _ok(at)
    assert "nothing at" in _plain(at.sidebar.error[0].value) and "No runs found" in at.info[0].value


def test_the_overview_colours_the_text_and_draws_timelines_and_the_heatmap(runs):
    at = _app(runs, "overview")
    _ok(at)
    assert _plain(at.title[0].value) == "Overview · Alpha"
    text = at.html[0].value
    pieces = [part.split(">", 1)[1].split("</span>", 1)[0] for part in text.split('class="tok"')[1:]]
    assert pieces == [" b", "c", "d", "&lt;eos&gt;"]
    assert "step 0: chose ␣b" in html.unescape(text) and "(masked)" in text
    timelines, heatmap = _charts(at)
    removed = next(t for t in timelines["data"] if t.get("yaxis") == "y3")
    p_masked = np.exp(0.3) / (np.exp(1.0) + np.exp(0.3) + 4 * np.exp(-3.0))  # "a", which the constraint masks
    np.testing.assert_allclose(removed["y"], [p_masked] * 4, rtol=1e-5)
    assert heatmap["data"][0]["type"] == "heatmap" and "␣b" in heatmap["data"][0]["y"]
    at.radio(key="overview_metric").set_value("probability mass the constraint removed").run()
    assert "rgba(76,120,168" in at.html[0].value  # the blue scale of removed mass


def test_step_replay_moves_steps_with_the_slider_and_the_buttons(runs):
    at = _app(runs, "replay")
    _ok(at)
    assert at.slider(key="step_slider").value == 0 and _plain(at.metric[0].value) == "␣b"
    figure = _charts(at)[0]
    bars = figure["data"]
    assert bars[0]["name"] == "model (natural)" and bars[1]["name"] == "after the constraint"
    ticks = figure["layout"]["xaxis"]["ticktext"]
    assert "<b>▶ ␣b</b>" in ticks and bars[2]["name"] == "masked by the constraint"
    assert [ticks[round(x)] for x in bars[2]["x"]] == ["a"]
    at.slider(key="step_slider").set_value(2).run()
    assert _plain(at.metric[0].value) == "d" and '<span style="color:#888">a</span> bc<span' in at.html[0].value
    at.button(key="next").click().run()
    assert at.session_state["step"] == 3 and _plain(at.metric[0].value) == "<eos>"
    at.button(key="back").click().run()
    assert at.session_state["step"] == 2 and at.slider(key="step_slider").value == 2
    at.radio(key="replay_value").set_value("logit").run()
    logits = _charts(at)[0]["data"][0]
    assert max(v for v in logits["y"] if v is not None) == pytest.approx(1.0)
    assert _charts(at)[0]["layout"]["yaxis"]["title"]["text"] == "logit"


class _Texts(HTMLParser):
    """The texts of an HTML block in order, and the ``title`` (hover) of each element that has one."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        self.titles: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.titles += [value for name, value in attrs if name == "title"]

    def handle_data(self, data: str) -> None:
        self.texts.append(data)


def _numbers(at: AppTest) -> tuple[list[tuple[str, str]], list[str]]:
    """Step replay's numbers as a reader sees them, (label, value) in order, and their help texts: from the
    metrics when paused, from the one block of HTML that holds them while playing."""
    if at.metric:
        return [(_plain(m.label), _plain(m.value)) for m in at.metric], [m.help for m in at.metric if m.help]
    block = [h.value for h in at.html if "logitscope-numbers" in h.value]
    assert len(block) == 1, "no metrics and no block of numbers on the page"
    texts = _Texts()
    texts.feed(block[0][block[0].index('<div class="logitscope-numbers"') :])
    return list(zip(texts.texts[::2], texts.texts[1::2])), texts.titles


def test_play_moves_one_step_per_tick_and_stops_at_the_end(runs):
    at = _app(runs, "replay")
    at.button(key="play").click().run()
    _ok(at)
    assert at.session_state["playing"] and at.session_state["step"] == 1 and at.button(key="play").label == "⏸ Pause"
    at.run()  # a tick of the timer
    playing = _numbers(at)
    assert at.session_state["step"] == 2 and playing[0][0] == ("Chosen token", "d")  # step 2 chose "d"
    assert not at.metric and not at.dataframe  # while playing, one block shows the numbers; the table waits ...
    assert at.query_params.get("step") == "0"  # ... and the address follows at the pause
    at.button(key="play").click().run()  # pause
    assert not at.session_state["playing"] and at.session_state["step"] == 2
    assert at.dataframe[0].value["token"].tolist()[:1] == ["d"]  # ... and comes back at the pause, for this step
    assert _numbers(at) == playing and len(playing[0]) == 5  # the same numbers, labels and help as the metrics
    assert at.query_params.get("step") == "2"
    at.button(key="play").click().run()
    at.run()
    assert at.session_state["step"] == 3 and not at.session_state["playing"]  # the last step stops the play
    assert at.button(key="play").label == "▶ Play"


def test_switching_generation_and_sequence_changes_what_is_shown(runs):
    at = _app(runs, "replay")
    at.slider(key="step_slider").set_value(2).run()
    assert _plain(at.metric[0].value) == "d"
    at.sidebar.selectbox(key="sequence").set_value(1).run()
    _ok(at)
    assert at.session_state["step"] == 0  # another sequence starts at its first step
    at.slider(key="step_slider").set_value(2).run()
    assert _plain(at.metric[0].value) == "e"
    at.sidebar.selectbox(key="generation").set_value(1).run()
    assert at.sidebar.selectbox(key="sequence").options == ["0", "1"]
    at.slider(key="step_slider").set_value(1).run()
    assert _plain(at.metric[0].value) == "d"  # generation 1, sequence 1 writes "d d d"
    at.switch_page("app_pages/overview.py").run()
    assert at.html[0].value.count('class="tok"') == 4 and "step 0: chose d" in html.unescape(at.html[0].value)


def test_compare_lines_two_runs_up_by_step_and_says_where_they_diverge(runs):
    at = _app(runs, "compare")
    _ok(at)
    assert any("Pick a second run" in c.value for c in at.caption)
    at.selectbox(key="b_sequence").set_value(1).run()
    assert "diverge at step 2: A chose d, B chose e" in _plain(at.warning[0].value)
    at.sidebar.selectbox(key="run_b").set_value(str(runs / "beta.parquet")).run()
    _ok(at)
    assert "agree on their first 2 tokens and diverge at step 2" in at.warning[0].value
    chart = _charts(at)[0]
    assert [t["name"] for t in chart["data"]] == ["A", "A", "B", "B"]
    assert any(s.get("x0") == 2 for s in chart["layout"]["shapes"])
    table = at.dataframe[0].value
    assert table["same"].tolist() == [True, True, False, True]
    assert table["chosen_token_b"].tolist() == ["␣b", "c", "e", "<eos>"]  # a space shows as ␣
    right = at.html[1].value
    assert "rgba(228,87,86,0.25)" in right and "e&lt;eos&gt;" in right


def test_compare_with_no_second_run_opens_on_the_next_sequence_never_on_a_itself(runs):
    at = _app(runs, "compare")
    _ok(at)
    # alpha, generation 0: sequence 0 against sequence 1 (they part at step 2), not against itself
    assert (at.selectbox(key="b_generation").value, at.selectbox(key="b_sequence").value) == (0, 1)
    assert not at.success and "diverge at step 2" in _plain(at.warning[0].value)
    at.sidebar.selectbox(key="sequence").set_value(1).run()  # A moves onto B: B moves on, to generation 1
    assert (at.selectbox(key="b_generation").value, at.selectbox(key="b_sequence").value) == (1, 0)
    assert not at.success
    at = _pick(_app(runs, "compare"), "beta.parquet", runs)  # one sequence: nothing else in it to compare with
    _ok(at)
    assert not at.success and "pick a second run under *Compare with*" in at.info[0].value
    assert not at.get("plotly_chart")


def test_a_long_run_is_read_by_step_and_by_window(runs, monkeypatch):
    at = _app(runs)
    at = _pick(at, "long.parquet", runs)
    at.switch_page("app_pages/replay.py").run()
    _ok(at)
    reader = data.reader(str(runs / "long.parquet"))
    assert reader.blocks_read == 1  # opening reads ids and the first step's row group only
    at.slider(key="step_slider").set_value(200).run()
    assert reader.blocks_read == 2 and _plain(at.metric[-2].value) == "1,024 / 2,048"
    at.slider(key="step_slider").set_value(201).run()
    assert reader.blocks_read == 2  # same row group: from the cache
    monkeypatch.setattr(data, "WINDOW_BYTES", 2048 * 4 * 2 * 32)  # a 32-step overview window
    at.switch_page("app_pages/overview.py").run()
    _ok(at)
    assert "Steps 0–31 of 240." in at.caption[0].value
    assert reader.blocks_read == 3  # rows 0-31: row groups 0 and 1, the first already read
    at.slider(key="overview_start").set_value(64).run()
    assert "Steps 64–95 of 240." in at.caption[0].value and reader.blocks_read == 5
    timelines = _charts(at)[0]
    assert timelines["data"][0]["x"][0] == 64 and len(timelines["data"][0]["x"]) == 32


def test_the_shipped_sample_runs_all_open(tmp_path):
    root = default_runs_path()
    if not root.is_dir():
        pytest.skip(f"no sample runs at {root}")
    at = _app(root)
    _ok(at)
    assert not at.error, [e.value for e in at.error]
    titles = at.dataframe[0].value["run"].tolist()
    assert {
        "JSON record (schema)",
        "Phone number (regex)",
        "Arithmetic line (CFG)",
        "Bad words",
        "Greedy",
        "High temperature (1.6)",
        "Batch of four",
        "Two seeds",
    } <= set(titles)
    at.switch_page("app_pages/overview.py").run()
    _ok(at)
    assert len(at.get("plotly_chart")) == 2


def test_a_small_probability_reads_as_its_value_not_as_zero(tmp_path):
    """At the JSON run's first step the schema forces a token the model gave about 2e-4: the replay says so."""
    from tracker import Run

    path = default_runs_path() / "json_record.parquet"
    if not path.is_file():
        pytest.skip(f"no sample run at {path}")
    expected = float(Run.load(path).stats()["p_chosen_natural"].iloc[0])
    assert 0 < expected < 1e-3
    at = _app(path.parent, "replay")
    at = _pick(at, "json_record.parquet", path.parent)
    _ok(at)
    shown = {_plain(m.label): m.value for m in at.metric}
    natural = shown["p, model (natural)"]
    assert natural != "0.000" and float(natural) == pytest.approx(expected, rel=0.05)
    assert float(shown["p, after the constraint"]) == pytest.approx(1.0)


def test_a_stage_per_processor_run_names_its_last_stage_after_its_processor(tmp_path):
    """The replay, the timelines and the chart of mass removed by each processor call the last stage alike."""
    path = default_runs_path() / "two_processors.parquet"
    if not path.is_file():
        pytest.skip(f"no sample run at {path}")
    at = _pick(_app(path.parent, "replay"), "two_processors.parquet", path.parent)
    _ok(at)
    labels = [_plain(m.label) for m in at.metric]
    assert "p, after:penalties" in labels and "p, after:regex" in labels
    bars = {trace["name"] for trace in _charts(at)[0]["data"]}
    assert {"model (natural)", "after:regex", "after:penalties", "sampled from"} <= bars
    assert "after the constraint" not in bars
    at.switch_page("app_pages/overview.py").run()
    _ok(at)
    timelines, by_processor = _charts(at)[:2]
    names = {trace.get("name") for trace in timelines["data"]}
    assert "after:penalties" in names and "after the constraint" not in names
    assert {trace.get("name") for trace in by_processor["data"]} == {"after:regex", "after:penalties"}


def test_comparing_runs_of_two_vocabularies_says_so(runs):
    at = _app(runs, "compare")
    at.sidebar.selectbox(key="run_b").set_value(str(runs / "long.parquet")).run()
    assert not at.exception, at.exception[0].message if at.exception else ""
    assert any("only runs of one vocabulary compare" in e.value for e in at.error)


@pytest.mark.parametrize("storage", ["float32", "topk"])
def test_a_run_cut_short_by_a_failing_processor_shows_on_every_page(tmp_path, storage):
    """The third step's constraint raised (only the model's row was recorded) and no token was chosen there,
    as after a generate() that raised: every page shows it; replay says what happened at that step."""
    from test_tracker_support import FailsOnThirdCall, byte_tokenizer, record_until_the_processor_raises

    tok = byte_tokenizer()
    tracker = LogitTrackingProcessor(FailsOnThirdCall(), tokenizer=tok, storage=storage, top_k=8)
    record_until_the_processor_raises(tracker, tok, seed=11)
    tracker.to_parquet(tmp_path / "cut.parquet")
    for page in ("overview", "compare"):
        at = _app(tmp_path, page)
        _ok(at)
        assert not at.error and at.get("plotly_chart")
    at = _app(tmp_path, "replay")
    for step in (0, 1, 2):
        at.slider(key="step_slider").set_value(step).run()
        _ok(at)
        failed = [w.value for w in at.warning if "wrapped processor raised" in w.value]
        assert bool(failed) == (step == 2)


def test_every_page_of_a_spill_folder_says_it_holds_only_the_spilled_rows(tmp_path):
    """A tracker killed mid-run leaves a spill folder: each page that shows it warns that rows may be missing."""
    from test_tracker_support import spill_six_steps

    with pytest.warns(UserWarning, match="spill"):
        track = LogitTrackingProcessor(None, memory_limit=0, spill_dir=tmp_path / "spill", chunk_bytes=64)
        spill_six_steps(track, np.random.default_rng())
    for page in ("overview", "replay", "compare"):
        at = _app(tmp_path / "spill", page)
        _ok(at)
        warnings = " ".join(_plain(w.value) for w in at.warning)
        assert "spill folder" in warnings and "still held in memory are not in it" in warnings, page
