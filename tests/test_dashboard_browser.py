"""The real app (``streamlit run``) in headless Chromium: every page renders its charts, with no error.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them
when missing) and the ``selenium`` client; skipped with the reason otherwise.
No tool here downloads a browser: the binaries are given by path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from dashboard import data
from dashboard.serve import streamlit_command, streamlit_env
from dashboard.synthetic import hand_made_run
from dashboard.text import plot_text

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="the selenium client is not installed (pip install -e '.[dev]')"
)
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "headless Chromium is not installed: apt-get install chromium chromium-driver (.ci/run does it)",
        allow_module_level=True,
    )

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_dashboard_browser import DOCUMENTS, chromium, free_port  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

TOKENS = ["a", " b", "c", "d", "e", "<eos>"]
BARE_LINKS = "https://example.invalid/page www.example.invalid someone@example.invalid"


@pytest.fixture(scope="module")
def beacon():
    """A local HTTP server that records every request: a page that shows run text as text fetches nothing from it."""
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    httpd.shutdown()
    httpd.server_close()


@contextmanager
def _serving(folder: Path, **env: str):
    """The app (``streamlit run``, as ``logitscope dashboard`` starts it) on the runs in ``folder``, with ``env``
    added to its environment: its address, once it answers."""
    port = free_port()
    log = open(folder / "server.log", "wb")
    process = subprocess.Popen(
        streamlit_command(port), env={**streamlit_env(folder), **env}, stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/_stcore/health", timeout=1)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"streamlit did not start: {(folder / 'server.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()


def _alpha(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """Alpha: two sequences of four steps over six tokens; the constraint masks token "a" at every step. Its
    natural logits and chosen tokens."""
    chosen = np.array([[1, 2, 3, 5], [1, 2, 4, 5]])
    natural = np.full((2, 4, 6), -3.0, dtype=np.float32)
    np.put_along_axis(natural, chosen[..., None], 1.0, axis=-1)
    natural[..., 0] = 0.3
    constrained = natural.copy()
    constrained[..., 0] = -np.inf
    run = hand_made_run(natural, chosen, TOKENS, constrained=constrained, eos_token_id=5, title="Alpha")
    run.to_parquet(folder / "alpha.parquet")
    return natural, chosen


@pytest.fixture(scope="module")
def server(tmp_path_factory, beacon):
    folder = tmp_path_factory.mktemp("runs")
    natural, chosen = _alpha(folder)
    (folder / "broken.parquet").write_bytes(b"PAR1 and then nothing")
    url = beacon[0]
    hostile = hand_made_run(
        natural[:1], chosen[:1], TOKENS, eos_token_id=5, title=f"Hostile ![pixel]({url}/title.png) **loud**"
    )
    meta = replace(hostile.metadata, model=f"![model]({url}/model.png)", processors=f"```\n![p]({url}/processors.png)")
    type(hostile)(hostile.to_arrow().to_batches(), meta, hostile.vocab).to_parquet(folder / "hostile.parquet")
    links = hand_made_run(natural[:1], chosen[:1], TOKENS, eos_token_id=5, title=f"Links {BARE_LINKS}")
    meta = replace(links.metadata, model="https://example.invalid/model")
    type(links)(links.to_arrow().to_batches(), meta, links.vocab).to_parquet(folder / "links.parquet")
    with _serving(folder) as base:
        yield base


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    # the benchmark's Chromium: the system's binaries by path, a 1,400 x 1,300 window, the network log on
    driver = chromium(tmp_path_factory.mktemp("chromium-profile"), "--hide-scrollbars")
    yield driver
    driver.quit()


def _load(browser, url: str, charts: int) -> None:
    """Open ``url`` and wait until ``charts`` plotly figures have drawn and the script has finished."""
    browser.get(url)

    def ready(driver) -> bool:
        drawn = _count(driver, ".js-plotly-plot .main-svg")
        running = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        return drawn >= 2 * charts and not running  # each figure has two svg layers

    WebDriverWait(browser, 60, poll_frequency=0.25).until(ready)


def _count(browser, selector: str) -> int:
    """How many elements match ``selector`` in the page and in its frames (Step replay's chart is in one)."""
    return browser.execute_script(
        DOCUMENTS + "return documents.reduce((n, d) => n + d.querySelectorAll(arguments[0]).length, 0);", selector
    )


def _errors(browser) -> list[str]:
    shown = browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
    return [e.text for e in shown] + [t for t in [browser.find_element(By.TAG_NAME, "body").text] if "Traceback" in t]


@pytest.mark.parametrize(
    "page, charts, marks",
    [
        ("overview", 2, ".scatterlayer .trace"),
        ("replay", 1, ".barlayer .point"),
        ("compare", 1, ".scatterlayer .trace"),
    ],
)
def test_each_page_renders_its_charts_in_chromium(server, browser, tmp_path, page, charts, marks):
    _load(browser, f"{server}/{page}?run=alpha.parquet", charts)
    assert not _errors(browser)
    assert _count(browser, marks) >= 2, f"the {page} figures drew no marks"
    shot = tmp_path / f"{page}.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    assert "Alpha" in browser.find_element(By.TAG_NAME, "main").text


def test_a_bad_file_shows_its_message_in_the_browser(server, browser, tmp_path):
    browser.get(f"{server}/replay?run=broken.parquet")
    WebDriverWait(browser, 60, poll_frequency=0.25).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, '[data-testid="stAlertContentError"]')
    )
    message = browser.find_element(By.CSS_SELECTOR, '[data-testid="stAlertContentError"]').text
    assert "broken.parquet cannot be shown" in message and "truncated" in message
    assert not _errors(browser)
    browser.save_screenshot(str(tmp_path / "bad-file.png"))


