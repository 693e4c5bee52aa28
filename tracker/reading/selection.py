"""Which rows a query reads: the run's row index, the selection of one sequence, per-row columns, caching.

Selectors, on every call: ``generation`` (default ``-1``, the latest; negative
values count from the end), ``sequence`` (the batch row, default 0) and
``include_finished`` (default False: a sequence ends where the host said it
ended, as logitscope's Generator does, else at its first end-of-sequence
token; the rows a host keeps feeding a finished sequence are padding). "position" is the index of the generated token (0 is the first
token after the prompt).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tracker.format.schema import RunMetadata

if TYPE_CHECKING:
    from processors.vocab import Vocabulary

__all__ = ["Selection", "Selecting", "sequence_end", "index_arg", "count_arg", "positions_arg"]


def index_arg(name: str, value: Any) -> int:
    """``value`` as a Python int: a sequence or a position (an int, numpy or 0-d tensor integer; not a bool; >= 0).

    TypeError for anything else (a string, a float), ValueError for a negative value, each naming
    the argument and the value.
    """
    try:
        index = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        index = None
    if index is None:
        raise TypeError(f"{name} must be an int >= 0, got {value!r} ({type(value).__name__})")
    if index < 0:
        raise ValueError(f"{name} must be an int >= 0, got {index}")
    return index


def count_arg(name: str, value: Any, minimum: int = 1, context: str = "") -> int:
    """``value`` as a Python int ``>= minimum`` (an int or numpy integer, not a bool); ValueError naming the
    argument, the value and what is allowed (``context`` says more, e.g. " for storage='topk'")."""
    try:
        count = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{context}, got {value!r}")
    return count


def positions_arg(positions: Any, steps: np.ndarray) -> list[int]:
    """The positions a query asks about, in the order asked: ``steps`` (every recorded one) for None, else an int
    or a list of ints (each >= 0); TypeError or ValueError naming the argument and the value."""
    if positions is None:
        return [int(s) for s in steps.tolist()]
    try:
        return [index_arg("positions", positions)]  # an int, numpy or 0-d tensor integer
    except TypeError:
        if isinstance(positions, (str, bytes, bool, np.bool_)) or not isinstance(positions, Iterable):
            raise TypeError(f"positions must be None, an int or a list of ints, got {positions!r}") from None
    return [index_arg(f"positions[{i}]", p) for i, p in enumerate(positions)]


def sequence_end(steps: np.ndarray, chosen: np.ndarray, metadata: RunMetadata, generation: int, sequence: int) -> int:
    """How many of a sequence's rows (in step order) are its own: the tokens it generated where the host
    said (logitscope's Generator does: a row that stopped early is fed padding while the others go on,
    and a row that ignores EOS goes past it), else up to its first end-of-sequence token."""
    record = next((g for g in metadata.generations if g.get("generation") == generation), None)
    lengths = None if record is None else record.get("lengths")
    if lengths is not None and 0 <= sequence < len(lengths):
        return int(np.searchsorted(steps, int(lengths[sequence])))
    if metadata.eos_token_ids:
        ends = np.nonzero(np.isin(chosen, metadata.eos_token_ids))[0]
        if ends.size:
            return int(ends[0]) + 1
    return int(chosen.size)


@dataclass(frozen=True)
class Selection:
    """The rows of one sequence of one generation, in step order."""

    generation: int
    sequence: int
    steps: np.ndarray
    chosen: np.ndarray  # int64, -1 where unknown
    processor_error: np.ndarray
    blocks: tuple[tuple[int, np.ndarray], ...]  # (batch index, rows of that batch)
    part: tuple[int, ...] | None = None  # a subset's indices into its whole selection (cache keys tell them apart)

    @property
    def length(self) -> int:
        return int(self.steps.shape[0])

    def subset(self, index: np.ndarray) -> Selection:
        """The rows at ``index`` (ascending indices into this selection), reading only the batches they are in:
        a query about a few positions of a spilled run maps and reads only their chunks."""
        index = np.asarray(index, dtype=np.int64)
        batch_of = np.concatenate([np.full(rows.size, b, dtype=np.int64) for b, rows in self.blocks])
        local = np.concatenate([rows for _, rows in self.blocks])
        blocks = []
        for b in dict.fromkeys(batch_of[index].tolist()):  # in the selection's order
            blocks.append((int(b), local[index[batch_of[index] == b]]))
        steps, chosen, error = self.steps[index], self.chosen[index], self.processor_error[index]
        return Selection(self.generation, self.sequence, steps, chosen, error, tuple(blocks), tuple(index.tolist()))

    @property
    def known_chosen(self) -> list[int]:
        """The chosen tokens up to the first unknown one."""
        unknown = np.nonzero(self.chosen < 0)[0]
        end = int(unknown[0]) if unknown.size else self.length
        return self.chosen[:end].tolist()


class Selecting:
    """Mixin: row selection and per-row columns over ``self._record_batches()``, ``self.metadata``, ``self.vocab``."""

    metadata: RunMetadata

    # provided by the class that holds the data
    def _record_batches(self) -> list[pa.RecordBatch]:
        raise NotImplementedError

    def _group_maxima(self, batch: int, stage: str) -> np.ndarray | None:
        """Group maxima of every row of a stage in batch ``batch`` given with the data (``[rows, V // 16]``),
        or None: then the reads fold the rows themselves."""
        return None

    @property
    def vocab(self) -> Vocabulary:
        raise NotImplementedError

    # ---------------------------------------------------------------- caching and selection

    def _cache(self) -> dict[Any, Any]:
        cache = self.__dict__.get("_analysis_cache")
        if cache is None:
            cache = self.__dict__["_analysis_cache"] = {}
        return cache

    def _cached(self, key: Any, make: Callable[[], Any]) -> Any:
        cache = self._cache()
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def _index(self) -> dict[str, np.ndarray]:
        def build() -> dict[str, np.ndarray]:
            batches = self._record_batches()
            parts: dict[str, list[np.ndarray]] = {
                k: [] for k in ("generation", "sequence", "step", "chosen", "error", "batch", "local")
            }
            for b, batch in enumerate(batches):
                n = batch.num_rows
                parts["generation"].append(batch.column("generation").to_numpy())
                parts["sequence"].append(batch.column("sequence").to_numpy())
                parts["step"].append(batch.column("step").to_numpy())
                parts["chosen"].append(batch.column("chosen").fill_null(-1).to_numpy())
                parts["error"].append(batch.column("processor_error").to_numpy(zero_copy_only=False))
                parts["batch"].append(np.full(n, b, dtype=np.int64))
                parts["local"].append(np.arange(n, dtype=np.int64))
            empty = {"chosen": np.int64, "error": bool}
            return {k: np.concatenate(v) if v else np.zeros(0, dtype=empty.get(k, np.int64)) for k, v in parts.items()}

        return self._cached("index", build)

    def generations(self) -> list[int]:
        """The generation ids recorded, in order."""
        return sorted(set(self._index()["generation"].tolist()))

    def sequences(self, generation: int = -1) -> list[int]:
        """The sequence ids (batch rows) of a generation."""
        g = self._generation_id(generation)
        index = self._index()
        return sorted(set(index["sequence"][index["generation"] == g].tolist()))

    def _generation_id(self, generation: int) -> int:
        ids = self.generations()
        if not ids:
            raise ValueError("nothing recorded yet: run a generation with the tracker first")
        if not isinstance(generation, (int, np.integer)) or isinstance(generation, bool):
            raise TypeError(f"generation must be an int, got {generation!r} ({type(generation).__name__})")
        if generation < 0:
            if -generation > len(ids):
                raise ValueError(f"generation={generation} but only {len(ids)} generations were recorded")
            return ids[generation]
        if generation not in ids:
            raise ValueError(f"generation={generation} was not recorded; recorded generations: {ids}")
        return int(generation)

    def _select(self, generation: int = -1, sequence: int = 0, include_finished: bool = False) -> Selection:
        g = self._generation_id(generation)
        sequence = index_arg("sequence", sequence)
        key = ("select", g, sequence, include_finished)

        def build() -> Selection:
            index = self._index()
            in_gen = index["generation"] == g
            rows = np.nonzero(in_gen & (index["sequence"] == sequence))[0]
            if rows.size == 0:
                present = sorted(set(index["sequence"][in_gen].tolist()))
                raise ValueError(f"sequence={sequence} is not in generation {g}; its sequences are {present}")
            rows = rows[np.argsort(index["step"][rows], kind="stable")]
            chosen = index["chosen"][rows]
            if not include_finished:
                end = sequence_end(index["step"][rows], chosen, self.metadata, g, sequence)
                rows, chosen = rows[:end], chosen[:end]
            batch_of, local = index["batch"][rows], index["local"][rows]
            blocks = []
            for b in np.unique(batch_of):
                blocks.append((int(b), local[batch_of == b]))
            blocks.sort(key=lambda item: int(np.nonzero(batch_of == item[0])[0][0]))
            return Selection(g, int(sequence), index["step"][rows], chosen, index["error"][rows], tuple(blocks))

        return self._cached(key, build)

    def _at(self, sel: Selection, positions: int | Sequence[int] | None) -> tuple[Selection, list[int]]:
        """``(rows, wanted)``: the rows of ``sel`` at ``positions`` in step order (positions not recorded left
        out) and the positions asked for, in the order asked (see :func:`positions_arg`).

        Every position (None, or all of them): ``sel`` itself. A few: :meth:`Selection.subset`, so that the
        query reads only the batches holding them (on a spilled run, maps in only their chunks) and caches
        its answer apart from the whole selection's.
        """
        wanted = positions_arg(positions, sel.steps)
        if positions is None:
            return sel, wanted
        where = {int(s): i for i, s in enumerate(sel.steps.tolist())}
        picked = sorted({where[p] for p in wanted if p in where})
        return (sel if len(picked) == sel.length else sel.subset(np.array(picked, np.int64))), wanted

    def _has(self, stage: str) -> bool:
        return stage in self.metadata.stages

    @property
    def stages(self) -> list[str]:
        return list(self.metadata.stages)

    @property
    def _full(self) -> bool:
        return self.metadata.storage != "topk"

    def _has_stats(self, sel: Selection) -> bool:
        """Whether the selection's rows carry the record-time statistics columns (runs of schema 1.1)."""
        batches = self._record_batches()
        return bool(sel.blocks) and all("natural_entropy" in batches[b].schema.names for b, _ in sel.blocks)

    def _column(self, name: str, sel: Selection) -> np.ndarray:
        """A per-row column over the selection as float64 (null as NaN)."""
        key = ("column", name, sel.generation, sel.sequence, sel.length, sel.part)

        def build() -> np.ndarray:
            batches = self._record_batches()
            parts = [np.zeros(0)]
            for b, rows in sel.blocks:
                column = batches[b].column(name)
                values = column.to_numpy(zero_copy_only=False)[rows].astype(np.float64)
                if column.null_count:
                    values[~column.is_valid().to_numpy(zero_copy_only=False)[rows]] = math.nan
                parts.append(values)
            return np.concatenate(parts)

        return self._cached(key, build)

    def clear_cache(self) -> None:
        """Drop cached answers (they are rebuilt on the next call)."""
        self._cache().clear()
