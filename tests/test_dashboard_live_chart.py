"""The live chart's folder: its page and plotly.js from the installed plotly package, built once, whole or not at all."""

from __future__ import annotations

import re

import pytest

from dashboard import live_chart


def test_the_folder_holds_the_page_and_plotly_js_and_is_built_once(tmp_path):
    folder = live_chart.component_folder(tmp_path)
    assert (folder / "index.html").read_bytes() == live_chart.PAGE.read_bytes()
    assert (folder / "plotly.min.js").read_bytes() == live_chart.PLOTLY_JS.read_bytes()
    stamp = (folder / "plotly.min.js").stat().st_mtime_ns
    assert live_chart.component_folder(tmp_path) == folder
    assert (folder / "plotly.min.js").stat().st_mtime_ns == stamp  # found, not copied again
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # nothing half-built left beside it


def test_a_folder_missing_a_file_is_built_again(tmp_path):
    folder = live_chart.component_folder(tmp_path)
    (folder / "plotly.min.js").unlink()
    again = live_chart.component_folder(tmp_path)
    assert again == folder and (again / "plotly.min.js").stat().st_size == live_chart.PLOTLY_JS.stat().st_size


def test_a_cache_that_is_a_file_is_an_os_error(tmp_path):
    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(OSError):
        live_chart.component_folder(tmp_path / "cache")


def test_the_page_loads_scripts_from_its_own_folder_only():
    """The product makes no outside request: the page's one script comes from beside it."""
    page = live_chart.PAGE.read_text()
    assert re.findall(r'<script src="([^"]+)"', page) == ["plotly.min.js"]
    assert not re.search(r"https?://", page)
