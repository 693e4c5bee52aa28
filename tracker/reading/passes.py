"""Passes over a selection's rows, stage by stage, as :class:`~tracker.reading.block.Block` objects.

:meth:`Passes._map` hands each query its rows block by block, whatever the
storage: top-k storage is one small block per stage; full storage streams
blocks of about 16 MiB per stage (spilled chunks are read through their
memory maps), run on a small thread pool. In the same read of a block the
pass finds what every later query needs and caches it per stage: the
rows' log-sum-exp, which rows hold NaN or ``+inf`` (a row's maximum tells,
so the exact count runs on those rows only) and their NaN counts; it also
hands the queries the rows' group maxima, from which the top-token and
threshold searches start. Runs that recorded the statistics with the rows
take all of that from their columns and read no row for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from tracker.format.checks import LSE_TOLERANCE, DamagedRowError
from tracker.format.schema import flag_column
from tracker.reading.block import Block, full_rows, read_as_recorded, take_rows, topk_columns
from tracker.reading.rows import (
    group_max,
    groupable,
    logsumexp_rows,
    logsumexp_shared,
    map_blocks,
    row_max,
)
from tracker.reading.selection import Selecting, Selection

__all__ = ["Passes"]

# Per stage and block: a default 32 MiB chunk of two float32 stages in one block each. A block's kernels
# cost a fixed Python overhead each, so fewer, larger blocks answer sooner (a first get_top_tokens over 512
# steps at 128k tokens: 18 blocks instead of 35, about 25% faster), while scratch stays a block per thread.
_BLOCK_BYTES = 16 << 20
_SCAN = {"lse": np.float32, "nan": np.float64, "nonfinite": bool}


class Passes(Selecting):
    """Mixin: blocks of a selection's rows and the per-row facts found while reading them."""

    def _block_rows(self) -> int:
        """Rows per block: about 16 MiB of float32 per stage (few large kernels, bounded memory)."""
        return max(1, _BLOCK_BYTES // (4 * max(1, self.metadata.vocab_size)))

    def _pieces(self, sel: Selection) -> list[tuple[int, int, np.ndarray]]:
        """``(first row, batch, rows)`` of the selection in blocks of at most :meth:`_block_rows` rows."""
        per = self._block_rows()
        out, start = [], 0
        for b, rows in sel.blocks:
            for a in range(0, rows.size, per):
                out.append((start + a, b, rows[a : a + per]))
            start += rows.size
        return out

    def _scanned(self, stage: str, sel: Selection) -> dict[str, np.ndarray] | None:
        return self._cache().get(("scan", stage, sel.generation, sel.sequence, sel.length, sel.part))

    def _recorded_scan(self, stage: str, sel: Selection) -> dict[str, np.ndarray]:
        """The per-row facts from the statistics columns recorded with the rows."""
        lse, allowed = self._column(f"{stage}_lse", sel), self._column(f"{stage}_allowed", sel)
        nan = self._column(f"{stage}_nan", sel)
        with np.errstate(divide="ignore"):
            read = np.where(lse == math.inf, np.log(np.maximum(allowed, 1)), lse)
        return {"lse": read.astype(np.float32), "nan": nan, "nonfinite": (nan > 0) | (lse == math.inf)}

    def _topk_scan(self, stage: str, sel: Selection) -> dict[str, np.ndarray]:
        block = self._topk(stage, sel)
        batches = self._record_batches()
        if all(flag_column(stage) in batches[b].schema.names for b, _ in sel.blocks):
            parts = [np.zeros(0, dtype=bool)]
            parts += [
                batches[b].column(flag_column(stage)).to_numpy(zero_copy_only=False)[rows] for b, rows in sel.blocks
            ]
            flags = np.concatenate(parts)
        else:
            flags = np.isnan(block.lse)
        return {"lse": block.lse, "nan": np.full(sel.length, math.nan), "nonfinite": flags}

    def _scan(self, stage: str, sel: Selection) -> dict[str, np.ndarray]:
        """``{"lse", "nan", "nonfinite"}`` per row of a stage: the log-sum-exp as the record reads the row,
        its NaN entries (NaN when unknown) and whether it holds NaN or ``+inf``."""
        key = ("scan", stage, sel.generation, sel.sequence, sel.length, sel.part)
        cache = self._cache()
        if key not in cache:
            if self._has_stats(sel):
                cache[key] = self._recorded_scan(stage, sel)
            elif not self._full:
                cache[key] = self._topk_scan(stage, sel)
            else:
                self._map(sel, [stage], None)  # fills the cache
        return cache[key]

    def _lse(self, stage: str, sel: Selection) -> np.ndarray:
        return self._scan(stage, sel)["lse"]

    def _nonfinite(self, sel: Selection) -> np.ndarray:
        """Rows holding NaN or +inf in any stage."""
        out = np.zeros(sel.length, dtype=bool)
        for stage in self.stages:
            out |= self._scan(stage, sel)["nonfinite"]
        return out

    def _nan_counts(self, sel: Selection) -> dict[str, np.ndarray]:
        """Per stage, the NaN entries of each row (left out of its distribution; NaN when unknown)."""
        return {stage: self._scan(stage, sel)["nan"] for stage in self.stages}

    def _topk(self, stage: str, sel: Selection) -> Block:
        """Top-k storage of a stage over the selection."""
        key = ("topk", stage, sel.generation, sel.sequence, sel.length, sel.part)
        with self._naming_the_file():
            return self._cached(key, lambda: topk_columns(self._record_batches(), sel.blocks, stage))

    @contextmanager
    def _naming_the_file(self) -> Iterator[None]:
        """A damaged row's error names the file it came from, when the run knows it (:attr:`source`)."""
        try:
            yield
        except DamagedRowError as exc:
            source = getattr(self, "source", None)
            if source is None or str(exc).startswith("'"):
                raise
            raise DamagedRowError(f"'{source}': {exc}") from exc

    def _map(
        self,
        sel: Selection,
        stages: Sequence[str],
        work: Callable[[int, dict[str, Block]], Any] | None,
        raw: bool = False,
    ) -> list[Any]:
        """``[work(first row, {stage: block}), ...]`` over the selection's blocks, in order.

        Top-k storage gives one block per stage. Full storage gives blocks of
        :meth:`_block_rows` rows read as the record reads them (``raw``: as
        stored, with no log-sum-exp), worked on by a thread pool; each
        worker holds one block per stage beyond the recorded rows. Stages
        whose per-row facts are not known yet get them from the same read.
        ``work`` must only read its blocks.
        """
        stages = list(dict.fromkeys(stages))
        if not self._full:
            blocks = {stage: self._topk(stage, sel) for stage in stages}
            return [] if work is None or sel.length == 0 else [work(0, blocks)]
        batches = self._record_batches()
        vocab = self.metadata.vocab_size
        recorded = self._has_stats(sel)
        if raw:
            known: dict[str, Any] = dict.fromkeys(stages, {})
        else:
            known = {stage: self._scan(stage, sel) if recorded else self._scanned(stage, sel) for stage in stages}
        missing = [stage for stage in stages if known[stage] is None]
        pieces = self._pieces(sel)

        def one(i: int) -> tuple[dict[str, dict[str, np.ndarray]], Any]:
            start, b, rows = pieces[i]
            end = start + rows.size
            blocks: dict[str, Block] = {}
            found: dict[str, dict[str, np.ndarray]] = {}
            read: dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray]] = {}
            for stage in stages:
                if raw:
                    values, _ = full_rows(batches[b], stage, rows, vocab)
                    blocks[stage] = Block(values, np.full(rows.size, math.nan, dtype=np.float32))
                    continue
                facts = known[stage]
                read[stage], new = _read(
                    batches[b],
                    stage,
                    rows,
                    vocab,
                    None if facts is None else facts["nonfinite"][start:end],
                    self._group_maxima(b, stage),
                )
                if new is not None:
                    found[stage] = new
            if raw:
                return found, (None if work is None else work(start, blocks))
            lses = {stage: known[stage]["lse"][start:end] for stage in stages if known[stage] is not None}
            todo = [stage for stage in stages if stage not in lses]
            if "natural" in todo and len(todo) > 1:  # one exp pass for natural and the stages that only mask it
                others = [stage for stage in todo if stage != "natural"]
                lses["natural"], shared = logsumexp_shared(
                    read["natural"][0],
                    _top(read["natural"]),
                    [read[s][0] for s in others],
                    [_top(read[s]) for s in others],
                )
                lses.update(zip(others, shared))
            for stage in stages:  # a file's recorded log-sum-exp: a stored logit above it would give p > 1
                if stage not in todo:
                    _check_below(batches[b], stage, rows, _top(read[stage]), lses[stage])
            for stage in todo:
                if stage not in lses:
                    lses[stage] = logsumexp_rows(read[stage][0], _top(read[stage]))
            for stage in stages:
                values, gmax, _ = read[stage]
                if stage in found:
                    found[stage]["lse"] = lses[stage]
                blocks[stage] = Block(values, lses[stage], gmax=gmax)
            return found, (None if work is None else work(start, blocks))

        with self._naming_the_file():
            results = map_blocks(one, len(pieces))
        for stage in missing:
            parts = [found[stage] for found, _ in results]
            self._cache()[("scan", stage, sel.generation, sel.sequence, sel.length, sel.part)] = {
                name: np.concatenate([p[name] for p in parts]) if parts else np.zeros(0, dtype=dtype)
                for name, dtype in _SCAN.items()
            }
        return [result for _, result in results]


