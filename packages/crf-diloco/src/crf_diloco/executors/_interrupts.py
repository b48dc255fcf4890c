"""`interrupts_held`: Ctrl-C and SIGTERM wait until a replica's start is on record, so none is ever orphaned."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

_HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block, then deliver the first that came to its own handler.

    A replica's start creates something outside this process (a child, a container, a Ray actor) and only then
    returns its handle; an interrupt raised between the two would leave it running with no handle to stop it. With
    the block around ``start + record``, the interrupt raises once the handle is recorded, where the launch's error
    path stops it with the others. A second interrupt while one is held is delivered at once (a start that hangs
    must not make Ctrl-C useless; that replica may then be left running). Only Python-level handlers are held
    (``default_int_handler`` and any callable); ``SIG_DFL``/``SIG_IGN`` stay as they are, and off the main thread
    (where handlers cannot be set) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, FrameType | None]] = []

    def deliver() -> None:
        while pending:
            signum, frame = pending.pop(0)
            previous[signal.Signals(signum)](signum, frame)

    def hold(signum: int, frame: FrameType | None) -> None:
        pending.append((signum, frame))
        if len(pending) > 1:  # asked twice: stop waiting for the start
            deliver()

    previous: dict[signal.Signals, Callable[[int, FrameType | None], object]] = {}
    try:
        for sig in _HELD:
            handler = signal.getsignal(sig)
            if callable(handler):
                previous[sig] = handler
                signal.signal(sig, hold)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    deliver()
