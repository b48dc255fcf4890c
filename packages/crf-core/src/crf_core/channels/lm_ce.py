"""The ``lm_ce`` channel of ``compose_loss``: next-token cross-entropy, the verification stand-in for GRPO.

``L = −Σ_r m_r·log p_θ(y_r | x_<r) / Σ_r m_r`` over the scored rows ``r`` (every next-token prediction), with
``m`` the response mask. Not GRPO's surrogate (seed failure mode 11): production GRPO is
``ComposerReplicationTrainer``'s ``grpo`` channel.
"""

from __future__ import annotations

import torch

from crf_distill import RowTerm, token_logprobs

__all__ = ["lm_ce_term"]


def lm_ce_term(labels: torch.Tensor, mask: torch.Tensor) -> RowTerm:
    """The per-row negative log-likelihood ``−log p(y_r)`` of ``labels`` ``(N,)`` on the rows where ``mask > 0``
    (token-average it with the mask's :func:`~crf_core.channels.head.mean_weights`)."""
    return RowTerm(lambda z, rows: -token_logprobs(z, labels[rows], ignore_index=None), active=mask > 0)
