"""When and how long to wait before trying a teacher request again.

The wait before retry ``k`` (0-based) is the server's ``Retry-After`` when it sends one (seconds or an
HTTP date; above ``max_retry_after_s`` the request fails at once instead), else equal-jitter exponential
backoff ``d/2 + U(0, d/2)`` with ``d = min(backoff_max_s, backoff_base_s * 2**k)``. Only errors whose
``retryable`` is true are retried; after ``max_retries`` retries :class:`TeacherRetriesExhausted` is raised.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from crf_replaysim.teacher.errors import TeacherError, TeacherHTTPError, TeacherRetriesExhausted

__all__ = ["RetryPolicy", "parse_retry_after"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds, possibly fractional, or an HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass
class RetryPolicy:
    """``max_retries`` retries after the first attempt; backoff in seconds; ``rng`` draws the jitter."""

    max_retries: int
    backoff_base_s: float
    backoff_max_s: float
    max_retry_after_s: float
    rng: random.Random = field(default_factory=random.Random)

    def backoff(self, attempt: int) -> float:
        """``d/2 + U(0, d/2)``, ``d = min(backoff_max_s, backoff_base_s * 2**attempt)``."""
        d = min(self.backoff_max_s, self.backoff_base_s * 2.0**attempt)
        return d / 2.0 + self.rng.uniform(0.0, d / 2.0)

    def delay(self, err: TeacherError, attempt: int) -> float:
        """Seconds to wait after ``err`` (a retryable failure of attempt ``attempt``); a ``Retry-After`` above
        ``max_retry_after_s`` raises a non-retryable ``TeacherHTTPError`` instead."""
        delay = self.backoff(attempt)
        if isinstance(err, TeacherHTTPError) and err.retry_after_s is not None:
            if err.retry_after_s > self.max_retry_after_s:
                raise TeacherHTTPError(
                    f"{err} (server asks to wait {err.retry_after_s:.0f} s, above max_retry_after_s="
                    f"{self.max_retry_after_s:.0f}; retry later or raise the limit)",
                    status=err.status,
                    retryable=False,
                ) from None
            delay = err.retry_after_s
        return delay

    async def run(self, attempt: Callable[[], Awaitable[T]], on_retry: Callable[[], None] | None = None) -> T:
        """``await attempt()`` until it returns, retrying retryable ``TeacherError``s; ``on_retry()`` before each
        retry. Non-retryable errors propagate at once."""
        last: TeacherError | None = None
        for number in range(self.max_retries + 1):
            try:
                return await attempt()
            except TeacherError as err:
                if not err.retryable:
                    raise
                last = err
                delay = self.delay(err, number)
            if number == self.max_retries:
                break
            if on_retry is not None:
                on_retry()
            logger.warning(
                "teacher attempt %d/%d failed: %s; retrying in %.2f s", number + 1, self.max_retries + 1, last, delay
            )
            await asyncio.sleep(delay)
        assert last is not None
        raise TeacherRetriesExhausted(
            f"teacher request failed {self.max_retries + 1} times; last error: {last}",
            attempts=self.max_retries + 1,
            last_error=last,
        )
