"""What a run file's values must satisfy, checked where they are read: run files may come from anyone.

A crafted file must be refused with one line naming it, never crash the
process nor answer wrongly. The checks here are those that read values, kept
cheap and off the recording path:

- :func:`check_batch`: a record batch's declared lengths fit its buffers and
  its offsets stay inside them (``RecordBatch.validate(full=True)``: a pass
  over offsets and text, none over fixed-width values, which it only sizes;
  once per batch of a memory-mapped IPC file, before any value is touched);
- :func:`check_row_groups`: a Parquet footer's row counts agree with each
  other (a lowered count would drop rows);
- :func:`check_ids`: the id columns (read whole by every reader anyway): no
  nulls where the schema has none, non-negative generation/sequence/step,
  chosen ids in the vocabulary (null or -1: unknown), each
  (generation, sequence, step) once (a folder holding a run and a copy of it
  is refused, never read with every step twice);
- :func:`check_topk`: top-k ids inside the vocabulary (one pass over the
  ``k``-wide id columns, not the vocabulary-wide values);
- :func:`damaged_lse`: rows whose log-sum-exp is below their largest stored
  logit (probabilities above 1): the query reading them says so.

Metadata limits (nesting depth, field types) are checked by
:meth:`tracker.format.schema.RunMetadata.from_json`.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from processors.vocab import Vocabulary
from tracker.format.schema import ID_SCHEMA, RunMetadata, check_columns, value_column

__all__ = [
    "RunFileError",
    "check_stats",
    "stats_damage",
    "DamagedRowError",
    "arrow_reason",
    "metadata_from",
    "vocabulary_from",
    "check_batch",
    "check_ids",
    "check_row_groups",
    "check_topk",
    "check_rows",
    "row_stats_damage",
    "check_schemas",
    "damaged_lse",
    "LSE_TOLERANCE",
]

ID_COLUMNS: tuple[str, ...] = tuple(ID_SCHEMA.names)

#: How far (nats) a stored log-sum-exp may sit below the row's largest stored logit (float32 rounding).
LSE_TOLERANCE = 1e-3


def arrow_reason(exc: BaseException) -> str:
    """What an Arrow or OS error reading a run file means, in words."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lowered = text.lower()
    if "checksum" in lowered or "crc" in lowered:
        return f"a data page fails its checksum: the file is damaged ({text})"
    if "magic" in lowered or "footer" in lowered or "not an arrow file" in lowered:
        return f"the file is truncated or is not a Parquet/Arrow file ({text})"
    return f"the file could not be read ({type(exc).__name__}: {text})"


def metadata_from(raw: bytes | None) -> RunMetadata:
    """Run metadata from its JSON (a schema's :data:`META_RUN` value); ValueError saying what is wrong."""
    if raw is None:
        raise ValueError(
            "it holds no logitscope run metadata (schema key 'logitscope.run'); it is a table, but not one "
            "written by tracker's Run.to_arrow / to_parquet / to_dataset"
        )
    return RunMetadata.from_json(raw)


def vocabulary_from(raw: bytes | None, vocab_size: int = 0) -> Vocabulary | None:
    """A vocabulary from its serialised form (a schema's :data:`META_VOCAB` value), None when there is none;
    ValueError when it is damaged or spells fewer than ``vocab_size`` tokens (the rows' width)."""
    if raw is None:
        return None
    try:
        vocab = Vocabulary.deserialize(raw)
    except Exception as exc:  # base64, Arrow or layout errors: all mean a damaged vocabulary
        raise ValueError(
            f"its vocabulary (schema key 'logitscope.vocab') is damaged ({type(exc).__name__}: {exc})"
        ) from exc
    if vocab.size < vocab_size:
        raise ValueError(f"its vocabulary holds {vocab.size} tokens, fewer than the {vocab_size} its rows have")
    return vocab


