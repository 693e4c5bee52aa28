"""Finding the runs under a path and describing each one for the run browser.

A path may be one run (a ``.parquet`` or Arrow IPC file, a ``run_id=...``
folder, a spill folder) or a folder holding runs, at any depth up to
:data:`MAX_DEPTH`. Hidden entries and half-written temporary files are
skipped, and so are symlinks that lead out of the folder and subfolders the
server may not read. A file that looks like a run but cannot be read still appears, with
its error, so the browser can say what is wrong with it.

A dataset's complete runs (``run_id=...`` folders with their ``_complete.json``,
:mod:`tracker.format.dataset`) are described from that marker alone, so a folder of
10,000 runs is listed without opening one. A URL (``s3://bucket/runs``) is a
run file, a run folder or a dataset root on that store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from dashboard.reader import IPC_SUFFIXES, PARQUET_SUFFIXES, BadRunError, RunReader
from tracker.format.dataset import RunEntry, list_runs
from tracker.format.fs import is_url, resolve
from tracker.format.layout import COMPLETE, is_partition
from tracker.format.spill import RUN_JSON

__all__ = [
    "MAX_DEPTH",
    "RunSummary",
    "find_runs",
    "is_run_folder",
    "summarize",
    "summary_of",
    "summary_from_marker",
    "marker_summaries",
    "unexpected_reason",
]

MAX_DEPTH = 4
RUN_SUFFIXES = PARQUET_SUFFIXES + IPC_SUFFIXES


def is_run_folder(path: Path) -> bool:
    """A folder that is one run: a dataset partition (``run_id=...``) holding a part, or a spill folder.
    A partition holding only the temporary file of an export in progress (or killed) is no run yet."""
    return is_partition(path) or (path.is_dir() and (path / RUN_JSON).is_file())


def _visible(path: Path) -> bool:
    return not path.name.startswith((".", "_")) and not path.name.endswith(".tmp")


def _leads_out(entry: Path, inside: Path) -> bool:
    """A symlink whose target is not under ``inside`` (or cannot be resolved)."""
    if not entry.is_symlink():
        return False
    try:
        return not entry.resolve().is_relative_to(inside)
    except (OSError, RuntimeError):
        return True


def _holds_outside_links(folder: Path, inside: Path) -> bool:
    """A run folder one of whose files (a part, a spill chunk) is a symlink leading out of ``inside``."""
    try:
        return any(_leads_out(entry, inside) for entry in folder.iterdir())
    except OSError:
        return True


def _find_remote(url: str) -> list[str]:
    """The runs at a URL: the run file or run folder it names, else the complete runs of the dataset there."""
    fs, where = resolve(url, "path")
    info = fs.get_file_info(where.rstrip("/"))
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"path: nothing at '{url}' (give a run file or a folder of runs)")
    if info.type == pafs.FileType.File or where.rstrip("/").rsplit("/", 1)[-1].startswith("run_id="):
        return [url]
    return [entry.path for entry in list_runs(url)]


def find_runs(root: str | Path) -> list[Path] | list[str]:
    """The runs at or under ``root`` (a path, or a URL: then URLs), sorted by path.

    FileNotFoundError naming ``root`` if it is missing; PermissionError if
    ``root`` itself cannot be listed (unreadable subfolders are skipped).
    Symlinks are followed only to targets inside ``root``; a run folder holding a symlink that leads out
    (``run_id=x/part-00000.parquet`` linked from elsewhere) is not listed either.
    """
    if is_url(root):
        return _find_remote(str(root))
    base = Path(root)
    if not base.exists():
        raise FileNotFoundError(f"path: nothing at '{base}' (give a run file or a folder of runs)")
    inside = base.resolve()
    if base.is_file() or is_run_folder(base):
        return [] if base.is_dir() and _holds_outside_links(base, inside) else [base]
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            if folder == base:
                raise
            return  # a subfolder this server may not read
        for entry in entries:
            if not _visible(entry) or _leads_out(entry, inside):
                continue
            try:
                if entry.is_file() and entry.suffix in RUN_SUFFIXES:
                    found.append(entry)
                elif is_run_folder(entry):
                    if not _holds_outside_links(entry, inside):  # a part linked from elsewhere: not shown
                        found.append(entry)
                elif entry.is_dir() and depth < MAX_DEPTH:
                    walk(entry, depth + 1)
            except OSError:
                continue  # an entry that cannot be looked at

    walk(base, 1)
    return found


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
    """Open ``path`` and describe it; a bad run gives a summary with ``error`` set instead of raising."""
    target = Path(path)
    label = (
        str(target.relative_to(root))
        if root is not None and target != Path(root) and target.is_relative_to(root)
        else target.name
    )
    try:
        return summary_of(RunReader(target), label)
    except BadRunError as exc:
        return RunSummary(path=str(target), label=label, error=exc.reason)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError, pa.ArrowException) as exc:
        return RunSummary(path=str(target), label=label, error=unexpected_reason(exc))


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


def marker_summaries(folders: list[Path] | list[str]) -> dict[str, RunSummary]:
    """Summaries, by path, of those local ``folders`` that are complete dataset runs, read from their markers
    (the others are left out: they are opened as runs). A damaged marker is left out too: opening the run
    says what is wrong."""
    found: dict[str, RunSummary] = {}
    for folder in folders:
        name = Path(folder).name
        if is_url(folder) or not name.startswith("run_id="):
            continue
        try:
            raw = json.loads((Path(folder) / COMPLETE).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and isinstance(raw.get("summary"), dict):
            summary = {**raw["summary"], "bytes": raw.get("bytes", 0)}
            found[str(folder)] = summary_from_marker(RunEntry(name.split("=", 1)[1], str(folder), summary), "")
    return found
