"""dashboard.views, dashboard.charts and dashboard.text on small hand-made runs: the numbers each figure shows."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from dashboard import charts, text, views
from dashboard.reader import RunReader
from dashboard.synthetic import hand_made_run

TOKENS = ["a", " b", "c", "d", "e", "<eos>"]
#: step 0: the model wants "a" (0.5) but the constraint masks it; step 1: nothing masked; step 2: EOS.
PROBS = np.array(
    [
        [0.50, 0.20, 0.12, 0.08, 0.05, 0.05],
        [0.10, 0.60, 0.10, 0.10, 0.05, 0.05],
        [0.05, 0.05, 0.05, 0.05, 0.10, 0.70],
    ],
    dtype=np.float32,
)


@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> RunReader:
    natural = np.log(PROBS)
    constrained = natural.copy()
    constrained[0, 0] = -np.inf
    run = hand_made_run(natural, [1, 1, 5], TOKENS, constrained=constrained, eos_token_id=5)
    path = tmp_path_factory.mktemp("runs") / "run.parquet"
    run.to_parquet(path)
    return RunReader(path)


@pytest.fixture(scope="module")
def table(reader) -> pd.DataFrame:
    return views.step_table(reader.step(reader.track(0, 0), 0), reader.vocab, k=3)


def test_step_table_lists_the_best_tokens_with_each_stages_value_and_state(table):
    assert table["token"].tolist() == ["a", " b", "c"]
    assert table["label"].tolist() == ["a", "␣b", "c"]
    assert table["chosen"].tolist() == [False, True, False]
    np.testing.assert_allclose(table["natural_prob"], [0.5, 0.2, 0.12], rtol=1e-5)
    np.testing.assert_allclose(table["constrained_prob"], [0.0, 0.4, 0.24], rtol=1e-5)
    assert table["constrained_state"].tolist() == ["masked", "kept", "kept"]
    assert table["removed_by"].tolist() == ["constrained", "", ""]


def test_top_k_storage_says_which_values_it_did_not_keep(tmp_path):
    natural = np.log(PROBS)
    constrained = natural.copy()
    constrained[0, 0] = -np.inf
    run = hand_made_run(natural, [1, 1, 5], TOKENS, constrained=constrained, eos_token_id=5, storage="topk", top_k=2)
    run.to_parquet(tmp_path / "topk.parquet")
    reader = RunReader(tmp_path / "topk.parquet")
    shown = views.step_table(reader.step(reader.track(0, 0), 0), reader.vocab, k=3)
    by_token = shown.set_index("token")
    assert by_token.loc["a", "constrained_state"] == "not stored"  # 5 allowed, 2 kept: "a" is unknown, not masked
    assert by_token.loc[" b", "natural_state"] == "kept"
    assert by_token.loc["c", "natural_state"] == "kept"  # natural value known through the constrained list
    np.testing.assert_allclose(by_token.loc["c", "natural_prob"], 0.12, rtol=1e-5)


def test_step_summary_matches_a_float64_reference(reader):
    track = reader.track(0, 0)
    for position in range(track.length):
        row = reader.step(track, position)
        summary = views.step_summary(row, reader.vocab)
        natural = np.log(PROBS[position].astype(np.float64))
        constrained = natural.copy()
        if position == 0:
            constrained[0] = -np.inf
        p_nat = np.exp(natural - np.log(np.exp(natural).sum()))
        p_con = np.exp(constrained - np.log(np.exp(constrained).sum()))
        chosen = int(track.chosen[position])
        assert summary.chosen_token == TOKENS[chosen]
        assert summary.allowed == int(np.isfinite(constrained).sum())
        assert math.isclose(summary.removed_mass, p_nat[~np.isfinite(constrained)].sum(), rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(summary.entropy["natural"], -(p_nat * np.log(p_nat)).sum(), rel_tol=1e-5)
        kept = p_con[p_con > 0]
        assert math.isclose(summary.entropy["constrained"], -(kept * np.log(kept)).sum(), rel_tol=1e-5)
        assert math.isclose(summary.p_chosen["natural"], p_nat[chosen], rel_tol=1e-5)
        assert math.isclose(summary.p_chosen["constrained"], p_con[chosen], rel_tol=1e-5)


def test_window_view_gives_stats_alternatives_and_a_heat_matrix(reader):
    track = reader.track(0, 0)
    view = views.window_view(reader.window(track, 0, 3), 0, 0, alternatives=2, heat_tokens=3)
    assert view.tokens == [" b", " b", "<eos>"]
    assert view.stats["position"].tolist() == [0, 1, 2]
    first = view.alternatives[view.alternatives["position"] == 0]
    assert first["token"].tolist() == ["a", " b"] and first["constrained_prob"].tolist()[0] == 0
    heat = view.heat["natural"]
    assert list(heat.columns) == [0, 1, 2] and "␣b" in heat.index and "<eos>" in heat.index
    assert heat.loc["<eos>", 2] == pytest.approx(0.7, rel=1e-5)
    assert view.heat_chosen == ["␣b", "␣b", "<eos>"]


def test_divergence_and_alignment():
    assert views.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert views.first_divergence([1, 2, 3], [1, 4, 3]) == 1
    assert views.first_divergence([1, 2], [1, 2, 3]) == 2
    assert views.first_divergence([1, -1, 3], [1, 5, 3]) is None  # an unknown token (-1) is not known to differ
    a = pd.DataFrame({"position": [0, 1, 2], "chosen_id": [1, 2, 3], "chosen_token": ["x", "y", "z"]})
    b = pd.DataFrame({"position": [0, 1], "chosen_id": [1, 5], "chosen_token": ["x", "w"]})
    lined = views.aligned(a, b)
    assert lined["same"].tolist() == [True, False, False]
    assert lined["chosen_token_b"].tolist()[:2] == ["x", "w"]


def test_step_bars_draw_each_stage_mark_the_masked_token_and_the_chosen_one(table):
    fig = charts.step_bars(table, ["natural", "constrained"], title="step 0")
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["model (natural)", "after the constraint"]
    assert list(fig.layout.xaxis.ticktext) == ["a", "<b>▶ ␣b</b>", "c"] and list(bars[0].x) == [0, 1, 2]
    np.testing.assert_allclose(bars[0].y, [0.5, 0.2, 0.12], rtol=1e-5)
    assert math.isnan(bars[1].y[0])  # no bar where the constraint masked "a" ...
    masked = [t for t in fig.data if t.type == "scatter"]
    assert len(masked) == 1 and list(masked[0].text) == ["masked"]  # ... but a marker in its slot
    assert masked[0].name == "masked by the constraint"
    assert masked[0].x[0] == pytest.approx(bars[1].offset + bars[1].width / 2)  # token 0, the constraint's slot
    assert masked[0].y[0] == pytest.approx(0.5, rel=1e-5)  # at the height the model gave it
    assert [a.text for a in fig.layout.annotations] == ["chosen"] and fig.layout.annotations[0].x == 1
    assert fig.layout.yaxis.type is None and fig.layout.yaxis.title.text == "probability"


@pytest.mark.parametrize("steady", [False, True])
@pytest.mark.parametrize("value, log_y", [("prob", False), ("prob", True), ("logit", False)])
def test_step_bars_pass_plotly_s_own_validation(table, value, log_y, steady):
    """The figure is built without plotly's checks (it is drawn at every click): plotly accepts it in full."""
    fig = charts.step_bars(table, ["natural", "constrained"], value=value, log_y=log_y, title="step 0", steady=steady)
    checked = go.Figure(fig.to_dict())  # raises on any property plotly does not know or any value it refuses
    assert json.loads(checked.to_json()) == json.loads(fig.to_json())  # and draws the same