class RunFileError(ValueError):
    """A file or folder that cannot be read as a run; the message names it and what is wrong."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"'{path}' cannot be read as a logitscope run: {reason}")


def _fail(path: str | os.PathLike[str], reason: str) -> None:
    raise RunFileError(path, reason)


def check_batch(path: str | os.PathLike[str], batch: pa.RecordBatch, where: str) -> None:
    """RunFileError naming ``path`` when ``batch``'s declared lengths or offsets do not fit its buffers, or its
    text is not UTF-8 (reads offsets and text; fixed-width values are only sized)."""
    try:
        batch.validate(full=True)
    except pa.ArrowException as exc:
        reason = str(exc).strip().splitlines()[0]
        _fail(path, f"{where} declares more values than its buffers hold: the file is damaged ({reason})")


def check_row_groups(path: str | os.PathLike[str], meta: pq.FileMetaData) -> None:
    """RunFileError naming ``path`` when a Parquet footer's row counts contradict each other (reads no page): a
    row group must hold as many rows as each of its flat columns holds values, and the file the sum of its
    row groups (a lowered count would drop rows without a word)."""
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        total += group.num_rows
        for j in range(group.num_columns):
            column = group.column(j)
            if "." not in column.path_in_schema and column.num_values != group.num_rows:
                _fail(
                    path,
                    f"row group {g} says it holds {group.num_rows} rows, but its column {column.path_in_schema!r} "
                    f"holds {column.num_values} values: the file is damaged",
                )
    if total != meta.num_rows:
        _fail(path, f"its row groups hold {total} rows, but its footer says {meta.num_rows}: the file is damaged")


def check_ids(path: str | os.PathLike[str], ids: pa.Table | pa.RecordBatch, vocab_size: int) -> None:
    """RunFileError naming ``path`` when the id columns cannot be a run's (see the module docstring).

    One pass over the id columns (and a sort of the row keys to find repeated ones).
    """
    for name in ("generation", "sequence", "step", "processor_error"):
        column = ids.column(name)
        if column.null_count:
            _fail(path, f"column {name!r} holds {column.null_count} null(s); every row has one")
    for name in ("generation", "sequence", "step"):
        low = pc.min(ids.column(name)).as_py()
        if low is not None and low < 0:
            _fail(path, f"column {name!r} holds {low}; it must be >= 0")
    chosen = pc.min_max(ids.column("chosen")).as_py()
    if chosen["min"] is not None and (chosen["min"] < -1 or chosen["max"] >= max(vocab_size, 1)):
        bad = chosen["min"] if chosen["min"] < -1 else chosen["max"]
        _fail(
            path,
            f"column 'chosen' holds {bad}, outside the vocabulary [0, {vocab_size}) (null or -1: not known)",
        )
    if ids.num_rows < 2:
        return
    columns = [ids.column(n).to_numpy().astype(np.int64) for n in ("generation", "sequence", "step")]
    order = np.lexsort(columns[::-1])
    keys = np.stack([c[order] for c in columns], axis=1)
    same = np.all(keys[1:] == keys[:-1], axis=1)
    if same.any():
        g, s, t = keys[int(np.argmax(same))].tolist()
        _fail(
            path,
            f"generation {g}, sequence {s}, step {t} is recorded {int(same.sum()) + 1 if same.sum() == 1 else 'several'} "
            "times (two files of one run id, or a copy of a run beside it?); keep one copy",
        )


def check_topk(path: str | os.PathLike[str], batches: list[pa.RecordBatch] | pa.Table, metadata: RunMetadata) -> None:
    """RunFileError naming ``path`` when a stored top-k id is outside ``[0, vocab_size)`` (one pass over the
    ``k``-wide id columns; nothing to do in full storage)."""
    if metadata.storage != "topk":
        return
    for batch in batches.to_batches() if isinstance(batches, pa.Table) else batches:
        for stage in metadata.stages:
            name = f"{stage}_topk_ids"
            if name not in batch.schema.names:
                continue
            bounds = pc.min_max(batch.column(name).flatten()).as_py()
            if bounds["min"] is not None and (bounds["min"] < 0 or bounds["max"] >= metadata.vocab_size):
                bad = bounds["min"] if bounds["min"] < 0 else bounds["max"]
                _fail(path, f"column {name!r} holds token id {bad}, outside the vocabulary [0, {metadata.vocab_size})")


def check_schemas(
    files: list[tuple[str | os.PathLike[str], pa.Schema]], metadata: RunMetadata, *, spill: bool = False
) -> None:
    """RunFileError naming the file when the ``(path, schema)`` of a run's files cannot hold the run its
    ``metadata`` describes: every file has the id columns and the natural stage's values, no column twice,
    the types the metadata implies; outside a spill folder (whose chunks may predate a stage) every
    declared column is in some file (``_nonfinite`` flags may be absent)."""
    present: set[str] = set()
    for path, schema in files:
        names = set(schema.names)
        lacking = [n for n in (*ID_COLUMNS, value_column("natural", metadata.storage)) if n not in names]
        if lacking:  # the id columns and the natural stage's values: every run, every chunk has them
            raise RunFileError(path, f"it lacks the columns {lacking} every run has")
        try:
            check_columns(schema, metadata, complete=False)
        except ValueError as exc:
            raise RunFileError(path, str(exc)) from exc
        present |= names
    if not spill and files:
        try:
            check_columns(files[0][1], metadata, present=present)
        except ValueError as exc:
            raise RunFileError(files[0][0], str(exc)) from exc


class DamagedRowError(ValueError):
    """A stored row whose values cannot be right (a run file crafted or damaged past what its checks at load
    catch); the query that reads it raises this rather than answer."""


def damaged_lse(values: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """``[t]`` bool: rows whose log-sum-exp is below their largest stored (finite) logit, or NaN where the
    row holds a value: their probabilities would exceed 1; and rows whose log-sum-exp is +inf though they
    store no +inf (every probability would read 0). ``values`` ``[t, k]``, ``lse`` ``[t]``."""
    with np.errstate(invalid="ignore"):
        finite = np.where(np.isfinite(values), values, -np.inf)
        top = finite.max(axis=1) if finite.shape[1] else np.full(len(lse), -np.inf)
        stored = np.isfinite(top)
        no_inf = ~(values == np.inf).any(axis=1) if values.shape[1] else np.ones(len(lse), bool)
        return (stored & ~(lse >= top - LSE_TOLERANCE)) | ((lse == np.inf) & no_inf)


def _floats(data: pa.RecordBatch | pa.Table, name: str) -> np.ndarray | None:
    if name not in data.schema.names:
        return None
    return data.column(name).to_numpy(zero_copy_only=False).astype(np.float64)  # nulls as NaN


def _row(data: pa.RecordBatch | pa.Table, bad: np.ndarray) -> str:
    """Where the first of the ``bad`` rows is, and how many there are."""
    i = int(np.argmax(bad))
    at = [data.column(n)[i].as_py() if n in data.schema.names else "?" for n in ("generation", "sequence", "step")]
    more = f" (and {int(bad.sum()) - 1} more row(s))" if bad.sum() > 1 else ""
    return f"at generation {at[0]}, sequence {at[1]}, step {at[2]}{more}"


def _stage_damage(data: pa.RecordBatch | pa.Table, stage: str, vocab_size: int) -> tuple[np.ndarray, str] | None:
    """The first impossibility of :func:`stats_damage` in one stage: ``(rows, what)``."""
    lse = _floats(data, f"{stage}_lse")
    if lse is None:
        return None
    recorded = data.column(f"{stage}_lse").is_valid().to_numpy(zero_copy_only=False)
    allowed, top = _floats(data, f"{stage}_allowed"), _floats(data, f"{stage}_max")
    entropy, rank = _floats(data, f"{stage}_entropy"), _floats(data, f"{stage}_rank_chosen")
    p_chosen, chosen_logit = _floats(data, f"{stage}_p_chosen"), _floats(data, f"{stage}_chosen_logit")
    never = np.zeros(len(lse), bool)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        finite = np.isfinite(lse)
        tol = 1e-3 * np.maximum(1.0, np.abs(np.where(finite, lse, 0.0)))
        room = np.log(np.maximum(allowed, 1)) if allowed is not None else np.inf
        found = [
            (
                recorded & np.isnan(lse),
                f"column '{stage}_lse' is NaN in a recorded row (NaN logits are left out of it)",
            ),
            (
                never if allowed is None else recorded & ~((allowed >= 0) & (allowed <= vocab_size)),
                f"column '{stage}_allowed' holds counts outside [0, {vocab_size}]",
            ),
            (
                never if allowed is None else recorded & ((lse == -np.inf) != (allowed == 0)),
                f"columns '{stage}_lse' and '{stage}_allowed' disagree (a row allows no token exactly when its "
                "log-sum-exp is -inf)",
            ),
            (
                never
                if top is None
                else (finite & ~((top <= lse + tol) & (lse <= top + room + tol)))
                | (recorded & ~finite & ~np.isnan(lse) & (top != lse)),
                f"columns '{stage}_lse' and '{stage}_max' disagree (the log-sum-exp of a row lies in [max, max + "
                "log(allowed)], and is +inf or -inf only with its max)",
            ),
            (
                never if entropy is None else finite & ~((entropy >= -tol) & (entropy <= room + tol)),
                f"column '{stage}_entropy' holds values outside [0, log(allowed)] (or NaN) for rows with a "
                "distribution",
            ),
        ]
        for name in ("p_chosen", "p_eos", "removed_mass"):
            p = _floats(data, f"{stage}_{name}")
            if p is not None:
                found.append(
                    (
                        (p < -1e-6) | (p > 1 + 1e-6) | np.isinf(p),
                        f"column '{stage}_{name}' holds probabilities outside [0, 1]",
                    )
                )
        if p_chosen is not None and rank is not None:  # `rank` tokens above it: (rank + 1) * p <= 1
            found.append(
                (
                    (rank < 0) | (rank >= vocab_size) | (p_chosen * (rank + 1) > 1 + 1e-4),
                    f"columns '{stage}_p_chosen' and '{stage}_rank_chosen' disagree (with r tokens above it, the "
                    "chosen token's probability is at most 1 / (r + 1))",
                )
            )
        if p_chosen is not None and chosen_logit is not None:
            expected = np.exp(chosen_logit - lse)
            known = finite & np.isfinite(chosen_logit) & ~np.isnan(p_chosen)
            found.append(
                (
                    known & ~(np.abs(p_chosen - expected) <= 1e-4 + 1e-3 * expected),
                    f"columns '{stage}_p_chosen', '{stage}_chosen_logit' and '{stage}_lse' disagree (p = "
                    "exp(logit - log-sum-exp))",
                )
            )
    return next(((bad, what) for bad, what in found if bad.any()), None)


def stats_damage(data: pa.RecordBatch | pa.Table, metadata: RunMetadata) -> str | None:
    """What is impossible in the recorded statistics of ``data``, and at which row (None: nothing).
    Vectorised over the rows' scalar columns only (never the values): a log-sum-exp that is NaN, or that
    its row's largest logit and allowed count cannot give (+inf and -inf included: a row allows no token
    exactly when its log-sum-exp is -inf, and holds +inf exactly when it is +inf); an allowed count outside
    ``[0, vocab_size]``; an entropy outside ``[0, log(allowed)]``; a probability outside ``[0, 1]``; a
    chosen token's probability its rank or its logit cannot give."""
    for stage in metadata.stages:
        damage = _stage_damage(data, stage, metadata.vocab_size)
        if damage is not None:
            return f"{damage[1]}, {_row(data, damage[0])}"
    return None


