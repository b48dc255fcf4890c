"""Masked aggregation of per-token values: ``token_mean``, ``seq_mean`` and ``sum``.

Conventions (shared by every loss in this package): ``mask`` is 1 on response tokens and 0 on prompt and
padding; a float mask acts as per-token weights. Values at masked-out positions never reach the result,
even when they are ``inf``/``NaN`` (they are replaced by 0 before weighting), and an all-zero mask gives
0 rather than ``NaN``.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from crf_distill._checks import check_float_tensor, check_mask

__all__ = ["Aggregation", "aggregate", "masked_values"]

Aggregation = Literal["token_mean", "seq_mean", "sum"]
_MODES: tuple[Aggregation, ...] = get_args(Aggregation)


def masked_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` with masked-out entries forced to exactly 0 (so inf/NaN there cannot leak)."""
    weights = mask.to(values.dtype)
    return torch.where(weights != 0, values, torch.zeros((), dtype=values.dtype, device=values.device)) * weights


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return num / torch.where(den > 0, den, torch.ones((), dtype=den.dtype, device=den.device))


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation = "token_mean",
    *,
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar under ``mask``.

    Modes (``m`` = mask, ``v`` = values):

    * ``token_mean``: ``Σ v·m / Σ m`` over every token of the batch (verl ``token-mean``). ``num_items``
      replaces the denominator, e.g. a token count gathered over micro-batches/ranks (TRL's
      ``num_items_in_batch``).
    * ``seq_mean``: per sequence ``Σ_t v·m / Σ_t m`` over the last dim, then the mean over sequences that
      have at least one token (verl ``seq-mean-token-mean``). Needs ``values.dim() >= 2``.
    * ``sum``: ``Σ v·m``.

    Args:
        values: ``(..., T)`` floating tensor of per-token values.
        mask: same shape; bool/int/float, entries >= 0.
        mode: one of ``token_mean``, ``seq_mean``, ``sum``.
        num_items: optional positive denominator for ``token_mean``.

    Returns:
        0-d tensor in ``values.dtype``; 0 when no token is selected.
    """
    check_float_tensor("values", values, min_ndim=1)
    check_mask("mask", mask, values.shape)
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}")
    if num_items is not None and mode != "token_mean":
        raise ValueError("`num_items` only applies to mode='token_mean'; drop it or switch the mode")
    weighted = masked_values(values, mask)
    if mode == "sum":
        return weighted.sum()
    weights = mask.to(values.dtype)
    if mode == "token_mean":
        if num_items is None:
            return _safe_div(weighted.sum(), weights.sum())
        den = torch.as_tensor(num_items, dtype=values.dtype, device=values.device)
        if den.dim() != 0 or not bool(den > 0):
            raise ValueError(f"`num_items` must be a positive scalar, got {num_items!r}")
        return weighted.sum() / den
    if values.dim() < 2:
        raise ValueError("mode='seq_mean' needs values of shape (..., B, T) with a sequence dim; got 1-D values")
    tokens = weights.sum(-1)
    per_seq = _safe_div(weighted.sum(-1), tokens)
    has_tokens = (tokens > 0).to(values.dtype)
    return _safe_div((per_seq * has_tokens).sum(), has_tokens.sum())
