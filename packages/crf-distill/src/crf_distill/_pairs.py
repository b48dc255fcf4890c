"""Shared helpers for pairwise preference losses (private)."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from crf_distill._checks import check_float_tensor

__all__ = ["REDUCTIONS", "Reduction", "check_pair_tensors", "reduce_pairs"]

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[Reduction, ...] = get_args(Reduction)


def check_pair_tensors(**tensors: torch.Tensor) -> torch.Tensor:
    """All tensors ``(P,)`` floating and of the same shape; returns the first."""
    first_name, first = next(iter(tensors.items()))
    check_float_tensor(first_name, first, ndim=1)
    for name, value in tensors.items():
        check_float_tensor(name, value, ndim=1)
        if value.shape != first.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(value.shape)} but `{first_name}` has {tuple(first.shape)}; "
                "pass one value per preference pair, shape (P,)"
            )
    return first


def reduce_pairs(losses: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """Mean (0 for zero pairs), sum, or the ``(P,)`` per-pair losses."""
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / max(losses.numel(), 1)
    raise ValueError(f"`reduction` must be 'mean', 'sum' or 'none', got {reduction!r}")
