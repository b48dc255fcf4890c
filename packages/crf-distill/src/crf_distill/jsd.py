"""Generalised Jensen–Shannon divergence: the SDPO self-distillation loss.

Paper: Hübotter et al., "Self-Distillation Policy Optimization" (SDPO, arXiv 2601.20802); reference code
lasgroup/SDPO ``compute_self_distillation_loss``. Same ``alpha`` convention as TRL GKD and Liger JSD.

Per token, with student ``S`` and detached teacher ``T`` over the full vocabulary or the student's top-k
ids (+ tail bucket):

* ``alpha = 0``: forward KL ``KL(T ‖ S)``;
* ``alpha = 1``: reverse KL ``KL(S ‖ T)``;
* ``0 < alpha < 1``: mixture ``M = (1 − α)·S + α·T`` (in log space) and
  ``gJSD_α = α·KL(T ‖ M) + (1 − α)·KL(S ‖ M)``.

The interior values are not a continuous interpolation of the endpoints (``gJSD_α → 0`` as ``α → 0`` or
``1``); the endpoints are the conventional special cases, exactly as upstream. At ``α = 0.5`` the loss is
symmetric in ``S`` and ``T`` (the classical JSD).

Optional truncated importance weight (SDPO ``is_clip``): ``w_t = min(exp(clamp(sg(lp_S(y_t) − lp_old(y_t)),
−20, 20)), is_clip)`` multiplies each token's loss; it is detached (a weight, not a gradient path).

Aggregation defaults to the token mean over ``mask · sample_mask`` — response tokens of samples that carry
a teacher signal (SDPO's ``self_distillation_mask``).
"""

from __future__ import annotations

import math

import torch

from crf_distill._checks import check_float_tensor, check_in_range, check_mask
from crf_distill._support import check_top_k, close_support, kl_per_token, support_logprobs
from crf_distill.aggregate import Aggregation, aggregate
from crf_distill.logprobs import compute_dtype, token_logprobs

__all__ = [
    "generalized_jsd",
    "generalized_jsd_from_logprobs",
    "generalized_jsd_on_support",
    "generalized_jsd_per_token",
    "is_ratio_weight",
    "top_k_ids",
]

IS_LOG_RATIO_CLAMP = 20.0


def generalized_jsd_from_logprobs(s: torch.Tensor, t: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-token generalised JSD from log-probs ``s`` (student) and ``t`` (teacher) on a common support."""
    if alpha == 0.0:
        return kl_per_token(t, s)
    if alpha == 1.0:
        return kl_per_token(s, t)
    dead = torch.isneginf(s) & torch.isneginf(t)
    if not bool(dead.any()):
        mix = torch.logaddexp(s + math.log1p(-alpha), t + math.log(alpha))
        return alpha * kl_per_token(t, mix) + (1.0 - alpha) * kl_per_token(s, mix)
    # entries masked on both sides (−inf): keep logaddexp's inputs finite so its gradient is not NaN
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    mix = torch.logaddexp(torch.where(dead, zero, s) + math.log1p(-alpha), torch.where(dead, zero, t) + math.log(alpha))
    mix = torch.where(dead, torch.full((), float("-inf"), dtype=s.dtype, device=s.device), mix)
    return alpha * kl_per_token(t, mix) + (1.0 - alpha) * kl_per_token(s, mix)


def generalized_jsd_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    alpha: float = 0.5,
    top_k: int | None = None,
    add_tail: bool = True,
) -> torch.Tensor:
    """Per-token generalised JSD: ``(..., V) × 2 -> (...)`` (see module docstring)."""
    alpha = check_in_range("alpha", alpha, 0.0, 1.0)
    s, t = support_logprobs(student_logits, teacher_logits, top_k=top_k, add_tail=add_tail)
    return generalized_jsd_from_logprobs(s, t, alpha)


def top_k_ids(student_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The student's ``top_k`` ids ``(..., k)`` of ``(..., V)`` logits: the support of the top-k divergences (no grad)."""
    check_float_tensor("student_logits", student_logits, min_ndim=1)
    check_top_k(top_k, student_logits.shape[-1])
    return student_logits.detach().to(compute_dtype(student_logits)).topk(top_k, dim=-1).indices


def generalized_jsd_on_support(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    alpha: float = 0.5,
    add_tail: bool = True,
) -> torch.Tensor:
    """:func:`generalized_jsd_per_token` with ``top_k`` given only what it reads: both sides' full-vocabulary-normalised
    log-probs ``z_i − logsumexp(z)`` at the student's top-k ids (:func:`top_k_ids`), ``(..., k) × 2 -> (...)``.

    Closed with the tail bucket (``add_tail``) or renormalised, as there; equal to it without the ``(..., V)`` logits.
    """
    alpha = check_in_range("alpha", alpha, 0.0, 1.0)
    check_float_tensor("student_logprobs", student_logprobs, min_ndim=1)
    check_float_tensor("teacher_logprobs", teacher_logprobs, min_ndim=1)
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"`teacher_logprobs` must have the student's shape {tuple(student_logprobs.shape)} (the same ids), got "
            f"{tuple(teacher_logprobs.shape)}"
        )
    s = close_support(student_logprobs, add_tail)
    t = close_support(teacher_logprobs.detach().to(s.dtype), add_tail)
    return generalized_jsd_from_logprobs(s, t, alpha)


