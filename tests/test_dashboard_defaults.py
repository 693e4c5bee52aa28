"""What a newcomer sees first: the headline sample run, and no empty constraint panels for a run without one."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import streamlit as st
from streamlit.testing.v1 import AppTest

from dashboard import charts
from dashboard.paths import APP, HEADLINE_RUN, default_runs_path
from dashboard.synthetic import hand_made_run

TOKENS = ["a", " b", "c\n", "d", "<eos>"]


def _app(root, page: str | None = None, **query) -> AppTest:
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["root"] = str(root)
    for key, value in query.items():
        at.query_params[key] = value
    if page is not None:
        at.switch_page(f"app_pages/{page}.py")
    return at.run()


def _panel_titles(at: AppTest) -> list[str]:
    figure = json.loads(at.get("plotly_chart")[0].proto.spec)
    return [a["text"] for a in figure["layout"]["annotations"]]


def test_the_sample_runs_open_on_the_headline_example_unless_a_link_names_another():
    root = default_runs_path()
    at = _app(root)
    assert not at.exception
    assert at.sidebar.selectbox(key="run").value == str(root / HEADLINE_RUN)
    assert re.sub(r"\\(.)", r"\1", at.subheader[0].value) == "JSON record (schema)"  # run text is Markdown-escaped
    linked = _app(root, run="greedy.parquet")
    assert linked.sidebar.selectbox(key="run").value == str(root / "greedy.parquet")


def test_a_folder_without_the_headline_run_opens_on_its_first_run(tmp_path):
    for name in ("hot.parquet", "greedy.parquet"):
        shutil.copy(default_runs_path() / name, tmp_path / name)
    at = _app(tmp_path)
    assert at.sidebar.selectbox(key="run").value == str(tmp_path / "greedy.parquet")


def test_an_unconstrained_run_has_no_removed_mass_or_margin_panels(tmp_path):
    rng = np.random.default_rng(0)
    chosen = np.array([1, 2, 3, 4])
    natural = rng.normal(size=(4, len(TOKENS))).astype(np.float32)
    hand_made_run(natural, chosen, TOKENS, eos_token_id=4, title="Free").to_parquet(tmp_path / "free.parquet")
    constrained = natural.copy()
    constrained[:, 0] = -np.inf
    hand_made_run(natural, chosen, TOKENS, constrained=constrained, eos_token_id=4, title="Held").to_parquet(
        tmp_path / "held.parquet"
    )

    free = _app(tmp_path, "overview")
    assert not free.exception
    titles = _panel_titles(free)
    assert "entropy (nats)" in titles and not any("removed" in t or "margin" in t for t in titles), titles
    assert not any("removed" in option for option in free.radio(key="overview_metric").options)

    held = free.sidebar.selectbox(key="run").set_value(str(tmp_path / "held.parquet")).run()
    titles = _panel_titles(held)
    assert "mass removed by the constraint" in titles and any(t.startswith("margin") for t in titles)


def test_token_labels_on_axes_use_a_larger_monospace_face():
    heat = charts.token_heatmap(
        __import__("pandas").DataFrame([[0.5, 0.2], [0.1, 0.7]], index=["␣b", "c↵"], columns=[0, 1]), ["␣b", "c↵"]
    )
    font = heat.layout.yaxis.tickfont
    assert "monospace" in font.family and font.size >= 14
