"""The dashboard shows run text as text, stays in its folder, and answers bad folders and files with messages."""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import streamlit as st
from dashboard_support import chart_specs
from streamlit.testing.v1 import AppTest

from dashboard import data
from dashboard.discover import find_runs
from dashboard.paths import APP, ENV_ANY_PATH, ENV_PATH, inside
from dashboard.synthetic import hand_made_run
from dashboard.text import md_shown, md_text, numbers_html
from tracker.format.schema import META_RUN

IMAGE = "http://127.0.0.1:9/leak.png"
#: Token texts and run fields that are Markdown (or HTML) if shown as such.
TOKENS = ["a", "**b**", f"![t]({IMAGE})", "```", f"<img src={IMAGE}>", "<eos>"]
TITLE = f"**bold** ![title]({IMAGE}) :red[red] $x^2$"
PROMPT_TEXT = f"```\n![prompt]({IMAGE})"


def _hostile_run(folder: Path, name: str = "hostile.parquet") -> Path:
    chosen = np.array([[1, 2, 3, 4, 5]])
    natural = np.full((1, 5, len(TOKENS)), -2.0, dtype=np.float32)
    np.put_along_axis(natural, chosen[..., None], 1.0, axis=-1)
    run = hand_made_run(natural, chosen, TOKENS, eos_token_id=5, title=TITLE, prompt=(3, 2))
    meta = replace(
        run.metadata,
        model=f"[model]({IMAGE})",
        processors=f"```\n![processors]({IMAGE})\n```",
        sampling={"temperature": f"![sampling]({IMAGE})"},
        run_id=f"![id]({IMAGE})",
    )
    type(run)(run.to_arrow().to_batches(), meta, run.vocab).to_parquet(folder / name)
    return folder / name


def _app(page: str | None = None, root: Path | None = None) -> AppTest:
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    if root is not None:
        at.session_state["root"] = str(root)
    if page is not None:
        at.switch_page(f"app_pages/{page}.py")
    return at.run()


def _ok(at: AppTest) -> None:
    assert not at.exception, at.exception[0].message if at.exception else ""


def _markdown_texts(at: AppTest) -> list[str]:
    """Every element value Streamlit renders as Markdown, with the labels of radios and metrics."""
    kinds = ("title", "header", "subheader", "markdown", "caption", "error", "warning", "info", "success")
    texts = [e.value for kind in kinds for e in at.get(kind)]
    texts += [str(m.value) for m in at.metric] + [m.label for m in at.metric]
    texts += [str(o) for r in at.radio for o in r.options]
    return texts


def _unescaped(text: str) -> list[str]:
    """Markdown constructs that would render: an image or link, emphasis, a code fence, a directive."""
    bare = re.sub(r"\\.", "", text)  # what backslash escapes neutralise
    return [p for p in (r"!\[", r"\]\(", r"\*\*b", "```", r":red\[", r"\$x") if re.search(p, bare)]


@pytest.mark.parametrize("page", ["runs", "overview", "replay", "compare"])
def test_run_text_is_never_rendered_as_markdown(tmp_path, page):
    _hostile_run(tmp_path)
    at = _app(page, tmp_path)
    _ok(at)
    rendered = _markdown_texts(at)
    bad = {t: _unescaped(t) for t in rendered if _unescaped(t)}
    assert not bad, bad
    assert any("bold" in t for t in rendered)  # the title is shown, as text
    if page == "runs":
        codes = [c.value for c in at.code]
        assert "```\n![prompt]" not in codes  # not the prompt text, which is the tokens' own
        assert any(IMAGE in c for c in codes)  # prompt and processors shown verbatim in text elements


def test_charts_show_token_text_as_text(tmp_path):
    _hostile_run(tmp_path)
    at = _app("replay", tmp_path)
    _ok(at)
    figure = json.dumps(chart_specs(at)[0])
    assert "<img" not in figure and "&lt;img" in figure


def test_md_text_escapes_every_markdown_construct():
    for text in (
        TITLE,
        PROMPT_TEXT,
        "<b>x</b>",
        "# heading",
        "- item",
        "1. item",
        "|a|b|",
        "~~gone~~",
        ":material/home:",
    ):
        shown = md_text(text)
        # the text itself, with a word joiner (U+2060) where a bare URL would have become a link
        assert re.sub(r"\\(.)", r"\1", shown).replace("\u2060", "") == text.replace("\n", " ")


def test_numbers_drawn_as_html_show_run_text_as_the_metrics_do():
    """While playing, Step replay draws its numbers as one block of HTML from the Markdown it gives the metrics:
    each shows as that Markdown does, as text, whatever a token holds."""
    for text in (TITLE, PROMPT_TEXT, "<b>x</b>", "a\\b", "**bold** & <img src=x>", "50%"):
        assert md_shown(md_text(text)).replace("\u2060", "") == text.replace("\n", " ")  # U+2060: see md_text
    block = numbers_html([(md_text("<token>"), md_text("<img src=x> **b**"), 'help "<i>"')], [4])
    assert "<img" not in block and "&lt;img src=x&gt; **b**" in block and "&lt;token&gt;" in block
    assert 'title="help &quot;&lt;i&gt;&quot;"' in block
    with pytest.raises(ValueError, match="numbers and widths"):
        numbers_html([("a", "b", None)], [1, 2])


