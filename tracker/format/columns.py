"""How a run's columns sit in a Parquet file, and how a reader gets the run schema back.

Run files of schema 1.2 are written without pyarrow's copy of the Arrow schema
(``store_schema=False``): that copy repeated the schema metadata, so every
file carried its vocabulary twice. Parquet itself has no fixed-size list, no
16-bit float that every engine reads, and Delta Lake tables have no 16-bit
float at all, so a file holds:

- every ``fixed_size_list`` column as a Parquet list (a reader without the
  Arrow schema sees a plain list);
- a half-precision value column (``{stage}_logits`` in float16 or bfloat16)
  as the 16-bit patterns of its values, in int16, under the name
  ``{stage}_logits_float16`` or ``{stage}_logits_bfloat16``: one table may then
  hold float32 and half-precision runs without two types for one column.

:func:`restore` gives the run schema back from the run's metadata (the types,
the width of every row checked, the field metadata the schema module
defines). Files written before 1.2 carry the Arrow schema: their columns read as
they are. Needs pyarrow and numpy only.
"""

from __future__ import annotations

import os

import pyarrow as pa

from tracker.format.schema import FIELD_DTYPE, RunMetadata, run_schema

__all__ = ["ARROW_SCHEMA_KEY", "to_file", "restore", "restored_schema", "bits_name"]

#: The key under which pyarrow stores its copy of the Arrow schema in a Parquet footer.
ARROW_SCHEMA_KEY = b"ARROW:schema"
_HALF = ("float16", "bfloat16")


def bits_name(stage: str, storage: str) -> str:
    """The file column holding a half-precision stage's values as 16-bit patterns."""
    return f"{stage}_logits_{storage}"


def to_file(table: pa.Table) -> pa.Table:
    """``table`` (the run schema) with its columns as a file holds them (see the module docstring): the
    half-precision value columns renamed and viewed as int16 (no value is copied). Fixed-size lists are
    written as Parquet lists as they are."""
    names, columns = [], []
    for field, column in zip(table.schema, table.columns):
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
    schema = run_schema(
        metadata.storage, metadata.stages, metadata.vocab_size, metadata.top_k, flags=flags, stats=stats
    )
    return {f.name: f for f in schema}


def restored_schema(schema: pa.Schema, metadata: RunMetadata, arrow_schema: bool) -> pa.Schema:
    """The run schema of a file whose own (Parquet) schema is ``schema``: what :func:`restore` gives.

    ``arrow_schema``: the file carries pyarrow's copy of the Arrow schema (written before 1.2, or rewritten
    by a pyarrow user): a column of the run's type keeps its field as written (the field metadata of its
    time). Columns the metadata does not name keep their types.
    """
    expected = _expected(metadata, set(schema.names))
    fields = []
    for field in schema:
        name = field.name
        if metadata.storage in _HALF and name.endswith(f"_logits_{metadata.storage}"):
            name = name[: -len(metadata.storage) - 1]
        want = expected.get(name)
        kept = want is None or (arrow_schema and name == field.name and field.type == want.type)
        fields.append(field if kept or not _restorable(field, want, name != field.name) else want)
    return pa.schema(fields, metadata=schema.metadata)


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
