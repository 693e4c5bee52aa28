"""Stage names as a run keeps them: a name or its alias resolved, and the names a user sees.

A run records its stages in pipeline order (``natural``, any ``after:<processor>`` stages, ``constrained``,
``sampled``) and keeps ``stage_aliases`` (``after:<last processor>`` -> ``constrained``). Needs nothing but Python.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["resolve_stage", "display_stages"]


def resolve_stage(stages: Sequence[str], aliases: dict[str, str], stage: str) -> str:
    """The recorded stage that ``stage`` names (itself, or what its alias points to)."""
    if not isinstance(stage, str):
        raise TypeError(f"stage must be a string, got {type(stage).__name__}")
    if stage in stages:
        return stage
    if stage in aliases and aliases[stage] in stages:
        return aliases[stage]
    known = list(stages) + [a for a in aliases if aliases[a] in stages]
    raise ValueError(f"stage={stage!r} was not recorded; recorded stages: {known}")


def display_stages(stages: Sequence[str], aliases: dict[str, str]) -> list[str]:
    """The stage names a user sees, in order: the last processor's name in place of ``constrained``."""
    back = {v: k for k, v in aliases.items()}
    return [back.get(s, s) for s in stages]
