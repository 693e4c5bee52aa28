"""The run's Arrow schema, declared once and versioned, and its metadata.

One row per (generation, sequence, step). The id columns come first; then one
column group per recorded stage ("natural": the logits before the wrapped
processor, "constrained": what it returned, "sampled": the distribution the
sampling stack drew from, as log-probabilities):

================================ ===================================== ===========
column                           type                                  storage
================================ ===================================== ===========
``generation``                   int32                                 all
``sequence``                     int32 (the batch row)                 all
``step``                         int32 (index of the generated token)  all
``chosen``                       int64, null until known               all
``processor_error``              bool: the wrapped processor failed    all
``{stage}_logits``               fixed_size_list<V> of float32,        full
                                 float16, or uint16 holding bfloat16
                                 (half precision with statistics: the
                                 logits minus ``{stage}_max``, see
                                 :data:`FIELD_OFFSET`)
``{stage}_topk_ids``             fixed_size_list<k> of int32           top-k
``{stage}_topk_logits``          fixed_size_list<k> of float32         top-k
``{stage}_topk_natural``         natural logits at those ids           top-k
                                 (stages other than natural)
``{stage}_lse``                  float32: the row's log-sum-exp        top-k
``{stage}_allowed``              int32: tokens with logit > -inf       top-k
``{stage}_nonfinite``            bool: the stored row holds NaN/+inf   all (exports)
================================ ===================================== ===========

Statistics columns (:data:`STAT_COLUMNS`, schema 1.1), computed from the whole
row when it is recorded (on its device), in every storage mode, so that a
top-k run answers them exactly and a full run without another pass:

================================ =====================================================
``{stage}_lse``, ``_allowed``    log-sum-exp and count of tokens with probability > 0
``{stage}_max``                  the row's largest logit
``{stage}_entropy``              entropy in nats
``{stage}_nan``                  NaN entries (left out of the distribution)
``{stage}_p_eos``                probability of the EOS ids (NaN when none are known)
``{stage}_chosen_logit``,        the chosen token's logit, probability and rank
``_p_chosen``, ``_rank_chosen``  (0 = best); null until the chosen token is known
``{stage}_removed_mass``,        natural probability of the tokens this stage masked;
``{stage}_margin``               best natural log-probability minus the best one this
                                 stage allows (stages other than natural)
================================ =====================================================

A row's distribution leaves NaN entries out; a row holding ``+inf`` is a
one-hot on its ``+inf`` token(s) (``lse`` is then ``+inf`` and ``allowed``
counts the ``+inf`` tokens).

The ``_nonfinite`` flags are computed when a run is exported
(:meth:`tracker.Run.to_arrow`), not while recording, so recording stays a copy;
the recorder's own batches use the schema without them (``flags=False``).

A stage's value columns are null in rows where that stage was not recorded
(the wrapped processor raised, or the sampling tap was not there). Run-level
facts travel in the schema metadata under :data:`META_RUN` (JSON) and
:data:`META_VOCAB` (a table's part names it by hash); files: :mod:`tracker.format.columns`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import pyarrow as pa

__all__ = [
    "SCHEMA_VERSION",
    "ID_SCHEMA",
    "META_RUN",
    "META_VOCAB",
    "META_VOCAB_REF",
    "FIELD_DTYPE",
    "FIELD_OFFSET",
    "row_offsets",
    "STORAGE_KINDS",
    "StorageKind",
    "RunMetadata",
    "value_column",
    "stage_fields",
    "column_stages",
    "run_schema",
    "flag_column",
    "GENERATIONS_COLUMN",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH",
    "check_generations",
    "STAT_COLUMNS",
    "stat_names",
    "as_float32",
    "check_columns",
    "generations_column",
    "generations_from_column",
]

#: Bumped when a column changes meaning or type; readers check the major part (1.2: the file layout of columns.py).
SCHEMA_VERSION = "1.2"

#: Schema metadata keys.
META_RUN = b"logitscope.run"
META_VOCAB = b"logitscope.vocab"
META_VOCAB_REF = b"logitscope.vocab_sha256"  # a table's part: its vocabulary's hash (vocab_store.py)
#: Field metadata key naming the element type of a value column ("bfloat16" is stored as uint16).
FIELD_DTYPE = b"logitscope.dtype"
#: Field metadata key of a half-precision value column stored relative to a per-row offset: the name of the
#: statistics column holding it (``b"max"``: ``{stage}_max``, the row's largest logit; 0 where not finite).
FIELD_OFFSET = b"logitscope.offset"

StorageKind = Literal["float32", "float16", "bfloat16", "topk"]
STORAGE_KINDS: tuple[str, ...] = ("float32", "float16", "bfloat16", "topk")

#: The id columns every run has, in order.
ID_SCHEMA = pa.schema(
    [
        pa.field("generation", pa.int32(), nullable=False),
        pa.field("sequence", pa.int32(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("chosen", pa.int64(), nullable=True),
        pa.field("processor_error", pa.bool_(), nullable=False),
    ]
)

#: Per-stage statistics columns (suffix -> type), in column order; see the module docstring.
STAT_COLUMNS: dict[str, pa.DataType] = {
    "lse": pa.float32(),
    "allowed": pa.int32(),
    "max": pa.float32(),
    "entropy": pa.float32(),
    "nan": pa.int32(),
    "p_eos": pa.float32(),
    "removed_mass": pa.float32(),
    "margin": pa.float32(),
    "chosen_logit": pa.float32(),
    "p_chosen": pa.float32(),
    "rank_chosen": pa.int32(),
}
_PAIR_STATS = ("removed_mass", "margin")


def stat_names(stage: str) -> list[str]:
    """The statistics suffixes a stage has (the natural stage has no removed mass or margin)."""
    return [name for name in STAT_COLUMNS if stage != "natural" or name not in _PAIR_STATS]


_FULL_TYPES = {"float32": pa.float32(), "float16": pa.float16(), "bfloat16": pa.uint16()}


def as_float32(values: np.ndarray, dtype: bytes) -> np.ndarray:
    """Stored values (``dtype``: a value column's :data:`FIELD_DTYPE`) as float32: float16 widened,
    bfloat16 (kept as uint16) shifted into the high half; float32 is returned as it is."""
    if dtype == b"bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


def row_offsets(data: pa.RecordBatch | pa.Table, stage: str, rows: np.ndarray | slice) -> np.ndarray | None:
    """``[rows]`` float32: what to add to the stored values of ``stage`` at ``rows`` to give the logits
    (:data:`FIELD_OFFSET`); None when the column is stored as the logits themselves."""
    field = data.schema.field(f"{stage}_logits") if f"{stage}_logits" in data.schema.names else None
    name = None if field is None else (field.metadata or {}).get(FIELD_OFFSET)
    if name is None:
        return None
    offsets = data.column(f"{stage}_{name.decode()}").to_numpy(zero_copy_only=False)[rows].astype(np.float32)
    return np.where(np.isfinite(offsets), offsets, np.float32(0))


def value_column(stage: str, storage: str) -> str:
    """The column holding a stage's values: ``{stage}_logits`` or ``{stage}_topk_logits``."""
    return f"{stage}_topk_logits" if storage == "topk" else f"{stage}_logits"


def flag_column(stage: str) -> str:
    """The column flagging rows of ``stage`` that hold NaN or +inf."""
    return f"{stage}_nonfinite"


def column_stages(columns: Sequence[str], stages: Sequence[str]) -> dict[str, str]:
    """The stage each of ``columns`` belongs to (``{stage}_...``; the longest stage name that fits, since one stage's
    name may begin another's: ``after:bias`` and ``after:bias_2``). Columns of no stage are left out."""
    by_length = sorted(stages, key=len, reverse=True)
    out = {}
    for column in columns:
        stage = next((s for s in by_length if column.startswith(f"{s}_")), None)
        if stage is not None:
            out[column] = stage
    return out


def stage_fields(
    stage: str, storage: str, vocab_size: int, top_k: int, flags: bool = True, stats: bool = False
) -> list[pa.Field]:
    """The columns of one stage for a storage kind (see the module tables; ``stats``: with the statistics)."""
    if storage == "topk":
        k = int(top_k)
        fields = [
            pa.field(f"{stage}_topk_ids", pa.list_(pa.int32(), k)),
            pa.field(f"{stage}_topk_logits", pa.list_(pa.float32(), k), metadata={FIELD_DTYPE: b"float32"}),
        ]
        if stage != "natural":
            fields.append(pa.field(f"{stage}_topk_natural", pa.list_(pa.float32(), k)))
        if not stats:
            fields += [
                pa.field(f"{stage}_lse", pa.float32()),
                pa.field(f"{stage}_allowed", pa.int32()),
            ]
    elif storage in _FULL_TYPES:
        # half-precision rows with statistics keep logit - max: the best logits, near 0, keep their digits
        offset = {FIELD_OFFSET: b"max"} if stats and storage != "float32" else {}
        fields = [
            pa.field(
                f"{stage}_logits",
                pa.list_(_FULL_TYPES[storage], int(vocab_size)),
                metadata={FIELD_DTYPE: storage.encode(), **offset},
            )
        ]
    else:
        raise ValueError(f"storage must be one of {STORAGE_KINDS}, got {storage!r}")
    if stats:
        fields += [pa.field(f"{stage}_{name}", STAT_COLUMNS[name]) for name in stat_names(stage)]
    if flags:
        fields.append(pa.field(f"{stage}_nonfinite", pa.bool_(), nullable=False))
    return fields


def run_schema(
    storage: str,
    stages: tuple[str, ...] | list[str],
    vocab_size: int,
    top_k: int,
    metadata: dict[bytes, bytes] | None = None,
    flags: bool = True,
    stats: bool = False,
) -> pa.Schema:
    """The schema of a run: :data:`ID_SCHEMA` then each stage's columns (``flags``: with ``_nonfinite``;
    ``stats``: with the statistics columns, as the recorder writes them)."""
    fields = list(ID_SCHEMA)
    for stage in stages:
        fields += stage_fields(stage, storage, vocab_size, top_k, flags, stats)
    return pa.schema(fields, metadata=metadata)


@dataclass
class RunMetadata:
    """What a run says about itself; stored as JSON under :data:`META_RUN`.

    Attributes:
        run_id: unique name of the run (also its partition value on disk).
        storage: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"topk"``.
        top_k: values kept per stage and row in top-k storage (0 otherwise).
        stages: the recorded stages, in pipeline order.
        vocab_size: the width of every logits row.
        eos_token_ids: end-of-sequence ids (steps after one are "finished").
        model: the model's name, when known.
        processors: a description of the wrapped processor.
        sampling: sampling parameters, when the host told them (logitscope's
            Generator does; :meth:`~tracker.LogitTrackingProcessor.annotate`
            sets them by hand): one dict, or one per request.
        generations: per generation: ``{"generation", "batch_size",
            "prompt_ids" (one list per row), "started_at"}``, and
            ``"sampling"`` (one dict per row, seed included) when the host
            told them.
        library_version, created_at, schema_version: provenance.
        extra: anything the user added (JSON-ready).
        stage_aliases: other names of recorded stages (``{"after:penalties":
            "constrained"}``: with one stage per processor, the last
            processor's stage is the one stored as ``constrained``).

    In a Parquet file the ``generations`` list does not travel in the footer
    (Parquet caps a footer at 100 MB, and a run may hold many long prompts):
    ``Run.to_parquet`` writes each generation's entry as JSON in the column
    :data:`GENERATIONS_COLUMN`, on the generation's first row, and readers put
    it back. What stays in the footer must fit :data:`MAX_METADATA_BYTES`.
    """

    run_id: str
    storage: str
    top_k: int
    stages: list[str]
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    model: str | None = None
    processors: str | None = None
    sampling: Any = None
    generations: list[dict[str, Any]] = field(default_factory=list)
    library_version: str = ""
    created_at: str = ""
    schema_version: str = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    stage_aliases: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        # fields() rather than asdict(): asdict deep-copies every prompt id first
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> RunMetadata:
        """Parse and check run metadata; ValueError naming the field and what it holds when it is damaged."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"run metadata is not valid JSON ({exc})") from exc
        except RecursionError:
            raise ValueError(f"run metadata is nested deeper than {MAX_METADATA_DEPTH} levels") from None
        if not isinstance(data, dict):
            raise ValueError(f"run metadata must be a JSON object, got {type(data).__name__}")
        version = str(data.get("schema_version", ""))
        if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise ValueError(
                f"run schema version {version!r} cannot be read by this logitscope (it reads schema "
                f"{SCHEMA_VERSION.split('.')[0]}.x, up to {SCHEMA_VERSION}); open it with the logitscope version that wrote it"
            )
        for name, kinds, allowed in _METADATA_FIELDS:
            if name not in data:
                if name in _REQUIRED_FIELDS:
                    raise ValueError(f"run metadata lacks the field {name!r}")
                continue
            value = data[name]
            if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
                raise ValueError(
                    f"run metadata field {name!r} must be {allowed}, got {type(value).__name__} {value!r:.80}"
                )
        if data["storage"] not in STORAGE_KINDS:
            raise ValueError(
                f"run metadata field 'storage' must be one of {STORAGE_KINDS}, got {data['storage']!r:.80}"
            )
        if data["vocab_size"] < 0 or data["top_k"] < 0:
            raise ValueError(
                f"run metadata: vocab_size and top_k must be >= 0, got {data['vocab_size']} and {data['top_k']}"
            )
        stages = data["stages"]
        if not all(isinstance(s, str) for s in stages) or stages[:1] != ["natural"] or len(set(stages)) < len(stages):
            raise ValueError(f"run metadata field 'stages' must begin with 'natural', each once, got {stages!r:.80}")
        check_generations(data.get("generations", []), data["vocab_size"])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in data.get("eos_token_ids", [])):
            raise ValueError(
                f"run metadata field 'eos_token_ids' must be a list of token ids, got {data['eos_token_ids']!r:.80}"
            )
        too_deep = _deeper_than({k: v for k, v in data.items() if k != "generations"}, MAX_METADATA_DEPTH)
        if too_deep:
            raise ValueError(f"run metadata field {too_deep!r} is nested deeper than {MAX_METADATA_DEPTH} levels")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


#: How deep run metadata (``extra``, ``sampling``, a generation's entry) may nest: deeper is refused, so that no
#: reader recurses past Python's limit (json, repr, copies) on a crafted file.
MAX_METADATA_DEPTH = 32
_BULK_KEYS = ("prompt_ids", "prompt_logprobs")


def _deeper_than(value: Any, limit: int) -> str | None:
    """The top-level key of ``value`` (a dict) under which containers nest deeper than ``limit``, else None.
    Walks containers without recursion; lists of scalars cost one ``isinstance`` per item."""
    for key, item in value.items():
        stack = [(item, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > limit:
                return str(key)
            children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return None


def _token_rows(rows: Any, vocab_size: int, what: str) -> None:
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ValueError(f"{what} must be a list of token id lists, got {rows!r:.80}")
    for row in rows:
        if not all(type(t) is int for t in row):
            raise ValueError(f"{what} must hold integer token ids, got {row!r:.80}")
        if row and (min(row) < 0 or max(row) >= vocab_size):
            raise ValueError(
                f"{what} holds token id {min(row) if min(row) < 0 else max(row)}, outside [0, {vocab_size})"
            )


def check_generations(entries: Any, vocab_size: int) -> None:
    """ValueError saying what is wrong when generation entries (see :class:`RunMetadata`) are not what a run
    writes: objects with an integer ``generation`` >= 0, integer prompt ids in the vocabulary, nesting
    within :data:`MAX_METADATA_DEPTH`. One pass over the prompt ids."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("run metadata field 'generations' must be a list of objects")
    for entry in entries:
        number = entry.get("generation")
        if type(number) is not int or number < 0:
            raise ValueError(f"a generation entry's 'generation' must be an integer >= 0, got {number!r:.80}")
        what = f"generation {number}'s"
        if "batch_size" in entry and (type(entry["batch_size"]) is not int or entry["batch_size"] < 0):
            raise ValueError(f"{what} 'batch_size' must be an integer >= 0, got {entry['batch_size']!r:.80}")
        if "prompt_ids" in entry:
            _token_rows(entry["prompt_ids"], vocab_size, f"{what} 'prompt_ids'")
        scores = entry.get("prompt_logprobs", [])
        if not isinstance(scores, list) or not all(isinstance(r, list) for r in scores):
            raise ValueError(f"{what} 'prompt_logprobs' must be a list of lists, got {scores!r:.80}")
        if any(not (v is None or isinstance(v, (int, float))) for r in scores for v in r):
            raise ValueError(f"{what} 'prompt_logprobs' must hold numbers or nulls")
        too_deep = _deeper_than({k: v for k, v in entry.items() if k not in _BULK_KEYS}, MAX_METADATA_DEPTH)
        if too_deep:
            raise ValueError(f"{what} field {too_deep!r} is nested deeper than {MAX_METADATA_DEPTH} levels")


#: The column of a Parquet run file holding each generation's metadata entry (JSON, on its first row).
GENERATIONS_COLUMN = "generation_meta"
#: The most bytes of run metadata (JSON, without the generations) a Parquet footer takes.
MAX_METADATA_BYTES = 4 << 20

_REQUIRED_FIELDS = ("run_id", "storage", "top_k", "stages", "vocab_size")
#: (field, accepted types, what to say when it is something else)
_METADATA_FIELDS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("run_id", (str,), "a string"),
    ("storage", (str,), "a string"),
    ("top_k", (int,), "an integer"),
    ("stages", (list,), "a list of stage names"),
    ("vocab_size", (int,), "an integer"),
    ("eos_token_ids", (list,), "a list of token ids"),
    ("model", (str, type(None)), "a string or null"),
    ("processors", (str, type(None)), "a string or null"),
    ("generations", (list,), "a list of objects"),
    ("library_version", (str,), "a string"),
    ("created_at", (str,), "a string"),
    ("extra", (dict,), "an object"),
    ("stage_aliases", (dict,), "an object mapping stage names"),
)