def test_play_moves_the_step_slider_by_itself(server, browser):
    _load(browser, f"{server}/replay?run=alpha.parquet", 1)

    def step() -> int:
        values = [e.text for e in browser.find_elements(By.CSS_SELECTOR, '[data-testid="stSliderThumbValue"]')]
        return int(values[-1])  # the step slider comes after "Tokens shown"

    assert step() == 0
    next(b for b in browser.find_elements(By.TAG_NAME, "button") if "Play" in b.text).click()
    WebDriverWait(
        browser, 20, poll_frequency=0.2, ignored_exceptions=(ValueError, IndexError, StaleElementReferenceException)
    ).until(lambda d: step() >= 2)
    assert not _errors(browser)


def _replay_shows(browser) -> tuple[int | None, int, str]:
    """The step in the chart's title, the step slider's value and the chosen token's number on the page."""
    return browser.execute_script(
        DOCUMENTS + "const title = documents.flatMap(d => [...d.querySelectorAll('.js-plotly-plot .gtitle')])"
        "  .map(t => t.textContent).find(t => t.startsWith('Step '));"
        "const sliders = document.querySelectorAll('[data-testid=\"stSlider\"] input[type=range]');"
        "const chosen = document.querySelector('[data-testid=\"stMetricValue\"]');"
        "return [title ? parseInt(title.slice(5)) : null, parseInt(sliders[sliders.length - 1].value),"
        "  chosen ? chosen.innerText : ''];"
    )


def test_next_and_back_move_the_step_its_tokens_and_the_slider(server, browser):
    """Back and Next redraw the step's part of the page: the chart, the chosen token and the slider follow."""
    _load(browser, f"{server}/replay?run=alpha.parquet", 1)
    assert _replay_shows(browser) == [0, 0, "␣b"]  # step 0 chose " b"
    for button, expected in (("Next", [1, 1, "c"]), ("Next", [2, 2, "d"]), ("Back", [1, 1, "c"])):
        next(b for b in browser.find_elements(By.TAG_NAME, "button") if button in b.text).click()
        WebDriverWait(browser, 20, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda d, expected=expected: (
                _replay_shows(d) == expected and not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
            )
        )
    assert "step=1" in browser.current_url  # the address links to the step shown
    assert not _errors(browser)


