"""In-flight deduplication: identical requests made while one is running wait for it instead of sending their own.

Each key has one task and a count of callers awaiting it. A caller that is cancelled stops waiting;
the last one to give up cancels the task too. The task is forgotten when it ends, so a later
identical request runs again (or is answered by the cache).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["InflightRequests"]

T = TypeVar("T")


class InflightRequests(Generic[T]):
    """The requests running now, by key (``tasks``); bound to one event loop, :meth:`clear` it for another."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Future[T]] = {}
        self._waiters: dict[str, int] = {}

    def clear(self) -> None:
        """Forget every task (they belong to a closed or other event loop)."""
        self.tasks, self._waiters = {}, {}

    async def share(
        self, key: str, start: Callable[[], Coroutine[Any, Any, T]], on_join: Callable[[], None] | None = None
    ) -> T:
        """The result of the task running for ``key``, started with ``start()`` if none is; ``on_join()`` is
        called when this caller joins a task another caller started."""
        task = self.tasks.get(key)
        if task is None:
            task = asyncio.ensure_future(start())
            self.tasks[key] = task
            self._waiters[key] = 0
            task.add_done_callback(functools.partial(self._forget, key))
        elif on_join is not None:
            on_join()
        self._waiters[key] += 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiters.get(key) == 1:  # the last caller gave up: stop the request too
                task.cancel()
            raise
        finally:
            if key in self._waiters:
                self._waiters[key] -= 1

    def _forget(self, key: str, task: object) -> None:
        if self.tasks.get(key) is task:
            del self.tasks[key]
            self._waiters.pop(key, None)
