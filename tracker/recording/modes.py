"""Storage modes, one object each: what a recorded row keeps, the work it takes on the rows' device, its bytes.

- :class:`FullRows` (``"float32"``, ``"float16"``, ``"bfloat16"``): the whole row. Half precision keeps the
  row minus its largest logit (where float16 and bfloat16 are finest), with the log-sum-exp of the rounded
  values, so that probabilities read back sum to 1.
- :class:`TopK` (``"topk"``): the ``k`` largest logits and their ids, the natural logits at those ids (for
  stages after the natural one), and the row's statistics, which only the full row gives exactly.
- ``"auto"``: decided at the first step (:meth:`Storage.resolve`).

:meth:`Storage.store` does a mode's work for a batch of rows in batched tensor operations on the rows' device
and returns what goes into the recorder's buffers; :meth:`Storage.layout` says what those buffers are. The
run's columns for each mode are :func:`tracker.format.schema.run_schema`'s; the read side decodes them
(:mod:`tracker.reading.block`). :data:`STATISTICS` says when statistics are computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tracker.format.schema import STORAGE_KINDS
from tracker.reading.selection import count_arg
from tracker.recording.record_stats import CHOSEN_STATS, ROW_STATS, half_rows, offset_rows, row_stats, top_k

__all__ = ["AUTO_STEPS", "STATISTICS", "FullRows", "Storage", "Stored", "TopK", "stats_when_recorded"]

#: When rows get their statistics (entropy, the chosen token's probability and rank, removed mass, margin...):
#: ``"record"``, as they are recorded (batched kernels on the rows' device); ``"read"``, from the stored rows
#: when they are first read (built into a run, exported, taken out by an engine: every row of a chunk in one
#: batched pass; float32 storage only, since the other modes do not keep the row the statistics need, so they
#: always record them); ``"auto"``: ``"read"`` for float32 rows on a CPU (the stored row is exact, and a pass
#: over every row costs more than its copy), ``"record"`` otherwise.
STATISTICS = ("auto", "record", "read")
#: Steps of a batch that ``storage="auto"`` keeps within the memory bound.
AUTO_STEPS = 500
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class Stored:
    """A stage's rows as a mode keeps them: ``columns`` (buffer suffix -> ``[n, ...]`` tensor on the rows'
    device) and, with statistics, the ``[n, 8]`` statistics of the exact rows (:data:`ROW_STATS`), which the
    chosen token's statistics are computed against."""

    columns: dict[str, torch.Tensor]
    stats: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Storage:
    """How a stage's row is kept: ``kind`` (one of :data:`~tracker.format.schema.STORAGE_KINDS` or ``"auto"``)
    and ``top_k`` (values kept per row in top-k storage). Build one with :meth:`parse`."""

    kind: str = "float32"
    top_k: int = 0

    @classmethod
    def parse(cls, storage: str | Storage, top_k: int = 20) -> Storage:
        """The mode called ``storage``: one of :data:`STORAGE_KINDS`, or ``"auto"`` (see :meth:`resolve`)."""
        if isinstance(storage, Storage):
            return storage
        if storage not in STORAGE_KINDS and storage != "auto":
            raise ValueError(f"storage must be one of {STORAGE_KINDS} or 'auto', got {storage!r}")
        if storage == "topk":
            return TopK("topk", count_arg("top_k", top_k, context=" for storage='topk'"))
        if storage == "auto":
            return Storage("auto", count_arg("top_k", top_k, context=" for storage='auto'"))
        return FullRows(storage, 0)

    def __eq__(self, other: object) -> bool:  # a mode is its name and k, whichever class spells it
        return isinstance(other, Storage) and (self.kind, self.top_k) == (other.kind, other.top_k)

    def __hash__(self) -> int:
        return hash((self.kind, self.top_k))

    @property
    def full(self) -> bool:
        return self.kind != "topk"

    def k_for(self, vocab_size: int) -> int:
        """Values kept per row for a vocabulary: ``top_k`` (at most the vocabulary) in top-k storage, else 0."""
        return min(self.top_k, vocab_size) if self.kind == "topk" else 0

    def resolve(self, stages: Sequence[str], vocab_size: int, batch: int, memory_limit: int | None) -> Storage:
        """The mode ``"auto"`` stands for, decided at the first step: the fullest that keeps :data:`AUTO_STEPS`
        steps of the batch in ``memory_limit``: float32 when it fits (or with no bound, or a zero one: the user
        chose to spill), else bfloat16, else top-k. At 128k tokens and 2 GiB: float32 up to batch 4, bfloat16
        up to 8, top-k beyond."""
        if self.kind != "auto":
            return self
        if not memory_limit:
            return FullRows("float32")
        for kind in ("float32", "bfloat16"):
            if FullRows(kind).row_bytes(stages, vocab_size) * batch * AUTO_STEPS <= memory_limit:
                return FullRows(kind)
        return TopK("topk", self.top_k)

    def layout(self, stage: str, vocab_size: int) -> Layout:
        """Buffer name -> (shape of one row, dtype) for one stage: its values, then its statistics (the row's,
        and the chosen token's)."""
        raise ValueError(f"storage {self.kind!r} has no layout until resolved (call resolve() first)")

    def _stats_layout(self, stage: str) -> Layout:
        return {
            f"{stage}:stats": ((len(ROW_STATS),), torch.float32),
            f"{stage}:cstats": ((len(CHOSEN_STATS),), torch.float32),
        }

    def row_bytes(self, stages: Sequence[str], vocab_size: int) -> int:
        """Bytes one row takes in host memory (about as many on disk) for these stages, its ids included."""
        total = 20  # generation, sequence, step (int32) and chosen (int64)
        for stage in stages:
            for shape, dtype in self.layout(stage, vocab_size).values():
                total += math.prod(shape) * dtype.itemsize
        return total

    def store(self, x: torch.Tensor, natural: torch.Tensor | None, eos: torch.Tensor | None, stats: bool) -> Stored:
        """Rows ``x [n, V]`` as this mode keeps them, on their device (``natural``: the rows before the
        processor, for a later stage's removed mass, margin and top-k natural logits; ``eos``: int64 ids on
        the device, for ``p_eos``). Batched kernels only: does not synchronise with an accelerator."""
        raise ValueError(f"storage {self.kind!r} stores nothing until resolved (call resolve() first)")

    def records_stats(self) -> bool:
        """Whether rows in this mode always get their statistics as recorded (every mode but float32)."""
        return self.kind != "float32"


