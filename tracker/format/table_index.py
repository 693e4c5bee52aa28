"""What the committed parts of a table say about their runs: from the table's log, else read once and kept.

Listing the runs of a table (the run browser, ``logitscope query``'s ``runs``
view, ``list_runs``) needs what each part holds: its run metadata, columns,
vocabulary, rows and steps, its generations and their batch sizes. A part
this version writes carries them in its :data:`~tracker.format.columns.RUN_META`
column, and its commit repeats them as that column's statistics, with the
rows and the largest step: the log alone lists the runs, no part is opened.
A part whose commit did not (written by another tool, or with metadata past
:data:`~tracker.format.table.LOGGED_META_BYTES`) is read once: a committed
part never changes, so what was read of it is kept per table in
``~/.cache/logitscope/table-index/`` (``$LOGITSCOPE_CACHE`` overrides). The
footers read in this process are kept too (at most :data:`FOOTERS_KEPT`), so
that reading the parts' columns next does not parse them again; so are the
columns a query scanned of them, in one local file per table
(:func:`keep_columns`, :func:`kept_columns`): the next process answers from it
instead of opening every part. Needs pyarrow only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracker.format.checks import RunFileError, arrow_reason
from tracker.format.spill import atomic_path
from tracker.format.table import Committed, RunTable

__all__ = ["PartFacts", "part_facts", "run_summary_of", "CACHE_ENV", "FOOTERS_KEPT", "footer_of", "cache_folder"]
__all__ += ["COLUMNS_KEPT", "keep_columns", "kept_columns"]

#: Where what was read of committed parts is kept (default ``~/.cache/logitscope``).
CACHE_ENV = "LOGITSCOPE_CACHE"
#: Parsed footers kept in this process for the next read of the same parts.
FOOTERS_KEPT = 4096
_INDEX_VERSION = 1
#: The most Arrow bytes of a table's scanned columns kept on this machine (a larger table's are not kept).
COLUMNS_KEPT = 256 << 20
_KEPT_KEY = b"logitscope.kept"
_PROMPT_IDS = 64

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
    lengths: tuple[tuple[int, tuple[int, ...]], ...] = ()
    metadata: Any = field(default=None, compare=False, repr=False)  # run_json parsed, where it was

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "metadata"}

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
            lengths=tuple((int(g), tuple(int(n) for n in ls)) for g, ls in raw.get("lengths", [])),
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


def _facts(part: Committed, raw: str, steps: int, columns: list[str] | None) -> PartFacts:
    """A part's facts from its :data:`~tracker.format.columns.RUN_META` JSON (checked as run metadata) and its
    steps; ``columns``: the file's own (None: those this version writes for such a run)."""
    from tracker.format.columns import file_names
    from tracker.format.schema import RunMetadata

    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError(f"run metadata must be a JSON object, got {type(body).__name__}")
    metadata = _metadata(raw, body, RunMetadata)
    facts = body.get("part") if isinstance(body.get("part"), dict) else {}
    entries = facts.get("generations") if isinstance(facts.get("generations"), list) else []
    prompt = facts.get("prompt_ids") if isinstance(facts.get("prompt_ids"), list) else []
    vocab = facts.get("vocab") if isinstance(facts.get("vocab"), str) else ""
    told = facts.get("lengths") if isinstance(facts.get("lengths"), list) else []
    lengths = tuple(
        (e[0], tuple(e[1]))
        for e in told
        if isinstance(e, list)
        and len(e) == 2
        and type(e[0]) is int
        and isinstance(e[1], list)
        and all(type(n) is int for n in e[1])
    )
    if columns is None:
        columns = file_names(metadata, facts.get("stats") is True)
    return PartFacts(
        path=part.path,
        run_id=part.run_id,
        size=part.size,
        rows=part.rows,
        steps=steps,
        run_json=raw,
        vocab=vocab,
        columns=tuple(columns),
        generations=tuple(
            (int(e[0]), int(e[1]))
            for e in entries
            if isinstance(e, list) and len(e) == 2 and all(type(x) is int for x in e)
        ),
        prompt_ids=tuple(int(i) for i in prompt[:_PROMPT_IDS] if type(i) is int),
        lengths=lengths,
        metadata=metadata,
    )


#: Run metadata checked once per shape: the parts of a table's runs differ mostly in their id and time.
_shapes: OrderedDict[str, Any] = OrderedDict()
_SHAPES_KEPT = 64


def _metadata(raw: str, body: dict[str, Any], kind: Any) -> Any:
    """``kind.from_json(raw)`` (RunMetadata), checked in full once per shape of metadata (all but its run id,
    time and part facts): a part of the same shape only has those three checked."""
    run_id, created_at = body.get("run_id"), body.get("created_at", "")
    if not isinstance(run_id, str) or not isinstance(created_at, str):
        return kind.from_json(raw)  # says what is wrong
    key = json.dumps({k: v for k, v in body.items() if k not in ("run_id", "created_at", "part")}, sort_keys=True)
    with _lock:
        shape = _shapes.get(key)
    if shape is None:
        shape = kind.from_json(raw)
        with _lock:
            _shapes[key] = shape
            while len(_shapes) > _SHAPES_KEPT:
                _shapes.popitem(last=False)
    return replace(shape, run_id=run_id, created_at=created_at)


