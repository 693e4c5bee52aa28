"""A package's public names imported on first use (PEP 562).

``processors`` and ``tracker`` export names whose modules need torch, while
``processors.vocab`` and the run-reading modules of ``tracker`` must load
without it (the viewer's environment). Their ``__init__`` names where each
public name lives, and :func:`lazy_exports` gives the module ``__getattr__``
and ``__dir__`` that import it on first use and keep it in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names live in the modules ``homes`` gives."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