# ---------------------------------------------------------------- the columns a run's metadata implies


def check_columns(
    schema: pa.Schema, metadata: RunMetadata, *, complete: bool = True, present: Collection[str] | None = None
) -> None:
    """Every column the metadata implies is there with its type.

    ``_nonfinite`` flags may be absent; with ``complete=False`` (a spill chunk
    written before a stage was added) any column may be. ``present``: the columns that count as there (default:
    the schema's; a run of several files passes the union of theirs). ValueError saying which column is
    missing, of which wrong type, or there twice.
    """
    if repeated := sorted({n for n in schema.names if schema.names.count(n) > 1}):
        raise ValueError(f"it holds columns {repeated} more than once; a run file has each column once")
    try:
        expected = run_schema(metadata.storage, metadata.stages, metadata.vocab_size, metadata.top_k)
    except (ValueError, TypeError, OverflowError, pa.ArrowException) as exc:
        raise ValueError(f"its metadata describes no valid run schema ({exc})") from exc
    there = set(schema.names if present is None else present)
    missing = [f.name for f in expected if f.name not in there and not f.name.endswith("_nonfinite")]
    if missing and complete:
        raise ValueError(
            f"its metadata declares storage {metadata.storage!r} with stages {metadata.stages} "
            f"(vocabulary {metadata.vocab_size}), but columns {missing} are missing"
        )
    names = set(schema.names)
    for stage in metadata.stages:  # a stage's statistics come together: some without the others is damage
        kept = [n for n in stat_names(stage) if f"{stage}_{n}" in names]
        if kept and "entropy" in kept and len(kept) < len(stat_names(stage)):
            lacking = [f"{stage}_{n}" for n in stat_names(stage) if n not in kept]
            raise ValueError(f"it has statistics columns of stage {stage!r} but lacks {lacking}")
    stats = [pa.field(f"{s}_{name}", STAT_COLUMNS[name]) for s in metadata.stages for name in stat_names(s)]
    for expected_field in [*expected, *stats]:  # statistics columns, where there, have their types too
        if expected_field.name in names:
            actual = schema.field(expected_field.name).type
            if actual != expected_field.type:
                raise ValueError(
                    f"column {expected_field.name!r} has type {actual}, a run with this metadata has {expected_field.type}"
                )


