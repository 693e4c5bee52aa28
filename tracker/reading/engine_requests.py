"""What a vLLM run says about its requests: which generations vLLM sampled, with which parameters, and
which tokens each had output before each step (the inputs of :mod:`tracker.reading.vllm_sampler`).

logitscope's vLLM processor (:mod:`tracker.recording.engines.vllm`) records each tracked request as a
generation whose metadata holds ``prompt_ids`` (one list) and ``sampling`` (one dict per row) with the
request's ``temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty, presence_penalty``
and ``"sampler": "vllm"``. A run file may come from anyone: every value is checked before use, and a
bad one is a ValueError naming the generation, the key, the value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tracker.format.schema import RunMetadata
from tracker.reading.vllm_sampler import SAMPLING_EPS, RowParams

__all__ = [
    "SAMPLER_KEY",
    "VLLM",
    "Request",
    "request_from",
    "vllm_requests",
    "History",
    "row_params",
    "rows_by_sequence",
]

#: The key of a generation's sampling dict naming whose sampler its parameters follow.
SAMPLER_KEY = "sampler"
VLLM = "vllm"

#: (key, default, check, what is allowed)
_PARAMS: tuple[tuple[str, float, Any, str], ...] = (
    ("temperature", 1.0, lambda v: v >= 0, "a number >= 0"),
    ("top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("top_k", 0, lambda v: v >= -1 and float(v).is_integer(), "an integer >= -1 (0 or -1: none)"),
    ("min_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("repetition_penalty", 1.0, lambda v: v > 0, "a number > 0"),
    ("frequency_penalty", 0.0, lambda v: True, "a finite number"),
    ("presence_penalty", 0.0, lambda v: True, "a finite number"),
)


@dataclass(frozen=True)
class Request:
    """One row of a vLLM generation: its parameters and its prompt's token ids."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    prompt_ids: tuple[int, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalised(self) -> bool:
        """Whether the penalties change anything (then they need the output so far)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def _engine_says_vllm(metadata: RunMetadata) -> bool:
    """Whether the run's metadata names vLLM as its engine: ``extra["engine"]`` as the vLLM processor writes it
    (``{"name": "vllm", "version": ...}``) or a plain name."""
    engine = metadata.extra.get("engine") if isinstance(metadata.extra, dict) else None
    name = engine.get("name") if isinstance(engine, dict) else engine
    return isinstance(name, str) and name.lower() == VLLM


def request_from(row: Mapping[str, Any], prompt: Any = (), where: str = "sampling") -> Request:
    """One request's :class:`Request` from its sampling dict (vLLM's defaults for keys it lacks) and prompt ids;
    ValueError naming ``where``, the key, the value and what is allowed."""
    values: dict[str, Any] = {}
    for key, default, check, allowed in _PARAMS:
        value = row.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{where}['{key}'] must be {allowed}, got {value!r:.80}")
        if not check(value):
            raise ValueError(f"{where}['{key}'] must be {allowed}, got {value!r:.80}")
        values[key] = int(value) if key == "top_k" else float(value)
    return Request(**values, prompt_ids=tuple(prompt) if isinstance(prompt, (list, tuple)) else ())


def vllm_requests(metadata: RunMetadata) -> dict[tuple[int, int], Request]:
    """``(generation, sequence) -> Request`` for every row vLLM sampled: rows whose sampling dict says
    ``"sampler": "vllm"``, or every row with a sampling dict when the run's ``extra["engine"]`` names vLLM. ValueError
    naming the generation and the key when a parameter is not one vLLM takes."""
    whole = _engine_says_vllm(metadata)
    out: dict[tuple[int, int], Request] = {}
    for entry in metadata.generations:
        rows = entry.get("sampling")
        if not isinstance(rows, list):
            continue
        prompts = entry.get("prompt_ids") or []
        generation = int(entry["generation"])
        for sequence, row in enumerate(rows):
            if not isinstance(row, Mapping) or not (whole or row.get(SAMPLER_KEY) == VLLM):
                continue
            prompt = prompts[sequence] if sequence < len(prompts) else []
            out[(generation, sequence)] = request_from(
                row, prompt, f"generation {generation}, sequence {sequence}: sampling"
            )
    return out


def row_params(requests: list[Request], vocab_size: int) -> RowParams:
    """The parameters of rows belonging to ``requests`` (one per row), as vLLM's input batch holds them."""

    def column(name: str, dtype: Any) -> np.ndarray:
        return np.array([getattr(r, name) for r in requests], dtype=dtype)

    top_k = column("top_k", np.int64)
    return RowParams(
        temperature=column("temperature", np.float32),
        top_k=np.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size),
        top_p=column("top_p", np.float32),
        min_p=column("min_p", np.float32),
        repetition=column("repetition_penalty", np.float32),
        frequency=column("frequency_penalty", np.float32),
        presence=column("presence_penalty", np.float32),
        greedy=np.array([r.greedy for r in requests], dtype=bool),
    )


