"""What a teacher client has done so far: requests sent, answers reused, retries, paid tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from crf_replaysim._checks import is_int

__all__ = ["TeacherStats"]


@dataclass
class TeacherStats:
    """Counters of one :class:`~crf_replaysim.teacher.TeacherClient` (all start at 0 and only grow).

    ``requests``: HTTP attempts sent; ``cache_hits``: answers read from the disk cache;
    ``retries``: attempts repeated after a retryable failure; ``deduplicated``: calls that shared
    an identical request already in flight; ``prompt_tokens`` / ``completion_tokens``: the ``usage``
    of every completion received over the network (unusable ones included; cache hits and shared
    answers are not paid again). ``stats["requests"]`` reads a counter by name too (the form the
    0.1 changelog documents).
    """

    requests: int = 0
    cache_hits: int = 0
    retries: int = 0
    deduplicated: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __getitem__(self, name: str) -> int:
        if name not in _COUNTERS:
            raise KeyError(f"TeacherStats has no counter {name!r}. Fix: use one of {_COUNTERS}")
        value: int = getattr(self, name)
        return value

    def count_usage(self, usage: dict[str, Any] | None) -> None:
        """Add a reply's ``usage`` (``prompt_tokens``, ``completion_tokens``; non-positive or non-int counts as 0)."""
        if usage:
            self.prompt_tokens += _tokens(usage.get("prompt_tokens"))
            self.completion_tokens += _tokens(usage.get("completion_tokens"))

    def snapshot(self) -> TeacherStats:
        """A frozen-in-time copy (to measure a stretch of work with :meth:`since`)."""
        return dataclasses.replace(self)

    def since(self, earlier: TeacherStats) -> TeacherStats:
        """The counts added after ``earlier`` (a :meth:`snapshot` of these counters)."""
        if not isinstance(earlier, TeacherStats):
            raise TypeError(f"earlier must be a TeacherStats (from stats.snapshot()), got {type(earlier).__name__}")
        return TeacherStats(**{name: self[name] - earlier[name] for name in _COUNTERS})


_COUNTERS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TeacherStats))


def _tokens(value: Any) -> int:
    return value if is_int(value) and value > 0 else 0
