"""Where things are: the app script, the shipped sample runs, and the variable naming the runs to show.

Kept free of Streamlit so that the command line can use it cheaply.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit
from urllib.request import url2pathname

__all__ = [
    "ANY_PATH_FLAG",
    "APP",
    "ENV_ANY_PATH",
    "ENV_PATH",
    "HEADLINE_RUN",
    "PACKAGED_RUNS",
    "REPO_ROOT",
    "default_runs_path",
    "inside",
]

#: The Streamlit entry script.
APP = Path(__file__).resolve().parent / "app.py"
#: The folder holding the ``dashboard`` package (the repository root in a checkout or editable install).
REPO_ROOT = APP.parent.parent
#: The sample run a folder of sample runs opens on (the JSON schema at the city: the README's picture).
HEADLINE_RUN = "json_record.parquet"
#: Environment variable naming the runs to show (set by ``logitscope dashboard``).
ENV_PATH = "LOGITSCOPE_RUNS"
#: Environment variable that, set to ``1``, lets the path box open folders outside the served one.
ENV_ANY_PATH = "LOGITSCOPE_ALLOW_ANY_PATH"
#: The same as a script argument: ``streamlit run app.py -- PATH --allow-any-path``.
ANY_PATH_FLAG = "--allow-any-path"


#: Where an installed wheel holds the sample runs: the build copies the repository's
#: ``sample_runs/`` into the ``logitscope`` package (see ``setup.py``).
PACKAGED_RUNS = REPO_ROOT / "logitscope" / "sample_runs"


def default_runs_path() -> Path:
    """The shipped sample runs: ``sample_runs/`` in a checkout (or editable install), else the installed copy."""
    checkout = REPO_ROOT / "sample_runs"
    if (REPO_ROOT / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout
    return PACKAGED_RUNS


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _local(location: str, base: Path) -> Path | None:
    """``location`` as a local path with symlinks resolved (a ``file://`` URL or a path; a relative path is
    taken inside ``base``), or None when it names no local place."""
    if _SCHEME.match(location):
        parts = urlsplit(location)
        if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            return None
        path = Path(url2pathname(parts.path))
    else:
        path = Path(location).expanduser()
        path = path if path.is_absolute() else base / path
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


def _remote(location: str) -> tuple[str, str, list[str], list[tuple[str, str]]] | None:
    """``(scheme, bucket, path segments, options)`` of a storage URL, its path percent-decoded and
    normalised; None when it is not one, or its path climbs above the bucket."""
    found = _SCHEME.match(location)
    if found is None or found.group(1).lower() == "file":
        return None
    parts = urlsplit(location)
    if parts.fragment:
        return None
    segments: list[str] = []
    for segment in unquote(parts.path).split("/"):
        if segment == "..":
            if not segments:
                return None
            segments.pop()
        elif segment not in ("", "."):
            segments.append(segment)
    return parts.scheme.lower(), parts.netloc, segments, sorted(parse_qsl(parts.query, keep_blank_values=True))


def inside(candidate: str, served: str) -> str | None:
    """Where ``candidate`` (what a viewer typed in the path box) leads, when that is inside ``served`` (the
    folder, run file or storage URL the dashboard serves); None when it leads elsewhere.

    Decided on parsed, normalised components, never on how the text begins: on a local disk (a path, or a
    ``file://`` URL) both are resolved, symlinks included, and compared folder by folder; in a store, the
    scheme, the bucket and the options (``?...``) must be the served URL's, and the path's segments
    (percent-decoded, ``..`` applied) must continue its segments (``s3://b/runs-private`` is not inside
    ``s3://b/runs``). A relative path is taken inside what is served. The place returned is the normalised
    one: what was checked is what is read.
    """
    served_local = _local(served, Path.cwd())
    if served_local is not None:
        base = served_local if served_local.is_dir() else served_local.parent
        path = _local(candidate, base)
        return str(path) if path is not None and path.is_relative_to(base) else None
    if not _SCHEME.match(candidate) and not candidate.startswith(("/", "~")):  # relative: inside the served URL
        candidate = f"{served.rstrip('/')}/{candidate}"
    root, wanted = _remote(served.rstrip("/")), _remote(candidate)
    if root is None or wanted is None or wanted[:2] != root[:2] or wanted[3] != root[3]:
        return None
    if wanted[2][: len(root[2])] != root[2]:
        return None
    scheme, bucket, segments, options = wanted
    query = "&".join(f"{quote(k)}={quote(v)}" for k, v in options)
    return urlunsplit((scheme, bucket, quote("/" + "/".join(segments)), query, ""))
