"""The analysis API: top tokens, data frames, text, arrays and per-step statistics of a run.

:class:`Analysis` answers the documented tracking calls (``get_top_tokens``,
``to_dataframe``, ``sequence``, ``get_logits``, ``get_probabilities``) plus
``stats`` and ``continuation_probability`` from a run's Arrow rows, with no
model and no tokenizer. Every answer is computed on whole blocks of rows (see
:mod:`tracker.compute`) and cached, so asking again is free.

Selectors, on every call: ``generation`` (default ``-1``, the latest; negative
values count from the end), ``sequence`` (the batch row, default 0) and
``include_finished`` (default False: a sequence ends at its first
end-of-sequence token, as the rows a host keeps feeding a finished sequence
are padding). "position" is the index of the generated token (0 is the first
token after the prompt).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from tracker import compute
from tracker.schema import FIELD_DTYPE, RunMetadata, flag_column, value_column
from processors.vocab import Vocabulary
from tracker.stages import resolve_stage

__all__ = ["Analysis", "Continuation", "Selection", "stage_matrix"]

_KEYS = {"natural": "unstructured", "constrained": "structured"}
_BLOCK_BYTES = 8 << 20  # per stage: a query's blocks and scratch stay under one 32 MiB chunk


def _part(values: np.ndarray | None, start: int, count: int) -> np.ndarray | None:
    return None if values is None else values[start : start + count]


@dataclass(frozen=True)
class Selection:
    """The rows of one sequence of one generation, in step order."""

    generation: int
    sequence: int
    steps: np.ndarray
    chosen: np.ndarray  # int64, -1 where unknown
    processor_error: np.ndarray
    blocks: tuple[tuple[int, np.ndarray], ...]  # (batch index, rows of that batch)

    @property
    def length(self) -> int:
        return int(self.steps.shape[0])

    @property
    def known_chosen(self) -> list[int]:
        """The chosen tokens up to the first unknown one."""
        unknown = np.nonzero(self.chosen < 0)[0]
        end = int(unknown[0]) if unknown.size else self.length
        return self.chosen[:end].tolist()


@dataclass(frozen=True)
class Continuation:
    """The probability that the text continues with ``text`` at ``position``.

    Summed over every way the vocabulary can start it: tokens whose text
    starts with the whole remainder, plus (along the recorded path) a token
    that is a proper prefix of it times the probability of the rest at the
    next step. ``exact`` is False when a prefix token other than the one
    chosen had probability (its continuation was never computed) or the
    record ended first: the values are then lower bounds.

    Attributes:
        text: the continuation asked about.
        position: where it starts.
        probabilities: per recorded stage ("natural", "constrained", ...).
        exact: whether the values are exact rather than lower bounds.
        path: the chosen token ids the computation followed.
    """

    text: str
    position: int
    probabilities: dict[str, float]
    exact: bool
    path: list[int] = field(default_factory=list)

    @property
    def natural(self) -> float:
        return self.probabilities["natural"]

    @property
    def constrained(self) -> float:
        return self.probabilities.get("constrained", self.probabilities["natural"])


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a (possibly read-only) numpy array; it is never written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def stage_matrix(batch: pa.RecordBatch, stage: str, vocab_size: int) -> torch.Tensor:
    """A full-storage stage of a record batch as a ``[rows, V]`` tensor in its stored type, without a copy.

    Rows that are null hold unspecified values; check the column's validity.
    """
    name = value_column(stage, "full")
    column = batch.column(name)
    child = column.values.slice(column.offset * vocab_size, len(column) * vocab_size)
    matrix = _tensor(child.to_numpy(zero_copy_only=True).reshape(len(column), vocab_size))
    stored = batch.schema.field(name).metadata or {}
    if stored.get(FIELD_DTYPE) == b"bfloat16":
        matrix = matrix.view(torch.int16).view(torch.bfloat16)
    return matrix


def _count(value: float) -> int | None:
    return None if math.isnan(value) else int(value)


def _one_hot_rows(values: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Stored top-k values with rows whose log-sum-exp is +inf read as one-hots (0 at +inf, -inf elsewhere)."""
    rows = (lse == math.inf)[:, None]
    if not bool(rows.any()):
        return values
    one_hot = torch.where(values == math.inf, 0.0, -math.inf)
    return torch.where(rows, one_hot, values)


def _contiguous(rows: np.ndarray) -> bool:
    return rows.size > 0 and int(rows[-1]) - int(rows[0]) + 1 == rows.size and bool(np.all(np.diff(rows) == 1))