def test_the_path_box_stays_inside_the_served_folder(tmp_path, monkeypatch):
    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir()
    outside.mkdir()
    _hostile_run(served, "mine.parquet")
    _hostile_run(outside, "secret.parquet")
    monkeypatch.setenv(ENV_PATH, str(served))
    monkeypatch.delenv(ENV_ANY_PATH, raising=False)
    at = _app()
    _ok(at)
    for attempt in (str(outside), "../outside", str(served / ".." / "outside")):
        at = at.text_input(key="root_input").set_value(attempt).run()
        _ok(at)
        assert any("outside the folder this dashboard serves" in re.sub(r"\\(.)", r"\1", e.value) for e in at.error)
        assert at.session_state["root"] == str(served)
        assert at.dataframe[0].value["file"].tolist() == ["mine.parquet"]
    (served / "sub").mkdir()
    _hostile_run(served / "sub", "inner.parquet")
    at = at.text_input(key="root_input").set_value("sub").run()
    _ok(at)
    assert at.dataframe[0].value["file"].tolist() == ["inner.parquet"]


def test_the_path_box_compares_places_not_text(tmp_path):
    """Inside or not is decided on parsed, normalised places: a sibling whose name begins like the served
    folder's, ``..`` written out or percent-encoded, a symlink out, another bucket, scheme or set of options
    are all outside; the place kept is the normalised one."""
    served, outside = tmp_path / "served", tmp_path / "outside"
    (served / "sub").mkdir(parents=True)
    outside.mkdir()
    (tmp_path / "servedX").mkdir()
    (served / "out").symlink_to(outside)
    url = served.as_uri()
    for attempt in (
        f"{url}/../outside", (tmp_path / "servedX").as_uri(), f"{url}X", str(tmp_path / "servedX"), "../outside",
        f"{url}/out", str(served / "out"), "out", f"{url}/%2e%2e/outside", "s3://b/served/sub",
    ):  # fmt: skip
        for root in (url, str(served)):
            assert inside(attempt, root) is None, (attempt, root)
    for attempt in (f"{url}/sub", str(served / "sub"), "sub", f"{url}/sub/../sub/.", f"{url}/sub/"):
        assert inside(attempt, url) == str(served / "sub") == inside(attempt, str(served))
    for attempt in (
        "s3://b/runs-private", "s3://b/run", "s3://b/runs/../secret", "s3://b/runs/%2E%2E/secret",
        "s3://b/runs/x/../../secret", "s3://other/runs/x", "gs://b/runs/x", "s3://b/runs/x?endpoint_override=h:1",
        "s3://b/runs/x#f", "file:///b/runs/x", str(tmp_path), "/runs/x",
    ):  # fmt: skip
        assert inside(attempt, "s3://b/runs") is None, attempt
    for attempt, where in (
        ("s3://b/runs", "s3://b/runs"), ("s3://b/runs/", "s3://b/runs"), ("S3://b/runs/a/./b/", "s3://b/runs/a/b"),
        ("s3://b/runs//a", "s3://b/runs/a"), ("s3://b/runs/a/../c", "s3://b/runs/c"), ("a b", "s3://b/runs/a%20b"),
    ):  # fmt: skip
        assert inside(attempt, "s3://b/runs/") == where, attempt
    assert inside("s3://b/runs/x?region=eu", "s3://b/runs?region=eu") == "s3://b/runs/x?region=eu"


def test_the_path_box_of_a_served_url_stays_inside_it(tmp_path, monkeypatch):
    served, outside = tmp_path / "served", tmp_path / "servedX"  # datasets: what a URL serves
    natural = np.zeros((2, 4), np.float32)
    mine = hand_made_run(natural, [0, 1], list("abcd"), title="mine").to_dataset(served).parent.name
    hand_made_run(natural, [0, 1], list("abcd"), title="secret").to_dataset(outside)
    monkeypatch.setenv(ENV_PATH, served.as_uri())
    monkeypatch.delenv(ENV_ANY_PATH, raising=False)
    at = _app()
    _ok(at)
    for attempt in (f"{served.as_uri()}/../servedX", outside.as_uri(), f"{served.as_uri()}X", str(outside)):
        at = at.text_input(key="root_input").set_value(attempt).run()
        _ok(at)
        assert any("is outside what this dashboard serves" in re.sub(r"\\(.)", r"\1", e.value) for e in at.error)
        assert at.session_state["root"] == served.as_uri()
        assert [Path(f).name for f in at.dataframe[0].value["file"]] == [mine]


def test_the_path_box_may_leave_the_folder_when_the_server_allows_it(tmp_path, monkeypatch):
    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir()
    outside.mkdir()
    _hostile_run(outside, "elsewhere.parquet")
    monkeypatch.setenv(ENV_PATH, str(served))
    monkeypatch.setenv(ENV_ANY_PATH, "1")
    at = _app()
    at = at.text_input(key="root_input").set_value(str(outside)).run()
    _ok(at)
    assert at.dataframe[0].value["file"].tolist() == ["elsewhere.parquet"]


