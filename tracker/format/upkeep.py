"""A table's upkeep: removing what no reader sees.

What a table holds that no commit names is debris: parts a killed writer
staged, parts a rewritten run replaced, temporary files of writes that did
not finish, vocabularies no committed part names. No reader sees any of it
(readers go by the log); :func:`vacuum` removes what is older than
``older_than_hours`` (Delta Lake's own vacuum for the parts, then the
vocabularies). The age protects writers at work: a stream's parts wait for
their commit until the stream closes, so the default is Delta's own (a week);
0 is for when no writer is at work. On an object store, uploads a killed
writer left unfinished are invisible and cost storage until the bucket's
lifecycle rule for incomplete multipart uploads aborts them (set one:
``AbortIncompleteMultipartUpload``); they are never read. Needs ``deltalake``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pyarrow.fs as pafs

from tracker.format.marker import complete_runs
from tracker.format.table import RunTable, TableError, is_table
from tracker.format.table_index import part_facts
from tracker.format.vocab_store import VOCAB_DIR, VOCAB_SUFFIX

__all__ = ["vacuum", "Vacuumed", "DEFAULT_AGE_HOURS"]

#: Delta Lake's own default: a week.
DEFAULT_AGE_HOURS = 168.0


@dataclass(frozen=True)
class Vacuumed:
    """What :func:`vacuum` removed (or, with ``dry_run``, would remove), as paths relative to the table."""

    parts: list[str]
    vocabularies: list[str]

    def __len__(self) -> int:
        return len(self.parts) + len(self.vocabularies)


def _age_arg(older_than_hours: object) -> float:
    if (
        isinstance(older_than_hours, bool)
        or not isinstance(older_than_hours, (int, float))
        or not older_than_hours >= 0
    ):
        raise ValueError(f"older_than_hours must be a number of hours >= 0, got {older_than_hours!r}")
    return float(older_than_hours)


def vacuum(
    location: str | os.PathLike[str], *, older_than_hours: float = DEFAULT_AGE_HOURS, dry_run: bool = False
) -> Vacuumed:
    """Remove the files of the table at ``location`` that no commit names and that are older than
    ``older_than_hours`` (see the module docstring). TableError for a location that is not a table."""
    age = _age_arg(older_than_hours)
    table = RunTable.at(location)
    if not is_table(table.fs, table.where):
        if table.fs.get_file_info(table.where).type == pafs.FileType.Directory and complete_runs(table.fs, table.where):
            raise TableError(
                f"'{table.location}' is a folder of completion markers, not a table: copy its runs into a table "
                f"(logitscope convert '{table.location}' NEW_ROOT), then remove it"
            )
        raise TableError(f"'{table.location}' is not a table (it holds no {'_delta_log'}/)")
    parts = table.vacuum(age, dry_run=dry_run)
    named = {f.vocab for f in part_facts(table, table.committed()) if f.vocab}
    cutoff = time.time() - age * 3600
    vocabularies = []
    listing = table.fs.get_file_info(pafs.FileSelector(f"{table.where}/{VOCAB_DIR}", allow_not_found=True))
    for info in listing:
        if info.type != pafs.FileType.File:
            continue
        name = info.base_name
        key = name[: -len(VOCAB_SUFFIX)] if name.endswith(VOCAB_SUFFIX) else None
        stale = info.mtime is None or info.mtime.timestamp() <= cutoff
        if (key is None and name.endswith(".tmp") or key is not None and key not in named) and stale:
            vocabularies.append(f"{VOCAB_DIR}/{name}")
            if not dry_run:
                table.fs.delete_file(info.path)
    return Vacuumed(parts, sorted(vocabularies))
