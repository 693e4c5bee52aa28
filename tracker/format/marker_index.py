"""The completion markers of a folder of marker runs, read once and kept on this machine.

A marker dataset (the layout before tables, :mod:`tracker.format.marker`) is
listed from its markers: one listing and one small object per run, never a
run's data. A complete run is never rewritten, so what was read of its
marker is kept (``~/.cache/logitscope/run-index/``, or under
``$LOGITSCOPE_CACHE``) and a later listing reads only the markers of runs it
has not seen, except those marked growing (a serving engine's run, whose
marker lists more parts as requests end). Needs pyarrow only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from tracker.format.checks import RunFileError
from tracker.format.marker import COMPLETE, read_marker
from tracker.format.spill import atomic_path

__all__ = ["markers", "CACHE_ENV"]

#: Where what was read of markers is kept (default ``~/.cache/logitscope``).
CACHE_ENV = "LOGITSCOPE_CACHE"
_VERSION = 2


def _cache_file(key: str) -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "logitscope")
    return Path(base) / "run-index" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"


def _load(path: Path) -> dict[str, dict]:
    try:
        cached = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(cached, dict) or cached.get("version") != _VERSION or not isinstance(cached.get("runs"), dict):
        return {}
    return {k: v for k, v in cached["runs"].items() if isinstance(v, dict) and isinstance(v.get("parts"), list)}


def markers(
    fs: pafs.FileSystem, where: str, shown: str, names: list[str], *, cache: bool = True, threads: int = 16
) -> dict[str, dict[str, Any]]:
    """Per ``run_id=`` folder name of ``names`` (complete runs of the dataset at ``where``): its marker's
    ``parts``, ``summary`` (with ``bytes`` and ``growing``). RunFileError naming a damaged marker."""
    index_file = _cache_file(shown if "://" in shown else where)
    known = _load(index_file) if cache else {}

    def read(name: str) -> dict[str, Any]:
        if name in known and not known[name].get("growing"):
            return known[name]
        path = f"{where}/{name}/{COMPLETE}"
        with fs.open_input_stream(path) as f:
            raw = f.read()
        try:
            marker = read_marker(raw)
        except ValueError as exc:
            raise RunFileError(f"{shown}/{name}/{COMPLETE}", f"a damaged completion marker: {exc}") from exc
        summary = marker.get("summary") if isinstance(marker.get("summary"), dict) else {}
        growing = marker.get("growing") is True
        return {"parts": marker["parts"], "summary": {**summary, "bytes": marker.get("bytes", 0)}, "growing": growing}

    unseen = [n for n in names if n not in known or known[n].get("growing")]
    if isinstance(fs, pafs.LocalFileSystem) or threads <= 1 or len(unseen) < 8:
        found = {n: read(n) for n in names}
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="logitscope-markers") as pool:
            found = dict(zip(names, pool.map(read, names)))
    if cache and unseen:
        with contextlib.suppress(OSError):  # a cache that cannot be written is only slower next time
            index_file.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(index_file) as tmp:
                done = {n: v for n, v in found.items() if not v.get("growing")}
                tmp.write_text(json.dumps({"version": _VERSION, "runs": done}, separators=(",", ":"), default=str))
    return found
