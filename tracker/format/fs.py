"""Where runs live: a local path, or a URL of any filesystem that pyarrow or fsspec knows.

``s3://``, ``gs://``, ``abfs://``, ``hdfs://`` and ``file://`` go to pyarrow's own filesystems, configured the
standard way (for S3 the ``AWS_*`` environment variables, ``AWS_ENDPOINT_URL`` included); any other scheme that an
installed fsspec implementation registers (``memory://``, ``sftp://``, ...) goes through fsspec. logitscope has no
storage client of its own. Needs pyarrow only (fsspec for the other schemes).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow.fs as pafs

__all__ = ["is_url", "resolve", "PYARROW_SCHEMES", "path_arg", "folder_arg"]

#: The schemes that pyarrow's own filesystems serve.
PYARROW_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "az")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(location: object) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and _SCHEME.match(location) is not None


def resolve(location: str | os.PathLike[str], name: str = "path") -> tuple[pafs.FileSystem, str]:
    """The filesystem that holds ``location`` and the path inside it.

    A local path (``str`` or ``os.PathLike``) gives the local filesystem and the absolute path. A URL gives the
    filesystem of its scheme; ``name`` is the argument named in the error for a scheme nobody serves.
    """
    if isinstance(location, os.PathLike) or (isinstance(location, str) and not is_url(location)):
        return pafs.LocalFileSystem(), str(Path(location).expanduser().absolute())
    if not isinstance(location, str):
        raise TypeError(f"{name} must be a path or a URL, got {type(location).__name__} {location!r}")
    scheme = _SCHEME.match(location).group(1).lower()  # type: ignore[union-attr]
    if scheme in PYARROW_SCHEMES:
        try:
            return pafs.FileSystem.from_uri(location)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{name} {location!r} cannot be opened: {exc}") from exc
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fs, path = fsspec.core.url_to_fs(location)
    except ImportError as exc:
        raise ValueError(
            f"{name} {location!r}: the scheme {scheme!r} needs fsspec and its package for {scheme!r}"
            f" ({exc}); pyarrow itself serves {', '.join(s + '://' for s in PYARROW_SCHEMES)}"
        ) from exc
    except (ValueError, OSError) as exc:
        raise ValueError(f"{name} {location!r} cannot be opened: {exc}") from exc
    return PyFileSystem(FSSpecHandler(fs)), path


def path_arg(name: str, value: object) -> Path:
    """``value`` as a Path: a non-empty ``str`` or an ``os.PathLike``; else an error naming the argument and the value."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (a str or os.PathLike), got {value!r} ({type(value).__name__})")
    if str(value) == "":
        raise ValueError(f"{name} must be a path, got '' (an empty string)")
    return Path(value)


def folder_arg(name: str, value: object) -> Path:
    """``value`` as a Path (:func:`path_arg`) to a folder that exists or can be made (not at or under a file)."""
    folder = path_arg(name, value)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == folder else f"lies under '{existing}', which is a file"
        raise NotADirectoryError(f"{name} must be a folder (made if missing), got '{folder}', which {where}")
    return folder
