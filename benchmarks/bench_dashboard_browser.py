"""The dashboard in headless Chromium: what a person waits for, from the click until the page settles.

    python benchmarks/bench_dashboard_browser.py                        # sample runs + a 10,000 x 128k run
    python benchmarks/bench_dashboard_browser.py --steps 1000 --keep /tmp/runs
    python benchmarks/bench_dashboard_browser.py --replay-run sample_runs/json_record.parquet

Starts the real app (``dashboard.serve.start``, as ``logitscope dashboard``
does) on a free 127.0.0.1 port and drives Debian's Chromium through
selenium (the binaries by path: nothing is downloaded). It reports:

- *first page*: a new browser session on the shipped sample runs, from the
  navigation until the page settles (Streamlit's status widget gone, the
  main element present, no change to the page for :data:`QUIET_S`); once on
  a server nobody visited yet, then as further new sessions (reloads);
- *Step replay* on a large run (by default 10,000 steps x 131,072 tokens,
  Arrow IPC, written by :func:`dashboard.synthetic.write_large_run` to a
  temporary folder removed at the end, or to ``--keep``): Next, Back and a
  slider move to a far step, each from the click until the page shows that
  step and settles; and Play's steps per second over ``--play-seconds``,
  with what each step shown cost the browser: its main thread's script,
  layout and style seconds (DevTools' ``Performance.getMetrics``)
  and the CPU seconds of its renderer processes, which other jobs on the
  machine do not inflate as they do wall time.

For each click it also reports the *server time* (from the browser sending
the rerun to receiving Streamlit's "script finished", read from Chromium's
log of the WebSocket frames), whether only the step's fragment ran, and the
bytes the server sent. Figures are medians. The baseline, in the same
browser and hour, is a one-button Streamlit script served with the same
options (:data:`HELLO`): its first page and a click, what any Streamlit app
costs here; each figure is also given as a ratio to it. Goals (issue 32): a
step under 200 ms of server time, Play at 5 steps a second, the first page
under 3 s.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dashboard.paths import default_runs_path  # noqa: E402
from dashboard.serve import _wait_until_up, start  # noqa: E402
from dashboard.synthetic import write_large_run  # noqa: E402

#: A page has settled when it has not changed for this long (seconds).
QUIET_S = 0.75
#: Each change to the page stamps ``window.__changed`` (ms since navigation) before any page script runs.
WATCH = """
window.__changed = performance.now();
new MutationObserver(() => { window.__changed = performance.now(); })
  .observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
