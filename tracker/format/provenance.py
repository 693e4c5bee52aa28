"""Where a run comes from: its id, its time, the library's version and a model's name (for its metadata)."""

from __future__ import annotations

import datetime as _dt
import functools
import secrets
from importlib import metadata as _importlib_metadata
from typing import Any

__all__ = ["now", "new_run_id", "library_version", "model_name"]


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    """A UTC timestamp and 64 random bits (16 hex digits): unique across processes and machines."""
    return f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(8)}"


@functools.cache
def library_version() -> str:
    """The installed logitscope's version, read once a process (reading a distribution's metadata parses its
    METADATA file: 2.2 ms, paid by every part an engine wrote)."""
    try:
        return _importlib_metadata.version("logitscope")
    except _importlib_metadata.PackageNotFoundError:
        return "unknown"


def model_name(model: Any) -> Any:
    """A model's name for the metadata: a string as it is, else its config's ``_name_or_path`` or its type."""
    if model is None or isinstance(model, str):
        return model
    return getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
