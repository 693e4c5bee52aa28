"""How a run's columns sit in a Parquet file, and how a reader gets the run schema back.

Run files of schema 1.2 are written without pyarrow's copy of the Arrow schema
(``store_schema=False``): that copy repeated the schema metadata, so every
file carried its vocabulary twice. Parquet itself has no fixed-size list, no
16-bit float that every engine reads, and Delta Lake tables have no 16-bit
float at all, so a file holds:

- every ``fixed_size_list`` column as a Parquet list (a reader without the
  Arrow schema sees a plain list);
- no ``{stage}_nonfinite`` flag where the stage has its statistics columns;
- a half-precision value column (``{stage}_logits`` in float16 or bfloat16)
  as the 16-bit patterns of its values, in int16, under the name
  ``{stage}_logits_float16`` or ``{stage}_logits_bfloat16``: one table may then
  hold float32 and half-precision runs without two types for one column;
- in a table's part, the run metadata in the column :data:`RUN_META`: the same
  JSON on every row (one dictionary entry), with what the part holds under
  ``"part"`` (its generations, their batch sizes and lengths, the first
  prompt's ids, the vocabulary's hash, whether it has statistics). A table's commit repeats
  it as that column's statistics, so the table's log alone lists its runs
  (:mod:`tracker.format.table`); a single file keeps it in its footer instead.

:func:`restore` gives the run schema back from the run's metadata (the types,
the width of every row checked, the field metadata the schema module
defines). Files written before 1.2 carry the Arrow schema: their columns read as
they are. Needs pyarrow and numpy only.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import fields

import pyarrow as pa

from tracker.format.schema import FIELD_DTYPE, GENERATIONS_COLUMN, RunMetadata, run_schema

__all__ = [
    "ARROW_SCHEMA_KEY",
    "RUN_META",
    "to_file",
    "restore",
    "restored_schema",
    "bits_name",
    "file_names",
    "part_json",
    "NOT_ROWS",
]

#: The key under which pyarrow stores its copy of the Arrow schema in a Parquet footer.
ARROW_SCHEMA_KEY = b"ARROW:schema"
#: A table part's column holding the run metadata and what the part holds (see the module docstring).
RUN_META = "run_meta"
#: The columns of a file that describe the run rather than hold its rows.
NOT_ROWS = (GENERATIONS_COLUMN, RUN_META)
#: Prompt ids a part's facts keep (for listings: the first prompt of its last generation).
PROMPT_IDS = 64
_KEPT = ("run_id", "storage", "top_k", "stages", "vocab_size", "schema_version")
_HALF = ("float16", "bfloat16")


def bits_name(stage: str, storage: str) -> str:
    """The file column holding a half-precision stage's values as 16-bit patterns."""
    return f"{stage}_logits_{storage}"


def to_file(table: pa.Table) -> pa.Table:
    """``table`` (the run schema) with its columns as a file holds them (see the module docstring): the
    half-precision value columns renamed and viewed as int16 (no value is copied), the ``_nonfinite``
    flags of stages with statistics left out (their ``_nan`` and ``_lse`` say it; :meth:`tracker.Run.to_arrow`
    computes them again). Fixed-size lists are written as Parquet lists as they are."""
    names, columns = [], []
    present = set(table.schema.names)
    for field, column in zip(table.schema, table.columns):
        if field.name.endswith("_nonfinite") and f"{field.name[: -len('_nonfinite')]}_nan" in present:
            continue  # the stage's statistics tell it (NaN count, +inf log-sum-exp): computed when read
        kind = (field.metadata or {}).get(FIELD_DTYPE, b"").decode()
        if pa.types.is_fixed_size_list(field.type) and kind in _HALF:
            bits = pa.list_(pa.int16(), field.type.list_size)
            chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
            column = pa.chunked_array([c.view(bits) for c in chunks], bits)
            names.append(bits_name(field.name[: -len("_logits")], kind))
        else:
            names.append(field.name)
        columns.append(column)
    return pa.Table.from_arrays(columns, names=names, metadata=table.schema.metadata)


def _expected(metadata: RunMetadata, names: set[str]) -> dict[str, pa.Field]:
    stats = "natural_entropy" in names
    flags = any(n.endswith("_nonfinite") for n in names)
    return _fields(metadata.storage, tuple(metadata.stages), metadata.vocab_size, metadata.top_k, flags, stats)


@functools.lru_cache(maxsize=256)
def _fields(
    storage: str, stages: tuple[str, ...], vocab: int, top_k: int, flags: bool, stats: bool
) -> dict[str, pa.Field]:
    return {f.name: f for f in run_schema(storage, stages, vocab, top_k, flags=flags, stats=stats)}


