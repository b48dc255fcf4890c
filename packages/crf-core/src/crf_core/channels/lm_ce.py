"""The ``lm_ce`` channel of ``compose_loss``: next-token cross-entropy, the verification stand-in for GRPO.

``L = −Σ_r m_r·log p_θ(y_r | x_<r) / Σ_r m_r`` over the scored rows ``r`` (every next-token prediction), with
``m`` the response mask. Not GRPO's surrogate (seed failure mode 11): production GRPO is
``ComposerReplicationTrainer``'s ``grpo`` channel.
"""

from __future__ import annotations

import torch

__all__ = ["lm_ce_loss"]


def lm_ce_loss(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood of ``(N,)`` label log-probs under ``(N,)`` weights (0 if none)."""
    w = weights.to(logprobs.dtype)
    total = w.sum()
    return -(logprobs * w).sum() / torch.where(total > 0, total, torch.ones_like(total))
