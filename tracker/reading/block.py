"""One stage's rows as every query reads them, whatever the storage: values, token ids, log-sum-exp.

Full storage is a :class:`Block` whose ids are all the columns (``ids is
None``: column ``j`` is token ``j``); top-k storage is a block of the ``k``
stored ids per row. A query written over blocks answers both storages.
This module also reads blocks out of Arrow record batches, in numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tracker.format.checks import DamagedRowError, damaged_lse
from tracker.format.schema import FIELD_DTYPE, row_offsets, value_column
from tracker.reading.rows import NEG_INF, as_float32, effective

__all__ = ["Block", "stage_matrix", "full_rows", "read_as_recorded", "one_hot_rows", "topk_columns", "contiguous"]


@dataclass(frozen=True)
class Block:
    """Rows of one stage.

    Attributes:
        values: ``[t, w]`` float32 logits as the record reads them (NaN as
            ``-inf``; a row holding ``+inf`` is 0 there and ``-inf`` elsewhere;
            a null row, or an entry top-k storage did not keep, is NaN).
        lse: ``[t]`` float32 log-sum-exp of each whole row (of the full row
            when only ``k`` ids are stored).
        ids: ``[t, w]`` int64 token ids of ``values``; None in full storage
            (column ``j`` is token ``j``).
        allowed: ``[t]`` tokens with a logit above ``-inf`` (in the full row),
            when known without counting.
        natural: top-k storage of a stage after ``natural``: ``[t, w]`` the
            natural logits at ``ids``.
        gmax: full storage, large vocabularies: the rows' group maxima
            (:func:`tracker.reading.rows.group_max`) when a pass already computed them.
    """

    values: np.ndarray
    lse: np.ndarray
    ids: np.ndarray | None = None
    allowed: np.ndarray | None = None
    natural: np.ndarray | None = None
    gmax: np.ndarray | None = None

    @property
    def full(self) -> bool:
        return self.ids is None

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])

    def unstored(self) -> np.ndarray:
        """``[t, 1]`` float32: what a token top-k storage did not keep is known to be. ``-inf`` where the row's
        allowed tokens all fit in the stored width (so every other token was masked), else NaN (not known)."""
        width = self.values.shape[1]
        with np.errstate(invalid="ignore"):  # a null row's allowed count is NaN: not known
            complete = np.zeros(self.rows, bool) if self.allowed is None else np.asarray(self.allowed) <= width
        return np.where(complete, np.float32(NEG_INF), np.float32(math.nan)).astype(np.float32)[:, None]

    def at(self, ids: np.ndarray) -> np.ndarray:
        """``[t, j]`` float32 values at token ``ids`` ``[t, j]`` (where not stored: :meth:`unstored`)."""
        if self.ids is None:
            return np.take_along_axis(self.values, ids, axis=1)
        hit = self.ids[:, :, None] == ids[:, None, :]  # [t, w, j]
        found = hit.any(axis=1)
        where = hit.argmax(axis=1)
        return np.where(found, np.take_along_axis(self.values, where, axis=1), self.unstored())

    def dense(self, vocab_size: int) -> np.ndarray:
        """``[t, V]`` float32 values (where not stored: :meth:`unstored`)."""
        if self.ids is None:
            return self.values
        out = np.repeat(self.unstored(), vocab_size, axis=1)
        np.put_along_axis(out, self.ids, self.values, axis=1)
        return out


def contiguous(rows: np.ndarray) -> bool:
    return rows.size > 0 and int(rows[-1]) - int(rows[0]) + 1 == rows.size and bool(np.all(np.diff(rows) == 1))


def take_rows(array: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``array[rows]``: a view when the rows are consecutive, else a copy."""
    return array[int(rows[0]) : int(rows[-1]) + 1] if contiguous(rows) else array[rows]


def stage_matrix(batch: pa.RecordBatch, stage: str, vocab_size: int) -> np.ndarray:
    """A full-storage stage of a record batch as a ``[rows, V]`` array in its stored type, without a copy
    (bfloat16 as its uint16 bits: :func:`tracker.reading.rows.as_float32` reads it).

    Rows that are null hold unspecified values; check the column's validity. (A null row's values are
    themselves null once read from Parquet: the batch is then copied, with zeros there.)
    """
    name = value_column(stage, "full")
    column = batch.column(name)
    child = column.values.slice(column.offset * vocab_size, len(column) * vocab_size)
    if child.null_count:
        child = child.fill_null(0)
    matrix = child.to_numpy(zero_copy_only=True).reshape(len(column), vocab_size)
    stored = batch.schema.field(name).metadata or {}
    if stored.get(FIELD_DTYPE) == b"bfloat16":
        matrix = matrix.view(np.uint16)
    return matrix


