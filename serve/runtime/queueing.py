"""What the dynamic batcher and the generation scheduler share: a queue drained by one worker thread.

``QueueWorker`` holds the lock and condition the queue lives under, the daemon thread that runs the
subclass's ``_loop``, and the shutdown: ``close`` marks the queue stopping and wakes the worker,
whose loop answers everything still queued (and running) before it returns. ``submit`` calls
``_check_open`` under the lock, so nothing is queued after ``close``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any


class QueueFullError(RuntimeError):
    """A queue (the scheduler's, a batcher's) is at capacity; retry later."""


def resolve_future(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Answer a future unless its caller cancelled it meanwhile (a race the caller may win)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class QueueWorker:
    """A queue under ``_cond``, drained by ``_loop`` on one daemon thread named ``thread_name``.

    Subclasses set up their queue before calling ``__init__`` (the thread may start here) and
    implement ``_loop``: wait on ``_cond`` for work, and return once ``_stopping`` is set and
    nothing is left to answer."""

    def __init__(self, thread_name: str, start: bool = True) -> None:
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the worker (when constructed with ``start=False``, e.g. to queue a known batch first)."""
        self._thread.start()

    def close(self, timeout_s: float | None = None) -> None:
        """Answer everything queued or running, then stop the worker; wait for it up to ``timeout_s``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _check_open(self, name: str) -> None:
        """Under ``_cond``: refuse new work once ``close`` was called."""
        if self._stopping:
            raise RuntimeError(f"{name} is shut down")

    def _loop(self) -> None:
        raise NotImplementedError