@dataclass(frozen=True, eq=False)
class FullRows(Storage):
    """The whole row, as float32, float16 or bfloat16 (the two last minus the row's largest logit)."""

    def layout(self, stage: str, vocab_size: int) -> Layout:
        return {f"{stage}:logits": ((vocab_size,), _DTYPES[self.kind]), **self._stats_layout(stage)}

    def store(self, x: torch.Tensor, natural: torch.Tensor | None, eos: torch.Tensor | None, stats: bool) -> Stored:
        if self.kind == "float32":
            if not stats:
                return Stored({"logits": x})
            found = row_stats(x, eos, natural)
            return Stored({"logits": x, "stats": found}, found)
        found, offset = offset_rows(x, eos, natural)
        kept, stored = half_rows(x, found, offset, _DTYPES[self.kind])
        return Stored({"logits": kept, "stats": stored}, found)


@dataclass(frozen=True, eq=False)
class TopK(Storage):
    """The ``top_k`` largest logits of each row with their ids (and the natural logits at those ids)."""

    def layout(self, stage: str, vocab_size: int) -> Layout:
        k = self.k_for(vocab_size)
        out: Layout = {f"{stage}:ids": ((k,), torch.int32), f"{stage}:logits": ((k,), torch.float32)}
        if stage != "natural":
            out[f"{stage}:natural"] = ((k,), torch.float32)
        out.update(self._stats_layout(stage))
        return out

    def store(self, x: torch.Tensor, natural: torch.Tensor | None, eos: torch.Tensor | None, stats: bool) -> Stored:
        found = row_stats(x, eos, natural)
        values, ids = top_k(x, self.k_for(x.shape[1]))
        columns = {"ids": ids.to(torch.int32), "logits": values, "stats": found}
        if natural is not None:
            columns["natural"] = natural.float().gather(1, ids)
        return Stored(columns, found)


def stats_when_recorded(statistics: str, storage: Storage, device: torch.device) -> bool:
    """Whether rows in ``storage`` on ``device`` get their statistics as recorded (see :data:`STATISTICS`)."""
    if statistics not in STATISTICS:
        raise ValueError(f"statistics must be one of {STATISTICS}, got {statistics!r}")
    if storage.records_stats():
        return True
    if statistics != "auto":
        return statistics == "record"
    return device.type != "cpu"