"""
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--window-size=1400,1300",
)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chromium(profile: Path, *flags: str, watch: bool = False):
    """Headless Chromium from the system's packages (:data:`CHROMIUM_FLAGS` and ``flags``), its network log
    on (requests and WebSocket frames); with ``watch``, every page stamps its changes (:data:`WATCH`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        raise SystemExit("headless Chromium is not installed: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", *flags):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium's manager must not fetch anything
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    if watch:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": WATCH})
    return driver


@dataclass
class Timing:
    """Seconds until the page showed the result and until it settled; what went over the WebSocket."""

    shown_s: float
    settled_s: float
    exchanges: list[Exchange] = field(default_factory=list)


@dataclass
class Exchange:
    """What went over the WebSocket for one action: server seconds, whether only a fragment ran, bytes."""

    server_s: float
    fragment_only: bool
    bytes_received: int


def _frames(driver) -> list[tuple[str, float, bytes]]:
    """The WebSocket frames since the log was last read: (sent/received, monotonic seconds, payload)."""
    frames = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        method = message["method"]
        if method in ("Network.webSocketFrameSent", "Network.webSocketFrameReceived"):
            response = message["params"]["response"]
            payload = response["payloadData"]
            data = base64.b64decode(payload) if response.get("opcode") == 2 else payload.encode()
            frames.append(("sent" if method.endswith("Sent") else "received", message["params"]["timestamp"], data))
    return frames


def exchanges(driver) -> list[Exchange]:
    """Each rerun the browser asked for since the log was last read, until its script finished."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    done: list[Exchange] = []
    asked: tuple[float, bool] | None = None
    received = 0
    for way, stamp, data in _frames(driver):
        if way == "sent":
            back = BackMsg.FromString(data)
            if back.WhichOneof("type") == "rerun_script" and asked is None:
                asked, received = (stamp, bool(back.rerun_script.fragment_id)), 0
            continue
        received += len(data)
        forward = ForwardMsg.FromString(data)
        if forward.WhichOneof("type") == "script_finished" and asked is not None:
            done.append(Exchange(stamp - asked[0], asked[1], received))
            asked = None
    return done


def settle(driver, since_ms: float, shown, timeout: float = 60.0) -> tuple[float, float]:
    """Seconds from ``since_ms`` (the page's clock) until the page showed what ``shown(driver)`` checks with
    Streamlit's status widget gone (the last change before a poll, every 50 ms, first saw it), and until its
    last change, once nothing changed for :data:`QUIET_S` (a font that arrives late, a table that sizes its
    columns after drawing)."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    first = None
    while time.monotonic() < deadline:
        try:
            ready = shown(driver) and not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        except Exception:  # an element replaced while reading it: not settled yet
            ready = False
        if ready:
            now, changed = driver.execute_script("return [performance.now(), window.__changed]")
            first = changed if first is None else first  # the change that showed it (the poll comes later)
            if now - changed >= QUIET_S * 1e3:
                return (first - since_ms) / 1e3, (changed - since_ms) / 1e3
        else:
            first = None
        time.sleep(0.05)
    raise TimeoutError(f"the page did not settle within {timeout:.0f} s")


def _main_shown(driver) -> bool:
    return bool(driver.execute_script("const m = document.querySelector('main'); return m && m.innerText.trim();"))


def first_pages(url: str, profile: Path, repeats: int) -> list[Timing]:
    """The first page: the very first session of the server, then ``repeats`` new sessions (page loads)."""
    driver = chromium(profile, watch=True)
    try:
        times = []
        for _ in range(repeats + 1):
            driver.get("about:blank")
            driver.get(url)  # a new page load is a new Streamlit session
            times.append(Timing(*settle(driver, 0.0, _main_shown)))
        return times
    finally:
        driver.quit()


#: The page's documents: its own and those of its frames from the same server (a chart drawn by a component).
DOCUMENTS = (
    "const documents = [document, ...[...document.querySelectorAll('iframe')]"
    "  .map(f => { try { return f.contentDocument; } catch (e) { return null; } }).filter(d => d)];"
)


def shown_step(driver) -> int | None:
    """The step the replay shows (its chart's title, in the page or in a frame), None while none is drawn."""
    return driver.execute_script(
        DOCUMENTS + "for (const d of documents) for (const t of d.querySelectorAll('.js-plotly-plot .gtitle'))"
        "  if (t.textContent.startsWith('Step ')) return parseInt(t.textContent.slice(5));"
        "return null;"
    )


def _click(driver, label: str) -> float:
    """Click the button whose text holds ``label``; the page's clock at the click (ms)."""
    return float(
        driver.execute_script(
            "const b = [...document.querySelectorAll('button')].find(b => b.innerText.includes(arguments[0]));"
            "const t = performance.now(); b.click(); return t;",
            label,
        )
    )


def _slide(driver, key: str) -> float:
    """Press ``key`` on the step slider (the page's last); the page's clock at the key press (ms)."""
    from selenium.webdriver.common.action_chains import ActionChains

    since = float(
        driver.execute_script(
            "const s = document.querySelectorAll('[data-testid=\"stSlider\"] input[type=range]');"
            "s[s.length - 1].focus(); return performance.now();"
        )
    )
    ActionChains(driver).send_keys(key).perform()
    return since


def slider_step(driver) -> int:
    """The step the step slider shows."""
    return int(
        driver.execute_script(
            "const s = document.querySelectorAll('[data-testid=\"stSlider\"] input[type=range]');"
            "return s[s.length - 1].value;"
        )
    )


def replay(url: str, profile: Path, repeats: int, play_seconds: float) -> tuple[dict[str, list[Timing]], tuple]:
    """Next (each to a step not shown yet), Back (to steps shown before), slider moves to the last step (a
    block not read yet) and back to the first; then Play: (steps shown a second, exchanges of its ticks)."""
    from selenium.webdriver.common.keys import Keys

    driver = chromium(profile, watch=True)
    results: dict[str, list[Timing]] = {}
    try:
        driver.get(url)
        results["replay page (new session)"] = [Timing(*settle(driver, 0.0, lambda d: shown_step(d) == 0))]
        _frames(driver)  # the page load's frames are not a click's

        def act(name: str, do, expect: int) -> None:
            since = do()
            shown, settled = settle(driver, since, lambda d: shown_step(d) == expect == slider_step(d))
            results.setdefault(name, []).append(Timing(shown, settled, exchanges(driver)))

        for step in range(1, repeats + 1):
            act("Next (a new step)", lambda: _click(driver, "Next"), step)
        for step in range(repeats - 1, -1, -1):
            act("Back (a step shown before)", lambda: _click(driver, "Back"), step)
        last = int(
            driver.execute_script(
                "const s = document.querySelectorAll('[data-testid=\"stSlider\"] input[type=range]');"
                "return s[s.length - 1].max;"
            )
        )
        for _ in range(max(1, repeats // 2)):
            act("slider to the last step", lambda: _slide(driver, Keys.END), last)
            act("slider to the first step", lambda: _slide(driver, Keys.HOME), 0)
        _click(driver, "Play")
        time.sleep(1.0)  # the timer's first ticks
        _frames(driver)
        driver.execute_cdp_cmd("Performance.enable", {})
        before, cpu_before = main_thread(driver), renderer_cpu(driver)
        first, start = shown_step(driver), time.monotonic()
        time.sleep(play_seconds)
        moved, elapsed = (shown_step(driver) or 0) - (first or 0), time.monotonic() - start
        after, cpu_after = main_thread(driver), renderer_cpu(driver)
        ticks = exchanges(driver)
        _click(driver, "Pause")
        per_step = {name: (after[name] - before[name]) / max(moved, 1) for name in after}
        per_step["renderer CPU"] = (cpu_after - cpu_before) / max(moved, 1)
        return results, (moved / elapsed, len(ticks) / elapsed, ticks, per_step)
    finally:
        driver.quit()


#: What Chromium's DevTools protocol (``Performance.getMetrics``) counts of the page's main thread, in seconds.
MAIN_THREAD = ("ScriptDuration", "LayoutDuration", "RecalcStyleDuration")


def main_thread(driver) -> dict[str, float]:
    """Seconds the page's main thread has spent so far running scripts, laying out and restyling."""
    metrics = driver.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]
    return {m["name"]: float(m["value"]) for m in metrics if m["name"] in MAIN_THREAD}


def renderer_cpu(driver) -> float:
    """CPU seconds (user and system, all threads) Chromium's renderer processes under this driver have used:
    unlike wall time, it does not grow when other jobs hold the cores (Linux ``/proc``; 0 elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        try:
            children.setdefault(int(_stat(entry)[1]), []).append(int(entry.name))
        except (OSError, ValueError):
            continue
    total, todo = 0.0, [driver.service.process.pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if b"--type=renderer" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                fields = _stat(Path("/proc") / str(pid))
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return total


def _stat(process: Path) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state first, parent's pid second)."""
    return (process / "stat").read_text().rsplit(")", 1)[1].split()


def _ratio(name: str, values: list[Timing], floor: list[Timing]) -> None:
    """How many times the baseline's time until shown ``values`` took (medians)."""
    ratio = statistics.median(v.shown_s for v in values) / statistics.median(v.shown_s for v in floor)
    print(f"    {name}: {ratio:.2f}x")


def _report(name: str, values: list[Timing]) -> None:
    shown = statistics.median(v.shown_s for v in values)
    settled = statistics.median(v.settled_s for v in values)
    line = f"  {name:<30} shown {shown * 1e3:6.0f} ms, settled {settled * 1e3:6.0f} ms"
    runs = [e for v in values for e in v.exchanges]
    if runs:
        server = statistics.median(e.server_s for e in runs)
        sent = statistics.median(e.bytes_received for e in runs)
        scope = "fragment only" if all(e.fragment_only for e in runs) else "whole page"
        line += f"; server {server * 1e3:5.0f} ms ({scope}), {sent / 1024:.0f} KiB sent"
    print(f"{line} (median of {len(values)})")


#: The baseline: a one-button Streamlit script, what any Streamlit app costs in the same browser and hour.
HELLO = """
import streamlit as st
if "n" not in st.session_state:
    st.session_state.n = 0
if st.button("Next"):
    st.session_state.n += 1
st.write(f"Step {st.session_state.n}")
"""


def baseline(folder: Path, repeats: int) -> dict[str, list[Timing]]:
    """The first page and a button click of :data:`HELLO`, served as the dashboard is (same options)."""
    import subprocess

    from dashboard.serve import FAST_OPTIONS, QUIET_OPTIONS

    script = folder / "hello.py"
    script.write_text(HELLO)
    port = free_port()
    command = [sys.executable, "-m", "streamlit", "run", str(script), "--server.address", "127.0.0.1"]
    command += ["--server.port", str(port), "--server.headless", "true"]
    for option, value in {**QUIET_OPTIONS, **FAST_OPTIONS}.items():
        command += [f"--{option}", value]
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver = None
    try:
        if not _wait_until_up(child, port):
            raise SystemExit("the baseline's Streamlit server did not start")
        driver = chromium(folder / "profile-baseline", watch=True)

        def says(n: int):
            return lambda d: f"Step {n}" in (d.execute_script("return document.querySelector('main')?.innerText") or "")

        results: dict[str, list[Timing]] = {}
        for _ in range(repeats + 1):
            driver.get("about:blank")
            driver.get(f"http://127.0.0.1:{port}")
            results.setdefault("first page", []).append(Timing(*settle(driver, 0.0, says(0))))
        _frames(driver)
        for n in range(1, repeats + 1):
            since = _click(driver, "Next")
            results.setdefault("a click", []).append(Timing(*settle(driver, since, says(n)), exchanges(driver)))
        return results
    finally:
        if driver is not None:
            driver.quit()
        child.terminate()
        child.wait(timeout=20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--vocab", type=int, default=131_072)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--play-seconds", type=float, default=5.0)
    parser.add_argument("--keep", default=None, help="folder to write the large run to and keep (default: temporary)")
    parser.add_argument("--replay-run", default=None, help="replay this run file instead of writing a large one")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-dashboard-browser-"))
    folder = Path(args.keep) if args.keep else work / "runs"
    try:
        print(f"baseline: a one-button Streamlit script; load {os.getloadavg()[0]:.1f}", flush=True)
        floor = baseline(work, args.repeats)
        _report("first page (new sessions)", floor["first page"][1:])
        _report("a button click (whole script)", floor["a click"])
        port = free_port()
        samples = default_runs_path()
        print(f"first page of a new session on {samples}; load {os.getloadavg()[0]:.1f}", flush=True)
        with start(samples, port) as server:
            if not _wait_until_up(server.child, port):
                raise SystemExit("the dashboard server did not start")
            pages = first_pages(server.url, work / "profile-first", args.repeats)
        _report("the server's first session", pages[:1])
        _report("a new session (server warm)", pages[1:])
        _ratio("a new session / the baseline's", pages[1:], floor["first page"][1:])
        if args.replay_run:
            run = Path(args.replay_run)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            run = folder / f"large-{args.steps}x{args.vocab}.arrow"
            if not run.exists():
                need = 2 * 4 * args.steps * args.vocab
                if need > shutil.disk_usage(folder).free:
                    raise SystemExit(f"the run needs {need / 2**30:.1f} GiB; pass --keep FOLDER or fewer --steps")
                write_large_run(run, args.steps, args.vocab)
        print(f"\nStep replay of {run.name} ({run.stat().st_size / 2**30:.2f} GiB); load {os.getloadavg()[0]:.1f}")
        port = free_port()
        with start(run.parent, port) as server:
            if not _wait_until_up(server.child, port):
                raise SystemExit("the dashboard server did not start")
            found, (rate, ticks_rate, ticks, per_step) = replay(
                f"{server.url}/replay?run={run.name}", work / "profile-replay", args.repeats, args.play_seconds
            )
        for name, values in found.items():
            _report(name, values)
            if name != "replay page (new session)":
                _ratio(f"{name.split(' (')[0]} / the baseline's click", values, floor["a click"])
        server_s = statistics.median(t.server_s for t in ticks) if ticks else float("nan")
        print(
            f"  Play                           {rate:.2f} steps shown a second ({ticks_rate:.2f} ticks a second "
            f"finished; server {server_s * 1e3:.0f} ms a tick, median of {len(ticks)})"
        )
        print(
            "    the browser a step shown: main thread "
            + ", ".join(
                f"{name.removesuffix('Duration').lower()} {per_step[name] * 1e3:.0f} ms" for name in MAIN_THREAD
            )
            + f"; renderer processes' CPU {per_step['renderer CPU'] * 1e3:.0f} ms; load {os.getloadavg()[0]:.1f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
