"""The analysis API: top tokens, data frames, text, arrays and per-step statistics of a run.

:class:`Analysis` answers the documented tracking calls (``get_top_tokens``,
``to_dataframe``, ``sequence``, ``get_logits``, ``get_probabilities``) plus
``stats`` and ``continuation_probability`` from a run's Arrow rows, with no
model, no tokenizer and no torch. Each query is written once over
:class:`~tracker.reading.block.Block` rows, whatever the storage (full or top-k),
works block by block (:mod:`tracker.reading.passes`) and is cached, so asking again
is free. Selectors as in :mod:`tracker.reading.selection`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa

from processors.checks import is_number
from tracker.format.stages import resolve_stage
from tracker.reading import metrics
from tracker.reading.block import Block, full_rows, read_as_recorded, stage_matrix
from tracker.reading.candidates import (
    Candidates,
    best_candidates,
    entries_above,
    top_candidates,
)
from tracker.reading.continuation import Continuation, continuation
from tracker.reading.passes import Passes
from tracker.reading.rows import probabilities
from tracker.reading.selection import Selection, count_arg, index_arg

__all__ = ["Analysis", "Continuation", "Selection", "stage_matrix"]

_KEYS = {"natural": "unstructured", "constrained": "structured"}


def _count(value: float) -> int | None:
    return None if math.isnan(value) else int(value)


def _candidates(nat: Block, con: Block, k: int, same: bool) -> Candidates:
    """Candidates for a block's best allowed tokens: the stored lists in top-k storage, else a search."""
    if not con.full:
        natural = con.values if same or con.natural is None else con.natural
        return Candidates(con.ids, np.ones(con.ids.shape, dtype=bool), natural, con.values)
    con_values = nat.values if same else con.values
    return top_candidates(nat.values, con_values, nat.lse, con.lse, k, nat.gmax, None if same else con.gmax)


def _entries(nat: Block, con: Block, tn: np.ndarray | None, tc: np.ndarray | None, same: bool):
    """``(rows, ids, natural, constrained)`` of a block's entries at or above a threshold in either stage
    (every entry without thresholds); in top-k storage the stored ones (constrained list, then the
    natural-only ones, their constrained value as :meth:`Block.unstored` says), filtered later."""
    if con.full:
        if tn is None:
            t, v = nat.values.shape
            rows, ids = np.repeat(np.arange(t), v), np.tile(np.arange(v), t)
        else:
            rows, ids = entries_above(
                nat.values, nat.values if same else con.values, tn, tc, nat.gmax, None if same else con.gmax
            )
        return rows, ids, nat.values[rows, ids], (nat if same else con).values[rows, ids]
    t, k = con.ids.shape
    c_nat = con.values if same or con.natural is None else con.natural
    extra = np.zeros(nat.ids.shape, dtype=bool) if same else ~(nat.ids[:, :, None] == con.ids[:, None, :]).any(axis=2)
    rows = np.repeat(np.arange(t), k + nat.ids.shape[1]).reshape(t, -1)
    keep = np.concatenate([np.ones(con.ids.shape, dtype=bool), extra], axis=1)
    ids = np.concatenate([con.ids, nat.ids], axis=1)
    vn = np.concatenate([c_nat, nat.values], axis=1)
    vc = np.concatenate([con.values, np.repeat(con.unstored(), nat.values.shape[1], axis=1)], axis=1)
    rows, ids, vn, vc = rows[keep], ids[keep], vn[keep], vc[keep]
    order = np.lexsort((ids, rows))
    return rows[order], ids[order], vn[order], vc[order]


