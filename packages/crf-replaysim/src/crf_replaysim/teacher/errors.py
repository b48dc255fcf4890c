"""The teacher client's errors: one base class whose ``retryable`` tells the retry loop whether to try again."""

from __future__ import annotations

from typing import Any

__all__ = [
    "TeacherActionError",
    "TeacherConfigError",
    "TeacherError",
    "TeacherHTTPError",
    "TeacherResponseError",
    "TeacherResponseTooLarge",
    "TeacherRetriesExhausted",
]


class TeacherError(RuntimeError):
    """A teacher request failed. ``retryable``: whether another attempt may succeed."""

    retryable = False


class TeacherConfigError(TeacherError, ValueError):
    """The client is misconfigured (bad argument, missing API key)."""


class TeacherHTTPError(TeacherError):
    """The endpoint answered with an HTTP error status (``status`` 0: no answer: timeout or transport error)."""

    def __init__(self, message: str, status: int, retryable: bool, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.retry_after_s = retry_after_s


class TeacherResponseError(TeacherError):
    """The endpoint answered 200 with something that is not a usable chat completion (retried)."""

    retryable = True


class TeacherActionError(TeacherResponseError):
    """A chat completion arrived (and was paid for) but its assistant message is unusable; not retried.

    ``usage`` is the reply's token usage (``None`` if it had none).
    """

    retryable = False

    def __init__(self, message: str, usage: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.usage = usage


class TeacherResponseTooLarge(TeacherResponseError):
    """The response body passed ``max_response_bytes`` (after decompression); not retried."""

    retryable = False


class TeacherRetriesExhausted(TeacherError):
    """Every attempt failed with a retryable error; ``last_error`` is the final one."""

    def __init__(self, message: str, attempts: int, last_error: BaseException) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last_error = last_error
