"""The runs under a path, described for the run browser and ``logitscope inspect``.

Which runs a path or URL holds is :func:`tracker.format.discovery.find_runs`'s
answer, the one every reader uses (files, tables, folders of completion
markers, spill folders, any folder holding them up to :data:`MAX_DEPTH` deep;
hidden and temporary files, uncommitted parts and symlinks leading out of the
folder left out). A table's or a marker folder's run is described from what
its listing already read (its parts' footers, its marker), so a folder of
10,000 runs is listed without opening one; any other run is opened. A file
that looks like a run but cannot be read still appears, with its error, so
the browser can say what is wrong with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from dashboard.reader import BadRunError, RunReader
from tracker.format import discovery
from tracker.format.dataset import RunEntry
from tracker.format.fs import is_url
from tracker.format.layout import is_partition
from tracker.format.spill import RUN_JSON

__all__ = [
    "MAX_DEPTH",
    "RunSummary",
    "find_runs",
    "found_runs",
    "is_run_folder",
    "summarize",
    "summary_of",
    "summary_from_marker",
    "label_of",
    "unexpected_reason",
]

MAX_DEPTH = discovery.MAX_DEPTH


def is_run_folder(path: Path) -> bool:
    """A folder that is one run: a complete marker folder (``run_id=...`` with its ``_complete.json``), or a
    spill folder. A partition holding only the temporary file of an export in progress (or killed) is no run."""
    return is_partition(path) or (path.is_dir() and (path / RUN_JSON).is_file())


def found_runs(root: str | Path) -> list[discovery.FoundRun]:
    """The runs at or under ``root`` (a path or a URL), as :func:`tracker.format.discovery.find_runs` finds
    them. FileNotFoundError naming ``root`` if nothing is there; PermissionError if it cannot be listed."""
    try:
        return discovery.find_runs(root)
    except discovery.NoRunError as exc:
        raise FileNotFoundError(f"path: nothing at '{root}' (give a run file or a folder of runs)") from exc


def find_runs(root: str | Path) -> list[Path] | list[str]:
    """The paths of the runs at or under ``root`` (Paths for a local root, URLs for a URL), sorted."""
    return [r.path for r in found_runs(root)]  # type: ignore[return-value]


@dataclass(frozen=True)
class RunSummary:
    """One line of the run browser.

    ``error`` is set (and most other fields empty) when the path is not a
    readable run; ``label`` is what pickers show.
    """

    path: str
    label: str
    title: str = ""
    run_id: str = ""
    prompt: str = ""
    model: str = ""
    processors: str = ""
    sampling: str = ""
    steps: int = 0
    sequences: int = 0
    generations: int = 0
    created_at: str = ""
    storage: str = ""
    stages: str = ""
    vocab_size: int = 0
    size_bytes: int = 0
    error: str | None = None
    note: str | None = None


def sampling_text(sampling: object) -> str:
    if sampling is None:
        return ""
    if isinstance(sampling, dict):
        shown = {k: v for k, v in sampling.items() if not (v is None or v is False or v == [] or v == ())}
        return ", ".join(f"{k}={sampling_text(v) if isinstance(v, dict) else v}" for k, v in shown.items())
    return json.dumps(sampling) if not isinstance(sampling, str) else sampling


def summary_of(reader: RunReader, label: str) -> RunSummary:
    """Describe an open run (the latest generation's first prompt, the longest sequence)."""
    m = reader.metadata
    generations = reader.generations()
    steps = 0
    sequences = 0
    for g in generations:
        seqs = reader.sequences(g)
        sequences = max(sequences, len(seqs))
        steps = max([steps] + [reader.track(g, s).length for s in seqs])
    prompt = reader.prompt(generations[-1]) if generations else ""
    title = str(m.extra.get("title", "")) if isinstance(m.extra, dict) else ""
    return RunSummary(
        path=str(reader.path),
        label=label,
        title=title,
        run_id=m.run_id,
        prompt=prompt,
        model=m.model or "",
        processors=m.processors or "none",
        sampling=sampling_text(m.sampling),
        steps=steps,
        sequences=sequences,
        generations=len(generations),
        created_at=m.created_at,
        storage=m.storage if m.storage != "topk" else f"top-{m.top_k}",
        stages=", ".join(m.stages),
        vocab_size=m.vocab_size,
        size_bytes=reader.size_bytes,
        note=reader.note,
    )


def summarize(path: str | Path, root: str | Path | None = None) -> RunSummary:
    """Open ``path`` (a path or a URL) and describe it; a bad run gives a summary with ``error`` set instead
    of raising."""
    target: str | Path = str(path) if is_url(path) else Path(path)
    label = label_of(target, root)
    try:
        return summary_of(RunReader(target), label)
    except BadRunError as exc:
        return RunSummary(path=str(target), label=label, error=exc.reason)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError, pa.ArrowException) as exc:
        return RunSummary(path=str(target), label=label, error=unexpected_reason(exc))


def label_of(target: str | Path, root: str | Path | None) -> str:
    """How a run under ``root`` is labelled: its path relative to ``root``, else its name."""
    if isinstance(target, str):
        base = str(root).rstrip("/") if root is not None else ""
        inside = bool(base) and target.startswith(base + "/")
        return target[len(base) + 1 :] if inside else target.rstrip("/").rsplit("/", 1)[-1]
    if root is not None and not is_url(root) and target != Path(root) and target.is_relative_to(root):
        return str(target.relative_to(root))
    return target.name


def unexpected_reason(exc: BaseException) -> str:
    """One line for a fault no check named (a run file damaged in a way not foreseen): listing goes on."""
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"it could not be read ({type(exc).__name__}{': ' + text if text else ''})"


def summary_from_marker(entry: RunEntry, label: str) -> RunSummary:
    """Describe a dataset's complete run from its marker's summary (no run file is opened)."""
    m = entry.summary
    top_k = m.get("top_k") or 0
    return RunSummary(
        path=entry.path,
        label=label,
        title=str(m.get("title") or ""),
        run_id=entry.run_id,
        prompt=str(m.get("prompt") or ""),
        model=str(m.get("model") or ""),
        processors=str(m.get("processors") or "none"),
        sampling=sampling_text(m.get("sampling")),
        steps=int(m.get("steps") or 0),
        sequences=int(m.get("sequences") or 0),
        generations=int(m.get("generations") or 0),
        created_at=str(m.get("created_at") or ""),
        storage=f"top-{top_k}" if m.get("storage") == "topk" else str(m.get("storage") or ""),
        stages=", ".join(str(x) for x in m.get("stages") or []),
        vocab_size=int(m.get("vocab_size") or 0),
        size_bytes=int(m.get("bytes") or 0),
    )
