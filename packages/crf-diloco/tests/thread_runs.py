"""Test support (not shipped): run a test's replicas as threads and fail if one does not end."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(*targets: Callable[[], None], timeout: float = 120.0) -> None:
    """Start a thread per target, join them all, and fail if any is still running after ``timeout`` seconds."""
    threads = [threading.Thread(target=t) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads)
