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

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DppoTerms:
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
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return total / mask.sum().clamp_min(1)


def dppo_metrics(terms: DppoTerms, advantages: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """PRIME-RL's default-loss metrics, under its names (0-d tensors, no graph).

    ``*_mismatch_kl`` use the k3 estimator ``r − log_r − 1`` of KL(μ‖π) on sampler tokens.
    """
    with torch.no_grad():
        mismatch_kl = terms.ratio - terms.log_ratio - 1
        negative_advantages = advantages < 0
        drop_mask = loss_mask & terms.is_masked
        return {
            "masked_mismatch_kl": masked_mean(mismatch_kl, drop_mask),
            "unmasked_mismatch_kl": masked_mean(mismatch_kl, terms.keep_mask),
            "is_masked": masked_mean(terms.is_masked, loss_mask),
            "is_masked_low": masked_mean(negative_advantages & terms.drop_low, loss_mask),
            "is_masked_high": masked_mean(terms.positive_advantages & terms.drop_high, loss_mask),
            "masked_advantage_positive": masked_mean(terms.positive_advantages, drop_mask),
            "masked_advantage_negative": masked_mean(negative_advantages, drop_mask),
        }
