"""The completion marker of a dataset's run: what makes a ``run_id=...`` folder a run.

Writers put every part of a run into ``root/run_id=<id>/`` first and the small
JSON object :data:`COMPLETE` last; readers take a ``run_id=...`` folder for a run
only once it is there. On a local disk each file is renamed into place whole; on
an object store, where there is no rename, each object appears whole when its
upload completes, and the marker's upload is the run's last write: either way no
reader sees half a run. Needs pyarrow only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.fs as pafs

__all__ = ["COMPLETE", "PARQUET_SUFFIXES", "complete_runs", "is_partition", "read_marker"]

#: The object a ``run_id=...`` folder of a dataset holds once its run is complete, written after every part:
#: JSON naming the parts and summarising the run (see :mod:`tracker.format.dataset`).
COMPLETE = "_complete.json"
PARQUET_SUFFIXES = (".parquet", ".pq")


def is_partition(path: Path) -> bool:
    """A dataset's complete ``run_id=...`` folder: one holding its completion marker :data:`COMPLETE`, which
    is written after every part (a run still being written, or a killed export's leftovers, is no run yet)."""
    return path.name.startswith("run_id=") and (path / COMPLETE).is_file()


def complete_runs(fs: pafs.FileSystem, root: str) -> list[str]:
    """The names of the complete ``run_id=...`` folders right under ``root`` (inside ``fs``), sorted.

    On an object store this is one recursive listing (a request per 1,000 objects), not a request per run.
    """
    if isinstance(fs, pafs.LocalFileSystem):
        with os.scandir(root) as entries:
            return sorted(e.name for e in entries if e.name.startswith("run_id=") and is_partition(Path(e.path)))
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True, recursive=True))
    base = root.rstrip("/") + "/"
    names = []
    for info in infos:
        rest = info.path[len(base) :].split("/") if info.path.startswith(base) else []
        if len(rest) == 2 and rest[0].startswith("run_id=") and rest[1] == COMPLETE:
            names.append(rest[0])
    return sorted(names)


def read_marker(raw: bytes) -> dict:
    """A completion marker's JSON (``run_id``, ``parts``, ``summary``); ValueError saying what is wrong."""
    try:
        marker = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"it is not JSON ({exc})") from exc
    parts = marker.get("parts") if isinstance(marker, dict) else None
    if (
        not isinstance(marker, dict)
        or not isinstance(marker.get("run_id"), str)
        or not isinstance(parts, list)
        or not all(isinstance(n, str) and n.endswith(PARQUET_SUFFIXES) and "/" not in n and n[:1] != "." for n in parts)
    ):
        raise ValueError("it must be a JSON object with 'run_id' and 'parts' (names of .parquet files)")
    return marker
