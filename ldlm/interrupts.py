"""Ctrl-C that is not lost.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread happens to be. When that
is a weakref callback or a ``__del__``, the exception is printed as "Exception ignored in ..." and
dropped, and the interrupted command carries on: `ldlm serve` exporting a checkpoint can take Ctrl-C
inside an import lock's weakref callback, finish the export and start serving. The handler here also remembers the signal, so the next stage boundary
(``raise_if_interrupted``) raises it again; and the dropped one is not printed, since it is not lost.

While C++ runs code that calls back into Python (a TensorRT build, with its logger and progress
monitor), SIGINT is only recorded (``deferred_interrupts``): raised, the KeyboardInterrupt would land
in a callback, where the binding prints it as an error and loses it. The build's monitor cancels the
build at its next step instead, and the code after the call delivers the interrupt.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_received = threading.Event()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _received.set()  # first, so that a dropped KeyboardInterrupt is still known
    raise KeyboardInterrupt


@contextmanager
def remembered_interrupts() -> Iterator[None]:
    """Within the block, SIGINT raises KeyboardInterrupt as usual and is also remembered for
    ``raise_if_interrupted``. Elsewhere than in the main thread (where Python runs signal handlers,
    and the only thread that may install one) the block runs with the handler it has."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous, previous_hook = signal.signal(signal.SIGINT, _on_sigint), sys.unraisablehook

    def unraisable_hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and interrupted()):
            previous_hook(unraisable)  # a remembered Ctrl-C is raised again later, not printed as "Exception ignored"

    sys.unraisablehook = unraisable_hook
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
        _received.clear()


def _record_sigint(signum: int, frame: FrameType | None) -> None:
    _received.set()


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Within the block, SIGINT is recorded and not raised; ``raise_if_interrupted`` after it delivers
    it. Also outside ``remembered_interrupts`` (from Python, a notebook). Off the main thread, or where
    SIGINT is ignored or handled outside Python, the block runs with the handler it has."""
    current = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or current in (signal.SIG_IGN, None):
        yield
        return
    signal.signal(signal.SIGINT, _record_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, current)


def interrupted() -> bool:
    """Whether a Ctrl-C arrived, not yet delivered, inside ``remembered_interrupts`` or ``deferred_interrupts``."""
    return _received.is_set()


def raise_if_interrupted() -> None:
    """Deliver a remembered Ctrl-C, once: a long job calls this between its stages."""
    if interrupted():
        _received.clear()
        raise KeyboardInterrupt
