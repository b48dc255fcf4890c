"""A dependency-free progress line on stderr.

``StderrProgress`` is a callable taking the number of items done so far (``progress(n)``), the
shape that ``replay_jsonl`` and ``normalize_jsonl`` accept for ``progress=``. On a terminal it
redraws one line at most every ``min_interval_s``; elsewhere (CI logs, pipes) it prints a line
every ``log_every`` items so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["StderrProgress"]


class StderrProgress:
    """``label: N items (R/s)`` on ``stream``; call with the count done so far, ``close()`` at the end."""

    def __init__(
        self,
        label: str,
        unit: str = "items",
        *,
        stream: TextIO | None = None,
        min_interval_s: float = 0.2,
        log_every: int = 10_000,
    ) -> None:
        self.label = label
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval_s = min_interval_s
        self.log_every = log_every
        self.count = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def _line(self) -> str:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        return f"{self.label}: {self.count} {self.unit} ({self.count / elapsed:.1f}/s)"

    def __call__(self, done: int) -> None:
        step = done - self.count
        self.count = done
        if self._tty:
            now = time.perf_counter()
            if now - self._last_draw >= self.min_interval_s:
                self._last_draw = now
                self.stream.write("\r" + self._line())
                self.stream.flush()
        elif self.log_every and step > 0 and self.count % self.log_every < step:
            self.stream.write(self._line() + "\n")

    def close(self) -> None:
        """Draw the final count and end the line."""
        self.stream.write(("\r" if self._tty else "") + self._line() + "\n")
        self.stream.flush()
