"""Validation of channel configuration values (private): each error names the option and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from crf_core._checks import is_int, is_number

__all__ = ["check_choice", "check_number", "check_optional_int", "check_unit", "check_weight"]


def check_number(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_inclusive: bool = True,
    none_means: str | None = None,
) -> float:
    """A finite real number within ``[low, high]`` (``(low, high]`` when not ``low_inclusive``)."""
    if not is_number(value) or not math.isfinite(value):
        extra = f" or None ({none_means})" if none_means else ""
        raise ValueError(f"{name} must be a finite number{extra}, got {value!r}")
    ok_low = value >= low if low_inclusive else value > low
    if not ok_low or value > high:
        lb = "[" if low_inclusive else "("
        raise ValueError(f"{name} must lie in {lb}{low}, {high}], got {value!r}")
    return float(value)


def check_weight(name: str, value: Any) -> float:
    """A channel weight: a finite number >= 0 (0 switches the channel off)."""
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (0 switches the channel off), got {value!r}")
    return float(value)


def check_unit(name: str, value: Any) -> float:
    """A number in [0, 1]."""
    return check_number(name, value, low=0.0, high=1.0)


def check_optional_int(name: str, value: Any, *, low: int, none_means: str) -> int | None:
    """None, or an int >= ``low``."""
    if value is None:
        return None
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low} or None ({none_means}), got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """One of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value