def is_ratio_weight(student_token_logprobs: torch.Tensor, old_logprobs: torch.Tensor, is_clip: float) -> torch.Tensor:
    """Detached truncated IS weight ``min(exp(clamp(lp_S − lp_old, ±20)), is_clip)``; shapes ``(...)``."""
    check_float_tensor("old_logprobs", old_logprobs)
    if old_logprobs.shape != student_token_logprobs.shape:
        raise ValueError(
            f"`old_logprobs` must have shape {tuple(student_token_logprobs.shape)} (one per token), "
            f"got {tuple(old_logprobs.shape)}"
        )
    check_in_range("is_clip", is_clip, 0.0, math.inf, low_inclusive=False, high_inclusive=False)
    log_ratio = (student_token_logprobs.detach() - old_logprobs.detach().to(student_token_logprobs.dtype)).clamp(
        -IS_LOG_RATIO_CLAMP, IS_LOG_RATIO_CLAMP
    )
    return torch.exp(log_ratio).clamp(max=is_clip)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float = 0.5,
    top_k: int | None = None,
    add_tail: bool = True,
    is_clip: float | None = None,
    labels: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sample_mask: torch.Tensor | None = None,
    aggregation: Aggregation = "token_mean",
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPO's generalised JSD loss, aggregated over response tokens of samples with a teacher signal.

    Args:
        student_logits: ``(B, T, V)`` (or any ``(..., V)``) student logits, with grad.
        teacher_logits: same shape; treated as a fixed target (detached).
        mask: ``(B, T)`` (the logits' leading shape): 1 on response tokens.
        alpha: ``0`` forward KL, ``1`` reverse KL, in between the generalised JSD (SDPO yaml default 0.5).
        top_k: student top-k support (SDPO yaml: 100), ``None`` = full vocabulary.
        add_tail: with ``top_k``, add the tail bucket (default, as SDPO) or renormalise.
        is_clip: enable the detached truncated IS weight (SDPO yaml: 2.0); needs ``labels`` (sampled
            token ids, same shape as ``mask``; -100 allowed at masked positions) and ``old_logprobs``
            (their behaviour log-probs).
        sample_mask: optional ``(B,)`` 1/0 per sample (SDPO ``self_distillation_mask``); multiplies ``mask``.
        aggregation, num_items: see :func:`crf_distill.aggregate`.

    Returns:
        0-d tensor; 0 when no token is selected.
    """
    per_token = generalized_jsd_per_token(student_logits, teacher_logits, alpha=alpha, top_k=top_k, add_tail=add_tail)
    check_mask("mask", mask, per_token.shape)
    weights = mask.to(per_token.dtype)
    if sample_mask is not None:
        check_mask("sample_mask", sample_mask, per_token.shape[:1])
        weights = weights * sample_mask.to(per_token.dtype).reshape((-1,) + (1,) * (per_token.dim() - 1))
    if is_clip is not None:
        if labels is None or old_logprobs is None:
            raise ValueError(
                "`is_clip` needs `labels` (sampled token ids) and `old_logprobs` (their behaviour log-probs); "
                "pass both or set is_clip=None"
            )
        student_lp = token_logprobs(student_logits, labels)
        per_token = per_token * is_ratio_weight(student_lp, old_logprobs, is_clip)
    elif labels is not None or old_logprobs is not None:
        raise ValueError("`labels`/`old_logprobs` are only used with `is_clip`; set is_clip or drop them")
    return aggregate(per_token, weights, aggregation, num_items=num_items)