class Analysis:
    """Mixin: the analysis API over ``self._record_batches()``, ``self.metadata``, ``self.vocab``."""

    metadata: RunMetadata

    # provided by the class that holds the data
    def _record_batches(self) -> list[pa.RecordBatch]:
        raise NotImplementedError

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
            parts: dict[str, list[np.ndarray]] = {k: [] for k in ("generation", "sequence", "step", "chosen", "error", "batch", "local")}
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
            return {
                k: np.concatenate(v) if v else np.zeros(0, dtype=empty.get(k, np.int64)) for k, v in parts.items()
            }

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
            raise TypeError(f"generation must be an int, got {type(generation).__name__}")
        if generation < 0:
            if -generation > len(ids):
                raise ValueError(f"generation={generation} but only {len(ids)} generations were recorded")
            return ids[generation]
        if generation not in ids:
            raise ValueError(f"generation={generation} was not recorded; recorded generations: {ids}")
        return int(generation)

    def _select(self, generation: int = -1, sequence: int = 0, include_finished: bool = False) -> Selection:
        g = self._generation_id(generation)
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
            if not include_finished and self.metadata.eos_token_ids:
                ends = np.nonzero(np.isin(chosen, self.metadata.eos_token_ids))[0]
                if ends.size:
                    rows, chosen = rows[: ends[0] + 1], chosen[: ends[0] + 1]
            batch_of, local = index["batch"][rows], index["local"][rows]
            blocks = []
            for b in np.unique(batch_of):
                blocks.append((int(b), local[batch_of == b]))
            blocks.sort(key=lambda item: int(np.nonzero(batch_of == item[0])[0][0]))
            return Selection(g, int(sequence), index["step"][rows], chosen, index["error"][rows], tuple(blocks))

        return self._cached(key, build)

    # ---------------------------------------------------------------- stage data

    @property
    def stages(self) -> list[str]:
        return list(self.metadata.stages)

    def _has(self, stage: str) -> bool:
        return stage in self.metadata.stages

    def _has_stats(self, sel: Selection) -> bool:
        """Whether the selection's rows carry the record-time statistics columns (runs of schema 1.1)."""
        batches = self._record_batches()
        return bool(sel.blocks) and all("natural_entropy" in batches[b].schema.names for b, _ in sel.blocks)

    def _column(self, name: str, sel: Selection) -> np.ndarray:
        """A per-row column over the selection as float64 (null as NaN)."""
        key = ("column", name, sel.generation, sel.sequence, sel.length)

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

    def _block(self, batch: pa.RecordBatch, stage: str, rows: np.ndarray, nonfinite: np.ndarray | None, raw: bool) -> torch.Tensor:
        """Rows of a full-storage stage as float32 (a view where possible).

        Unless ``raw``, rows holding NaN or +inf are read as the record reads
        them (:func:`compute.effective`); ``nonfinite`` says which (from the
        statistics columns), else they are found here. Null rows are NaN.
        """
        column = batch.column(value_column(stage, "full"))
        matrix = stage_matrix(batch, stage, self.metadata.vocab_size)
        block = matrix[int(rows[0]) : int(rows[-1]) + 1] if _contiguous(rows) else matrix[_tensor(rows)]
        block = block.float()
        # a view of the stored (immutable) Arrow buffer unless the index or the cast copied
        shared = block.untyped_storage().data_ptr() == matrix.untyped_storage().data_ptr()
        if not raw:
            bad = compute.nonfinite_rows(block) if nonfinite is None else _tensor(nonfinite)
            if bool(bad.any()):
                block = block.clone() if shared else block
                shared = False
                block[bad] = compute.effective(block[bad])
        if column.null_count:
            valid = column.is_valid().to_numpy(zero_copy_only=False)[rows]
            block = block.clone() if shared else block
            block[_tensor(~valid)] = math.nan
        return block

    def _sparse(self, stage: str, sel: Selection) -> dict[str, torch.Tensor]:
        """Top-k storage of a stage for the selection: ids, logits, natural, lse, allowed."""
        key = ("sparse", stage, sel.generation, sel.sequence, sel.length)

        def build() -> dict[str, torch.Tensor]:
            batches = self._record_batches()
            parts: dict[str, list[torch.Tensor]] = {}
            for b, rows in sel.blocks:
                batch = batches[b]
                for name in ("ids", "logits", "natural"):
                    col_name = f"{stage}_topk_{name}"
                    if col_name not in batch.schema.names:
                        continue
                    column = batch.column(col_name)
                    width = column.type.list_size
                    child = column.values.slice(column.offset * width, len(column) * width)
                    values = child.to_numpy(zero_copy_only=False).reshape(len(column), width)[rows]
                    if column.null_count:
                        valid = column.is_valid().to_numpy(zero_copy_only=False)[rows]
                        values = values.astype(np.float64 if name != "ids" else np.int64)
                        values[~valid] = math.nan if name != "ids" else 0
                    parts.setdefault(name, []).append(torch.as_tensor(np.ascontiguousarray(values)))
                for name in ("lse", "allowed"):
                    column = batch.column(f"{stage}_{name}")
                    values = column.to_numpy(zero_copy_only=False)[rows].astype(np.float64)
                    parts.setdefault(name, []).append(torch.as_tensor(values))
            if stage != "natural" and "natural" in parts:
                for b, rows in sel.blocks:
                    column = batches[b].column("natural_lse")
                    parts.setdefault("natural_lse", []).append(torch.as_tensor(column.to_numpy(zero_copy_only=False)[rows].astype(np.float64)))
            out = {k: torch.cat(v) for k, v in parts.items()}
            out["ids"] = out["ids"].long()
            for k in ("logits", "natural"):
                if k in out:
                    out[k] = out[k].float()
            # A +inf row is a one-hot on its +inf tokens: read it as 0 there, -inf elsewhere, lse log(count).
            out["logits"] = _one_hot_rows(out["logits"], out["lse"])
            if "natural" in out:
                out["natural"] = _one_hot_rows(out["natural"], out.pop("natural_lse"))
            out["lse"] = torch.where(out["lse"] == math.inf, torch.log(out["allowed"].clamp(min=1)), out["lse"])
            return out

        return self._cached(key, build)

    @property
    def _full(self) -> bool:
        return self.metadata.storage != "topk"

    def _block_rows(self) -> int:
        """Rows per block of maths: about 8 MiB of float32 per stage (few large kernels, bounded memory)."""
        return max(1, _BLOCK_BYTES // (4 * max(1, self.metadata.vocab_size)))

    def _sub_blocks(
        self, sel: Selection, stages: Sequence[str], raw: bool = False, views: bool = False
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """``(first row, {stage: rows})`` over the selection, in blocks of :meth:`_block_rows`.

        Streams: one block per stage is converted at a time (spilled chunks are
        read through their memory maps), so a query holds at most one chunk's
        worth beyond the recorded rows. With ``views`` (for maths that
        allocates little beside the rows it reads), rows that need no
        conversion (float32, no null, NaN or +inf row) come as one view per
        batch instead: nothing is copied, and there are fewer, larger kernels.
        """
        batches = self._record_batches()
        stages = list(dict.fromkeys(stages))
        flags = {stage: self._nonfinite_stage(stage, sel) for stage in stages} if not raw and self._has_stats(sel) else {}
        start = 0
        for b, rows in sel.blocks:
            # a quarter of the chunk's rows at most: a block of each stage, as float32, and scratch stay within one chunk
            per = max(1, min(self._block_rows(), batches[b].num_rows // 4))
            if views and _contiguous(rows) and self._plain(batches[b], stages, flags, start, rows.size, raw):
                per = rows.size
            for a in range(0, rows.size, per):
                sub = rows[a : a + per]
                yield start + a, {
                    stage: self._block(batches[b], stage, sub, _part(flags.get(stage), start + a, sub.size), raw)
                    for stage in stages
                }
            start += rows.size

    def _plain(
        self, batch: pa.RecordBatch, stages: Sequence[str], flags: dict[str, np.ndarray], start: int, count: int, raw: bool
    ) -> bool:
        """Whether ``count`` selected rows of ``batch`` (from ``start``) read as float32 views with nothing to fix."""
        for stage in stages:
            name = value_column(stage, "full")
            column = batch.column(name)
            if column.null_count or column.type.value_type != pa.float32():
                return False
            if (batch.schema.field(name).metadata or {}).get(FIELD_DTYPE, b"float32") != b"float32":
                return False
            if not raw and (stage not in flags or bool(flags[stage][start : start + count].any())):
                return False
        return True

    def _nonfinite_stage(self, stage: str, sel: Selection) -> np.ndarray:
        """Rows of a stage holding NaN or +inf, from the statistics columns."""
        return (self._column(f"{stage}_nan", sel) > 0) | (self._column(f"{stage}_lse", sel) == math.inf)

    def _lses(self, sel: Selection) -> dict[str, torch.Tensor]:
        """Each stage's per-row log-sum-exp as the record reads the rows (a +inf row: log of its +inf count)."""
        key = ("lse", sel.generation, sel.sequence, sel.length)

        def build() -> dict[str, torch.Tensor]:
            if self._has_stats(sel):
                out = {}
                for stage in self.stages:
                    lse, allowed = self._column(f"{stage}_lse", sel), self._column(f"{stage}_allowed", sel)
                    with np.errstate(divide="ignore"):
                        lse = np.where(lse == math.inf, np.log(np.maximum(allowed, 1)), lse)
                    out[stage] = torch.from_numpy(lse.astype(np.float32))
                return out
            if not self._full:
                return {stage: self._sparse(stage, sel)["lse"].float() for stage in self.stages}
            parts: dict[str, list[torch.Tensor]] = {stage: [] for stage in self.stages}
            scratch = torch.empty(self._block_rows(), self.metadata.vocab_size)
            for _, rows in self._sub_blocks(sel, self.stages):
                for stage in self.stages:
                    parts[stage].append(compute.logsumexp_rows(rows[stage], scratch))
            empty = torch.zeros(0)
            return {stage: torch.cat(v) if v else empty for stage, v in parts.items()}

        return self._cached(key, build)

    def _lse(self, stage: str, sel: Selection) -> torch.Tensor:
        return self._lses(sel)[stage]

    def _constrained_stage(self, stage: str | None = None) -> str:
        """The stage compared with natural: ``stage`` (a recorded name or alias) or constrained."""
        if stage is not None:
            return resolve_stage(self.metadata.stages, self.metadata.stage_aliases, stage)
        return "constrained" if self._has("constrained") else "natural"

    # ---------------------------------------------------------------- documented surface

    def sequence(
        self,
        pos: int | None = None,
        *,
        sequence: int = 0,
        generation: int = -1,
        include_finished: bool = False,
    ) -> str:
        """The text of the chosen tokens before position ``pos`` (all of them when None)."""
        sel = self._select(generation, sequence, include_finished)
        ids = sel.known_chosen
        if pos is not None:
            if not isinstance(pos, (int, np.integer)) or pos < 0:
                raise ValueError(f"pos must be an int >= 0 or None, got {pos!r}")
            ids = ids[: int(pos)]
        return self.vocab.decode(ids)

    def _texts(self, sel: Selection) -> list[str]:
        key = ("texts", sel.generation, sel.sequence, sel.length)
        return self._cached(key, lambda: self.vocab.prefixes(sel.known_chosen))

    def _top(self, sel: Selection, k: int, stage: str | None = None) -> dict[str, np.ndarray]:
        """Per position: the k best allowed tokens with both stages' logits and probabilities."""
        con_stage = self._constrained_stage(stage)
        key = ("top", k, sel.generation, sel.sequence, sel.length, con_stage)

        def build() -> dict[str, np.ndarray]:
            if self._full:
                lse_n, lse_c = self._lse("natural", sel), self._lse(con_stage, sel)
                width = min(k, self.metadata.vocab_size)
                parts: list[compute.Candidates] = []
                scratch = torch.empty(self._block_rows(), self.metadata.vocab_size)
                for start, rows in self._sub_blocks(sel, ["natural", con_stage], views=True):
                    nat, con = rows["natural"], rows[con_stage]
                    t = nat.shape[0]
                    parts.append(compute.top_candidates(nat, con, lse_n[start : start + t], lse_c[start : start + t], width, scratch))
                if not parts:
                    empty = torch.zeros(0, width)
                    ids, count, ln, lc = empty.long(), torch.zeros(0, dtype=torch.long), empty, empty
                else:  # the scoring in one go: a few small kernels per query, not per block
                    top, ln, lc = compute.best_candidates(compute.Candidates.join(parts), lse_n, lse_c, width)
                    ids, count = top.ids, top.count
            else:
                ids, count, ln, lc, lse_n, lse_c = self._top_sparse(sel, k, con_stage)
            return {
                "ids": ids.numpy(),
                "count": count.numpy(),
                "natural_logit": ln.numpy(),
                "constrained_logit": lc.numpy(),
                "natural_prob": torch.exp(ln - lse_n[:, None]).numpy(),
                "constrained_prob": torch.exp(lc - lse_c[:, None]).numpy(),
            }

        return self._cached(key, build)

    def _top_sparse(self, sel: Selection, k: int, con_stage: str):
        con = self._sparse(con_stage, sel)
        nat_lse = self._sparse("natural", sel)["lse"].float()
        ids, lc = con["ids"], con["logits"]
        ln = con.get("natural", lc)
        lse_c = con["lse"].float()
        score = torch.maximum(torch.exp(ln - nat_lse[:, None]), torch.exp(lc - lse_c[:, None]))
        score = torch.where((lc > compute.NEG_INF) & ~torch.isnan(score), score, -1.0)
        best, order = torch.topk(score, min(k, ids.shape[1]), dim=1)
        ids, ln, lc = (x.gather(1, order) for x in (ids, ln, lc))
        return ids, (best >= 0).sum(dim=1), ln, lc, nat_lse, lse_c

    def get_top_tokens(
        self,
        k: int = 10,
        positions: int | Sequence[int] | None = None,
        include_logits: bool = True,
        *,
        sequence: int = 0,
        generation: int = -1,
        include_finished: bool = False,
        stage: str | None = None,
    ) -> list[dict[str, Any]]:
        """The ``k`` most likely allowed tokens at each position.

        Returns one dict per position: ``{"position", "text_so_far",
        "tokens"}`` where ``tokens`` is a list, best first by the larger of
        the two probabilities, of ``{"token", "unstructured_prob",
        "structured_prob", "unstructured_logit", "structured_logit",
        "is_chosen"}`` (no logits when ``include_logits`` is False). Tokens
        the constraint masked are never listed: with fewer than ``k`` allowed
        the list is shorter. ``is_chosen`` compares token ids. Positions that
        were not recorded are skipped. Each position also says whether a
        stored row held NaN or +inf (``"nonfinite"``) and how many NaN entries
        each stage's row held (``"nan_count"``, None when unknown): NaN
        entries are left out of the distribution, and a row holding +inf is
        a one-hot on its +inf token(s). In top-k storage, ``k`` is at most the
        stored ``top_k``. ``stage`` names the stage shown as "structured"
        (default ``constrained``; e.g. ``"after:regex"``).
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        sel = self._select(generation, sequence, include_finished)
        top = self._top(sel, k, stage)
        texts = self._texts(sel)
        where = {int(s): i for i, s in enumerate(sel.steps.tolist())}
        wanted = self._positions(positions, sel)
        display = self.vocab.display
        ids_all, counts = top["ids"].tolist(), top["count"].tolist()
        columns = {name: top[name].tolist() for name in ("natural_prob", "constrained_prob", "natural_logit", "constrained_logit")}
        chosen = sel.chosen.tolist()
        nonfinite = self._nonfinite(sel)
        counts_nan = self._nan_counts(sel)
        results = []
        for pos in wanted:
            i = where.get(pos)
            if i is None:
                continue
            tokens = []
            for j in range(counts[i]):
                token_id = ids_all[i][j]
                entry: dict[str, Any] = {
                    "token": display[token_id],
                    "unstructured_prob": columns["natural_prob"][i][j],
                    "structured_prob": columns["constrained_prob"][i][j],
                }
                if include_logits:
                    entry["unstructured_logit"] = columns["natural_logit"][i][j]
                    entry["structured_logit"] = columns["constrained_logit"][i][j]
                entry["is_chosen"] = token_id == chosen[i]
                tokens.append(entry)
            results.append(
                {
                    "position": pos,
                    "text_so_far": texts[min(i, len(texts) - 1)],
                    "tokens": tokens,
                    "nonfinite": bool(nonfinite[i]),
                    "nan_count": {stage: _count(counts_nan[stage][i]) for stage in self.stages},
                }
            )
        return results

    @staticmethod
    def _positions(positions: int | Sequence[int] | None, sel: Selection) -> list[int]:
        if positions is None:
            return [int(s) for s in sel.steps.tolist()]
        if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool):
            return [int(positions)]
        try:
            out = [int(p) for p in positions]  # type: ignore[union-attr]
        except TypeError:
            raise TypeError(f"positions must be None, an int or a list of ints, got {type(positions).__name__}") from None
        return out

    def to_dataframe(
        self,
        show: Literal["probs", "logits"] = "probs",
        min_value: float | None = None,
        *,
        sequence: int | None = 0,
        generation: int = -1,
        include_finished: bool = False,
        token_ids: bool = False,
        stage: str | None = None,
    ) -> pd.DataFrame:
        """One row per (position, token) with columns ``position, token, natural, constrained, chosen``.

        ``show`` picks probabilities or logits. With ``min_value``, every token
        whose natural or constrained value is at least ``min_value`` is kept
        (no cap per position); without it, every token of the vocabulary.
        ``chosen`` compares token ids. ``sequence=None`` takes every sequence
        of the generation and adds a ``sequence`` column; ``token_ids=True``
        adds a ``token_id`` column. ``stage`` names the stage in the
        ``constrained`` column (default ``constrained``; e.g. ``"after:regex"``).
        """
        if show not in ("probs", "logits"):
            raise ValueError(f"show must be 'probs' or 'logits', got {show!r}")
        if min_value is not None and (not isinstance(min_value, (int, float)) or math.isnan(min_value)):
            raise ValueError(f"min_value must be a number or None, got {min_value!r}")
        if sequence is None:
            frames = [
                self.to_dataframe(show, min_value, sequence=s, generation=generation,
                                  include_finished=include_finished, token_ids=token_ids, stage=stage).assign(sequence=s)
                for s in self.sequences(generation)
            ]
            frame = pd.concat(frames, ignore_index=True)
            return frame[["sequence"] + [c for c in frame.columns if c != "sequence"]]
        sel = self._select(generation, sequence, include_finished)
        con_stage = self._constrained_stage(stage)
        key = ("frame", show, min_value, sel.generation, sel.sequence, sel.length, con_stage)
        rows, ids, nat, con = self._cached(key, lambda: self._entries(sel, show, min_value, con_stage))
        chosen = sel.chosen[rows] == ids
        data = {
            "position": pa.array(sel.steps[rows].astype(np.int64)),
            "token": self.vocab.display_array.take(pa.array(ids)),
            "natural": pa.array(nat),
            "constrained": pa.array(con),
            "chosen": pa.array(chosen),
        }
        if token_ids:
            data["token_id"] = pa.array(ids)
        return pa.table(data).to_pandas()

    def _entries(self, sel: Selection, show: str, min_value: float | None, con_stage: str | None = None):
        """Vectorised: (row index, token id, natural value, constrained value) of every kept entry."""
        con_stage = con_stage or self._constrained_stage()
        if not self._full:
            return self._entries_sparse(sel, show, min_value, con_stage)
        probs = show == "probs"
        lse_n, lse_c = (self._lse("natural", sel), self._lse(con_stage, sel)) if probs else (None, None)
        out: dict[str, list[np.ndarray]] = {k: [] for k in ("rows", "ids", "nat", "con")}
        scratch = torch.empty(self._block_rows(), self.metadata.vocab_size)
        for start, block in self._sub_blocks(sel, ["natural", con_stage], views=min_value is not None):
            nat, con = block["natural"], block[con_stage]
            t = nat.shape[0]
            if min_value is None:
                rows = torch.arange(t).repeat_interleave(nat.shape[1])
                ids = torch.arange(nat.shape[1]).repeat(t)
            elif probs:
                # Relaxed logit thresholds find the candidates; the exact test is on the probabilities.
                slack = math.log(min_value) - 1e-4 if min_value > 0 else -math.inf
                rows, ids = compute.entries_above(
                    nat, con, lse_n[start : start + t] + slack, lse_c[start : start + t] + slack, scratch
                )
            else:
                bound = torch.full((t,), float(min_value))
                rows, ids = compute.entries_above(nat, con, bound, bound, scratch)
            rows, ids = rows.numpy(), ids.numpy()
            out["rows"].append(rows + start)
            out["ids"].append(ids)
            out["nat"].append(compute._np(nat)[rows, ids])
            out["con"].append(compute._np(con)[rows, ids])
        if not out["rows"]:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)
        rows, ids, vn, vc = (np.concatenate(out[k]) for k in ("rows", "ids", "nat", "con"))
        if probs:  # in one go: a few kernels per query, not per block
            vn = torch.exp(torch.from_numpy(vn) - lse_n[torch.from_numpy(rows)]).numpy()
            vc = torch.exp(torch.from_numpy(vc) - lse_c[torch.from_numpy(rows)]).numpy()
            if min_value is not None:
                keep = (vn >= min_value) | (vc >= min_value)
                rows, ids, vn, vc = rows[keep], ids[keep], vn[keep], vc[keep]
        return rows, ids, vn, vc

    def _entries_sparse(self, sel: Selection, show: str, min_value: float | None, con_stage: str):
        """Top-k storage: the stored entries (constrained list, then natural-only ones with an unknown constrained value)."""
        nat = self._sparse("natural", sel)
        con = self._sparse(con_stage, sel)
        t, k = con["ids"].shape
        rows = torch.arange(t)[:, None].expand(t, k)
        c_ids, c_val = con["ids"], con["logits"]
        c_nat = con.get("natural", c_val)
        extra = ~(nat["ids"][:, :, None] == c_ids[:, None, :]).any(dim=2) if con_stage != "natural" else torch.zeros_like(nat["ids"], dtype=torch.bool)
        ids = torch.cat([c_ids, nat["ids"]], dim=1)
        vn = torch.cat([c_nat, nat["logits"]], dim=1)
        vc = torch.cat([c_val, torch.full_like(nat["logits"], math.nan)], dim=1)
        keep = torch.cat([torch.ones_like(c_ids, dtype=torch.bool), extra], dim=1)
        rows = torch.cat([rows, rows], dim=1)
        if show == "probs":
            vn = torch.exp(vn - nat["lse"].float()[:, None])
            vc = torch.exp(vc - con["lse"].float()[:, None])
        if min_value is not None:
            keep &= (vn >= min_value) | (vc >= min_value)
        order = torch.argsort(rows[keep] * (ids.max() + 1 if ids.numel() else 1) + ids[keep], stable=True)
        return tuple(x[keep][order].numpy() for x in (rows, ids, vn, vc))

    def get_logits(
        self, *, sequence: int = 0, generation: int = -1, include_finished: bool = False
    ) -> dict[str, np.ndarray]:
        """``{"unstructured": [T, V], "structured": [T, V]}`` float32 logits (plus ``"sampled"`` when recorded).

        In top-k storage, values that were not stored are NaN.
        """
        sel = self._select(generation, sequence, include_finished)
        return self._cached(("logits", sel.generation, sel.sequence, sel.length), lambda: self._arrays(sel, probs=False))

    def get_probabilities(
        self, *, sequence: int = 0, generation: int = -1, include_finished: bool = False
    ) -> dict[str, np.ndarray]:
        """The softmax of :meth:`get_logits`, same keys (masked tokens have probability 0)."""
        sel = self._select(generation, sequence, include_finished)
        return self._cached(("probs", sel.generation, sel.sequence, sel.length), lambda: self._arrays(sel, probs=True))

    def _arrays(self, sel: Selection, probs: bool) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        vocab = self.metadata.vocab_size
        for stage in self.stages:
            dense = np.empty((sel.length, vocab), dtype=np.float32)
            target = _tensor(dense)
            if self._full:
                lse = self._lse(stage, sel) if probs else None
                for start, rows in self._sub_blocks(sel, [stage], raw=not probs):
                    block = rows[stage]
                    t = block.shape[0]
                    if probs:
                        torch.exp(block - lse[start : start + t, None], out=target[start : start + t])
                    else:
                        target[start : start + t] = block
            else:
                data = self._sparse(stage, sel)
                target.fill_(math.nan)
                values = data["logits"] - data["lse"].float()[:, None] if probs else data["logits"]
                target.scatter_(1, data["ids"], torch.exp(values) if probs else values)
            out[_KEYS.get(stage, stage)] = dense
        if "structured" not in out:
            out["structured"] = out["unstructured"]
        return out

    def clear_cache(self) -> None:
        """Drop cached answers (they are rebuilt on the next call)."""
        self._cache().clear()

    # ---------------------------------------------------------------- beyond the documented surface

    def stats(
        self, *, sequence: int | None = 0, generation: int = -1, include_finished: bool = False
    ) -> pd.DataFrame:
        """One row per step: how the constraint and the sampler changed the distribution.

        Columns: ``generation, sequence, position, chosen_id, chosen_token``;
        per stage (natural, constrained, sampled when recorded)
        ``entropy_*`` (nats), ``p_chosen_*``, ``rank_chosen_*`` (0 = the
        stage's best token), ``p_eos_*`` (probability of end-of-sequence);
        ``allowed`` (tokens the constraint left), ``removed_mass`` (natural
        probability the constraint removed), ``margin`` (best token's natural
        log-probability minus the best allowed token's); ``nan_*`` (NaN
        entries of the row, left out of its distribution), ``processor_error``
        and ``nonfinite`` (NaN or +inf in a stored row; a +inf row is a
        one-hot on its +inf tokens). The statistics were computed from the
        whole row when it was recorded, so they are exact in every storage
        mode (runs written before schema 1.1 compute them from the stored
        rows; in top-k storage what those cannot tell is NaN).
        ``sequence=None`` gives every sequence.
        """
        if sequence is None:
            frames = [self.stats(sequence=s, generation=generation, include_finished=include_finished)
                      for s in self.sequences(generation)]
            return pd.concat(frames, ignore_index=True)
        sel = self._select(generation, sequence, include_finished)
        values = self._cached(("stats", sel.generation, sel.sequence, sel.length), lambda: self._stats(sel))
        frame = pd.DataFrame(
            {
                "generation": np.full(sel.length, sel.generation, dtype=np.int64),
                "sequence": np.full(sel.length, sel.sequence, dtype=np.int64),
                "position": sel.steps.astype(np.int64),
                "chosen_id": pd.arrays.IntegerArray(np.where(sel.chosen >= 0, sel.chosen, 0).astype(np.int64), sel.chosen < 0),
                "chosen_token": [self.vocab.display[c] if c >= 0 else None for c in sel.chosen.tolist()],
            }
        )
        for name, column in values.items():
            frame[name] = column
        for stage, counts in self._nan_counts(sel).items():
            frame[f"nan_{stage}"] = counts
        frame["processor_error"] = sel.processor_error
        frame["nonfinite"] = self._nonfinite(sel)
        return frame

    def _nonfinite(self, sel: Selection) -> np.ndarray:
        """Rows holding NaN or +inf in any stage: from the statistics or the stored flags, else from the rows."""
        return self._cached(("nonfinite", sel.generation, sel.sequence, sel.length), lambda: self._find_nonfinite(sel))

    def _find_nonfinite(self, sel: Selection) -> np.ndarray:
        if self._has_stats(sel):
            out = np.zeros(sel.length, dtype=bool)
            for stage in self.stages:
                out |= self._nonfinite_stage(stage, sel)
            return out
        batches = self._record_batches()
        if all(flag_column(stage) in batches[b].schema.names for b, _ in sel.blocks for stage in self.stages):
            out = np.zeros(sel.length, dtype=bool)
            start = 0
            for b, rows in sel.blocks:
                for stage in self.stages:
                    flags = batches[b].column(flag_column(stage)).to_numpy(zero_copy_only=False)
                    out[start : start + rows.size] |= flags[rows]
                start += rows.size
            return out
        if not self._full:
            flags = torch.zeros(sel.length, dtype=torch.bool)
            for stage in self.stages:
                lse = self._sparse(stage, sel)["lse"]
                flags |= torch.isnan(lse)
            return flags.numpy()
        out = np.zeros(sel.length, dtype=bool)
        for start, rows in self._sub_blocks(sel, self.stages, raw=True):
            for block in rows.values():
                out[start : start + block.shape[0]] |= compute.nonfinite_rows(block).numpy()
        return out

    def _nan_counts(self, sel: Selection) -> dict[str, np.ndarray]:
        """Per stage, the NaN entries of each row (left out of its distribution)."""
        return self._cached(("nan", sel.generation, sel.sequence, sel.length), lambda: self._count_nans(sel))

    def _count_nans(self, sel: Selection) -> dict[str, np.ndarray]:
        if self._has_stats(sel):
            return {stage: self._column(f"{stage}_nan", sel) for stage in self.stages}
        out = {stage: np.full(sel.length, math.nan) for stage in self.stages}
        if self._full:
            for start, rows in self._sub_blocks(sel, self.stages, raw=True):
                for stage, block in rows.items():
                    out[stage][start : start + block.shape[0]] = torch.isnan(block).sum(dim=1).numpy()
        return out

    def _stats(self, sel: Selection) -> dict[str, np.ndarray]:
        eos = list(self.metadata.eos_token_ids)
        chosen = torch.as_tensor(sel.chosen)
        if self._has_stats(sel):
            return self._stats_recorded(sel)
        if not self._full:
            return self._stats_sparse(sel, chosen, eos)
        lses = self._lses(sel)
        parts: dict[str, list[torch.Tensor]] = {}
        for start, rows in self._sub_blocks(sel, self.stages):
            t = rows["natural"].shape[0]
            part = compute.step_stats(
                rows, {s: lses[s][start : start + t] for s in self.stages}, chosen[start : start + t], eos
            )
            for name, value in part.items():
                parts.setdefault(name, []).append(value)
        return self._order_stats({name: torch.cat(v).double().numpy() for name, v in parts.items()})

    def _stats_recorded(self, sel: Selection) -> dict[str, np.ndarray]:
        """The statistics columns computed when the rows were recorded (exact in every storage mode)."""
        out: dict[str, np.ndarray] = {}
        known = sel.chosen >= 0
        for stage in self.stages:
            out[f"entropy_{stage}"] = self._column(f"{stage}_entropy", sel)
            for name in ("p_chosen", "rank_chosen"):
                out[f"{name}_{stage}"] = np.where(known, self._column(f"{stage}_{name}", sel), math.nan)
            out[f"p_eos_{stage}"] = self._column(f"{stage}_p_eos", sel)
        con = self._constrained_stage()
        out["allowed"] = self._column(f"{con}_allowed", sel)
        if con == "natural":
            out["removed_mass"] = np.zeros(sel.length)
            out["margin"] = np.zeros(sel.length)
        else:
            out["removed_mass"] = self._column(f"{con}_removed_mass", sel)
            out["margin"] = self._column(f"{con}_margin", sel)
        return self._order_stats(out)

    def _order_stats(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        order = []
        for stage in self.stages:
            order += [f"entropy_{stage}", f"p_chosen_{stage}", f"rank_chosen_{stage}", f"p_eos_{stage}"]
        order += ["allowed", "removed_mass", "margin"]
        return {name: values[name] for name in order if name in values}

    def _stats_sparse(self, sel: Selection, chosen: torch.Tensor, eos: list[int]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        n = sel.length
        nan = np.full(n, math.nan)
        for stage in self.stages:
            data = self._sparse(stage, sel)
            ids, logits, lse = data["ids"], data["logits"], data["lse"].float()
            hit = ids == chosen[:, None]
            found = hit.any(dim=1)
            value = torch.where(hit, logits, compute.NEG_INF).max(dim=1).values
            out[f"entropy_{stage}"] = nan
            out[f"p_chosen_{stage}"] = torch.where(found, torch.exp(value - lse), math.nan).double().numpy()
            rank = hit.float().argmax(dim=1).double()
            out[f"rank_chosen_{stage}"] = torch.where(found, rank, math.nan).numpy()
            is_eos = torch.isin(ids, torch.as_tensor(eos, dtype=torch.long)) if eos else torch.zeros_like(hit)
            p_eos = torch.where(is_eos, torch.exp(logits - lse[:, None]), 0.0).sum(dim=1).double()
            out[f"p_eos_{stage}"] = torch.where(is_eos.any(dim=1), p_eos, math.nan).numpy()
        con_stage = self._constrained_stage()
        out["allowed"] = self._sparse(con_stage, sel)["allowed"].double().numpy()
        out["removed_mass"] = nan
        out["margin"] = nan
        return self._order_stats(out)

    def _probability_row(self, sel: Selection, i: int) -> dict[str, np.ndarray]:
        """One position's probabilities per stage (keys as :meth:`get_probabilities`), read from its row alone."""
        out: dict[str, np.ndarray] = {}
        batches = self._record_batches()
        offset = 0
        for b, rows in sel.blocks:
            if i < offset + rows.size:
                break
            offset += rows.size
        row = rows[i - offset : i - offset + 1]
        lses = self._lses(sel)
        for stage in self.stages:
            if self._full:
                flags = self._nonfinite_stage(stage, sel)[i : i + 1] if self._has_stats(sel) else None
                block = self._block(batches[b], stage, row, flags, raw=False)
                value = torch.exp(block[0] - lses[stage][i]).double().numpy()
            else:
                data = self._sparse(stage, sel)
                value = np.full(self.metadata.vocab_size, math.nan)
                value[data["ids"][i].numpy()] = torch.exp(data["logits"][i].double() - data["lse"][i]).numpy()
            out[_KEYS.get(stage, stage)] = value
        if "structured" not in out:
            out["structured"] = out["unstructured"]
        return out

    def continuation_probability(
        self,
        text: str,
        position: int = 0,
        *,
        sequence: int = 0,
        generation: int = -1,
        include_finished: bool = False,
    ) -> Continuation:
        """The probability that the output continues with ``text`` at ``position`` (see :class:`Continuation`).

        ``"cat"`` counts every token starting with "cat" (" cat" does not:
        give the space), so it is at least the probability of ``"catfish"``.
        """
        if not isinstance(text, str) or not text:
            raise ValueError(f"text must be a non-empty string, got {text!r}")
        sel = self._select(generation, sequence, include_finished)
        where = {int(s): i for i, s in enumerate(sel.steps.tolist())}
        if position not in where:
            raise ValueError(f"position={position} was not recorded; recorded positions are 0..{sel.length - 1}")
        matrix, lengths = self.vocab.byte_matrix
        remaining = text.encode("utf-8")
        i = where[position]
        exact, path = True, []
        keys = [_KEYS.get(stage, stage) for stage in self.stages]
        if "structured" not in keys:
            keys.append("structured")
        path_prob = {key: 1.0 for key in keys}
        total = {key: 0.0 for key in keys}
        while remaining:
            if i >= sel.length:
                exact = False
                break
            probs = self._probability_row(sel, i)
            covers, prefixes = _match(matrix, lengths, remaining)
            for key, array in probs.items():
                total[key] += path_prob[key] * float(array[covers].sum())
            chosen = int(sel.chosen[i])
            others = prefixes.copy()
            if chosen >= 0:
                others[chosen] = False
            if any(float(array[others].sum()) > 0 for array in probs.values()):
                exact = False
            if chosen < 0 or not prefixes[chosen]:
                break
            for key, array in probs.items():
                path_prob[key] *= float(array[chosen])
            path.append(chosen)
            remaining = remaining[int(lengths[chosen]) :]
            i += 1
        names = {"unstructured": "natural", "structured": "constrained"}
        result = {names.get(key, key): value for key, value in total.items()}
        return Continuation(text, int(position), result, exact, path)


def _match(matrix: np.ndarray, lengths: np.ndarray, target: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Token masks: tokens whose bytes start with ``target``; non-empty proper prefixes of ``target``."""
    want = np.frombuffer(target, dtype=np.uint8)
    width = min(matrix.shape[1], want.size)
    equal = matrix[:, :width] == want[:width]
    cols = np.arange(width)
    covers = (lengths >= want.size) & equal.all(axis=1) if width == want.size else np.zeros(len(lengths), dtype=bool)
    prefix_equal = np.where(cols[None, :] < lengths[:, None], equal, True).all(axis=1)
    prefixes = (lengths > 0) & (lengths < want.size) & prefix_equal
    return covers, prefixes