@pytest.mark.parametrize("page", ["", "replay"])
def test_a_markdown_image_in_a_run_title_is_shown_as_text_and_fetches_nothing(server, browser, beacon, page):
    url, requests = beacon
    browser.get(f"{server}/{page}?run=hostile.parquet")
    WebDriverWait(browser, 60, poll_frequency=0.25).until(
        lambda d: (
            "Hostile" in d.find_element(By.TAG_NAME, "main").text
            and not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        )
    )
    time.sleep(1.0)  # give any image the page might load time to be requested
    main = browser.find_element(By.TAG_NAME, "main")
    assert f"![pixel]({url}/title.png) **loud**" in main.text.replace("\u2060", "")
    assert not main.find_elements(By.CSS_SELECTOR, f'img[src^="{url}"]')
    assert not main.find_elements(By.TAG_NAME, "strong") or all(
        "loud" not in e.text for e in main.find_elements(By.TAG_NAME, "strong")
    )
    assert not _errors(browser)
    assert requests == [], f"the page fetched {requests} from the run's text"


def _requests(browser) -> list[str]:
    """The URLs the page requested since the log was last read (Chromium's performance log: DevTools' network events)."""
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated"):
            params = message["params"]
            urls.append(params["request"]["url"] if "request" in params else params["url"])
    return urls


@pytest.mark.parametrize("page", ["", "overview", "replay", "compare"])
def test_no_page_makes_a_request_outside_127_0_0_1(server, browser, page):
    """A local debugging tool fetches nothing from the internet: no icon font, favicon, telemetry or image."""
    browser.get_log("performance")  # what earlier tests loaded is not this page's
    browser.get("about:blank")
    browser.get(f"{server}/{page}?run=alpha.parquet&compare=hostile.parquet")
    WebDriverWait(browser, 60, poll_frequency=0.25).until(
        lambda d: (
            "Alpha" in d.find_element(By.TAG_NAME, "main").text
            and not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        )
    )
    time.sleep(2.0)  # fonts, icons and images are requested after the first paint
    urls = _requests(browser)
    assert any(url.startswith(server) for url in urls), "the network log recorded nothing: it is not being read"
    outside = [
        url
        for url in urls
        # data: and blob: stay in the page; chrome: is the browser's own new-tab page, before ours
        if urllib.parse.urlsplit(url).scheme not in ("data", "blob", "about", "chrome")
        and urllib.parse.urlsplit(url).hostname != "127.0.0.1"
    ]
    assert outside == [], f"the {page or 'Runs'} page asked for {outside}"
    assert not _errors(browser)


@pytest.mark.parametrize("page", ["", "replay"])
def test_bare_urls_in_a_title_and_metadata_are_plain_text_not_links(server, browser, page):
    browser.get(f"{server}/{page}?run=links.parquet")
    wanted = ("Links",) if page else ("Links", "example.invalid/model")  # the picked run's details come last
    WebDriverWait(browser, 60, poll_frequency=0.25).until(
        lambda d: (
            all(w in d.find_element(By.TAG_NAME, "main").text.replace("\u2060", "") for w in wanted)
            and not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        )
    )
    main = browser.find_element(By.TAG_NAME, "main")
    shown = main.text.replace("\u2060", "")  # the invisible word joiner that keeps Markdown from linking them
    assert BARE_LINKS in shown
    if not page:  # the Runs page shows the picked run's model too
        assert "https://example.invalid/model" in shown
    links = [a.get_attribute("href") for a in main.find_elements(By.TAG_NAME, "a")]
    assert not [href for href in links if href and "example.invalid" in href], links
    assert not _errors(browser)


def test_the_runs_table_shows_length_and_date_without_scrolling_at_1400_px(server, browser):
    """The browser window is 1,400 px wide: the Runs table fits it, its steps and date columns in view."""
    browser.get(f"{server}/?run=alpha.parquet")
    WebDriverWait(browser, 60, poll_frequency=0.25).until(
        lambda d: (
            d.find_elements(By.CSS_SELECTOR, '[data-testid="stDataFrame"] .dvn-scroller')
            and not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        )
    )
    time.sleep(1.0)  # the grid sizes its columns after the first paint
    scroller = browser.find_element(By.CSS_SELECTOR, '[data-testid="stDataFrame"] .dvn-scroller')
    scroll, client = (int(scroller.get_attribute(a)) for a in ("scrollWidth", "clientWidth"))
    assert browser.execute_script("return window.innerWidth") == 1400
    assert scroll <= client + 1, f"the table is {scroll} px wide in a {client} px frame: it scrolls sideways"
    # every column is in view, so its steps and date are (tests/test_dashboard_app.py checks the columns)


