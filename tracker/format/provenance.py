"""Where a run comes from: its id, its time, the library's version and a model's name (for its metadata)."""

from __future__ import annotations

import datetime as _dt
import uuid
from importlib import metadata as _importlib_metadata
from typing import Any

__all__ = ["now", "new_run_id", "library_version", "model_name"]


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    return f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:16]}"  # 64 random bits: no collision across writers


def library_version() -> str:
    try:
        return _importlib_metadata.version("logitscope")
    except _importlib_metadata.PackageNotFoundError:
        return "unknown"


def model_name(model: Any) -> Any:
    """A model's name for the metadata: a string as it is, else its config's ``_name_or_path`` or its type."""
    if model is None or isinstance(model, str):
        return model
    return getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
