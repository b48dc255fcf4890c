"""Errors raised by the object-store allreduce and the MockManager.

Every failure of a round is an :class:`AllReduceError`; the input tensors are left unchanged
whenever one is raised.
"""

from __future__ import annotations

__all__ = [
    "AllReduceError",
    "CorruptObjectError",
    "HealError",
    "PayloadMismatchError",
    "RoundAbortedError",
    "RoundDesyncError",
    "RoundTimeoutError",
    "StoreBackendMissingError",
]


class AllReduceError(RuntimeError):
    """A round of :class:`~crf_diloco.allreduce.ObjectStoreAllReduce` did not commit."""


class RoundAbortedError(AllReduceError):
    """The round's decision object says ``abort``; every replica of the round sees the same."""


class RoundTimeoutError(AllReduceError):
    """A wait passed its deadline and no decision object could be read to follow."""


class CorruptObjectError(AllReduceError):
    """An object read from the store is malformed, has the wrong layout for its round, or failed authentication.

    The message starts with the object's key. Such an object is never adopted; the round aborts (one abort decision).
    """


class RoundDesyncError(AllReduceError):
    """The round committed but this replica could not read the result before its deadline.

    This replica is now behind the others; :class:`~crf_diloco.manager.MockManager` heals it from
    the last committed checkpoint at its next ``start_quorum()``.
    """


class HealError(AllReduceError):
    """A replica that is behind could not load the last committed state from the store."""


class StoreBackendMissingError(AllReduceError, ImportError):
    """The fsspec adapter for the URI's protocol is not installed (``s3fs``, ``gcsfs``, ``adlfs``…)."""


class PayloadMismatchError(ValueError):
    """This replica's payload (element count, codec, op, name) differs from the one its round settled on.

    Not an `AllReduceError` on purpose: it is a configuration error of this replica alone, so it is raised to the
    caller (``MockManager.should_commit`` re-raises it) instead of turning into a failed round. The other replicas
    exclude it from the round and carry on.
    """