@pytest.mark.parametrize("page", ["overview", "replay"])
def test_no_metric_label_is_cut_in_a_laptop_window(server, browser, page):
    """A 1,100 px window, the sidebar open: each number's label is whole (the details are in its help)."""
    browser.set_window_size(1100, 1300)
    try:
        _load(browser, f"{server}/{page}?run=alpha.parquet", 1)
        time.sleep(0.5)
        labels = browser.find_elements(By.CSS_SELECTOR, '[data-testid="stMetricLabel"]')
        assert labels, "no metric on the page"
        cut = [
            label.text
            for label in labels
            for inner in [label, *label.find_elements(By.CSS_SELECTOR, "*")]
            if int(inner.get_attribute("scrollWidth")) > int(inner.get_attribute("clientWidth")) + 1
        ]
    finally:
        browser.set_window_size(1400, 1300)
    assert cut == [], f"labels cut short: {cut}"


#: Step replay's chart: the live chart's frame (Streamlit titles a component's frame with its name).
LIVE_FRAME = 'iframe[title$=".live_chart"]'


def _plotted(browser) -> dict:
    """What the plot in the live chart's frame holds: each trace's name and heights (None for no bar), the
    token labels, the y axis's type and title, the chart's title; and whether it is the plot :func:`_watch`
    marked (not one drawn anew since)."""
    browser.switch_to.frame(browser.find_element(By.CSS_SELECTOR, LIVE_FRAME))
    try:
        return browser.execute_script(
            "const gd = document.querySelector('.js-plotly-plot'); const L = gd._fullLayout;"
            "return {traces: gd._fullData.map(t => [t.name, Array.from(t.y, v => Number.isFinite(v) ? v : null)]),"
            "  ticks: Array.from(L.xaxis.ticktext), axis: L.yaxis.type, unit: L.yaxis.title.text,"
            "  title: L.title.text, marked: gd.__marked === true};"
        )
    finally:
        browser.switch_to.default_content()


def _watch(browser) -> None:
    """Mark the live chart's plot and record the title of every figure it draws from now on (``__drawn``),
    after the title it shows now (``__drawn[0]``)."""
    browser.switch_to.frame(browser.find_element(By.CSS_SELECTOR, LIVE_FRAME))
    try:
        browser.execute_script(
            "const gd = document.querySelector('.js-plotly-plot'); gd.__marked = true;"
            "window.__drawn = [gd._fullLayout.title.text];"
            "gd.on('plotly_afterplot', () => window.__drawn.push(gd._fullLayout.title.text));"
        )
    finally:
        browser.switch_to.default_content()


def _drawn_steps(browser) -> list[int]:
    """The steps the live chart drew since :func:`_watch`, each once, in order, without the step it showed when
    watched (drawn again when Streamlit sends the same render message again, or the frame is resized)."""
    browser.switch_to.frame(browser.find_element(By.CSS_SELECTOR, LIVE_FRAME))
    try:
        titles = browser.execute_script("return window.__drawn || [];")
    finally:
        browser.switch_to.default_content()
    steps = [int(t.removeprefix("<b>").removeprefix("Step ").split(":")[0]) for t in titles]
    steps = [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]
    return steps[1:]


def _expected(path: Path, step: int, value: str = "prob", log: bool = False) -> dict:
    """Step ``step`` of Alpha's first sequence as ``dashboard.data.step`` tables it: each stage's bar heights as
    the chart should draw them (no bar where the stage masked the token, nor below zero on a log scale), the
    token labels in the table's order (the chosen one marked)."""
    table, _ = data.step(str(path), 0, 0, step, 10)
    bars = {}
    for stage, name in (("natural", "model (natural)"), ("constrained", "after the constraint")):
        heights = table[f"{stage}_{value}"].to_numpy(dtype=float)
        hidden = (table[f"{stage}_state"] == "masked").to_numpy() | ~np.isfinite(heights) | (log & (heights <= 0))
        bars[name] = [None if h else float(v) for v, h in zip(heights, hidden)]
    labels = [plot_text(label) for label in table["label"]]  # as plotly shows text: "<eos>" escaped
    return {"bars": bars, "labels": labels, "chosen": [label for label, c in zip(labels, table["chosen"]) if c]}


