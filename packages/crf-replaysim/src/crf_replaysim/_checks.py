"""The type checks every part of crf-replaysim shares (private; no dependencies)."""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["is_int", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, never a count or a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool`` (finiteness is the caller's to check)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
