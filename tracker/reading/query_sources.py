"""The runs :func:`tracker.open_dataset` answers over: found by :mod:`tracker.format.discovery`, described
without reading a value.

A table's run is described from what its parts' footers say
(:mod:`tracker.format.table_index`: read once per machine, since committed
parts never change); any other run (a file, the files of one run in a folder,
a completion-marker folder) from its files' footers, read now. Each
:class:`RunSource` opens its files when a view needs their columns (a footer
read in this process is not parsed again), through :mod:`tracker.format.parts`,
so every byte passes the format's checks. Needs pyarrow and numpy.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from processors.vocab import Vocabulary
from tracker.format.checks import RunFileError, arrow_reason, check_rows, check_schemas, metadata_from, vocabulary_from
from tracker.format.discovery import FoundRun, NoRunError, find_runs
from tracker.format.parts import ID_COLUMNS, Part, open_part
from tracker.format.schema import META_VOCAB, RunMetadata, check_generations
from tracker.format.table import RunTable
from tracker.format.table_index import footer_of
from tracker.reading.run import Run

__all__ = ["RunSource", "find_sources"]


def _url(fs: pafs.FileSystem, path: str) -> str:
    """How a file inside ``fs`` is named to a person: its local path, or its URL."""
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    scheme = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "abfs": "abfs"}.get(fs.type_name, fs.type_name)
    return f"{scheme}://{path}"


@dataclass
class RunSource:
    """One run's files and what their footers say (its metadata's generations are read with its columns).

    Attributes:
        fs, files: the filesystem and the run's files inside it, in row order.
        metadata: the run metadata (a table's run: without its generations, read with its columns).
        generations, sequences: its generations, and their sequences, counted from the footers.
        rows, steps, size: its rows, its largest step + 1, its bytes.
        columns: each file's columns (the run's names). file_rows, file_sizes: each file's rows and bytes.
        lengths: per generation, each sequence's length where its host told it.
    """

    fs: pafs.FileSystem
    files: list[str]
    metadata: RunMetadata
    vocab_raw: bytes | None = None
    vocab_ref: tuple[RunTable, str] | None = None
    generations: int = 0
    sequences: int = 0
    rows: int = 0
    steps: int = 0
    size: int = 0
    columns: list[set[str]] = field(default_factory=list)
    file_rows: list[int] = field(default_factory=list)
    file_sizes: list[int] = field(default_factory=list)
    lengths: dict[int, list[int]] = field(default_factory=dict)
    table: RunTable | None = None
    _parts: list[Part] | None = None

    @property
    def has_stats(self) -> bool:
        return bool(self.columns) and all("natural_entropy" in c for c in self.columns)

    @property
    def names(self) -> list[str]:
        return [_url(self.fs, f) for f in self.files]

    def parts(self) -> list[Part]:
        """The run's files, opened (a footer this process read is not parsed again) and checked."""
        if self._parts is None:
            opened = []
            for path in self.files:
                footer = None
                if self.table is not None:
                    footer = footer_of(self.table, path[len(self.table.where) + 1 :])
                if isinstance(self.fs, pafs.LocalFileSystem):
                    part = open_part(Path(path), metadata=footer)
                else:
                    part = open_part(path, self.fs, _url(self.fs, path), metadata=footer)
                _check_part(part, self.metadata)
                opened.append(part)
            self._parts = opened
        return self._parts

    def vocabulary(self, shared: dict[bytes, Vocabulary]) -> Vocabulary | None:
        """The run's vocabulary (shared by runs that carry the same bytes); RunFileError when damaged."""
        try:
            if self.vocab_ref is not None:
                from tracker.format.vocab_store import load_vocab

                table, key = self.vocab_ref
                return load_vocab(table.fs, table.where, key, table.location)
            if self.vocab_raw is None:
                return None
            key = (self.vocab_raw, self.metadata.vocab_size)  # one copy per vocabulary, checked against each width
            if key not in shared:
                shared[key] = vocabulary_from(self.vocab_raw, self.metadata.vocab_size)  # type: ignore[index]
            return shared[key]  # type: ignore[index]
        except (ValueError, OSError) as exc:
            raise RunFileError(self.names[0], str(exc)) from exc

    def vocab_identity(self) -> object:
        """What runs sharing this run's vocabulary share (its hash in a table, else its bytes)."""
        return ("table", self.vocab_ref[1]) if self.vocab_ref is not None else self.vocab_raw

    def token_display(self, shared: dict[bytes, Vocabulary], ids: np.ndarray) -> pa.Array:
        """How this run's vocabulary shows each of ``ids`` (in the vocabulary), without building all of a
        table's vocabulary."""
        try:
            if self.vocab_ref is not None:
                from tracker.format.vocab_store import token_display

                table, key = self.vocab_ref
                return token_display(table.fs, table.where, key, table.location, ids)
        except (ValueError, OSError) as exc:
            raise RunFileError(self.names[0], str(exc)) from exc
        vocab = self.vocabulary(shared) or Vocabulary.placeholder(self.metadata.vocab_size)
        return vocab.display_array.take(pa.array(ids))

    def load(self, shared: dict[bytes, Vocabulary], columns: list[str] | None = None) -> Run:
        """The run, with only ``columns`` (and the ids) read when given."""
        entries: list[dict] = []
        batches = []
        for part in self.parts():
            try:
                wanted = list(ID_COLUMNS) + [c for c in (columns or []) if c not in ID_COLUMNS]
                table = part.read_columns(wanted) if columns is not None else part.read_all()
                found = part.generations()
                check_generations(found, self.metadata.vocab_size)
            except (pa.ArrowException, OSError) as exc:
                raise RunFileError(part.path, arrow_reason(exc)) from exc
            except RunFileError:
                raise
            except ValueError as exc:
                raise RunFileError(part.path, str(exc)) from exc
            entries += found
            batches += table.to_batches()
        entries.sort(key=lambda e: e.get("generation", -1))
        check_rows(self.where, batches, self.metadata)
        run = Run(batches, replace(self.metadata, generations=entries), self.vocabulary(shared))
        try:  # a run vLLM sampled: its sampler's stages, computed from its rows
            return run.with_engine_stages()
        except ValueError as exc:
            raise RunFileError(self.where, str(exc)) from exc

    @property
    def where(self) -> str:
        """The run's file, or the folder of its files: what its errors name."""
        return self.names[0] if len(self.names) == 1 else posixpath.dirname(self.names[0])