def _assert_shows(shown: dict, expected: dict) -> None:
    traces = dict(shown["traces"])
    for name, heights in expected["bars"].items():
        drawn = [np.nan if v is None else v for v in traces[name]]  # None: no bar
        assert drawn == pytest.approx([np.nan if v is None else v for v in heights], rel=1e-6, nan_ok=True), name
    labels = [t.removeprefix("<b>▶ ").removesuffix("</b>") for t in shown["ticks"]]
    assert labels == expected["labels"]
    assert [t for t in shown["ticks"] if t.startswith("<b>▶ ")] == [f"<b>▶ {c}</b>" for c in expected["chosen"]]


def _wait_for(browser, check, timeout: float = 30):
    WebDriverWait(
        browser, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException, KeyError)
    ).until(lambda d: check(d) and not d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]'))


def _button(browser, label: str) -> None:
    next(b for b in browser.find_elements(By.TAG_NAME, "button") if label in b.text).click()


def test_the_live_chart_shows_each_steps_values_after_next_and_through_play(server, browser, tmp_path):
    """Step replay's plot stays in the page: Next and each step of Play update it in place with that step's
    values (read back from the plot), and Play draws every step, none skipped."""
    _alpha(tmp_path)
    path = tmp_path / "alpha.parquet"
    _load(browser, f"{server}/replay?run=alpha.parquet", 1)
    shown = _plotted(browser)
    assert shown["title"].endswith("Step 0: top 6 tokens by stage</b>") and shown["axis"] == "linear"
    _assert_shows(shown, _expected(path, 0))
    assert (
        shown["unit"] == "probability"
        and dict(shown["traces"])["after the constraint"][_expected(path, 0)["labels"].index("a")] is None
    )  # the constraint masked "a": no bar
    _watch(browser)
    _button(browser, "Next")
    _wait_for(browser, lambda d: "Step 1:" in _plotted(d)["title"])
    shown = _plotted(browser)
    assert shown["marked"], "Next drew a new plot instead of updating the one in the page"
    _assert_shows(shown, _expected(path, 1))
    drawn = _drawn_steps(browser)
    assert drawn == [1], f"Next from step 0 drew steps {drawn} (expected: 1, once)"
    _watch(browser)
    _button(browser, "Play")  # from step 1: steps 2 and 3, then it pauses at the last step
    _wait_for(
        browser,
        lambda d: (
            "Step 3:" in _plotted(d)["title"] and any("Play" in b.text for b in d.find_elements(By.TAG_NAME, "button"))
        ),
    )
    shown = _plotted(browser)
    assert shown["marked"], "Play drew a new plot instead of updating the one in the page"
    _assert_shows(shown, _expected(path, 3))
    drawn = _drawn_steps(browser)
    assert drawn == [2, 3], f"Play from step 1 drew steps {drawn} (expected: 2 then 3, each once, none skipped)"
    assert not _errors(browser)


def test_the_log_scale_and_logits_change_the_live_chart(server, browser, tmp_path):
    _alpha(tmp_path)
    path = tmp_path / "alpha.parquet"
    _load(browser, f"{server}/replay?run=alpha.parquet", 1)

    def choose(label: str) -> None:
        browser.execute_script(
            "[...document.querySelectorAll('[data-testid=\"stRadio\"] label')]"
            "  .find(l => l.innerText.trim() === arguments[0]).click();",
            label,
        )

    try:
        choose("log")
        _wait_for(browser, lambda d: _plotted(d)["axis"] == "log")
        shown = _plotted(browser)
        _assert_shows(shown, _expected(path, 0, log=True))
        assert shown["unit"] == "probability"
        choose("logit")
        _wait_for(browser, lambda d: _plotted(d)["unit"] == "logit")
        shown = _plotted(browser)
        assert shown["axis"] == "linear"  # logits are drawn on a linear axis: they are a log scale already
        _assert_shows(shown, _expected(path, 0, value="logit"))
        assert max(v for v in dict(shown["traces"])["model (natural)"] if v is not None) == pytest.approx(1.0)
    finally:
        choose("probability")
        choose("linear")
    assert not _errors(browser)


