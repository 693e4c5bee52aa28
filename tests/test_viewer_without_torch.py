"""Reading runs needs pyarrow and numpy, not the generation stack: the dashboard and Run.load work in a
process that can import only what the README's viewer install gives (torch, transformers, llguidance and
every other distribution outside it refused by an import hook)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from packaging.requirements import Requirement

from dashboard.synthetic import hand_made_run
from tracker import Run

REPO = Path(__file__).resolve().parent.parent
STACK = ("torch", "transformers", "llguidance")

#: Refuses the top-level modules named in ``REFUSED`` (and their submodules), as an environment without them would.
REFUSE = """
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
"""

VIEWER = """
import json, sys
from pathlib import Path

import dashboard.reader
from streamlit.testing.v1 import AppTest
from dashboard.paths import APP
from tracker import Run

root, out = Path(sys.argv[1]), Path(sys.argv[2])
results = {}
for path in sorted(root.glob("*.parquet")):
    run = Run.load(path)
    results[path.name] = run.get_top_tokens(k=3)
    run.to_dataframe().to_parquet(out / f"{path.stem}.frame.parquet")
shown = {}
for page in (None, "overview", "replay", "compare"):
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.session_state["root"] = str(root)
    if page == "compare":  # a second run to compare with (the sample runs hold one sequence each)
        at.session_state["run_b"] = str(root / "hot.parquet")
    if page is not None:
        at.switch_page(f"app_pages/{page}.py")
    at.run()
    if at.exception:
        raise SystemExit(f"page {page}: {at.exception[0].message}")
    live = [c for c in at.get("component_instance") if c.proto.component_name.endswith(".live_chart")]  # replay's
    shown[page or "runs"] = {"errors": [e.value for e in at.error], "charts": len(at.get("plotly_chart")) + len(live),
                              "titles": [t.value for t in at.title] + [s.value for s in at.subheader]}
results["pages"] = shown
import contextlib, io
from logitscope.cli import main
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    codes = [main(["inspect", str(root)]), main(["inspect", str(root / "topk.parquet"), "--steps", "all", "--json"])]
results["inspect"] = {"codes": codes, "printed": printed.getvalue()}
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    code = main(["query", str(root), "SELECT count(*) AS n FROM steps", "--csv"])
results["query"] = {"code": code, "printed": printed.getvalue()}
results["loaded"] = sorted({m.split(".")[0] for m in sys.modules} & set(STACK))
(out / "results.json").write_text(json.dumps(results))
"""


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _viewer_requirements() -> list[str]:
    """The packages the README's viewer install line names (``pip install "numpy>=1.26" ...``)."""
    line = next(line for line in (REPO / "README.md").read_text().splitlines() if "pip install --no-deps -e ." in line)
    return re.findall(r'"([^"]+)"', line)


def _with_dependencies(names: list[str]) -> set[str]:
    """``names`` and every distribution they require, as installed here (extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if _key(name) in seen:
            continue
        seen.add(_key(name))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


def _outside_the_viewer_install() -> set[str]:
    """Top-level modules installed here that no distribution of the viewer install (or logitscope) provides."""
    allowed = _with_dependencies([Requirement(r).name for r in _viewer_requirements()]) | {"logitscope"}
    provided = metadata.packages_distributions()
    return {module for module, dists in provided.items() if not {_key(d) for d in dists} & allowed} | set(STACK)


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)


def test_importing_the_run_reader_loads_no_generation_stack():
    done = _python(
        "import json, sys, dashboard.reader, tracker.format.layout, tracker.format.schema; print(json.dumps(sorted(sys.modules)))"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not loaded & set(STACK), f"importing dashboard.reader loaded {sorted(loaded & set(STACK))}"


def test_the_readme_viewer_install_asks_for_the_projects_bounds():
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    by_name = {_key(Requirement(r).name): r for r in declared}
    wanted = _viewer_requirements()
    assert {"numpy", "pyarrow", "streamlit"} <= {_key(Requirement(r).name) for r in wanted}
    assert not {_key(Requirement(r).name) for r in wanted} & set(STACK)
    assert [by_name.get(_key(Requirement(r).name)) for r in wanted] == wanted


def test_the_dashboard_and_run_load_work_with_only_the_viewer_install(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    for name in ("greedy.parquet", "hot.parquet"):  # recorded by the demo model, float16
        shutil.copy(REPO / "sample_runs" / name, root / name)
    rng = np.random.default_rng(3)
    natural = rng.normal(size=(1, 1, 5, 12)).astype(np.float32)
    constrained = np.where(rng.random(natural.shape) < 0.4, -np.inf, natural).astype(np.float32)
    chosen = np.argmax(constrained, axis=-1)
    tokens = [f"t{i}" for i in range(12)]
    hand_made_run(natural, chosen, tokens, constrained=constrained, storage="topk", top_k=4, title="top-k").to_parquet(
        root / "topk.parquet"
    )
    out = tmp_path / "out"
    out.mkdir()
    prelude = f"REFUSED = {sorted(_outside_the_viewer_install())!r}\nSTACK = {STACK!r}\n"
    done = _python(prelude + REFUSE + VIEWER, str(root), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results.pop("loaded") == []
    pages = results.pop("pages")
    for page, shown in pages.items():
        assert shown["errors"] == [], (page, shown["errors"])
    assert "Overview · Greedy" in " ".join(pages["overview"]["titles"]).replace("\\", "")
    inspect = results.pop("inspect")
    assert (
        inspect["codes"] == [0, 0]
        and "greedy.parquet: " in inspect["printed"]
        and '"step_details"' in inspect["printed"]
    )
    assert pages["overview"]["charts"] >= 2 and pages["replay"]["charts"] >= 1 and pages["compare"]["charts"] >= 1
    steps = sum(Run.load(path).num_rows for path in root.glob("*.parquet"))
    assert results.pop("query") == {"code": 0, "printed": f"n\n{steps}\n"}
    for path in sorted(root.glob("*.parquet")):
        run = Run.load(path)  # here, with torch: the reference
        assert results[path.name] == json.loads(json.dumps(run.get_top_tokens(k=3))), path.name
        pd.testing.assert_frame_equal(pd.read_parquet(out / f"{path.stem}.frame.parquet"), run.to_dataframe())


@pytest.mark.parametrize(
    "argv", [["run", "--prompt", "hi"], ["demo"], ["rescore", "r.parquet", "--model", "demo", "--out", "b.parquet"]]
)
def test_recording_without_torch_says_so_in_one_line(argv):
    code = (
        f"REFUSED = {list(STACK)!r}\n" + REFUSE + f"from logitscope.cli import main\nraise SystemExit(main({argv!r}))\n"
    )
    done = _python(code)
    assert done.returncode == 2
    assert done.stderr.startswith(f"logitscope {argv[0]}: error: recording needs torch, which is not installed")
    assert done.stderr.count("\n") == 1 and "--device" not in done.stderr, done.stderr  # an option never given