def generations_column(generation: np.ndarray, generations: list[dict[str, Any]]) -> pa.Array:
    """The :data:`GENERATIONS_COLUMN` of rows whose generation ids are ``generation``: each generation's
    metadata entry as a JSON list on its first row (null elsewhere); entries of generations without rows
    go on row 0."""
    values: list[list[dict[str, Any]] | None] = [None] * len(generation)
    unique, first = np.unique(generation, return_index=True)
    where = dict(zip(unique.tolist(), first.tolist()))
    for entry in generations:
        row = where.get(int(entry.get("generation", -1)), 0)
        values[row] = (values[row] or []) + [entry]
    return pa.array([None if v is None else json.dumps(v, separators=(",", ":")) for v in values], pa.string())


def generations_from_column(column: pa.ChunkedArray | pa.Array) -> list[dict[str, Any]]:
    """The generations' metadata entries held in a :data:`GENERATIONS_COLUMN`, in generation order."""
    if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
        raise ValueError(f"column {GENERATIONS_COLUMN!r} has type {column.type}, expected string (JSON)")
    entries: list[dict[str, Any]] = []
    for raw in column.drop_null().to_pylist():
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"column {GENERATIONS_COLUMN!r} holds text that is not JSON ({exc})") from exc
        except RecursionError:
            raise ValueError(f"column {GENERATIONS_COLUMN!r} holds JSON nested too deep") from None
        if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
            raise ValueError(f"column {GENERATIONS_COLUMN!r} must hold JSON lists of objects, got {raw[:80]!r}")
        entries.extend(value)
    return sorted(entries, key=lambda e: e.get("generation", -1) if isinstance(e.get("generation"), int) else -1)
