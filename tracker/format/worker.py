"""One background thread with an owner: started on first use, its queue bounded, stopped by ``close()``.

The recorder's spill writer and an engine's part writer each own one :class:`Worker`. Nothing is started per
request or per run: a thousand requests leave the thread count where it was. ``close()`` runs what was queued,
then stops and joins the thread; a worker still open when the interpreter exits is closed then (through
``atexit``, before daemon threads are stopped), so what it was given is written.
"""

from __future__ import annotations

import atexit
import ctypes
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["Worker", "name_os_thread"]

_STOP = object()
#: Seconds an idle worker thread waits before checking that its owner still exists.
_IDLE = 1.0


class Worker:
    """Runs submitted calls in order on one thread called ``name``; ``depth`` calls may wait before
    :meth:`submit` blocks (the caller then waits for the disk, never for more memory)."""

    def __init__(self, name: str, depth: int = 2, initializer: Callable[[], None] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.name = name
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._initializer = initializer
        self._lock = threading.Lock()
        self._closed = False
        ref = weakref.ref(self)
        self._exit = lambda: (w := ref()) is not None and w.close()
        atexit.register(self._exit)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue ``fn(*args)``; its future. Blocks while ``depth`` calls wait. RuntimeError once closed."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the worker is closed")
            if self._thread is None or not self._thread.is_alive():
                args_ = (weakref.ref(self), self._queue, self._initializer)
                self._thread = threading.Thread(target=_run, args=args_, name=self.name, daemon=True)
                self._thread.start()
        self._queue.put((fn, args, future))
        return future

    def flush(self) -> None:
        """Wait until every call queued so far has run."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Run what is queued, stop the thread and wait for it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        atexit.unregister(self._exit)
        if thread is not None and thread.is_alive():
            self._queue.put(_STOP)
            thread.join()


def name_os_thread() -> None:
    """Give the calling thread its Python name in the operating system too (Linux ``prctl``, 15 bytes), so that
    ``top -H``, ``py-spy`` and ``/proc/PID/task/*/comm`` tell logitscope's threads from the engine's. Elsewhere
    nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, threading.current_thread().name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (AttributeError, OSError):
        pass


def _run(owner: weakref.ref[Worker], jobs: queue.Queue[Any], initializer: Callable[[], None] | None) -> None:
    """The worker's thread. It holds its owner weakly: once the owner is collected (without ``close()``), the
    thread ends within :data:`_IDLE` seconds of its queue running dry."""
    name_os_thread()
    if initializer is not None:
        initializer()
    while True:
        try:
            item = jobs.get(timeout=_IDLE)
        except queue.Empty:
            if owner() is None:
                return
            continue
        try:
            if item is _STOP:
                return
            _call(*item)
        finally:
            del item  # nothing of a job outlives it (a spilled chunk's buffers go back to the pool once unviewed)
            jobs.task_done()


def _call(fn: Callable[..., Any], args: tuple[Any, ...], future: Future[Any]) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # the owner reads it from the future
            future.set_exception(exc)