@pytest.mark.parametrize("value, log_y", [("prob", False), ("prob", True), ("logit", False)])
def test_the_step_bars_drawn_while_playing_differ_only_in_their_margins(table, value, log_y):
    """Play's figure: the same bars, marks, labels, hover, colours and title; only the margins it starts with
    (those automargin gives the usual labels) differ, and automargin still widens them for longer labels."""
    paused, playing = (
        json.loads(charts.step_bars(table, ["natural", "constrained"], value=value, log_y=log_y, steady=s).to_json())
        for s in (False, True)
    )
    assert playing["data"] == paused["data"]
    margins = playing["layout"].pop("margin"), paused["layout"].pop("margin")
    assert playing["layout"] == paused["layout"]
    assert margins[0] == {**margins[1], **charts.STEADY_MARGINS} != margins[1]
    assert all(playing["layout"][axis].get("automargin") is not False for axis in ("xaxis", "yaxis"))


def test_tokens_the_sampler_cut_are_marked_apart_from_those_the_constraint_masked():
    table = pd.DataFrame(
        {
            "token_id": [0, 1],
            "token": ["x", "y"],
            "label": ["x", "y"],
            "chosen": [True, False],
            "natural_logit": [0.0, -1.0],
            "natural_prob": [0.7, 0.3],
            "natural_state": ["kept", "kept"],
            "sampled_logit": [0.0, -np.inf],
            "sampled_prob": [1.0, 0.0],
            "sampled_state": ["kept", "masked"],
            "removed_by": ["", "sampled"],
        }
    )
    fig = charts.step_bars(table, ["natural", "sampled"])
    cut = fig.data[-1]
    assert cut.name == "cut by the sampler" and list(cut.text) == ["cut"] and cut.x[0] > 1.0


