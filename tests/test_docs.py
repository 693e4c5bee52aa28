"""The README's and docs/*.md's Python examples run as written: in order, each file in a fresh process.

Blocks fenced as ``python`` run; any other fence language (``bash``, ``text``,
``python no-run`` for code that needs what logitscope does not install) is
only shown. Each file runs in its own interpreter in an empty temporary
folder, so a block may use only what the blocks above it in the same file
defined, as a reader pasting them into a notebook would.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_the_python_examples_run_in_order(doc, tmp_path):
    blocks = python_blocks(doc.read_text(encoding="utf-8"))
    (tmp_path / "blocks.json").write_text(__import__("json").dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json"), doc.name],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