#: The (schema, run shape) pairs this process found consistent: a table's thousand parts share a handful of
#: schemas, and checking each part's took 0.5 ms of the 2 s a first question over 1,000 runs spent opening.
_CONSISTENT: dict[tuple, None] = {}


def _check_part(part: Part, metadata: RunMetadata) -> None:
    part.bind(metadata)  # checks this file's row widths against its footer's counts
    schema = part.schema
    key = (schema.remove_metadata().serialize().to_pybytes(), metadata.storage, tuple(metadata.stages))
    key += (metadata.vocab_size, metadata.top_k)  # all that check_schemas reads of the metadata
    if key in _CONSISTENT:
        return
    check_schemas([(part.path, schema)], metadata, spill=True)  # this file alone; the run's all at load
    if len(_CONSISTENT) >= 256:
        _CONSISTENT.clear()
    _CONSISTENT[key] = None


def _metadata(path: str, raw: bytes | None) -> RunMetadata:
    try:
        return metadata_from(raw)
    except ValueError as exc:
        raise RunFileError(path, str(exc)) from exc


def _of_table(found: FoundRun) -> RunSource:
    """A table's run, from its parts' facts (no file opened)."""
    facts = found.facts
    metadata = facts[0].metadata or _metadata(str(found.path), facts[0].run_json.encode())
    if metadata.run_id != found.run_id:
        raise RunFileError(found.files[0], f"its metadata names another run than its table's {found.run_id!r}")
    counts = {g: b for f in facts for g, b in f.generations}
    suffix = f"_logits_{metadata.storage}"
    return RunSource(
        found.fs,
        list(found.files),
        metadata,
        vocab_ref=(found.table, facts[0].vocab) if facts[0].vocab and found.table is not None else None,
        generations=len(counts),
        sequences=sum(counts.values()),
        rows=sum(f.rows for f in facts),
        steps=max(f.steps for f in facts),
        size=sum(f.size for f in facts),
        columns=[{c[: -len(suffix)] + "_logits" if c.endswith(suffix) else c for c in f.columns} for f in facts],
        file_rows=[f.rows for f in facts],
        file_sizes=[f.size for f in facts],
        lengths={g: list(ls) for f in facts for g, ls in f.lengths},
        table=found.table,
    )