def test_step_bars_on_a_log_scale_and_as_logits(table):
    log = charts.step_bars(table, ["natural", "constrained"], log_y=True)
    assert log.layout.yaxis.type == "log"
    assert log.layout.annotations[0].y == pytest.approx(math.log10(0.4), rel=1e-5)
    logits = charts.step_bars(table, ["natural", "constrained"], value="logit")
    np.testing.assert_allclose(logits.data[0].y, np.log([0.5, 0.2, 0.12]), rtol=1e-5)
    assert logits.layout.yaxis.title.text == "logit"
    with pytest.raises(ValueError, match="value must be 'prob' or 'logit', got 'odds'"):
        charts.step_bars(table, ["natural"], value="odds")


def test_timelines_have_one_panel_per_statistic_and_mark_the_current_step(reader):
    track = reader.track(0, 0)
    stats = reader.window(track, 0, 3).stats(generation=0, sequence=0)
    fig = charts.timelines(stats, ["natural", "constrained"], current=1)
    names = {(t.name, t.yaxis) for t in fig.data}
    assert ("model (natural)", "y") in names and ("after the constraint", "y") in names
    removed = next(t for t in fig.data if t.yaxis == "y3")
    np.testing.assert_allclose(removed.y, [0.5, 0.0, 0.0], atol=1e-6)
    eos = [t for t in fig.data if t.yaxis == "y5"]
    assert len(eos) == 2 and eos[0].y[2] == pytest.approx(0.7, rel=1e-5)
    assert [a.text for a in fig.layout.annotations][:5] == [
        "entropy (nats)",
        "chosen token's probability",
        "mass removed by the constraint",
        "margin: best token − best allowed (nats)",
        "end-of-sequence probability",
    ]
    assert any(s.type == "line" and s.x0 == 1 for s in fig.layout.shapes)


def test_timelines_say_when_the_storage_cannot_tell(reader):
    stats = pd.DataFrame(
        {
            "position": [0, 1],
            "chosen_token": ["a", "b"],
            "entropy_natural": [np.nan, np.nan],
            "p_chosen_natural": [0.5, 0.4],
            "removed_mass": [np.nan, np.nan],
        }
    )
    fig = charts.timelines(stats, ["natural", "constrained"])  # a constrained run: it has the constraint's panels
    notes = [a.text for a in fig.layout.annotations]
    assert notes.count("not known in this run's storage") == 2 and notes.count("not recorded") == 2