def row_stats_damage(
    values: np.ndarray, lse: float, recorded_lse: float | None, recorded_nan: float | None, tol: float
) -> str | None:
    """How one full row's ``values`` (and ``lse``, their log-sum-exp as the record reads them) disagree with
    its recorded statistics (None: they agree, or none were recorded). ``tol``: the storage's rounding,
    relative to ``max(1, |lse|)``."""
    nan = int(np.isnan(values).sum())
    if recorded_lse is None:
        wrong = False
    elif np.isinf(recorded_lse) or np.isinf(lse):
        wrong = recorded_lse != lse
    else:
        wrong = not abs(recorded_lse - lse) <= tol * max(1.0, abs(lse))
    if wrong or (recorded_nan is not None and recorded_nan != nan):
        return (
            f"disagrees with its statistics (from its values: log-sum-exp {lse:.4g}, {nan} NaN; recorded: "
            f"log-sum-exp {recorded_lse}, {recorded_nan} NaN)"
        )
    return None


def check_stats(path: str | os.PathLike[str], data: pa.RecordBatch | pa.Table, metadata: RunMetadata) -> None:
    """RunFileError naming ``path`` when :func:`stats_damage` finds something impossible."""
    reason = stats_damage(data, metadata)
    if reason is not None:
        _fail(path, reason)


def check_rows(path: str | os.PathLike[str], batches: list[pa.RecordBatch], metadata: RunMetadata) -> None:
    """Every check of a run's rows that reads no vocabulary-wide value, as every reader applies them before
    answering: :func:`check_ids` over all the rows, :func:`check_topk`, and :func:`check_stats` batch by
    batch. RunFileError naming ``path``."""
    if not batches:
        return
    names = list(ID_COLUMNS)
    ids = pa.concat_tables([pa.Table.from_batches([b.select(names)]) for b in batches], promote_options="permissive")
    check_ids(path, ids, metadata.vocab_size)
    check_topk(path, batches, metadata)
    for batch in batches:
        check_stats(path, batch, metadata)
