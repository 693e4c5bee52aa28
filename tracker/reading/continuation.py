"""The probability that a run's output continues with a given text, summed over the tokens that start it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tracker.reading.selection import Selection, index_arg

__all__ = ["Continuation", "continuation"]

_KEYS = {"natural": "unstructured", "constrained": "structured"}


@dataclass(frozen=True)
class Continuation:
    """The probability that the text continues with ``text`` at ``position``.

    Summed over every way the vocabulary can start it: tokens whose text
    starts with the whole remainder, plus (along the recorded path) a token
    that is a proper prefix of it times the probability of the rest at the
    next step. ``exact`` is False when a prefix token other than the one
    chosen had probability (its continuation was never computed), the
    record ended first, or top-k storage did not keep a value that counts
    (counted as 0): the values are then lower bounds.

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


def continuation(
    text: str,
    position: int,
    sel: Selection,
    stages: list[str],
    byte_matrix: tuple[np.ndarray, np.ndarray],
    probability_row: Callable[[int], dict[str, np.ndarray]],
) -> Continuation:
    """The probability that the output continues with ``text`` at ``position`` (see :class:`Continuation`).

    ``byte_matrix`` is the vocabulary's token bytes and lengths;
    ``probability_row(i)`` the probabilities of the selection's ``i``-th row
    per stage (keys as ``get_probabilities``).
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    where = {int(s): i for i, s in enumerate(sel.steps.tolist())}
    position = index_arg("position", position)
    if position not in where:
        raise ValueError(f"position={position} was not recorded; recorded positions are 0..{sel.length - 1}")
    matrix, lengths = byte_matrix
    remaining = text.encode("utf-8")
    i = where[position]
    exact, path = True, []
    keys = [_KEYS.get(stage, stage) for stage in stages]
    if "structured" not in keys:
        keys.append("structured")
    path_prob = {key: 1.0 for key in keys}
    total = {key: 0.0 for key in keys}
    while remaining:
        if i >= sel.length:
            exact = False
            break
        probs = probability_row(i)
        covers, prefixes = _match(matrix, lengths, remaining)
        chosen = int(sel.chosen[i])
        others = prefixes.copy()
        if chosen >= 0:
            others[chosen] = False
        if any(np.isnan(array[covers | prefixes]).any() for array in probs.values()):
            exact = False  # a value top-k storage did not keep: counted as 0, so the result is a lower bound
            probs = {key: np.nan_to_num(array, nan=0.0) for key, array in probs.items()}
        for key, array in probs.items():
            total[key] += path_prob[key] * float(array[covers].sum())
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
