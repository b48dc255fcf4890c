"""Input validation shared by every loss (private).

Each helper raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape or range) with a
message that names the argument, what was expected, what was received and how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard

import torch

__all__ = [
    "as_weights",
    "check_finite_float",
    "check_float_tensor",
    "check_in_range",
    "check_index_tensor",
    "check_mask",
    "check_same_leading",
    "is_int",
    "is_number",
]


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, never a count or a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool`` (finiteness is the caller's to check)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shape(x: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in x.shape) + ")"


def check_float_tensor(name: str, x: object, *, min_ndim: int = 0, ndim: int | None = None) -> torch.Tensor:
    """Require a floating-point tensor with ``ndim`` dims (or at least ``min_ndim``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}; convert it with torch.as_tensor")
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got dtype {x.dtype}; cast it with `.float()`")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"`{name}` must have {ndim} dimension(s), got shape {_shape(x)}")
    if x.dim() < min_ndim:
        raise ValueError(f"`{name}` must have at least {min_ndim} dimension(s), got shape {_shape(x)}")
    return x


def check_index_tensor(name: str, x: object, *, shape: Sequence[int], upper: int) -> torch.Tensor:
    """Require an integer tensor of ``shape`` whose entries lie in ``[0, upper)``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of token ids, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"`{name}` must be an integer tensor of token ids, got dtype {x.dtype}; cast with `.long()`")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {tuple(shape)} (the logits without the vocab dim), got {_shape(x)}")
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= upper):
        raise ValueError(
            f"`{name}` holds ids outside [0, {upper}) (min {int(x.min())}, max {int(x.max())}); "
            "replace ignored positions (e.g. -100) before calling, or pass them through `ignore_index`"
        )
    return x


def check_mask(name: str, mask: object, shape: Sequence[int]) -> torch.Tensor:
    """Require a bool/int/float mask of exactly ``shape`` with non-negative entries."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a torch.Tensor (1 = response token, 0 = prompt/padding), got {type(mask).__name__}"
        )
    if mask.is_complex():
        raise TypeError(f"`{name}` must be bool, integer or real floating-point, got dtype {mask.dtype}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {_shape(mask)}")
    if mask.dtype != torch.bool and mask.numel():
        if mask.is_floating_point() and not bool(torch.isfinite(mask).all()):
            raise ValueError(f"`{name}` contains NaN or inf; masks/weights must be finite")
        if bool((mask < 0).any()):
            raise ValueError(f"`{name}` has negative entries; masks/weights must be >= 0")
    return mask


def as_weights(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mask as a floating tensor of ``dtype`` (bool -> 0/1)."""
    return mask.to(dtype)


def check_same_leading(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Require ``a`` and ``b`` to have identical shapes (e.g. student and teacher logits)."""
    if a.shape != b.shape:
        raise ValueError(
            f"`{name_a}` {_shape(a)} and `{name_b}` {_shape(b)} must have the same shape; "
            "align the teacher positions to the student's response tokens and use the same vocabulary"
        )


def check_finite_float(name: str, value: object) -> float:
    """Require a finite real number."""
    if not is_number(value):
        raise TypeError(f"`{name}` must be a float, got {type(value).__name__}")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"`{name}` must be finite, got {value}")
    return v


def check_in_range(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """Require ``low <= value <= high`` (with the given inclusivity)."""
    v = check_finite_float(name, value)
    ok_low = v >= low if low_inclusive else v > low
    ok_high = v <= high if high_inclusive else v < high
    if not (ok_low and ok_high):
        lb = "[" if low_inclusive else "("
        rb = "]" if high_inclusive else ")"
        raise ValueError(f"`{name}` must lie in {lb}{low}, {high}{rb}, got {value}")
    return v
