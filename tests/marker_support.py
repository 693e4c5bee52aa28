"""Runs in the layout before tables (``run_id=<id>/`` folders made complete by ``_complete.json``), as older
logitscope versions and the serving engines' part writer wrote them: readers must keep reading it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs

from tracker.format.dataset import run_summary, write_marker


def marker_run(run, root: Path, *, marker: bool = True, name: str = "part-00000.parquet") -> Path:
    """Write ``run`` as ``root/run_id=<id>/<name>`` and (with ``marker``) its completion marker; the part's path."""
    folder = Path(root) / f"run_id={run.run_id}"
    path = Path(run.to_parquet(folder / name))
    if marker:
        write_marker(pafs.LocalFileSystem(), str(folder), run.run_id, [name], path.stat().st_size, run_summary(run))
    return path
