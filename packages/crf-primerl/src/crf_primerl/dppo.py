"""PRIME-RL's default RL loss, DPPO + KL, for one sample (all tensors ``(seq,)``).

Sources: DPPO-Binary TV (arXiv 2602.04879) for the mask, Kimi-K2.5 (arXiv 2602.02276) for the KL
term, as combined in PRIME-RL ``src/prime_rl/trainer/rl/loss.py`` (``default_loss_fn``, identical
math at 46653c1 and 559b447).

Symbols: ``lp_θ`` trainer log-prob of the sampled token, ``lp_μ`` inference (sampler) log-prob,
``A`` per-token advantage, ``m`` the bool loss mask.

    log_r = lp_θ − lp_μ,   r = exp(log_r)                 (no clip, no detach)
    Δp    = exp(lp_θ) − exp(lp_μ)                         (probability space, not log-ratio)
    drop  = Δp > mask_high  where A > 0,  Δp < −mask_low  where A ≤ 0
    keep  = m ∧ ¬drop
    ℓ_t   = −keep_t · A'_t · r_t + kl_tau · m_t · log_r_t²   (KL over the full mask)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class DppoTerms(NamedTuple):
    """Per-token pieces of DPPO + KL that the loss and its metrics share (all ``(seq,)``)."""

    log_ratio: Tensor
    ratio: Tensor
    probs_diff: Tensor
    positive_advantages: Tensor
    drop_high: Tensor
    drop_low: Tensor
    is_masked: Tensor
    keep_mask: Tensor


def dppo_terms(
    trainer_logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    dppo_mask_low: float,
    dppo_mask_high: float,
) -> DppoTerms:
    """Importance ratio and the advantage-sign-gated probability-space trust-region mask.

    A token with ``A > 0`` is dropped when its probability rose by more than ``dppo_mask_high``;
    a token with ``A ≤ 0`` when it fell by more than ``dppo_mask_low`` (absolute probability units).
    """
    log_ratio = trainer_logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    drop_high = probs_diff > dppo_mask_high
    drop_low = probs_diff < -dppo_mask_low
    positive_advantages = advantages > 0
    is_masked = torch.where(positive_advantages, drop_high, drop_low)
    return DppoTerms(
        log_ratio=log_ratio,
        ratio=ratio,
        probs_diff=probs_diff,
        positive_advantages=positive_advantages,
        drop_high=drop_high,
        drop_low=drop_low,
        is_masked=is_masked,
        keep_mask=loss_mask & ~is_masked,
    )


def dppo_kl_token_loss(terms: DppoTerms, scaled_advantages: Tensor, loss_mask: Tensor, kl_tau: float) -> Tensor:
    """``ℓ_t = −keep_t · A'_t · r_t + kl_tau · m_t · log_r_t²`` with ``A'`` already scaled by ``adv_tau``."""
    pg = terms.keep_mask * scaled_advantages * terms.ratio
    kl = loss_mask * terms.log_ratio**2
    return -pg + kl_tau * kl


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over the bool ``mask``; 0 when the mask is empty (PRIME-RL's ``_safe_mean``).

    Uses a masked sum rather than boolean indexing, so it needs no device synchronisation.
    """
    return (values * mask).sum() / mask.sum().clamp_min(1)


def dppo_metrics(terms: DppoTerms, advantages: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """PRIME-RL's default-loss metrics, under its names (0-d tensors, no graph).

    ``*_mismatch_kl`` are means of the k3 estimator ``r − log_r − 1`` of KL(μ‖π) over dropped and
    kept tokens; the rest are fractions. Because ``drop = m ∧ masked`` and ``keep = m ∧ ¬masked``
    split the loss mask, and a token with ``A > 0`` (``A < 0``) can only be dropped by the high
    (low) bound, four counts give every fraction: ``is_masked_high = |A>0 ∧ drop| / |m|``,
    ``masked_advantage_positive = |A>0 ∧ drop| / |drop|``, and likewise for the low side.
    """
    with torch.no_grad():
        mismatch_kl = terms.ratio - terms.log_ratio - 1
        drop = loss_mask & terms.is_masked
        counts = torch.stack(
            [
                loss_mask.sum(),
                drop.sum(),
                (terms.positive_advantages & drop).sum(),
                ((advantages < 0) & drop).sum(),
            ]
        )
        n_mask, n_drop = counts[0], counts[1]
        n_keep = n_mask - n_drop
        fractions = counts[1:] / n_mask.clamp_min(1)  # is_masked, is_masked_high, is_masked_low
        by_drop = counts[2:] / n_drop.clamp_min(1)  # masked_advantage_positive, masked_advantage_negative
        return {
            "masked_mismatch_kl": (mismatch_kl * drop).sum() / n_drop.clamp_min(1),
            "unmasked_mismatch_kl": (mismatch_kl * terms.keep_mask).sum() / n_keep.clamp_min(1),
            "is_masked": fractions[0],
            "is_masked_low": fractions[2],
            "is_masked_high": fractions[1],
            "masked_advantage_positive": by_drop[0],
            "masked_advantage_negative": by_drop[1],
        }