def test_the_chart_falls_back_to_st_plotly_chart_where_the_live_chart_cannot_be_served(browser, tmp_path):
    """logitscope's cache is a file, not a folder: the live chart's files cannot be written, and Step replay
    draws its chart with st.plotly_chart, in the page, with the same values."""
    runs = tmp_path / "runs"
    runs.mkdir()
    _alpha(runs)
    (tmp_path / "cache").write_text("not a folder")
    with _serving(runs, LOGITSCOPE_CACHE=str(tmp_path / "cache")) as base:
        _load(browser, f"{base}/replay?run=alpha.parquet", 1)
        assert not browser.find_elements(By.CSS_SELECTOR, LIVE_FRAME)
        shown = browser.execute_script(
            "const gd = document.querySelector('[data-testid=\"stPlotlyChart\"] .js-plotly-plot');"
            "return {traces: gd._fullData.map(t => [t.name, Array.from(t.y, v => Number.isFinite(v) ? v : null)]),"
            "  ticks: Array.from(gd._fullLayout.xaxis.ticktext), title: gd._fullLayout.title.text};"
        )
        assert "Step 0: top 6 tokens by stage" in shown["title"]
        _assert_shows(shown, _expected(runs / "alpha.parquet", 0))
        _button(browser, "Next")
        _wait_for(browser, lambda d: _replay_shows(d)[0] == 1)
        assert not _errors(browser)
    assert "the live chart cannot be served" in (runs / "server.log").read_text()


def test_the_live_chart_fills_the_column_and_follows_the_window(server, browser):
    """The plot is as wide as the column holding it, and narrows with the window."""
    _load(browser, f"{server}/replay?run=alpha.parquet", 1)

    def widths(driver) -> tuple[int, int, int]:
        """The main column's width inside its padding, the live chart's frame's and its plot's (px)."""
        column = driver.execute_script(
            "const c = document.querySelector('[data-testid=\"stMainBlockContainer\"]'), s = getComputedStyle(c);"
            "return c.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);"
        )
        frame = driver.find_element(By.CSS_SELECTOR, LIVE_FRAME)
        driver.switch_to.frame(frame)
        try:
            plot = driver.execute_script("return document.querySelector('.js-plotly-plot')._fullLayout.width;")
        finally:
            driver.switch_to.default_content()
        return column, int(frame.size["width"]), int(plot)

    def fills(driver) -> bool:
        column, frame, plot = widths(driver)
        return plot == frame and abs(frame - column) <= 1

    try:
        _wait_for(browser, fills)
        wide = widths(browser)
        browser.set_window_size(1100, 1300)
        _wait_for(browser, lambda d: fills(d) and widths(d)[2] < wide[2] - 200)
    finally:
        browser.set_window_size(1400, 1300)


def test_a_megabyte_token_neither_stalls_step_replay_nor_is_drawn_whole(browser, tmp_path):
    """A vocabulary entry a megabyte long, chosen and leading every step: Step replay draws, plays on and shows
    the token clipped to a hundred characters (drawn whole, it stalled the page past the script timeout)."""
    from tracker.reading.display import TOKEN_CHARS

    runs = tmp_path / "runs"
    runs.mkdir()
    chosen = np.array([[1, 2, 1, 5]])
    natural = np.full((1, 4, 6), -3.0, dtype=np.float32)
    np.put_along_axis(natural, chosen[..., None], 1.0, axis=-1)
    tokens = ["a", "x" * (1 << 20), "c", "d", "e", "<eos>"]
    hand_made_run(natural, chosen, tokens, eos_token_id=5, title="Huge").to_parquet(runs / "huge.parquet")
    with _serving(runs) as base:
        for page, charts in (("replay", 1), ("overview", 2)):
            _load(browser, f"{base}/{page}?run=huge.parquet", charts)
            assert not _errors(browser)
        _load(browser, f"{base}/replay?run=huge.parquet", 1)
        ticks = _plotted(browser)["ticks"]
        assert ticks[0] == f"<b>▶ {'x' * TOKEN_CHARS}…(+{(1 << 20) - TOKEN_CHARS:,} characters)</b>"
        _button(browser, "Next")
        _wait_for(browser, lambda d: "Step 1:" in _plotted(d)["title"])
        longest = browser.execute_script(DOCUMENTS + "return Math.max(...documents.map(d => d.body.innerText.length));")
        assert longest < 100_000, f"a page holds {longest:,} characters of text"
        assert not _errors(browser)
