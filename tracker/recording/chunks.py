"""Chunks: blocks of recorded rows in (pinned or host) buffers, and how they become Arrow record batches.

A :class:`Chunk` holds the rows of several steps: the id columns in numpy,
each recorded column in a tensor of its own. :class:`StepRows` names the
rows one step reserved. On CUDA a chunk's buffers are first a pinned staging
slot filled by ``non_blocking`` copies; :class:`CudaStaging` records an event
after them and waits for it only when the slot is needed or read.
:func:`to_batch` turns a chunk's rows into a record batch (values zero-copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from tracker.format.schema import STAT_COLUMNS, column_stages
from tracker.recording.buffers import HostBuffer
from tracker.recording.record_stats import CHOSEN_STATS, ROW_STATS
from tracker.recording.storage import Storage

__all__ = ["Chunk", "CudaStaging", "StepRows", "conform", "numpy_view", "to_batch"]


@dataclass(slots=True)
class StepRows:
    """The rows one step reserved: ``count`` consecutive rows of ``chunk`` from ``start``."""

    chunk: Chunk
    start: int
    count: int
    generation: int
    step: int

    @property
    def end(self) -> int:
        return self.start + self.count


class CudaStaging:
    """How rows leave a CUDA device: pinned slots, ``non_blocking`` copies, one event per stream.

    The recorder only calls :meth:`empty`, :meth:`mark` (after enqueuing
    copies) and :meth:`wait` (before reading a slot); tests put a
    host-memory stand-in in its place to exercise the same bookkeeping on CPU.
    """

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor (once per slot; no synchronisation)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def mark(self, chunk: Chunk) -> None:
        """Record an event after the copies just enqueued on the current stream (no synchronisation)."""
        stream = torch.cuda.current_stream(chunk.device)
        event = chunk.events.get(stream.cuda_stream)
        if event is None:
            event = chunk.events[stream.cuda_stream] = torch.cuda.Event()
        event.record(stream)

    def wait(self, chunk: Chunk) -> None:
        """Block until the chunk's copies have landed: synchronises with those events, only when the
        chunk's slot is needed or its rows are read (never per step)."""
        for event in chunk.events.values():
            event.synchronize()