def full_rows(
    batch: pa.RecordBatch, stage: str, rows: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(values, valid)``: rows of a full-storage stage as float32, exactly as stored (a view of the Arrow
    buffer where possible; null rows NaN), and which rows are not null (None when all are)."""
    column = batch.column(value_column(stage, "full"))
    matrix = stage_matrix(batch, stage, vocab_size)
    block = take_rows(matrix, rows)
    block = as_float32(block)
    offsets = row_offsets(batch, stage, rows)
    if offsets is not None:  # half-precision rows kept relative to their largest logit
        block += offsets[:, None]  # a fresh float32 array (as_float32 converted)
    valid = None
    if column.null_count:
        valid = column.is_valid().to_numpy(zero_copy_only=False)[rows]
        if valid.all():
            valid = None
        else:
            block = block.copy() if np.shares_memory(block, matrix) else block
            block[~valid] = math.nan
    return block, valid


def read_as_recorded(raw: np.ndarray, bad: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """``raw`` rows with the ``bad`` ones (holding NaN or ``+inf``; null rows stay NaN) read as the record
    reads them (:func:`tracker.reading.rows.effective`); a copy only when there is something to change."""
    fix = bad if valid is None else bad & valid
    if not fix.any():
        return raw
    out = raw.copy()
    out[fix] = effective(raw[fix])
    return out


def one_hot_rows(values: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """Stored top-k values with rows whose log-sum-exp is +inf read as one-hots (0 at +inf, -inf elsewhere)."""
    rows = (lse == math.inf)[:, None]
    if not rows.any():
        return values
    one_hot = np.where(values == math.inf, np.float32(0.0), np.float32(NEG_INF))
    return np.where(rows, one_hot, values)


def topk_columns(batches: list[pa.RecordBatch], blocks: tuple[tuple[int, np.ndarray], ...], stage: str) -> Block:
    """The top-k storage of a stage over selected rows (``(batch, rows)`` pairs) as a :class:`Block`.

    A ``+inf`` row is a one-hot on its ``+inf`` tokens: 0 there, ``-inf``
    elsewhere, log-sum-exp the log of their count. A null row is NaN. No rows: an empty block.
    """
    if not blocks:
        empty = np.zeros((0, 0), np.float32)
        return Block(empty, np.zeros(0, np.float32), np.zeros((0, 0), np.int64), np.zeros(0))
    parts: dict[str, list[np.ndarray]] = {}
    for b, rows in blocks:
        batch = batches[b]
        for name in ("ids", "logits", "natural"):
            col_name = f"{stage}_topk_{name}"
            if col_name not in batch.schema.names:
                continue
            column = batch.column(col_name)
            width = column.type.list_size
            child = column.values.slice(column.offset * width, len(column) * width)
            child = child.fill_null(0) if child.null_count else child  # a null row's values, read from Parquet
            values = child.to_numpy(zero_copy_only=False).reshape(len(column), width)[rows]
            if column.null_count:
                valid = column.is_valid().to_numpy(zero_copy_only=False)[rows]
                values = values.astype(np.float64 if name != "ids" else np.int64)
                values[~valid] = math.nan if name != "ids" else 0
            parts.setdefault(name, []).append(np.ascontiguousarray(values))
        for name in ("lse", "allowed"):
            values = batch.column(f"{stage}_{name}").to_numpy(zero_copy_only=False)[rows].astype(np.float64)
            parts.setdefault(name, []).append(values)
        if stage != "natural" and f"{stage}_topk_natural" in batch.schema.names:
            column = batch.column("natural_lse")
            parts.setdefault("natural_lse", []).append(column.to_numpy(zero_copy_only=False)[rows].astype(np.float64))
    out = {k: np.concatenate(v) for k, v in parts.items()}
    lse, allowed = out["lse"], out["allowed"]
    damaged = damaged_lse(out["logits"], lse)
    if damaged.any():  # probabilities above 1: refuse rather than answer them
        first = out["logits"][damaged][0]
        largest = np.where(np.isnan(first), -np.inf, first).max(initial=-np.inf)
        raise DamagedRowError(
            f"stage {stage!r}: {int(damaged.sum())} stored row(s) have a log-sum-exp ({stage}_lse) below their "
            f"largest stored logit, or +inf where they store no +inf (first: {lse[damaged][0]:.4g}, largest "
            f"{largest:.4g}); the run file is damaged"
        )
    values = one_hot_rows(out["logits"].astype(np.float32), lse)
    natural = None
    if "natural" in out:
        natural = one_hot_rows(out["natural"].astype(np.float32), out["natural_lse"])
    with np.errstate(divide="ignore"):
        lse = np.where(lse == math.inf, np.log(np.maximum(allowed, 1)), lse)
    return Block(values, lse.astype(np.float32), out["ids"].astype(np.int64), allowed, natural)