def _read(
    batch: Any,
    stage: str,
    rows: np.ndarray,
    vocab: int,
    nonfinite: np.ndarray | None,
    maxima: np.ndarray | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray | None, np.ndarray], dict[str, np.ndarray] | None]:
    """``((values, group maxima, row maxima or None), facts)``: rows of a stage as the record reads them (the
    row maxima where this read found them; :func:`_top` gives them when needed).

    ``nonfinite`` flags the rows holding NaN or ``+inf`` when known; else
    the rows' maxima tell (NaN or ``+inf``), their NaN entries are counted,
    and ``facts`` returns both (the log-sum-exp is added by the caller).
    ``maxima``: the group maxima of every row of the batch, when the data
    came with them (read at ``rows`` instead of folding the rows).
    """
    values, valid = full_rows(batch, stage, rows, vocab)
    gmax = None
    if groupable(values):
        gmax = group_max(values) if maxima is None else take_rows(maxima, rows)
    top, facts, bad = row_max(values, gmax), None, nonfinite
    held = np.isnan(top) | (top == np.inf)
    if bad is None:
        bad = held
        nan = np.zeros(rows.size)
        if bad.any():
            nan[bad] = np.count_nonzero(np.isnan(values[bad]), axis=1)
        facts = {"nan": nan, "nonfinite": bad}
    elif (lying := held & ~bad & (True if valid is None else valid)).any():  # a file's statistics may lie
        raise DamagedRowError(
            f"stage {stage!r}: the row at {_where(batch, int(rows[np.argmax(lying)]))} holds NaN or +inf though its "
            f"statistics ({stage}_nan, {stage}_lse) say it holds none; the run file is damaged"
        )
    fixed = read_as_recorded(values, bad, valid)
    if fixed is not values:
        values = fixed
        gmax = group_max(values) if gmax is not None else None
        top = None
    return (values, gmax, top), facts


def _where(batch: Any, row: int) -> str:
    return ", ".join(f"{n} {batch.column(n)[row].as_py()}" for n in ("generation", "sequence", "step"))


def _check_below(batch: Any, stage: str, rows: np.ndarray, top: np.ndarray, lse: np.ndarray) -> None:
    """DamagedRowError naming the first row whose largest stored logit exceeds its recorded log-sum-exp."""
    with np.errstate(invalid="ignore"):
        above = np.isfinite(top) & (top > lse + LSE_TOLERANCE * np.maximum(1.0, np.abs(lse)))
    if above.any():
        raise DamagedRowError(
            f"stage {stage!r}: the row at {_where(batch, int(rows[np.argmax(above)]))} holds a logit above its "
            f"recorded log-sum-exp ({stage}_lse): its probabilities would exceed 1; the run file is damaged"
        )


def _top(read: tuple[np.ndarray, np.ndarray | None, np.ndarray | None]) -> np.ndarray:
    """The row maxima of what :func:`_read` returned (from its group maxima where it has them)."""
    values, gmax, top = read
    return row_max(values, gmax) if top is None else top
