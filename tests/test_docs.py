"""The README's and docs/*.md's Python examples run as written.

Blocks fenced as ``python`` run; any other fence language (``bash``, ``text``,
``python no-run`` for code that needs what logitscope does not install) is
only shown. The README's blocks each run alone, in a fresh interpreter, and
each prints what it shows: a newcomer copies one block, not the page. The
docs' blocks run in order, each file in its own interpreter, so a block may
use what the blocks above it in the same file defined, as a reader following
the guide in a notebook would. Everything runs in an empty temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)

RUNNER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for i, (line, code) in enumerate(blocks):
    try:
        exec(compile(code, f"{sys.argv[2]}:{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"block {i} (line {line}) failed", file=sys.stderr)
        sys.exit(1)
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the opening fence, code) for each block fenced exactly as ``python``."""
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1).strip() == "python"
    ]


DOCS = [
    doc
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if python_blocks(doc.read_text(encoding="utf-8"))
]


def test_the_readme_and_the_guide_have_examples():
    assert {doc.name for doc in DOCS} >= {"README.md", "guide.md"}


def test_fences_are_found_and_other_languages_are_left_alone():
    text = "x\n```python\na = 1\n```\n```bash\nrm -rf /\n```\n```python no-run\nimport nothing\n```\n```python\nb = a\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n"), (11, "b = a\n")]


def _run(blocks: list[tuple[int, str]], name: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The blocks, in order, in one fresh interpreter in an empty folder."""
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json"), name],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


GUIDES = [doc for doc in DOCS if doc.name != "README.md"]
README_BLOCKS = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


@pytest.mark.parametrize("doc", GUIDES, ids=[str(d.relative_to(ROOT)) for d in GUIDES])
def test_the_python_examples_run_in_order(doc, tmp_path):
    result = _run(python_blocks(doc.read_text(encoding="utf-8")), doc.name, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("line, code", README_BLOCKS, ids=[f"README.md:{line}" for line, _ in README_BLOCKS])
def test_each_readme_block_runs_alone_and_shows_its_result(line, code, tmp_path):
    result = _run([(line, code)], "README.md", tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip(), f"the block at README.md:{line} prints nothing: a reader running it sees no result"


def _bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ``bash`` block, one per ``&&`` part, comments dropped."""
    blocks = [m.group(2) for m in FENCE.finditer(text) if m.group(1).strip() == "bash"]
    return [[part.split("#")[0].strip() for line in b.splitlines() for part in line.split("&&")] for b in blocks]


def test_the_readme_s_dashboard_commands_open_what_a_fresh_clone_has():
    """`logitscope dashboard PATH` names a path the clone holds, or one its own block writes first (`--out`):
    each block is copied alone, the viewer-only install's on a machine that records nothing."""
    checked = 0
    for block in _bash_blocks((ROOT / "README.md").read_text(encoding="utf-8")):
        written: set[str] = set()
        for command in block:
            words = command.split()
            written.update(words[i + 1].rstrip("/") for i, w in enumerate(words[:-1]) if w == "--out")
            if "dashboard" in words and words.index("dashboard") + 1 < len(words):
                path = words[words.index("dashboard") + 1].rstrip("/")
                if words[words.index("dashboard") - 1] != "logitscope" or path.startswith("-"):
                    continue
                checked += 1
                assert path in written or (ROOT / path).exists(), f"`{command}`: no '{path}' in a fresh clone"
    assert checked >= 3