def test_heatmap_shows_the_matrix_and_circles_the_chosen_tokens():
    heat = pd.DataFrame([[0.5, 0.1], [0.2, 0.6]], index=["a", "␣b"], columns=[0, 1])
    fig = charts.token_heatmap(heat, ["a", None])
    assert fig.data[0].type == "heatmap" and fig.data[0].z.tolist() == [[0.5, 0.1], [0.2, 0.6]]
    assert list(fig.data[1].x) == [0] and list(fig.data[1].y) == ["a"]
    with pytest.raises(ValueError, match="one label per step"):
        charts.token_heatmap(heat, ["a"])


def test_compare_timelines_draw_both_runs_and_the_divergence():
    a = pd.DataFrame(
        {
            "position": [0, 1, 2],
            "chosen_token": ["x", "y", "z"],
            "p_chosen_natural": [0.9, 0.8, 0.7],
            "entropy_natural": [1.0, 1.1, 1.2],
        }
    )
    b = a.assign(p_chosen_natural=[0.9, 0.1, 0.2])
    fig = charts.compare_timelines(a, b, labels=("greedy", "hot"), divergence=1)
    assert [t.name for t in fig.data] == ["greedy", "greedy", "hot", "hot"]
    assert list(fig.data[2].y) == [0.9, 0.1, 0.2]
    assert any(ann.text == "diverge at step 1" for ann in fig.layout.annotations)


def test_token_text_colours_each_token_and_puts_alternatives_on_hover(reader):
    track = reader.track(0, 0)
    view = views.window_view(reader.window(track, 0, 3), 0, 0, alternatives=2)
    hovers = text.token_hovers(view, ["natural", "constrained"])
    assert hovers[0].startswith("step 0: chose ␣b") and "(masked)" in hovers[0] and "removed 50.0%" in hovers[0]
    html = text.token_text_html(
        view.tokens, view.stats["p_chosen_natural"].to_numpy(), "p_chosen_natural", hovers=hovers, prompt="<a>"
    )
    assert html.count('class="tok"') == 3 and "&lt;a&gt;" in html and "&lt;eos&gt;" in html
    assert "rgba(228,87,86,0.680)" in html  # p = 0.2: strong colour
    assert 'title="step 0: chose' in html
    with pytest.raises(ValueError, match="same length"):
        text.token_text_html(["a"], [0.1, 0.2], "p_chosen_natural")


@pytest.mark.parametrize(
    "column, value, expected",
    [
        ("p_chosen_natural", 0.9, 0.1),
        ("rank_chosen_natural", 0, 0.0),
        ("rank_chosen_natural", 100, 1.0),
        ("removed_mass", 0.25, 0.25),
        ("p_chosen_natural", float("nan"), 0.0),
    ],
)
def test_colour_intensity(column, value, expected):
    assert text.intensity(column, value) == pytest.approx(expected)


