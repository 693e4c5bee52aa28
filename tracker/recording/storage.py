"""How recorded rows are kept: the storage modes, their buffer layout and their size.

:class:`Storage` says, per stage, which buffers a row takes (the whole row as
float32, float16 or bfloat16; or the top ``k`` values with their ids) and how
many bytes that is, so the recorder can size its chunks and ``"auto"`` can
pick the fullest mode that keeps :data:`AUTO_STEPS` steps within the memory
bound. :data:`STATISTICS` lists when each row's statistics are computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tracker.format.schema import STORAGE_KINDS
from tracker.reading.rows import GROUP, GROUPED_MIN_VOCAB
from tracker.reading.selection import count_arg
from tracker.recording.record_stats import CHOSEN_STATS, ROW_STATS

__all__ = ["AUTO_STEPS", "STATISTICS", "Storage", "stats_when_recorded"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: When rows get their statistics (entropy, chosen token's probability and rank, removed mass, margin, ...):
#: ``"record"``, as they are recorded (kernels on the rows' device, copied with them: cheap and asynchronous
#: on an accelerator; several passes over each row on a CPU); ``"read"``, computed from the stored rows when
#: a query needs them (float32 storage only: other modes record them whatever is asked, since their stored rows
#: would give inexact statistics); ``"auto"``: when recorded unless the rows are kept whole in float32
#: on a CPU (top-k, float16 and bfloat16 rows are not the full-precision row the statistics need; on an
#: accelerator recording them costs a few asynchronous kernels), else off the decoding thread as chunks of rows
#: are sealed (:mod:`tracker.recording.chunk_stats`; exactly the same values). On a CPU, float16, bfloat16 and
#: top-k rows recorded with any value but ``"record"`` are copied as float32 on the decoding thread and
#: converted, selected and summed up on a background thread (:mod:`tracker.recording.deferred`; again the
#: same values, bit for bit).
STATISTICS = ("auto", "record", "read")
#: Steps of a batch that ``storage="auto"`` keeps within the memory bound.
AUTO_STEPS = 500


@dataclass(frozen=True)
class Storage:
    """How a stage's row is kept.

    Attributes:
        kind: ``"float32"``, ``"float16"``, ``"bfloat16"`` (the whole row) or
            ``"topk"`` (the ``top_k`` largest logits, their ids, the row's
            log-sum-exp and allowed count).
        top_k: values kept per row in top-k storage.
    """

    kind: str = "float32"
    top_k: int = 0

    @classmethod
    def parse(cls, storage: str, top_k: int = 20) -> Storage:
        """A storage mode by name: one of :data:`STORAGE_KINDS`, or ``"auto"`` (see :meth:`resolve`)."""
        if storage not in STORAGE_KINDS and storage != "auto":
            raise ValueError(f"storage must be one of {STORAGE_KINDS} or 'auto', got {storage!r}")
        if storage in ("topk", "auto"):
            return cls(storage, count_arg("top_k", top_k, context=" for storage='topk'"))
        return cls(storage, 0)

    def resolve(self, stages: Sequence[str], vocab_size: int, batch: int, memory_limit: int | None) -> Storage:
        """The mode ``"auto"`` stands for, decided at the first step: the fullest that keeps
        :data:`AUTO_STEPS` steps of the batch in ``memory_limit``.

        float32 when it fits (or when there is no bound, or a zero bound: the
        user chose to spill), else bfloat16, else top-k. At 128k tokens and
        the default 2 GiB bound: float32 up to batch 4, bfloat16 up to 8,
        top-k beyond (a batch of 64 in float32 would fill the bound in 32 steps).
        """
        if self.kind != "auto":
            return self
        if not memory_limit:
            return Storage("float32")
        for kind in ("float32", "bfloat16"):
            if Storage(kind).row_bytes(stages, vocab_size) * batch * AUTO_STEPS <= memory_limit:
                return Storage(kind)
        return Storage("topk", self.top_k)

    @property
    def full(self) -> bool:
        return self.kind != "topk"

    def k_for(self, vocab_size: int) -> int:
        """The number of values kept per row for a vocabulary (top_k, at most the vocabulary)."""
        return min(self.top_k, vocab_size) if not self.full else 0

    def layout(
        self, stage: str, vocab_size: int, stats: bool = True, maxima: bool = False
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Buffer name -> (shape of one row, dtype) for one stage (values, then the packed statistics, if ``stats``).

        ``maxima``: with a ``{stage}:gmax`` buffer for each row's group maxima
        (:func:`tracker.reading.rows.group_max`, the index the read side's
        searches start from), where the rows take the grouped paths: float32
        rows of a large vocabulary. It costs a sixteenth of the row.
        """
        if self.full:
            out = {f"{stage}:logits": ((vocab_size,), _TORCH_DTYPES[self.kind])}
        else:
            k = self.k_for(vocab_size)
            out = {f"{stage}:ids": ((k,), torch.int32), f"{stage}:logits": ((k,), torch.float32)}
            if stage != "natural":
                out[f"{stage}:natural"] = ((k,), torch.float32)
        if stats or not self.full:  # top-k rows cannot be summed up later: their statistics are always kept
            out[f"{stage}:stats"] = ((len(ROW_STATS),), torch.float32)
            out[f"{stage}:cstats"] = ((len(CHOSEN_STATS),), torch.float32)
        if maxima and self.kind == "float32" and vocab_size >= GROUPED_MIN_VOCAB:
            out[f"{stage}:gmax"] = ((vocab_size // GROUP,), torch.float32)
        return out

    def row_bytes(self, stages: Sequence[str], vocab_size: int, stats: bool = True, maxima: bool = False) -> int:
        """Bytes one row takes in host memory (and about as much on disk, less its group maxima) for these stages."""
        total = 8  # chosen
        for stage in stages:
            for shape, dtype in self.layout(stage, vocab_size, stats, maxima).values():
                total += math.prod(shape) * dtype.itemsize
        return total


def stats_when_recorded(statistics: str, storage: Storage, device: torch.device) -> bool:
    """Whether rows in ``storage`` on ``device`` get their statistics as they are recorded (see :data:`STATISTICS`)."""
    if storage.kind != "float32":
        return True  # half-precision and top-k rows are not the full row: only recording keeps them exact
    if statistics != "auto":
        return statistics == "record"
    return device.type != "cpu"