class Analysis(Passes):
    """Mixin: the analysis API over ``self._record_batches()``, ``self.metadata``, ``self.vocab``."""

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
            ids = ids[: index_arg("pos", pos)]
        return self.vocab.decode(ids)

    def _texts(self, sel: Selection) -> list[str]:
        key = ("texts", sel.generation, sel.sequence, sel.length, sel.part)
        return self._cached(key, lambda: self.vocab.prefixes(sel.known_chosen))

    def _top(self, sel: Selection, k: int, stage: str | None = None) -> dict[str, np.ndarray]:
        """Per position: the k best allowed tokens with both stages' logits and probabilities."""
        con_stage = self._constrained_stage(stage)
        key = ("top", k, sel.generation, sel.sequence, sel.length, sel.part, con_stage)

        def build() -> dict[str, np.ndarray]:
            same = con_stage == "natural"
            width = min(k, self.metadata.vocab_size)
            parts = self._map(
                sel, ["natural", con_stage], lambda start, b: _candidates(b["natural"], b[con_stage], width, same)
            )
            lse_n, lse_c = self._lse("natural", sel), self._lse(con_stage, sel)
            if parts:  # the scoring in one go: a few small kernels per query, not per block
                ids, count, ln, lc = best_candidates(Candidates.join(parts), lse_n, lse_c, width)
            else:
                ids, count = np.zeros((0, width), np.int64), np.zeros(0, np.int64)
                ln = lc = np.zeros((0, width), np.float32)
            with np.errstate(invalid="ignore", over="ignore"):
                return {
                    "ids": ids,
                    "count": count,
                    "natural_logit": ln,
                    "constrained_logit": lc,
                    "natural_prob": np.exp(ln - lse_n[:, None]),
                    "constrained_prob": np.exp(lc - lse_c[:, None]),
                }

        return self._cached(key, build)

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
        stored ``top_k``, and the tokens listed are those the constrained stage
        kept (a token the model liked that fell out of the constrained top-k,
        masked or merely lowered, is not known to be allowed, so it is not
        listed). ``stage`` names the stage shown as "structured"
        (default ``constrained``; e.g. ``"after:regex"``).
        """
        k = count_arg("k", k)
        sel = self._select(generation, sequence, include_finished)
        texts = self._texts(sel)
        where = {int(s): i for i, s in enumerate(sel.steps.tolist())}
        part, wanted = self._at(sel, positions)  # a few positions: only their rows (and chunks) are read
        at = {int(s): j for j, s in enumerate(part.steps.tolist())}
        top = self._top(part, k, stage)
        display = self.vocab.display
        ids_all, counts = top["ids"].tolist(), top["count"].tolist()
        pn, pc = top["natural_prob"].tolist(), top["constrained_prob"].tolist()
        ln, lc = top["natural_logit"].tolist(), top["constrained_logit"].tolist()
        chosen = part.chosen.tolist()
        nonfinite = self._nonfinite(part).tolist()
        counts_nan = {stage: [_count(c) for c in values.tolist()] for stage, values in self._nan_counts(part).items()}
        results = []
        for pos in wanted:
            whole = where.get(pos)
            if whole is None:
                continue
            i = at[pos]
            n, mine = counts[i], chosen[i]
            if include_logits:
                tokens = [
                    {
                        "token": display[t],
                        "unstructured_prob": a,
                        "structured_prob": b,
                        "unstructured_logit": c,
                        "structured_logit": d,
                        "is_chosen": t == mine,
                    }
                    for t, a, b, c, d in zip(ids_all[i][:n], pn[i], pc[i], ln[i], lc[i])
                ]
            else:
                tokens = [
                    {"token": display[t], "unstructured_prob": a, "structured_prob": b, "is_chosen": t == mine}
                    for t, a, b in zip(ids_all[i][:n], pn[i], pc[i])
                ]
            results.append(
                {
                    "position": pos,
                    "text_so_far": texts[min(whole, len(texts) - 1)],
                    "tokens": tokens,
                    "nonfinite": nonfinite[i],
                    "nan_count": {stage: counts_nan[stage][i] for stage in self.stages},
                }
            )
        return results

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
        positions: int | Sequence[int] | None = None,
    ) -> pd.DataFrame:
        """One row per (position, token) with columns ``position, token, natural, constrained, chosen``.

        ``show`` picks probabilities or logits. With ``min_value``, every token
        whose natural or constrained value is at least ``min_value`` is kept
        (no cap per position); without it, every token of the vocabulary.
        ``chosen`` compares token ids. ``sequence=None`` takes every sequence
        of the generation and adds a ``sequence`` column; ``token_ids=True``
        adds a ``token_id`` column. ``stage`` names the stage in the
        ``constrained`` column (default ``constrained``; e.g. ``"after:regex"``). ``positions`` (an int or a
        list) keeps those positions only, in step order, and reads only their rows.
        """
        if show not in ("probs", "logits"):
            raise ValueError(f"show must be 'probs' or 'logits', got {show!r}")
        if min_value is not None and (not is_number(min_value) or math.isnan(min_value)):
            raise ValueError(f"min_value must be a number or None, got {min_value!r}")
        min_value = None if min_value is None else float(min_value)
        if sequence is None:
            frames = [
                self.to_dataframe(
                    show,
                    min_value,
                    sequence=s,
                    generation=generation,
                    include_finished=include_finished,
                    token_ids=token_ids,
                    stage=stage,
                    positions=positions,
                ).assign(sequence=s)
                for s in self.sequences(generation)
            ]
            frame = pd.concat(frames, ignore_index=True)
            return frame[["sequence"] + [c for c in frame.columns if c != "sequence"]]
        sel, _ = self._at(self._select(generation, sequence, include_finished), positions)
        con_stage = self._constrained_stage(stage)
        key = ("frame", show, min_value, sel.generation, sel.sequence, sel.length, sel.part, con_stage)
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
        same = con_stage == "natural"
        probs = show == "probs"

        def work(start: int, blocks: dict[str, Block]):
            nat, con = blocks["natural"], blocks[con_stage]
            t = nat.rows
            if min_value is None or not con.full:
                tn = tc = None
            elif probs:
                # Relaxed logit thresholds find the candidates; the exact test is on the probabilities.
                slack = np.float32(math.log(min_value) - 1e-4 if min_value > 0 else -math.inf)
                # a row with nothing allowed (log-sum-exp -inf) has no entry to find: threshold +inf
                tn, tc = (np.where(b.lse == -np.inf, np.float32(np.inf), b.lse + slack) for b in (nat, con))
            else:
                tn = tc = np.full(t, min_value, dtype=np.float32)
            rows, ids, vn, vc = _entries(nat, con, tn, tc, same)
            return rows + start, ids, vn, vc

        parts = self._map(sel, ["natural", con_stage], work)
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32)
        rows, ids, vn, vc = (np.concatenate([p[i] for p in parts]) for i in range(4))
        if probs:  # in one go: a few kernels per query, not per block (the pass above found the lse)
            lse_n, lse_c = self._lse("natural", sel), self._lse(con_stage, sel)
            vn, vc = probabilities(vn, lse_n[rows]), probabilities(vc, lse_c[rows])
        if min_value is not None:
            keep = (vn >= min_value) | (vc >= min_value)
            rows, ids, vn, vc = rows[keep], ids[keep], vn[keep], vc[keep]
        return rows, ids, vn, vc

    def get_logits(
        self, *, sequence: int = 0, generation: int = -1, include_finished: bool = False
    ) -> dict[str, np.ndarray]:
        """``{"unstructured": [T, V], "structured": [T, V]}`` float32 logits (plus ``"sampled"`` when recorded).

        In top-k storage, a value that was not stored is ``-inf`` where the
        row allowed no more tokens than were stored (all of them were kept, so
        the rest were masked), else NaN (not known); the natural logits are
        also known at the ids later stages kept.
        """
        sel = self._select(generation, sequence, include_finished)
        return self._cached(
            ("logits", sel.generation, sel.sequence, sel.length, sel.part), lambda: self._arrays(sel, probs=False)
        )

    def get_probabilities(
        self, *, sequence: int = 0, generation: int = -1, include_finished: bool = False
    ) -> dict[str, np.ndarray]:
        """The softmax of :meth:`get_logits`, same keys (masked tokens have probability 0)."""
        sel = self._select(generation, sequence, include_finished)
        return self._cached(
            ("probs", sel.generation, sel.sequence, sel.length, sel.part), lambda: self._arrays(sel, probs=True)
        )

    def _arrays(self, sel: Selection, probs: bool) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        vocab = self.metadata.vocab_size
        for stage in self.stages:
            dense = np.empty((sel.length, vocab), dtype=np.float32)

            def fill(start: int, blocks: dict[str, Block], stage: str = stage, dense: np.ndarray = dense) -> None:
                block = blocks[stage]
                target = dense[start : start + block.rows]
                target[...] = block.dense(vocab)
                for other in blocks.values():  # top-k: later stages keep the natural logits at their own ids
                    if other is not block and other.natural is not None:
                        here = np.take_along_axis(target, other.ids, axis=1)
                        np.put_along_axis(target, other.ids, np.where(np.isnan(other.natural), here, other.natural), 1)
                if probs:
                    probabilities(target, block.lse[:, None], out=target)

            read = list(self.stages) if stage == "natural" and not self._full else [stage]
            self._map(sel, read, fill, raw=not probs)
            out[_KEYS.get(stage, stage)] = dense
        if "structured" not in out:
            out["structured"] = out["unstructured"]
        return out

    def stats(
        self,
        *,
        sequence: int | None = 0,
        generation: int = -1,
        include_finished: bool = False,
        positions: int | Sequence[int] | None = None,
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
        ``sequence=None`` gives every sequence. ``positions`` (an int or a list) keeps those steps only, in
        step order, and reads only their rows.
        """
        if sequence is None:
            frames = [
                self.stats(sequence=s, generation=generation, include_finished=include_finished, positions=positions)
                for s in self.sequences(generation)
            ]
            return pd.concat(frames, ignore_index=True)
        sel, _ = self._at(self._select(generation, sequence, include_finished), positions)
        values = self._cached(("stats", sel.generation, sel.sequence, sel.length, sel.part), lambda: self._stats(sel))
        frame = pd.DataFrame(
            {
                "generation": np.full(sel.length, sel.generation, dtype=np.int64),
                "sequence": np.full(sel.length, sel.sequence, dtype=np.int64),
                "position": sel.steps.astype(np.int64),
                "chosen_id": pd.arrays.IntegerArray(
                    np.where(sel.chosen >= 0, sel.chosen, 0).astype(np.int64), sel.chosen < 0
                ),
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

    def _stats(self, sel: Selection) -> dict[str, np.ndarray]:
        if self._has_stats(sel):
            return self._stats_recorded(sel)
        eos = list(self.metadata.eos_token_ids)
        parts = self._map(
            sel,
            self.stages,
            lambda start, b: metrics.step_metrics(b, sel.chosen[start : start + b["natural"].rows], eos),
        )
        if not parts:  # no rows (positions= named none that was recorded): every column, empty
            return self._stats_recorded(sel)
        return self._order_stats({name: np.concatenate([p[name] for p in parts]) for name in parts[0]})

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

    def _arrays_at(self, sel: Selection, index: np.ndarray, probs: bool) -> dict[str, np.ndarray]:
        """:meth:`get_probabilities` (``probs``) or :meth:`get_logits` at rows ``index`` (ascending) of ``sel``:
        the same values, read from those rows' batches alone (taken from the whole arrays when cached)."""
        name = "probs" if probs else "logits"
        arrays = self._cache().get((name, sel.generation, sel.sequence, sel.length, sel.part))
        if arrays is not None:
            return {stage: values[index] for stage, values in arrays.items()}
        part = sel.subset(index)
        return self._cached(
            (name, part.generation, part.sequence, part.length, part.part), lambda: self._arrays(part, probs)
        )

    def _probability_row(self, sel: Selection, i: int) -> dict[str, np.ndarray]:
        """One position's float64 probabilities per stage (keys as :meth:`get_probabilities`), read from its
        row alone (on a spilled run, its chunk alone)."""
        out: dict[str, np.ndarray] = {}
        part = sel.subset(np.array([i]))
        ((b, row),) = part.blocks
        for stage in self.stages:
            facts = self._scan(stage, part)
            if self._full:
                values, valid = full_rows(self._record_batches()[b], stage, row, self.metadata.vocab_size)
                values = read_as_recorded(values, facts["nonfinite"], valid)[0]
            else:
                values = self._topk(stage, part).dense(self.metadata.vocab_size)[0]
            out[_KEYS.get(stage, stage)] = probabilities(values.astype(np.float64), float(facts["lse"][0]))
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
        sel = self._select(generation, sequence, include_finished)
        return continuation(
            text, position, sel, self.stages, self.vocab.byte_matrix, lambda i: self._probability_row(sel, i)
        )
