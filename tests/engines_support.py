"""What the engine tests share: importing an engine's module, or skipping with the module that stopped it."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def import_or_skip(name: str) -> ModuleType:
    """The module ``name``; where it cannot be imported here, skip, naming it and why."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} does not import here: {type(exc).__name__}: {exc}")
