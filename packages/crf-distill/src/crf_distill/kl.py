"""Forward and reverse KL between a student and a (detached) teacher, per token, then aggregated.

Sources: knowledge distillation with forward KL (Hinton et al., arXiv 1503.02531); reverse KL for
on-policy/generalised distillation (GKD, Agarwal et al., arXiv 2306.13649; Thinking Machines "On-Policy
Distillation", 2025). These are the ``alpha = 0`` / ``alpha = 1`` ends of :mod:`crf_distill.jsd`.

* forward KL ``KL(T ‖ S) = Σ_v p_T(v) (log p_T(v) − log p_S(v))`` — mean-seeking (GKD/SDPO ``alpha = 0``);
* reverse KL ``KL(S ‖ T) = Σ_v p_S(v) (log p_S(v) − log p_T(v))`` — mode-seeking (on-policy distillation,
  SDPO ``alpha = 1``).

Symbols: ``S`` student, ``T`` teacher, ``V`` vocabulary. Shapes: logits ``(..., V)``, mask ``(...)``.
The teacher is treated as a fixed target (detached). Optional student top-k support with tail bucket as
in SDPO (see :func:`crf_distill.generalized_jsd`).
"""

from __future__ import annotations

import torch

from crf_distill._support import kl_per_token, support_logprobs
from crf_distill.aggregate import Aggregation, aggregate

__all__ = ["forward_kl", "forward_kl_per_token", "reverse_kl", "reverse_kl_per_token"]


def _kl_per_token(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, top_k: int | None, add_tail: bool, *, reverse: bool
) -> torch.Tensor:
    """``KL(S ‖ T)`` if ``reverse`` else ``KL(T ‖ S)``, per token, on the (optionally top-k) support."""
    s, t = support_logprobs(student_logits, teacher_logits, top_k=top_k, add_tail=add_tail)
    return kl_per_token(s, t) if reverse else kl_per_token(t, s)


def forward_kl_per_token(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, top_k: int | None = None, add_tail: bool = True
) -> torch.Tensor:
    """Per-token ``KL(T ‖ S)``: ``(..., V) × 2 -> (...)``."""
    return _kl_per_token(student_logits, teacher_logits, top_k, add_tail, reverse=False)


def reverse_kl_per_token(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, top_k: int | None = None, add_tail: bool = True
) -> torch.Tensor:
    """Per-token ``KL(S ‖ T)``: ``(..., V) × 2 -> (...)``."""
    return _kl_per_token(student_logits, teacher_logits, top_k, add_tail, reverse=True)


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    top_k: int | None = None,
    add_tail: bool = True,
    aggregation: Aggregation = "token_mean",
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregated forward KL ``KL(T ‖ S)`` over the tokens selected by ``mask``; returns a 0-d tensor."""
    per_token = _kl_per_token(student_logits, teacher_logits, top_k, add_tail, reverse=False)
    return aggregate(per_token, mask, aggregation, num_items=num_items)


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    top_k: int | None = None,
    add_tail: bool = True,
    aggregation: Aggregation = "token_mean",
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregated reverse KL ``KL(S ‖ T)`` over the tokens selected by ``mask``; returns a 0-d tensor."""
    per_token = _kl_per_token(student_logits, teacher_logits, top_k, add_tail, reverse=True)
    return aggregate(per_token, mask, aggregation, num_items=num_items)