class Chunk:
    """Rows of one block: id columns in numpy, recorded values in (pinned or host) tensors."""

    def __init__(
        self,
        index: int,
        capacity: int,
        stages: Sequence[str],
        buffers: dict[str, torch.Tensor],
        host: list[HostBuffer] | None,
        device: torch.device,
        transfer: CudaStaging | None = None,
    ) -> None:
        self.index = index
        self.transfer = transfer
        self.capacity = capacity
        self.n = 0
        self.device = device
        self.generation = np.zeros(capacity, dtype=np.int32)
        self.sequence = np.zeros(capacity, dtype=np.int32)
        self.step = np.zeros(capacity, dtype=np.int32)
        self.processor_error = np.zeros(capacity, dtype=bool)
        self.chosen_set = np.zeros(capacity, dtype=bool)
        self.written = {stage: np.zeros(capacity, dtype=bool) for stage in stages}
        self.chosen_known = {stage: np.zeros(capacity, dtype=bool) for stage in stages}  # chosen statistics
        self.stats_known = {stage: np.zeros(capacity, dtype=bool) for stage in stages}  # computed after writing
        self.maxima_known = {stage: np.zeros(capacity, dtype=bool) for stage in stages}  # ``{stage}:gmax`` rows
        self.buffers = buffers
        self.arrays = {name: numpy_view(t) for name, t in buffers.items()}  # numpy views, for plain copies
        self.host = host  # None while the buffers are a pinned staging slot
        self.events: dict[int, Any] = {}
        self.ring_key: Any = None  # the layout of its pinned slot, while staging
        self.spilled: pa.RecordBatch | None = None
        self.spilling = False  # queued for the spill writer, still in memory
        self.version = 0
        self.cached: tuple[int, tuple[str, ...], pa.RecordBatch] | None = None

    @property
    def staging(self) -> bool:
        return self.host is None and self.spilled is None

    @property
    def on_disk(self) -> bool:
        """Spilled, or on its way to disk: never spilled again."""
        return self.spilled is not None or self.spilling

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.host) if self.host else 0

    def complete(self, ended: set[int]) -> bool:
        """Every row's chosen token is known, or its generation is over."""
        rows = slice(0, self.n)
        pending = ~self.chosen_set[rows]
        return not pending.any() or bool(np.isin(self.generation[rows][pending], list(ended)).all())

    def check_writable(self, what: str) -> None:
        """Refuse to change rows that are on disk or on their way there."""
        if self.on_disk:
            raise RuntimeError(
                f"{what}: rows of generation {int(self.generation[0])} already spilled to disk; "
                "tell the tracker the chosen tokens before the next generation starts"
            )

    def note_stream(self) -> None:
        """After a step's copies into a staging slot: record an event (every step; no synchronisation)."""
        if self.transfer is not None:
            self.transfer.mark(self)

    def wait(self) -> None:
        """Block until a staging chunk's copies have landed (synchronises; never per step: only when its
        slot is needed again or its rows are read)."""
        if self.transfer is not None:
            self.transfer.wait(self)


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with the columns of ``schema``: stages it lacks become nulls."""
    if batch.schema.names == schema.names:
        return batch
    columns = []
    for field in schema:
        if field.name in batch.schema.names:
            columns.append(batch.column(field.name))
        else:
            columns.append(pa.nulls(batch.num_rows, field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a host tensor (bfloat16 as uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def to_batch(chunk: Chunk, schema: pa.Schema, stages: Sequence[str], storage: Storage, vocab: int) -> pa.RecordBatch:
    """The chunk's rows as a record batch: values zero-copy, id and statistics columns copied (no ``_nonfinite`` flags)."""
    n = chunk.n
    chosen = chunk.buffers["chosen"][:n].numpy().copy()
    unknown = ~chunk.chosen_set[:n] | (chosen < 0)
    arrays: list[pa.Array] = [
        pa.array(chunk.generation[:n].copy()),
        pa.array(chunk.sequence[:n].copy()),
        pa.array(chunk.step[:n].copy()),
        pa.array(chosen, mask=unknown),
        pa.array(chunk.processor_error[:n].copy()),
    ]
    k = storage.k_for(vocab)
    owner = column_stages(schema.names, stages)
    for stage in stages:
        fields = [f for f in schema if owner.get(f.name) == stage]
        written = chunk.written.get(stage)
        if written is None:  # stage added after this chunk began
            arrays += [pa.nulls(n, f.type) for f in fields]
            continue
        written = written[:n]
        mask = None if written.all() else pa.array(~written)
        stats = chunk.buffers[f"{stage}:stats"][:n].numpy() if f"{stage}:stats" in chunk.buffers else None
        cstats = chunk.buffers[f"{stage}:cstats"][:n].numpy() if f"{stage}:cstats" in chunk.buffers else None
        no_choice = ~(chunk.chosen_known[stage][:n] & written)
        for field in fields:
            suffix = field.name[len(stage) + 1 :]
            if suffix == "logits" and storage.full:
                flat = pa.array(numpy_view(chunk.buffers[f"{stage}:logits"][:n]).reshape(-1))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, vocab, mask=mask))
            elif suffix.startswith("topk_"):
                flat = pa.array(numpy_view(chunk.buffers[f"{stage}:{suffix[5:]}"][:n]).reshape(-1))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, k, mask=mask))
            elif suffix in ROW_STATS and stats is not None:
                values = stats[:, ROW_STATS.index(suffix)]
                invalid = ~written | np.isnan(values)  # not recorded, or not defined (no EOS ids known)
                values = np.where(invalid, 0, values).astype(_STAT_NUMPY[suffix])
                arrays.append(pa.array(values, mask=invalid))
            elif suffix in CHOSEN_STATS and cstats is not None:
                values = cstats[:, CHOSEN_STATS.index(suffix)]
                invalid = no_choice | np.isnan(values)
                values = np.where(invalid, 0, values).astype(_STAT_NUMPY[suffix])
                arrays.append(pa.array(values, mask=invalid))
            else:
                raise AssertionError(f"no buffer for column {field.name}")
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_STAT_NUMPY = {name: (np.int32 if t == pa.int32() else np.float32) for name, t in STAT_COLUMNS.items()}
