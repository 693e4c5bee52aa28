"""The layout DESIGN.md promises: packages import one way, no module imports itself back, modules stay small.

Read from the source (every ``import`` statement, at module level or inside a
function), so a cycle hidden in a function body counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("processors", "sampling", "tracker", "dashboard", "logitscope")
#: What each package may import of ours (DESIGN.md's table; the command line sits on top of all).
MAY_IMPORT = {
    "processors": set(),
    "sampling": {"processors"},
    "tracker": {"processors"},
    "dashboard": {"tracker", "processors"},
    "logitscope": {"processors", "sampling", "tracker", "dashboard"},
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of ours that ``name`` (a module or a name in one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path) -> set[str]:
    """Modules of ours that module ``name`` imports (a package's re-exports of its own modules left out)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target) if target.split(".")[0] in PACKAGES else None
            if owner and owner != name and not (is_package and owner.startswith(name + ".")):
                out.add(owner)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_one_way(package):
    wrong = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.split(".")[0] == package
        for target in targets
        if target.split(".")[0] not in MAY_IMPORT[package] | {package}
    )
    assert wrong == []


def test_no_module_over_500_lines():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


#: Inside the tracker, three groups import one way: recording -> reading -> format (DESIGN.md, "Layout").
TRACKER_GROUPS = {
    "tracker.recording": {"tracker.recording", "tracker.reading", "tracker.format"},
    "tracker.reading": {"tracker.reading", "tracker.format"},
    "tracker.format": {"tracker.format"},
}
#: The one import against the groups' direction, on purpose: ``Run.rescore`` is the reading face of a recording
#: job (it runs a model and records what it gives), imported when called, so reading runs still needs no torch.
AGAINST_THE_DIRECTION = {("tracker.reading.run", "tracker.recording.rescore")}


def _group(name: str) -> str | None:
    return next((g for g in TRACKER_GROUPS if name == g or name.startswith(g + ".")), None)


def test_tracker_modules_sit_in_a_group():
    loose = sorted(n for n in MODULES if n.startswith("tracker.") and _group(n) is None)
    assert loose == []


def test_tracker_groups_import_one_way():
    wrong = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if (group := _group(name))
        for target in targets
        if target.startswith("tracker.")
        and _group(target) not in TRACKER_GROUPS[group]
        and (name, target) not in AGAINST_THE_DIRECTION
    )
    assert wrong == []


HANGS = """
import time


def test_that_hangs():
    time.sleep(3600)
"""


def test_every_test_has_a_time_limit_and_a_hang_fails_naming_the_test(tmp_path, request):
    """The suite's configuration gives each test a time limit (pytest-timeout): a hang ends as a failure that
    names the test, and the run goes on, instead of stalling the suite."""
    import subprocess
    import sys

    assert float(request.config.getini("timeout") or 0) > 0, "pyproject.toml sets no per-test timeout"
    (tmp_path / "test_hang.py").write_text(HANGS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
        + ["--rootdir", str(tmp_path), "-o", "timeout=2", str(tmp_path / "test_hang.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout[-2000:]
    assert "Timeout" in out and "FAILED" in out and "test_that_hangs" in out, out
