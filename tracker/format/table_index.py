"""What the committed parts of a table say about their runs, read once and kept on this machine.

Listing the runs of a table (the run browser, ``logitscope query``'s ``runs``
view, ``list_runs``) needs each part's footer: its run metadata, columns,
vocabulary and row count, and the generations its small ``generation_meta``
column lists. A committed part never changes (a rewrite commits a new file),
so what was read of it stays true: it is kept per table in
``~/.cache/logitscope/table-index/`` (``$LOGITSCOPE_CACHE`` overrides), and a
later process reads only the footers of parts it has not seen. The footers
read in this process are kept too (a few kilobytes each, at most
:data:`FOOTERS_KEPT`), so that reading the parts' columns next does not parse
them again. Needs pyarrow only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracker.format.checks import RunFileError, arrow_reason
from tracker.format.schema import GENERATIONS_COLUMN, META_RUN, META_VOCAB_REF, generations_from_column
from tracker.format.spill import atomic_path
from tracker.format.table import Committed, RunTable

__all__ = ["PartFacts", "part_facts", "run_summary_of", "CACHE_ENV", "FOOTERS_KEPT", "footer_of", "cache_folder"]

#: Where what was read of committed parts is kept (default ``~/.cache/logitscope``).
CACHE_ENV = "LOGITSCOPE_CACHE"
#: Parsed footers kept in this process for the next read of the same parts.
FOOTERS_KEPT = 4096
_INDEX_VERSION = 1
_PROMPT_IDS = 128

_footers: OrderedDict[tuple[str, str], pq.FileMetaData] = OrderedDict()
_lock = threading.Lock()


@dataclass(frozen=True)
class PartFacts:
    """One committed part, as its footer and its ``generation_meta`` column tell.

    Attributes:
        path: relative to the table. size, rows: bytes and rows. steps: the largest step + 1.
        run_json: the run metadata (without generations) as the footer holds it.
        vocab: the hash of the run's vocabulary ('' when it has none).
        columns: the file's column names.
        generations: ``(generation, batch_size)`` of each generation entry.
        prompt_ids: the first prompt of the part's last generation (at most 128 ids), for listings.
    """

    path: str
    run_id: str
    size: int
    rows: int
    steps: int
    run_json: str
    vocab: str
    columns: tuple[str, ...]
    generations: tuple[tuple[int, int], ...]
    prompt_ids: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PartFacts:
        return cls(
            path=str(raw["path"]),
            run_id=str(raw["run_id"]),
            size=int(raw["size"]),
            rows=int(raw["rows"]),
            steps=int(raw["steps"]),
            run_json=str(raw["run_json"]),
            vocab=str(raw["vocab"]),
            columns=tuple(str(c) for c in raw["columns"]),
            generations=tuple((int(g), int(b)) for g, b in raw["generations"]),
            prompt_ids=tuple(int(i) for i in raw["prompt_ids"]),
        )


def cache_folder() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "logitscope")
    return Path(base) / "table-index"


def _cache_file(location: str) -> Path:
    return cache_folder() / f"{hashlib.sha1(location.encode()).hexdigest()[:24]}.json"


def footer_of(table: RunTable, path: str) -> pq.FileMetaData | None:
    """The parsed footer of the part ``path`` if this process read it, else None."""
    with _lock:
        return _footers.get((table.location, path))


def _keep(table: RunTable, path: str, footer: pq.FileMetaData) -> None:
    with _lock:
        _footers[(table.location, path)] = footer
        _footers.move_to_end((table.location, path))
        while len(_footers) > FOOTERS_KEPT:
            _footers.popitem(last=False)


def _read(table: RunTable, part: Committed) -> PartFacts:
    """What the footer (and the ``generation_meta`` column) of one committed part say."""
    url = f"{table.location}/{part.path}"
    try:
        with table.fs.open_input_file(f"{table.where}/{part.path}") as f:
            file = pq.ParquetFile(f, page_checksum_verification=True)
            meta, names = file.metadata, file.schema_arrow.names
            footer = dict(meta.metadata or {})
            high = -1
            if "step" in names:
                index = names.index("step")
                for g in range(meta.num_row_groups):
                    stats = meta.row_group(g).column(index).statistics
                    if stats is not None and stats.has_min_max:
                        high = max(high, int(stats.max))
            entries = (
                generations_from_column(file.read(columns=[GENERATIONS_COLUMN]).column(0))
                if GENERATIONS_COLUMN in names
                else []
            )
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise RunFileError(url, f"it is committed but cannot be read ({exc})") from exc
        raise RunFileError(url, arrow_reason(exc)) from exc
    except ValueError as exc:
        raise RunFileError(url, str(exc)) from exc
    if META_RUN not in footer:
        raise RunFileError(url, "it holds no logitscope run metadata (footer key 'logitscope.run')")
    _keep(table, part.path, meta)
    prompts = entries[-1].get("prompt_ids") if entries else None
    first = prompts[0] if isinstance(prompts, list) and prompts and isinstance(prompts[0], list) else []
    return PartFacts(
        path=part.path,
        run_id=part.run_id,
        size=part.size,
        rows=int(meta.num_rows),
        steps=high + 1,
        run_json=footer[META_RUN].decode("utf-8", "replace"),
        vocab=footer.get(META_VOCAB_REF, b"").decode("ascii", "replace"),
        columns=tuple(names),
        generations=tuple(
            (int(e["generation"]), int(e.get("batch_size") or 0))
            for e in entries
            if isinstance(e.get("generation"), int)
        ),
        prompt_ids=tuple(int(i) for i in first[:_PROMPT_IDS] if isinstance(i, int)),
    )


def _load(path: Path) -> dict[str, dict]:
    try:
        cached = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if (
        not isinstance(cached, dict)
        or cached.get("version") != _INDEX_VERSION
        or not isinstance(cached.get("parts"), dict)
    ):
        return {}
    return cached["parts"]


def part_facts(table: RunTable, parts: list[Committed], *, cache: bool = True, threads: int = 8) -> list[PartFacts]:
    """:class:`PartFacts` of ``parts`` (committed parts of ``table``), in their order: from this machine's
    cache, else from their footers (read ``threads`` at a time, then cached). RunFileError naming a part
    whose footer cannot be read."""
    index_file = _cache_file(table.location)
    known = _load(index_file) if cache else {}
    facts: dict[str, PartFacts] = {}
    for part in parts:
        raw = known.get(part.path)
        if isinstance(raw, dict) and raw.get("size") == part.size:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                facts[part.path] = PartFacts.from_json(raw)
    missing = [p for p in parts if p.path not in facts]
    if missing:
        if len(missing) < 4 or threads <= 1:
            found = [_read(table, p) for p in missing]
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="logitscope-footers") as pool:
                found = list(pool.map(lambda p: _read(table, p), missing))
        facts.update((f.path, f) for f in found)
        if cache:
            with contextlib.suppress(OSError):  # a cache that cannot be written is only slower next time
                index_file.parent.mkdir(parents=True, exist_ok=True)
                live = {p.path for p in parts}
                kept = {k: v for k, v in known.items() if k in live}
                kept.update((f.path, f.to_json()) for f in found)
                with atomic_path(index_file) as tmp:
                    tmp.write_text(json.dumps({"version": _INDEX_VERSION, "parts": kept}, separators=(",", ":")))
    return [facts[p.path] for p in parts]


def run_summary_of(table: RunTable, parts: list[PartFacts]) -> dict[str, Any]:
    """What the run browser shows of a table's run made of ``parts``, from their facts alone (the keys of a
    completion marker's summary; the prompt decoded with the run's vocabulary where it can be loaded)."""
    from tracker.format.vocab_store import load_vocab

    first = json.loads(parts[0].run_json) if parts else {}
    first = first if isinstance(first, dict) else {}
    extra = first.get("extra") if isinstance(first.get("extra"), dict) else {}
    generations = {g for p in parts for g, _ in p.generations}
    prompt = ""
    last = parts[-1] if parts else None
    if last is not None and last.prompt_ids and last.vocab:
        try:
            prompt = load_vocab(table.fs, table.where, last.vocab, table.location).decode_shown(list(last.prompt_ids))
        except (ValueError, OSError):
            prompt = ""  # a listing goes on; opening the run says what is wrong
    return {
        "title": str(extra.get("title", "")),
        "model": first.get("model") or "",
        "processors": first.get("processors") or "none",
        "sampling": first.get("sampling"),
        "created_at": first.get("created_at") or "",
        "storage": first.get("storage"),
        "top_k": first.get("top_k"),
        "stages": first.get("stages") if isinstance(first.get("stages"), list) else [],
        "vocab_size": first.get("vocab_size"),
        "rows": sum(p.rows for p in parts),
        "steps": max((p.steps for p in parts), default=0),
        "sequences": max((b for p in parts for _, b in p.generations), default=0),
        "generations": len(generations),
        "prompt": prompt[:300],
        "bytes": sum(p.size for p in parts),
    }