def restored_schema(schema: pa.Schema, metadata: RunMetadata, arrow_schema: bool) -> pa.Schema:
    """The run schema of a file whose own (Parquet) schema is ``schema``: what :func:`restore` gives.

    ``arrow_schema``: the file carries pyarrow's copy of the Arrow schema (written before 1.2, or rewritten
    by a pyarrow user): a column of the run's type keeps its field as written (the field metadata of its
    time). Columns the metadata does not name keep their types.
    """
    bare = schema.remove_metadata()
    key = (bare.serialize().to_pybytes(), metadata.storage, tuple(metadata.stages), metadata.vocab_size)
    key += (metadata.top_k, arrow_schema)
    restored = _RESTORED.get(key)
    if restored is None:  # a table's parts share a few schemas: 0.2 ms a part, of 1.5 ms, in a first question
        restored = _RESTORED[key] = _restored_schema(bare, metadata, arrow_schema)
        if len(_RESTORED) > 256:
            _RESTORED.pop(next(iter(_RESTORED)))
    return restored.with_metadata(schema.metadata) if schema.metadata else restored


_RESTORED: dict[tuple, pa.Schema] = {}


def _restored_schema(schema: pa.Schema, metadata: RunMetadata, arrow_schema: bool) -> pa.Schema:
    expected = _expected(metadata, set(schema.names))
    fields = []
    for field in schema:
        name = field.name
        if metadata.storage in _HALF and name.endswith(f"_logits_{metadata.storage}"):
            name = name[: -len(metadata.storage) - 1]
        want = expected.get(name)
        kept = want is None or (arrow_schema and name == field.name and field.type == want.type)
        fields.append(field if kept or not _restorable(field, want, name != field.name) else want)
    return pa.schema(fields)


def _restorable(field: pa.Field, want: pa.Field, bits: bool) -> bool:
    """Whether a file's column becomes the run's by the file layout's own conversions only (a list to a
    fixed-size list of the same values; 16-bit patterns to their half-precision values); anything else is
    left as it is, for the type checks to refuse."""
    have = field.type
    if have == want.type:
        return True
    if not pa.types.is_fixed_size_list(want.type) or not (pa.types.is_list(have) or pa.types.is_fixed_size_list(have)):
        return False
    return have.value_type == (pa.int16() if bits else want.type.value_type)


def restore(table: pa.Table, metadata: RunMetadata, path: str | os.PathLike[str], arrow_schema: bool) -> pa.Table:
    """``table`` read from a run file, with the run schema's types, names and field metadata back.

    ValueError naming ``path`` when a row is not as wide as the metadata says (a list of another length),
    or a column's type cannot be the run's.
    """
    target = restored_schema(table.schema, metadata, arrow_schema)
    columns = []
    for field, have, column in zip(target, table.schema, table.columns):
        if field.type == have.type:
            columns.append(column)
            continue
        try:
            if have.name != field.name:  # 16-bit patterns: view them as the stored dtype
                listed = pa.list_(field.type.value_type)
                column = pa.chunked_array([c.view(listed) for c in column.chunks], listed)
            columns.append(column.cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            reason = str(exc).strip().splitlines()[0]
            raise ValueError(
                f"'{path}': column {have.name!r} ({have.type}) cannot hold the run's {field.name!r} "
                f"({field.type}): {reason}"
            ) from exc
    return pa.Table.from_arrays(columns, schema=target)


def file_names(metadata: RunMetadata, stats: bool) -> list[str]:
    """The columns of a table part this version writes for a run of ``metadata`` (``stats``: with its
    statistics columns)."""
    return list(_file_names(metadata.storage, tuple(metadata.stages), metadata.vocab_size, metadata.top_k, stats))


@functools.lru_cache(maxsize=256)
def _file_names(storage: str, stages: tuple[str, ...], vocab_size: int, top_k: int, stats: bool) -> tuple[str, ...]:
    schema = run_schema(storage, stages, vocab_size, top_k, stats=stats)
    return (*to_file(schema.empty_table()).column_names, *NOT_ROWS)


def part_json(metadata: RunMetadata, stats: bool, vocab_ref: str | None) -> str:
    """The :data:`RUN_META` value of a part: the run metadata but its generations, and under ``"part"`` the
    generations it holds (``[generation, batch_size]``), the lengths their host told
    (``[generation, [length per row]]``, where a sequence ends), its last generation's first prompt (at
    most :data:`PROMPT_IDS` ids), its vocabulary's hash and whether it has statistics."""
    defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default for f in fields(metadata)}
    body = {  # what is at its default is left out (RunMetadata.from_json gives it back): the log repeats this
        f.name: getattr(metadata, f.name)
        for f in fields(metadata)
        if f.name != "generations" and (f.name in _KEPT or getattr(metadata, f.name) != defaults[f.name])
    }
    entries = metadata.generations
    prompts = entries[-1].get("prompt_ids") if entries else None
    first = prompts[0][:PROMPT_IDS] if isinstance(prompts, list) and prompts and isinstance(prompts[0], list) else []
    body["part"] = {
        "generations": [[e.get("generation"), e.get("batch_size") or 0] for e in entries],
        "lengths": [[e.get("generation"), e["lengths"]] for e in entries if isinstance(e.get("lengths"), list)],
        "prompt_ids": first,
        "vocab": vocab_ref,
        "stats": stats,
    }
    return json.dumps(body, separators=(",", ":"))