def test_text_so_far_keeps_the_tail_of_long_texts():
    html = text.text_so_far_html("P", ["x"] * 5000, "y", tail_chars=100)
    assert "… " in html and html.count("x") < 200 and "y</span>" in html


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "topk"])
def test_a_step_shows_what_the_tracker_says_in_every_storage_mode(storage, tmp_path):
    """The replay page's table and summary agree with the tracker's stats(), a +inf row included (a one-hot)."""
    import torch

    from processors import LogitsProcessor
    from tracker import LogitTrackingProcessor

    class MaskThird(LogitsProcessor):
        def process(self, logits, ctx):
            out = logits.clone()
            out[:, ::3] = float("-inf")
            return out

    x = torch.randn(2, 60, generator=torch.Generator().manual_seed(3))
    x[1, 4] = x[1, 9] = float("inf")  # a one-hot on 4 and 9; the constraint masks 9
    tracker = LogitTrackingProcessor(MaskThird(), storage=storage, top_k=5)
    tracker(torch.tensor([[1]]), x[:1].clone())
    tracker(torch.tensor([[1, 4]]), x[1:].clone())
    tracker.finish(torch.tensor([[1, 4, 4]]))
    tracker.to_parquet(tmp_path / "run.parquet")
    stats = tracker.stats()
    reader = RunReader(tmp_path / "run.parquet")
    track = reader.track(0, 0, include_finished=True)
    for position in range(2):
        row = reader.step(track, position)
        summary = views.step_summary(row, reader.vocab)
        for stage in ("natural", "constrained"):
            assert summary.entropy[stage] == pytest.approx(stats[f"entropy_{stage}"][position], rel=1e-5)
            assert summary.p_chosen[stage] == pytest.approx(stats[f"p_chosen_{stage}"][position], rel=1e-5)
        assert summary.removed_mass == pytest.approx(stats["removed_mass"][position], rel=1e-5, abs=1e-7)
    table = views.step_table(reader.step(track, 1), reader.vocab, k=3).set_index("token_id")
    assert table.loc[4, "natural_prob"] == table.loc[9, "natural_prob"] == 0.5
    assert table.loc[4, "constrained_prob"] == 1.0 and table.loc[9, "constrained_state"] == "masked"
    assert summary.removed_mass == pytest.approx(0.5)


def test_timelines_name_each_stage_even_when_one_name_begins_another():
    """``after:logit_bias`` and ``after:logit_bias_2`` each get their own line, colour and legend entry."""
    stages = ["natural", "after:logit_bias", "after:logit_bias_2", "constrained"]
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"position": np.arange(4), "chosen_token": list("abcd")})
    for stage in stages:
        for metric in ("entropy", "p_chosen", "p_eos"):
            frame[f"{metric}_{stage}"] = rng.random(4)
    frame["removed_mass"] = rng.random(4)
    frame["margin"] = rng.random(4)
    fig = charts.timelines(frame, stages, names=charts.stage_names(stages, {"after:penalties": "constrained"}))
    entropy = [t for t in fig.data if t.yaxis in (None, "y")]
    assert [t.name for t in entropy] == ["model (natural)", "after:logit_bias", "after:logit_bias_2", "after:penalties"]
    assert len({t.line.color for t in entropy}) == 4


def test_a_constraint_that_renormalises_does_not_crowd_the_models_favourites_out(tmp_path):
    """The model wants three words; a constraint allows only ten digits, which renormalise to ~0.1 each.

    By probability at any stage, the digits (0.1 each) would outrank every word but the first: the
    replay's table and chart must still show what the model wanted, next to what the constraint left.
    """
    rng = np.random.default_rng()
    vocab = 40
    tokens = [f"w{i}" for i in range(20)] + [str(d) for d in range(10)] + [f"x{i}" for i in range(10)]
    natural = rng.normal(size=(1, vocab)).astype(np.float32) - 6.0
    natural[0, :3] = [6.0, 2.5, 2.0]  # about 0.95, 0.03, 0.02
    natural[0, 20:30] -= 4.0  # the digits: unlikely to the model
    constrained = np.full_like(natural, -np.inf)
    constrained[0, 20:30] = natural[0, 20:30]
    chosen = [20 + int(np.argmax(natural[0, 20:30]))]
    run = hand_made_run(natural, chosen, tokens, constrained=constrained)
    run.to_parquet(tmp_path / "run.parquet")
    reader = RunReader(tmp_path / "run.parquet")
    table = views.step_table(reader.step(reader.track(0, 0), 0), reader.vocab, k=10)
    shown = table["token"].tolist()
    assert {"w0", "w1", "w2"} <= set(shown)  # the model's first three, masked by the constraint
    by_constrained = np.argsort(-constrained[0, 20:30])[:5] + 20
    assert {tokens[i] for i in by_constrained} <= set(shown)  # and the constraint's own first five
    assert len(shown) == 10 and tokens[chosen[0]] in shown
    assert table.set_index("token").loc[["w0", "w1", "w2"], "constrained_state"].tolist() == ["masked"] * 3