def test_symlinks_out_of_the_folder_are_not_followed(tmp_path):
    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir()
    (outside / "deep").mkdir(parents=True)
    _hostile_run(served, "mine.parquet")
    secret = _hostile_run(outside, "secret.parquet")
    _hostile_run(outside / "deep", "deeper.parquet")
    (served / "link.parquet").symlink_to(secret)
    (served / "linked-folder").symlink_to(outside / "deep")
    (served / "inner.parquet").symlink_to(served / "mine.parquet")  # a link that stays inside is fine
    assert [p.name for p in find_runs(served)] == ["inner.parquet", "mine.parquet"]
    at = _app(root=served)
    _ok(at)
    assert sorted(at.dataframe[0].value["file"].tolist()) == ["inner.parquet", "mine.parquet"]


def _unreadable_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0)
    try:
        os.listdir(folder)
    except PermissionError:
        return folder
    for candidate in (Path("/proc/1/map_files"),):  # root reads any mode; this one it may not list
        try:
            os.listdir(candidate)
        except PermissionError:
            return candidate
        except OSError:
            pass
    pytest.skip("no folder here refuses to be listed (running as root without a restricted /proc)")


def test_an_unreadable_folder_gives_a_message_not_a_traceback(tmp_path):
    folder = _unreadable_folder(tmp_path)
    try:
        at = _app(root=folder)
        _ok(at)
        assert any("permission denied" in e.value for e in at.sidebar.error)
    finally:
        (tmp_path / "locked").chmod(0o755)


@pytest.mark.parametrize("page", ["runs", "replay", "overview"])
def test_metadata_that_disagrees_with_the_columns_gives_a_message(tmp_path, page):
    good = _hostile_run(tmp_path, "good.parquet")
    table = pq.read_table(good)
    meta = dict(table.schema.metadata)
    described = json.loads(meta[META_RUN])
    described["vocab_size"] = 10**9
    meta[META_RUN] = json.dumps(described).encode()
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "wide.parquet")
    good.unlink()
    at = _app(page, tmp_path)
    _ok(at)
    errors = " ".join(re.sub(r"\\(.)", r"\1", e.value) for e in at.error)
    assert "wide.parquet" in errors and "natural_logits" in errors


def test_the_run_list_refreshes_beside_a_dangling_link(tmp_path):
    _hostile_run(tmp_path, "first.parquet")
    (tmp_path / "gone.parquet").symlink_to(tmp_path / "nowhere.parquet")
    at = _app(root=tmp_path)
    _ok(at)
    assert at.dataframe[0].value["file"].tolist() == ["first.parquet"]
    before = data.stamp(tmp_path)
    _hostile_run(tmp_path, "second.parquet")
    assert data.stamp(tmp_path) != before
    at.run()
    _ok(at)
    assert at.dataframe[0].value["file"].tolist() == ["first.parquet", "second.parquet"]


#: A vocabulary entry a megabyte long (a file may hold one): drawn whole, Step replay stalled the browser.
HUGE = "x" * (1 << 20)


def _huge_run(folder: Path) -> Path:
    """Four steps over six tokens; the megabyte token leads and is chosen at steps 0 and 2."""
    chosen = np.array([[1, 2, 1, 5]])
    natural = np.full((1, 4, 6), -3.0, dtype=np.float32)
    np.put_along_axis(natural, chosen[..., None], 1.0, axis=-1)
    natural[..., 1] = np.maximum(natural[..., 1], 0.5)
    tokens = ["a", HUGE, "c", "d", "e", "<eos>"]
    return hand_made_run(natural, chosen, tokens, eos_token_id=5, title="Huge").to_parquet(folder / "huge.parquet")


def _sent(node) -> int:
    """Bytes of what the page sends the browser: every element's message, the tables and figures included."""
    proto = getattr(node, "proto", None)
    own = len(proto.SerializeToString()) if proto is not None else 0
    return own + sum(_sent(child) for child in getattr(node, "children", {}).values())


@pytest.mark.parametrize("page", [None, "overview", "replay", "compare"])
def test_a_megabyte_token_draws_a_hundred_characters_on_every_page(tmp_path, page):
    from tracker.reading.display import TOKEN_CHARS

    path = _huge_run(tmp_path)
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["root"] = str(tmp_path)
    at.session_state["run"] = at.session_state["run_b"] = str(path)
    if page is not None:
        at.switch_page(f"app_pages/{page}.py")
    at = at.run()
    _ok(at)
    assert _sent(at._tree) < 200_000, f"the page sends {_sent(at._tree):,} bytes"
    clipped = f"{'x' * TOKEN_CHARS}…(+{len(HUGE) - TOKEN_CHARS:,} characters)"
    if page == "replay":
        shown = [json.dumps(json.loads(spec), ensure_ascii=False) for spec in chart_specs(at)]
        assert any(clipped in spec for spec in shown), "the chart's label is not the clipped token"
    if page == "overview":
        assert any(html.escape(clipped) in h.proto.body for h in at.get("html")), "the text shows no clipped token"