class History:
    """The token chosen at each recorded step of each sequence (from the id columns of the whole run), to
    count what a request had output before a step."""

    def __init__(self, generation: np.ndarray, sequence: np.ndarray, step: np.ndarray, chosen: np.ndarray) -> None:
        order = np.lexsort((step, sequence, generation))
        gen, seq, st, ch = generation[order], sequence[order], step[order], chosen[order]
        self._rows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        if not gen.size:
            return
        cuts = np.nonzero((np.diff(gen) != 0) | (np.diff(seq) != 0))[0] + 1
        for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [gen.size]])):
            self._rows[(int(gen[a]), int(seq[a]))] = (st[a:b].astype(np.int64), ch[a:b].astype(np.int64))

    def tokens(self, key: tuple[int, int], vocab: int) -> np.ndarray:
        """The distinct token ids the sequence output at its recorded steps."""
        tokens = self._rows.get(key, (None, np.zeros(0, np.int64)))[1]
        return np.unique(tokens[(tokens >= 0) & (tokens < vocab)])

    def counts_at(
        self, key: tuple[int, int], steps: np.ndarray, ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """How often each of token ``ids`` ``[n, k]`` (distinct per row) was chosen at steps ``0 .. s - 1``
        before each of ``steps`` (one sequence's): ``(counts [n, k], outside [n], known [n])``. ``outside``:
        the distinct tokens output before each step that are not among its ``ids``; ``known``: all those tokens
        are known (every step before was recorded with its chosen token: not so after a preemption resumed
        the request mid-way). Never a ``[n, V]`` array."""
        rec_steps, tokens = self._rows.get(key, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        steps = np.asarray(steps, dtype=np.int64)
        before = np.searchsorted(rec_steps, steps, side="left")
        unknown = np.concatenate([[0], np.cumsum(tokens < 0)])
        known = (before == steps) & (unknown[before] == 0)
        span = tokens.size + 1
        keys = np.sort(np.where(tokens >= 0, tokens, -1) * span + np.arange(tokens.size))
        ids = np.asarray(ids, dtype=np.int64)
        counts = np.searchsorted(keys, ids * span + before[:, None]) - np.searchsorted(keys, ids * span)
        seen = tokens >= 0
        _, first = np.unique(tokens[seen], return_index=True)
        firsts = np.sort(np.nonzero(seen)[0][first])  # where each distinct token is first output
        distinct = np.searchsorted(firsts, before)
        return counts.astype(np.int32), distinct - (counts > 0).sum(axis=1), known


def rows_by_sequence(batch: pa.RecordBatch) -> dict[tuple[int, int], np.ndarray]:
    """The rows of ``batch`` by ``(generation, sequence)``."""
    gen = batch.column("generation").to_numpy(zero_copy_only=False)
    seq = batch.column("sequence").to_numpy(zero_copy_only=False)
    keys = gen.astype(np.int64) << 32 | seq.astype(np.int64)
    unique, inverse = np.unique(keys, return_inverse=True)
    return {(int(k >> 32), int(k & 0xFFFFFFFF)): np.nonzero(inverse == i)[0] for i, k in enumerate(unique)}
