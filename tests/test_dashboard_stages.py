"""The dashboard on a run with a stage per processor: removed mass per processor, stage picker, distances."""

from __future__ import annotations

import shutil

import pytest
import streamlit as st
from dashboard_support import chart_specs
from streamlit.testing.v1 import AppTest

from dashboard.paths import APP, default_runs_path

SAMPLE = "two_processors.parquet"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    source = default_runs_path() / SAMPLE
    if not source.is_file():
        pytest.skip(f"no sample run {source}")
    folder = tmp_path_factory.mktemp("runs")
    shutil.copy(source, folder / SAMPLE)
    return folder


def _page(root, page: str) -> AppTest:
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["root"] = str(root)
    at.switch_page(f"app_pages/{page}.py")
    at.run()
    assert not at.exception, at.exception[0].message if at.exception else ""
    return at


def _names(spec: str) -> list[str]:
    import json

    return [trace.get("name") for trace in json.loads(spec)["data"]]


def test_overview_draws_the_mass_each_processor_removed(root):
    at = _page(root, "overview")
    names = [_names(spec) for spec in chart_specs(at)]
    assert ["after:regex", "after:penalties"] in names


def test_replay_lets_the_user_pick_stages(root):
    at = _page(root, "replay")
    picker = at.multiselect(key="replay_stages")
    assert picker.value == ["natural", "after:regex", "constrained", "sampled"]
    picker.set_value(["natural", "after:regex"]).run()
    assert not at.exception
    bars = [n for n in _names(chart_specs(at)[0]) if n]
    assert any("after:regex" in n for n in bars) and not any("sampled" in n for n in bars)


def test_compare_shows_distances_from_tracker_compare(root):
    at = _page(root, "compare")
    at.sidebar.selectbox(key="run_b").set_value(str(root / SAMPLE)).run()  # one sequence: B is asked for
    distance = [spec for spec in chart_specs(at) if "Distance between A and B" in spec]
    assert distance, "no distance chart"
    assert "after:regex" in _names(distance[0])


def test_overview_reports_prompt_and_generation_perplexity(root):
    from tracker import Run

    run = Run.load(root / SAMPLE)
    expected = run.perplexity()
    at = _page(root, "overview")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Prompt perplexity"] == f"{expected['prompt_perplexity'][0]:.2f}"
    assert metrics["Perplexity"] == f"{expected['perplexity_natural'][0]:.2f}"
