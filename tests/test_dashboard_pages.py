"""Findings of a browser review of the dashboard, each checked as a user meets it (through streamlit.testing)."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest
from test_dashboard_app import _charts, _ok

from dashboard import charts, data
from dashboard.paths import APP
from dashboard.synthetic import hand_made_run, write_large_run

TOKENS = ["a", " ", "\n", "b", "c", "<eos>"]
EOS = 5


def _logits(chosen: np.ndarray) -> np.ndarray:
    """The chosen token ~0.45, a newline ~0.27, "a" ~0.2 (the constraint masks "a")."""
    out = np.full(np.shape(chosen) + (len(TOKENS),), -3.0, dtype=np.float32)
    np.put_along_axis(out, np.asarray(chosen)[..., None], 1.0, axis=-1)
    out[..., 2] = np.where(np.asarray(chosen) == 2, 1.0, 0.5)
    out[..., 0] = 0.3
    return out


def _run(chosen, title: str, favour: int | None = None, **kwargs):
    """A run where the constraint masks "a" (and, with ``favour``, lifts that token above the rest)."""
    chosen = np.asarray(chosen)
    natural = _logits(chosen)
    constrained = natural.copy()
    constrained[..., 0] = -np.inf
    if favour is not None:
        constrained[..., favour] = 2.0
    return hand_made_run(natural, chosen, TOKENS, constrained=constrained, eos_token_id=EOS, title=title, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """one_step writes "b"; three: sequence 0 "b␣<eos>", sequence 1 "bc<eos>"; other "c␣<eos>"."""
    folder = tmp_path_factory.mktemp("runs")
    _run([3], "One step").to_parquet(folder / "one_step.parquet")
    _run([[3, 1, 5], [3, 4, 5]], "Three steps").to_parquet(folder / "three.parquet")
    _run([4, 1, 5], "Other").to_parquet(folder / "other.parquet")
    # top two: the model's "b" and newline, the constraint's "c" and "b": its newline is not stored
    _run([3, 1, 5], "Top two", favour=4, storage="topk", top_k=2).to_parquet(folder / "topk.parquet")
    return folder


@pytest.fixture(scope="module")
def long_short(tmp_path_factory):
    folder = tmp_path_factory.mktemp("long_short")
    write_large_run(folder / "long.parquet", 40, 2048, rows_per_block=16)
    write_large_run(folder / "short.parquet", 10, 2048, rows_per_block=16)
    return folder


@pytest.fixture(scope="module")
def stages_run(tmp_path_factory, demo):
    """The demo model through the sample recipe "Regex then penalty" (a stage per processor), for three tokens:
    at step 0 the regex masks "+" and the digits the model likes."""
    from logitscope.samples import RECIPES, record
    from sampling import SamplingParams

    recipe = next(r for r in RECIPES if r.name == "two_processors")
    recipe = replace(recipe, params=(SamplingParams(temperature=0.7, seed=0, max_new_tokens=3),))
    folder = tmp_path_factory.mktemp("stages")
    model, tokenizer = demo
    for _ in record(folder, model, tokenizer, recipes=(recipe,)):
        pass
    return folder


def _app(root, page: str | None = None, query: dict | None = None) -> AppTest:
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["root"] = str(root)
    if query:
        at.query_params.update(query)
    if page is not None:
        at.switch_page(f"app_pages/{page}.py")
    return at.run()


def _go(at: AppTest, page: str) -> AppTest:
    return at.switch_page(f"app_pages/{page}.py").run()


def _pick(at: AppTest, name: str, root, key: str = "run") -> AppTest:
    return at.sidebar.selectbox(key=key).set_value(str(root / name)).run()


def _plain(markdown: str) -> str:
    return re.sub(r"\\(.)", r"\1", markdown)


def _texts(at: AppTest) -> str:
    kinds = ("caption", "info", "warning", "success", "error", "markdown")
    return " | ".join(_plain(e.value) for kind in kinds for e in at.get(kind))


def _marked(figure: dict) -> dict[str, list[str]]:
    """Per marker trace of a step-bars figure (by name): the tokens it marks (read off the x axis)."""
    ticks = [re.sub(r"<[^>]+>|▶ ", "", t) for t in figure["layout"]["xaxis"]["ticktext"]]
    return {
        t["name"]: [ticks[round(x)] for x in t["x"]] for t in figure["data"] if t["type"] == "scatter" and t.get("x")
    }


# 1 ------------------------------------------------------------------ a one-step sequence


def test_a_one_step_sequence_replays_without_a_step_slider(runs):
    at = _pick(_app(runs, "replay"), "one_step.parquet", runs)
    _ok(at)
    assert not at.get("slider") or all(s.key != "step_slider" for s in at.slider)
    assert "This sequence has one step: step 0." in _texts(at)
    assert _plain(at.metric[0].value) == "b" and _charts(at)[0]["layout"]["title"]["text"].startswith("Step 0")
    assert at.button(key="play").disabled and at.button(key="next").disabled
    for page in ("overview", "compare"):
        _ok(_go(at, page))


def test_a_one_step_run_against_a_longer_one_says_which_ends_and_marks_no_divergence(runs):
    at = _pick(_app(runs, "compare"), "one_step.parquet", runs)
    at = _pick(at, "three.parquet", runs, key="run_b")
    _ok(at)
    assert "agree on all 1 token of A; then A ends (after step 0) and B goes on to step 2" in _texts(at)
    chart = _charts(at)[0]
    assert not any("diverge" in a.get("text", "") for a in chart["layout"].get("annotations", []))


# 2 ------------------------------------------------------------------ a window past the shorter run's end


def test_compare_past_the_end_of_the_shorter_run_shows_the_longer_one_alone(long_short, monkeypatch):
    monkeypatch.setattr(data, "WINDOW_BYTES", 1)  # 16-step windows
    at = _pick(_app(long_short, "compare"), "long.parquet", long_short)
    at = _pick(at, "short.parquet", long_short, key="run_b")
    _ok(at)
    at.slider(key="compare_start").set_value(16).run()
    _ok(at)
    assert "B has no steps from step 16 on: it ends at step 9." in _texts(at)
    lines = [t for t in _charts(at)[0]["data"] if t["name"] == "A"]
    assert lines and lines[0]["x"][0] == 16 and len(lines[0]["x"]) == 16
    table = at.dataframe[0].value
    assert table["position"].tolist() == list(range(16, 32)) and table["chosen_id_b"].isna().all()


# 3 ------------------------------------------------------------------ one colour per stage in every figure


def _line_colors(figure: dict) -> dict[str, str]:
    return {t["name"]: t["line"]["color"] for t in figure["data"] if t.get("line", {}).get("color") and t.get("name")}


def test_each_processor_keeps_its_stage_colour_in_the_mass_removed_chart(stages_run):
    at = _app(stages_run, "overview")
    _ok(at)
    timelines, by_processor = _charts(at)[:2]
    stage_colors, removed_colors = _line_colors(timelines), _line_colors(by_processor)
    assert removed_colors["after:regex"] == stage_colors["after:regex"]
    assert removed_colors["after:penalties"] == stage_colors["after:penalties"] == charts.STAGE_COLORS["constrained"]
    assert removed_colors["after:regex"] != removed_colors["after:penalties"]


def test_the_mass_removed_chart_colours_stages_as_the_timelines_do_without_being_told_the_stages():
    stages = ["natural", "after:regex", "constrained"]
    stats = pd.DataFrame(
        {
            "position": [0, 1],
            **{f"entropy_{s}": [1.0, 0.5] for s in stages},
            "removed_mass_after:regex": [0.5, 0.1],
            "removed_mass_after:penalties": [0.0, 0.2],
        }
    )
    names = charts.stage_names(stages, {"after:penalties": "constrained"})
    timelines = {t.name: t.line.color for t in charts.timelines(stats, stages, names=names).data}
    removed = {t.name: t.line.color for t in charts.removed_by_processor(stats).data}
    assert removed == {name: timelines[name] for name in ("after:regex", "after:penalties")}


def test_hiding_a_stage_in_the_replay_leaves_the_others_colours(stages_run):
    at = _app(stages_run, "replay")
    before = {t["name"]: t["marker"]["color"] for t in _charts(at)[0]["data"] if t["type"] == "bar"}
    at.multiselect(key="replay_stages").set_value(["after:regex", "sampled"]).run()
    after = {t["name"]: t["marker"]["color"] for t in _charts(at)[0]["data"] if t["type"] == "bar"}
    assert after == {name: before[name] for name in ("after:regex", "sampled from")}


# 4 ------------------------------------------------------------------ a token masked at a hidden stage


def test_a_token_masked_at_a_hidden_stage_is_still_marked_masked(stages_run):
    at = _app(stages_run, "replay")
    _ok(at)
    shown = _marked(_charts(at)[0])
    masked = shown["masked at after:regex"]
    assert "+" in masked and "5" in masked
    at.multiselect(key="replay_stages").set_value(["natural", "constrained", "sampled"]).run()
    _ok(at)
    figure = _charts(at)[0]
    assert sorted(_marked(figure)["masked at after:regex"]) == sorted(masked)  # now in after:penalties' slots
    bars = {t["name"]: t for t in figure["data"] if t["type"] == "bar"}
    slot = bars["after:penalties"]["offset"] + bars["after:penalties"]["width"] / 2
    marks = next(t for t in figure["data"] if t["name"] == "masked at after:regex")
    assert all(x - round(x) == pytest.approx(slot) for x in marks["x"])


# 5 ------------------------------------------------------------------ not stored is not masked


def test_a_value_top_k_storage_did_not_keep_has_its_own_mark(runs):
    at = _pick(_app(runs, "replay"), "topk.parquet", runs)
    _ok(at)
    marked = _marked(_charts(at)[0])
    numbers = at.dataframe[0].value.set_index("token")
    unknown = numbers.index[numbers["constrained_state"] == "not stored"].tolist()
    assert unknown and set(unknown) <= set(marked["not stored (top-k)"])
    assert set(marked["not stored (top-k)"]).isdisjoint(marked.get("masked by the constraint", []))
    assert "? marks a value this run's top-k storage did not keep: unknown, not masked." in _texts(at)
    figure = charts.step_bars(at.dataframe[0].value.rename(columns={"token": "label"}), ["natural", "constrained"])
    legend = [t.name for t in figure.data if t.type == "scatter"]
    assert legend.count("not stored (top-k)") == 1 and [t.text[0] for t in figure.data if t.type == "scatter"] == ["?"]


# 6 ------------------------------------------------------------------ the "not known" note sits in its panel


def test_the_note_on_an_empty_panel_sits_in_that_panel_and_leaves_the_steps_range():
    stats = pd.DataFrame(
        {
            "position": [64, 65, 66],
            "chosen_token": ["a", "b", "c"],
            "entropy_natural": [1.0, 2.0, 1.5],
            "p_chosen_natural": [0.5, 0.4, 0.3],
            "p_eos_natural": [np.nan] * 3,  # a run with no end-of-sequence ids
        }
    )
    fig = charts.timelines(stats, ["natural"])
    note = next(a for a in fig.layout.annotations if a.text == "not known in this run's storage")
    panel = fig.get_subplot(3, 1)  # end-of-sequence probability, the last panel
    assert (note.xref, note.yref) == ("paper", "paper")
    assert panel.yaxis.domain[0] < note.y < panel.yaxis.domain[1] and panel.xaxis.domain[0] < note.x < 1


# 7 ------------------------------------------------------------------ page controls survive other pages


def test_page_controls_keep_their_values_across_pages(runs):
    at = _pick(_app(runs, "replay"), "three.parquet", runs)
    at.slider(key="replay_k").set_value(4).run()
    at.radio(key="replay_scale").set_value("log").run()
    at = _go(at, "overview")
    at.radio(key="overview_metric").set_value("chosen token's rank (model)").run()
    at = _go(at, "compare")
    at.selectbox(key="b_sequence").set_value(1).run()
    at = _go(at, "replay")
    _ok(at)
    assert at.slider(key="replay_k").value == 4 and at.radio(key="replay_scale").value == "log"
    assert len(at.dataframe[0].value) <= 5  # four tokens (and the chosen one)
    at = _go(at, "overview")
    assert at.radio(key="overview_metric").value == "chosen token's rank (model)"
    at = _go(at, "compare")
    assert at.selectbox(key="b_sequence").value == 1
    assert "agree on their first 1 token and diverge at step 1" in _texts(at)  # sequence 1 parts at "c"
    at = _pick(at, "one_step.parquet", runs)  # a run of one sequence: B's sequence 1 is gone, and no other
    _ok(at)
    assert any("pick a second run under *Compare with*" in i.value for i in at.info)


# 8 ------------------------------------------------------------------ the address follows the picks


def test_the_query_string_follows_the_run_and_the_step(runs):
    at = _app(runs, "replay", query={"run": "three.parquet", "step": "2"})
    _ok(at)
    assert at.session_state["step"] == 2 and at.query_params["run"] == "three.parquet"
    at = _pick(at, "other.parquet", runs)
    assert at.query_params["run"] == "other.parquet" and at.query_params["step"] == "0"
    at.button(key="next").click().run()
    assert at.query_params["step"] == "1"
    at = _go(at, "overview")
    assert at.query_params.get("run") == "other.parquet" and "step" not in at.query_params


@pytest.mark.parametrize("step", ["²", "٣", "-1", "1e3", "2 "])
def test_a_link_s_step_that_is_not_a_number_says_so_and_shows_step_0(runs, step):
    at = _app(runs, "replay", query={"run": "three.parquet", "step": step})
    _ok(at)
    assert at.session_state["step"] == 0 and at.slider(key="step_slider").value == 0
    assert f"The link's step, {step!r}, is not a number: showing step 0." in [_plain(w.value) for w in at.warning]


# 9 ------------------------------------------------------------------ whitespace tokens in the numbers


def test_the_numbers_show_whitespace_tokens_as_the_chart_does(runs):
    at = _pick(_app(runs, "replay"), "three.parquet", runs)
    at.slider(key="step_slider").set_value(1).run()
    tokens = at.dataframe[0].value["token"].tolist()
    assert "␣" in tokens and "↵" in tokens and " " not in tokens and "\n" not in tokens


# 10 ----------------------------------------------------------------- logits are logits


def test_the_logit_view_leaves_out_the_sampled_stage_and_says_why(stages_run):
    at = _app(stages_run, "replay")
    at.radio(key="replay_value").set_value("logit").run()
    _ok(at)
    figure = _charts(at)[0]
    bars = [t["name"] for t in figure["data"] if t["type"] == "bar"]
    assert "sampled from" not in bars and "model (natural)" in bars
    assert figure["layout"]["yaxis"]["title"]["text"] == "logit"
    assert "records what the sampler drew from as log-probabilities" in _texts(at)
    at.radio(key="replay_value").set_value("prob").run()
    assert "sampled from" in [t["name"] for t in _charts(at)[0]["data"] if t["type"] == "bar"]


# 11 ----------------------------------------------------------------- wording and marks


def test_compare_counts_tokens_in_words(runs):
    at = _pick(_app(runs, "compare"), "three.parquet", runs)
    at = _pick(at, "other.parquet", runs, key="run_b")
    _ok(at)
    assert "The two sequences diverge at step 0: A chose b, B chose c." in _texts(at)
    at.sidebar.selectbox(key="run_b").set_value("").run()  # B: the run's other sequence, never A again
    assert "The two sequences agree on their first 1 token and diverge at step 1" in _texts(at)


def test_compare_names_the_stages_as_the_other_pages_do(stages_run):
    at = _app(stages_run, "compare")
    at = _pick(at, "two_processors.parquet", stages_run, key="run_b")  # the run has one sequence: B is asked for
    _ok(at)
    options = [_plain(o) for o in at.radio(key="compare_stage").options]
    assert "after:penalties" in options and "after the constraint" not in options


def test_the_heatmap_circles_the_chosen_token_in_the_marker_colour():
    heat = pd.DataFrame([[0.5, 0.1], [0.2, 0.6]], index=["a", "b"], columns=[0, 1])
    circles = charts.token_heatmap(heat, ["a", "b"]).data[1]
    assert circles.marker.symbol == "circle-open" and circles.marker.color == charts.MASK_COLOR