def _of_files(found: list[FoundRun], skipped: list[RunFileError] | None = None) -> list[RunSource]:
    """The runs held by these runs' files (files of one run share its run id), from their footers. With
    ``skipped`` (the files of a folder), a file that cannot be read is left out and its error added there;
    without it, RunFileError."""
    runs: dict[str, RunSource] = {}
    for run in found:
        for path in run.files:
            name = _url(run.fs, path)
            try:
                part, metadata, ref, entries = _read_footer(run, path, name)
                try:  # an Arrow IPC file's batches are read here: their lengths may lie
                    sizes, steps = part.block_sizes(), _steps(part)
                except (pa.ArrowException, OSError) as exc:
                    raise RunFileError(name, arrow_reason(exc)) from exc
            except RunFileError as exc:
                if skipped is None:
                    raise
                skipped.append(exc)
                continue
            source = runs.get(metadata.run_id)
            if source is None:
                vocab_ref = (run.table, ref) if ref is not None and run.table is not None else None
                source = runs[metadata.run_id] = RunSource(
                    run.fs, [], replace(metadata, generations=[]), part.footer.get(META_VOCAB), vocab_ref, _parts=[]
                )
            source.files.append(path)
            source._parts.append(part)  # type: ignore[union-attr]
            source.columns.append(set(part.schema.names))
            source.metadata = replace(source.metadata, generations=source.metadata.generations + entries)
            source.generations += len(entries)
            source.sequences += sum(int(e.get("batch_size") or 0) for e in entries)
            source.rows += sum(sizes)
            source.file_rows.append(sum(sizes))
            source.steps = max(source.steps, steps)
            source.size += int(part.nbytes)
    for source in runs.values():  # where the host told each sequence's length (it ends there)
        told = [e for e in source.metadata.generations if isinstance(e.get("lengths"), list)]
        source.lengths = {e["generation"]: e["lengths"] for e in told}
    return list(runs.values())


def _read_footer(run: FoundRun, path: str, name: str) -> tuple[Part, RunMetadata, str | None, list[dict]]:
    """One file's part, run metadata, vocabulary reference and generation entries, checked; RunFileError."""
    part = open_part(Path(path)) if isinstance(run.fs, pafs.LocalFileSystem) else open_part(path, run.fs, name)
    raw, ref = part.described()
    metadata = _metadata(name, raw)
    _check_part(part, metadata)
    try:
        entries = part.generations()
        check_generations(entries, metadata.vocab_size)
    except (pa.ArrowException, OSError) as exc:
        raise RunFileError(name, arrow_reason(exc)) from exc
    except RunFileError:
        raise
    except ValueError as exc:
        raise RunFileError(name, str(exc)) from exc
    return part, metadata, ref, entries


def _steps(part: Part) -> int:
    """The largest step of a Parquet part + 1, from its footer's statistics (an IPC part: from its ids)."""
    meta = getattr(getattr(part, "file", None), "metadata", None)
    if meta is None:
        steps = part.read_ids().column("step").to_numpy()
        return int(steps.max()) + 1 if steps.size else 0
    names = part.file.schema_arrow.names  # type: ignore[attr-defined]
    high = -1
    if "step" in names:
        index = names.index("step")
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(index).statistics
            if stats is not None and stats.has_min_max:
                high = max(high, int(stats.max))
    return high + 1


def find_sources(location: str | os.PathLike[str], skipped: list[RunFileError] | None = None) -> list[RunSource]:
    """Every complete run at ``location`` (a run file, a folder of run files, a table or a folder of
    completion markers, or a URL of one), sorted by run id; NoRunError when none is there. With ``skipped``,
    a file of a folder that cannot be read is left out and its error added there (raised when no run is left);
    a run file given alone that cannot be read raises RunFileError."""
    found = [r for r in find_runs(location, depth=1) if r.kind != "spill"]
    if not found:
        raise NoRunError(
            location,
            "the folder holds no run files (.parquet, .arrow), no table and no complete run_id=... folders",
        )
    sources = [_of_table(r) for r in found if r.kind == "table"]
    alone = len(found) == 1 and len(found[0].files) == 1 and found[0].kind != "table"
    sources += _of_files([r for r in found if r.kind != "table"], None if alone else skipped)
    if not sources and skipped:
        raise skipped[0]
    return sorted(sources, key=lambda s: s.metadata.run_id)