def _read(table: RunTable, part: Committed) -> PartFacts:
    """What the footer and the :data:`~tracker.format.columns.RUN_META` column of one committed part say
    (for a part whose commit did not repeat them)."""
    from tracker.format.parts import open_part

    url = f"{table.location}/{part.path}"
    where = f"{table.where}/{part.path}"
    try:
        opened = open_part(Path(where)) if table.fs.type_name == "local" else open_part(where, table.fs, url)
        raw, _ = opened.described()
        if raw is None:
            raise RunFileError(
                url, "it holds no logitscope run metadata (a run_meta column or footer key 'logitscope.run')"
            )
        file = getattr(opened, "file", None)
        high = -1
        if file is not None:
            meta, names = file.metadata, file.schema_arrow.names
            _keep(table, part.path, meta)
            if "step" in names:
                index = names.index("step")
                for g in range(meta.num_row_groups):
                    stats = meta.row_group(g).column(index).statistics
                    if stats is not None and stats.has_min_max:
                        high = max(high, int(stats.max))
        names = opened.schema.names
        return _facts(part, raw.decode("utf-8", "replace"), high + 1, list(names))
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise RunFileError(url, f"it is committed but cannot be read ({exc})") from exc
        raise RunFileError(url, arrow_reason(exc)) from exc
    except ValueError as exc:
        if isinstance(exc, RunFileError):
            raise
        raise RunFileError(url, str(exc)) from exc


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
    """:class:`PartFacts` of ``parts`` (committed parts of ``table``), in their order: from what their commits
    repeat (the log), else from this machine's cache, else from the parts themselves (read ``threads`` at a
    time, then cached). RunFileError naming a part whose metadata is damaged or cannot be read."""
    facts: dict[str, PartFacts] = {}
    for part in parts:
        if part.run_json and part.steps >= 0:
            try:
                facts[part.path] = _facts(part, part.run_json, part.steps, None)
            except ValueError as exc:
                raise RunFileError(f"{table.location}/{part.path}", str(exc)) from exc
    rest = [p for p in parts if p.path not in facts]
    if not rest:
        return [facts[p.path] for p in parts]
    index_file = _cache_file(table.location)
    known = _load(index_file) if cache else {}
    for part in rest:
        raw = known.get(part.path)
        if isinstance(raw, dict) and raw.get("size") == part.size:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                facts[part.path] = PartFacts.from_json(raw)
    missing = [p for p in rest if p.path not in facts]
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
                live = {p.path for p in rest}
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


def _columns_file(location: str) -> Path:
    return cache_folder() / f"{hashlib.sha1(location.encode()).hexdigest()[:24]}.columns.parquet"


def kept_columns(location: str, parts: dict[str, int]) -> dict[str, pa.Table]:
    """The columns an earlier scan kept of the table at ``location``'s committed parts ``parts`` (path ->
    size): per part kept with that size, its rows as read then (column names as the run's). A kept file
    that fails its checks (page checksums, its index against its rows) counts as none; the values go
    through the same checks as those read from the parts (:mod:`tracker.reading.query_steps`)."""
    try:
        file = pq.ParquetFile(_columns_file(location), memory_map=True, page_checksum_verification=True)
        index = json.loads((file.metadata.metadata or {})[_KEPT_KEY])
        if index.get("version") != _INDEX_VERSION or index.get("location") != location:
            return {}
        entries = [(str(p), int(s), int(n), [str(c) for c in cs]) for p, s, n, cs in index["parts"]]
        if sum(n for _, _, n, _ in entries) != file.metadata.num_rows or any(n < 0 for _, _, n, _ in entries):
            return {}
        table = file.read(use_threads=False)
        found, offset = {}, 0
        for path, size, rows, columns in entries:
            if parts.get(path) == size:
                found[path] = table.slice(offset, rows).select(columns)
            offset += rows
        return found
    except (OSError, ValueError, KeyError, TypeError, AttributeError, pa.ArrowException):
        return {}


def keep_columns(location: str, parts: dict[str, tuple[int, pa.Table]]) -> None:
    """Keep ``parts`` (path -> (size, the columns read of it)) of the table at ``location`` for the next
    process, in place of what was kept (those not given are forgotten). Kept only up to
    :data:`COLUMNS_KEPT` bytes; a cache that cannot be written is only slower next time."""
    if not parts:
        return
    index = [[path, size, t.num_rows, t.column_names] for path, (size, t) in parts.items()]
    body = json.dumps({"version": _INDEX_VERSION, "location": location, "parts": index}, separators=(",", ":"))
    with contextlib.suppress(OSError, pa.ArrowException):
        table = pa.concat_tables([t for _, t in parts.values()], promote_options="permissive").combine_chunks()
        if table.nbytes > COLUMNS_KEPT:
            return
        target = _columns_file(location)
        target.parent.mkdir(parents=True, exist_ok=True)
        with (
            atomic_path(target) as tmp,
            pq.ParquetWriter(
                tmp, table.schema, compression="lz4", write_page_checksum=True, store_schema=False
            ) as writer,
        ):
            writer.write_table(table)
            writer.add_key_value_metadata({_KEPT_KEY: body.encode()})
