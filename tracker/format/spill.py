"""Atomic file writes and the Arrow IPC spill files of a run that outgrew its memory bound.

Spilled chunks are Arrow IPC files (Feather v2), not Parquet: IPC writes
float32 at over 1 GB/s here and float16 as fast, where Parquet manages 40-60
MB/s for float16 columns, so spilling keeps up with generation; reading a
spilled chunk back is a memory map, with no copy. Every file is written to a
temporary name and renamed into place, so a crash leaves only whole files.

A spill folder holds ``chunk-NNNNNN.arrow`` files, ``_vocab.arrow`` (an empty
table whose schema metadata carries the vocabulary) and ``_run.json``;
:meth:`tracker.Run.load` reads such a folder as a run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from tracker.format.worker import Worker

__all__ = [
    "atomic_path",
    "fsync_path",
    "remove_orphans",
    "write_ipc",
    "read_ipc",
    "CHUNK_GLOB",
    "chunk_name",
    "RUN_JSON",
    "VOCAB_FILE",
    "SpillWriter",
    "temporary_spill_folder",
    "remove_stale_spill_folders",
]

_TEMP_PREFIX = "logitscope-spill-"

CHUNK_GLOB = "chunk-*.arrow"
RUN_JSON = "_run.json"
VOCAB_FILE = "_vocab.arrow"


def _file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (mkstemp gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def chunk_name(index: int) -> str:
    return f"chunk-{index:06d}.arrow"


def _host_name() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def _writer_tag() -> str:
    """``<host>-<pid>``: which process writes a temporary file, so that an orphan can be told from a live one."""
    return f"{_host_name()}-{os.getpid()}"


def remove_orphans(folder: str | os.PathLike[str], name: str) -> list[Path]:
    """Remove the temporary files of ``folder/name`` left by writers on this host that are gone.

    :func:`atomic_path` names its temporary files ``.<name>.<host>-<pid>.<random>.tmp``;
    a process killed mid-write leaves one behind. Files of live processes, and
    of other hosts (a shared folder), are kept. Returns what was removed.
    """
    base = Path(folder)
    if not base.is_dir():
        return []
    prefix = f".{name}.{_host_name()}-"
    removed = []
    for entry in base.iterdir():
        if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
            continue
        pid = entry.name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike[str], scratch: str | os.PathLike[str] | None = None, *, make_folders: bool = True
) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` if the block succeeds.

    On failure the temporary file is removed and ``path`` is left as it was.
    The file ends with the permissions an ordinary new file would have, so a
    run can be read by whoever may read its folder (a shared dashboard).
    With ``scratch`` (a folder on the same file system), the temporary file is
    made there and ``path``'s folder only when it is renamed into place: a
    writer killed midway leaves no new folder at ``path`` (a dataset partition
    holding no run). With ``make_folders=False`` a folder that is missing is
    not made: FileNotFoundError instead.
    """
    target = Path(path)
    folder = target.parent if scratch is None else Path(scratch)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # removed again if the write fails
    if make_folders:
        folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{_writer_tag()}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _file_mode())
        if make_folders:
            target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        for created in made:  # deepest first: a failed write leaves no empty folder it made
            with contextlib.suppress(OSError):
                created.rmdir()
        raise


def fsync_path(path: Path) -> None:
    """Flush a file (or a folder's entries) to the disk."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # a folder that cannot be opened (some platforms): nothing more to flush
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def write_ipc(
    path: str | os.PathLike[str], batches: list[pa.RecordBatch], schema: pa.Schema, *, make_folders: bool = True
) -> int:
    """Write record batches as one IPC file, atomically; returns the bytes written (``make_folders``: see
    :func:`atomic_path`)."""
    with atomic_path(path, make_folders=make_folders) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
        return os.path.getsize(tmp)


def read_ipc(path: str | os.PathLike[str]) -> pa.Table:
    """Read an IPC file through a memory map (no copy)."""
    source = pa.memory_map(str(path), "r")
    return pa.ipc.open_file(source).read_all()


# ---------------------------------------------------------------- temporary spill folders


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux), None when it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` runs (with ``started``: the same process, not a later one given its pid)."""
    if started is not None and os.path.isdir("/proc"):
        return _start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def temporary_spill_folder() -> Path:
    """A new folder in the temporary directory named after this process (pid and start time).

    :func:`remove_stale_spill_folders` recognises such folders once their
    process is gone, so a run killed before it could clean up leaves nothing
    behind for long.
    """
    pid = os.getpid()
    started = _start_time(pid) or "0"
    return Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{pid}-{started}-"))


def remove_stale_spill_folders(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove temporary spill folders whose creating process is gone; returns those removed."""
    folder = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed = []
    try:
        candidates = list(folder.glob(f"{_TEMP_PREFIX}*"))
    except OSError:
        return removed
    for path in candidates:
        parts = path.name[len(_TEMP_PREFIX) :].split("-")
        if len(parts) < 3 or not parts[0].isdigit() or not path.is_dir():
            continue
        if not _alive(int(parts[0]), parts[1]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------- the background writer


class SpillWriter:
    """Writes spilled chunks on its own background thread (a :class:`~tracker.format.worker.Worker`), each
    once, through a bounded queue.

    :meth:`submit` hands over ``(path, batch, schema, done, failed)``; the thread writes the batch as one IPC
    file and calls ``done(nbytes, seconds)``, or ``failed(error)`` when the write raised (nothing is left at
    ``path`` then: files are written atomically). When ``depth`` chunks already wait, :meth:`submit` blocks
    until one is written: generation then waits for the disk. :meth:`close` stops the thread.

    Attributes:
        writes: chunk files written so far.
        bytes_written, seconds: totals, for the rate the disk sustains.
    """

    def __init__(self, depth: int = 2) -> None:
        self._worker = Worker("logitscope-spill", depth)
        self.writes = 0
        self.bytes_written = 0
        self.seconds = 0.0

    def submit(
        self,
        path: Path,
        batch: pa.RecordBatch,
        schema: pa.Schema,
        done: Callable[[int, float], None],
        failed: Callable[[BaseException], None],
    ) -> None:
        """Queue one chunk for writing (blocks while the queue is full)."""
        self._worker.submit(self._write, path, batch, schema, done, failed)

    def flush(self) -> None:
        """Wait until every queued chunk is on disk."""
        self._worker.flush()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._worker.close()

    def _write(self, path: Path, batch: pa.RecordBatch, schema: pa.Schema, done: Any, failed: Any) -> None:
        try:
            start = time.perf_counter()
            # into the run's folder as it is: one removed meanwhile (its tracker went away) is not made
            # again, to be left behind, but refuses the chunk
            nbytes = write_ipc(path, [batch], schema, make_folders=False)
            elapsed = time.perf_counter() - start
            del batch
            self.writes += 1
            self.bytes_written += nbytes
            self.seconds += elapsed
            done(nbytes, elapsed)
        except BaseException as exc:  # the recording thread says it (SpillHandoff.collect)
            failed(exc)
