"""A table's runs rewritten in fewer parts: what a long-running server's runs need now and then.

A server commits each run's ended requests about once a second, a file per
run per commit: after a day a run is tens of thousands of small parts, and
every reader pays per part (opening one and checking its footer took about
1.5 ms here, whatever its size). :func:`compact` reads a run's consecutive
parts through the checked opener, as ``Run.load`` does (rows, and the
generations' metadata merged as readers merge them), writes them as parts of
about ``max_bytes`` each, and commits those in place of exactly the parts it
read: parts a writer commits meanwhile stay as they are, and a part another
compaction removed first makes this one's commit refused (nothing changes;
what it staged is debris for ``logitscope vacuum``). Readers see the run
before or after, never both. Delta Lake's own ``OPTIMIZE`` must not be run on
a logitscope table: it merges parts without their metadata (each part's
``run_meta``, which its commit repeats). Needs ``deltalake``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tracker.format.checks import check_rows
from tracker.format.discovery import find_runs
from tracker.format.layout import layout_of
from tracker.format.run_file import named_digest
from tracker.format.table import RunTable, TableError, is_table
from tracker.reading.run import Run

__all__ = ["Compacted", "compact"]


@dataclass(frozen=True)
class Compacted:
    """What :func:`compact` did (or, with ``dry_run``, would do) to one run: its committed parts and their
    bytes before and after."""

    run_id: str
    parts_before: int
    parts_after: int
    bytes_before: int
    bytes_after: int


def _int_arg(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _groups(sizes: Sequence[int], max_bytes: int) -> list[range]:
    """Consecutive parts, each group's bytes at most ``max_bytes`` (a larger part stands alone)."""
    groups, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > max_bytes:
            groups.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


def compact(
    location: str | os.PathLike[str],
    *,
    min_parts: int = 16,
    max_bytes: int = 256 << 20,
    run_ids: Sequence[str] | None = None,
    dry_run: bool = False,
    progress: Callable[[Compacted], None] | None = None,
) -> list[Compacted]:
    """Rewrite each run of the table at ``location`` that has at least ``min_parts`` committed parts as
    parts of at most about ``max_bytes`` each (one commit per run; see the module), and every part written
    before part names carried the digest of their bytes (so that queries read it in one scan with the
    others: :mod:`tracker.format.scan`). ``run_ids``: only these
    runs; ``dry_run``: say what would be done, write nothing; ``progress``: called after each run.

    Returns what was done to each run rewritten. TableError for a location that is not a table, or a run
    whose parts another writer removed meanwhile; RunFileError naming a part that cannot be read (nothing
    of its run is changed).
    """
    min_parts = _int_arg("min_parts", min_parts, 2)
    max_bytes = _int_arg("max_bytes", max_bytes, 1)
    table = RunTable.at(location)
    if not is_table(table.fs, table.where):
        raise TableError(f"'{location}' is not a table (no _delta_log); compact works on tables of runs")
    wanted = None if run_ids is None else set(run_ids)
    found = [r for r in find_runs(table.location, depth=1) if r.kind == "table"]
    done = []
    for run in found:
        undigested = [named_digest(f) is None for f in run.files]  # written before names carried it
        if (wanted is not None and run.run_id not in wanted) or (len(run.files) < min_parts and not any(undigested)):
            continue
        sizes = [f.size for f in run.facts]
        many = len(run.files) >= min_parts
        groups = [g for g in _groups(sizes, max_bytes) if (many and len(g) > 1) or any(undigested[i] for i in g)]
        if not groups:
            continue
        merged = sum(len(g) for g in groups)
        staged = []
        if not dry_run:
            for group in groups:
                part = replace(run, files=tuple(run.files[i] for i in group), facts=tuple(run.facts[i] for i in group))
                layout = layout_of(part, run.run_id)
                batches = layout.batches()
                check_rows(layout.path, batches, layout.metadata)
                rows = Run(batches, layout.metadata, layout.vocabulary())
                staged.append(table.stage(rows.to_arrow(), rows.metadata))
            table.commit(staged, remove={run.facts[i].path for g in groups for i in g})
        kept = sum(sizes) - sum(sizes[i] for g in groups for i in g)
        report = Compacted(
            str(run.run_id),
            len(run.files),
            len(run.files) - merged + len(groups),
            sum(sizes),
            kept + sum(s.size for s in staged) if not dry_run else sum(sizes),
        )
        done.append(report)
        if progress is not None:
            progress(report)
    return done
