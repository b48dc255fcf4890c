"""Distributions over the full vocabulary or over the student's top-k ids plus a tail bucket (private).

SDPO (arXiv 2601.20802, lasgroup/SDPO ``compute_self_distillation_loss``): the support is the student's
top-k token ids; both student and teacher log-probs there are full-vocabulary normalised
(``z_i − logsumexp(z)``). With ``add_tail`` one more category carries the remaining mass
``log(1 − Σ_k p_k)``, computed as ``log(−expm1(min(logsumexp(lp_topk), −1e-7)))``, so both sides are proper
(k+1)-category distributions. Without the tail, the top-k log-probs are renormalised.
"""

from __future__ import annotations

import torch

from crf_distill._checks import check_float_tensor, check_same_leading, is_int
from crf_distill.logprobs import compute_dtype

__all__ = [
    "TAIL_CLAMP",
    "check_logit_pair",
    "check_top_k",
    "close_support",
    "cross_entropy_per_token",
    "kl_per_token",
    "support_logprobs",
]

TAIL_CLAMP = -1e-7


def check_logit_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    """Both ``(..., V)`` floating tensors of identical shape."""
    check_float_tensor("student_logits", student_logits, min_ndim=1)
    check_float_tensor("teacher_logits", teacher_logits, min_ndim=1)
    check_same_leading("student_logits", student_logits, "teacher_logits", teacher_logits)


def check_top_k(top_k: int | None, vocab: int) -> None:
    if top_k is None:
        return
    if not is_int(top_k):
        raise TypeError(f"`top_k` must be an int or None, got {type(top_k).__name__}")
    if not 0 < top_k <= vocab:
        raise ValueError(f"`top_k` must lie in [1, vocab={vocab}], got {top_k}; use None for the full vocabulary")


def _tail(topk_logprobs: torch.Tensor) -> torch.Tensor:
    covered = torch.logsumexp(topk_logprobs, dim=-1, keepdim=True).clamp(max=TAIL_CLAMP)
    return torch.log(-torch.expm1(covered))


def _restrict(logits: torch.Tensor, idx: torch.Tensor, add_tail: bool) -> torch.Tensor:
    lp = logits.gather(-1, idx) - torch.logsumexp(logits, dim=-1, keepdim=True)
    return close_support(lp, add_tail)


def close_support(logprobs: torch.Tensor, add_tail: bool) -> torch.Tensor:
    """Full-vocabulary-normalised log-probs ``(..., k)`` at the support ids as a proper distribution: with the
    tail bucket appended (``(..., k + 1)``) or renormalised over the ``k`` ids."""
    if add_tail:
        return torch.cat([logprobs, _tail(logprobs)], dim=-1)
    return logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True)


def support_logprobs(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    top_k: int | None = None,
    add_tail: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and (detached) teacher log-probs on a common support (validates the logits and ``top_k``).

    Args:
        student_logits, teacher_logits: ``(..., V)``.
        top_k: ``None`` for the full vocabulary, else the number of student top ids to keep.
        add_tail: with ``top_k``, append the tail bucket (``True``) or renormalise (``False``).

    Returns:
        ``(s, t)`` each ``(..., V)`` or ``(..., k[+1])``, in float32 (float64 for float64 inputs).
    """
    check_logit_pair(student_logits, teacher_logits)
    check_top_k(top_k, student_logits.shape[-1])
    dtype = compute_dtype(student_logits)
    zs = student_logits.to(dtype)
    zt = teacher_logits.detach().to(dtype)
    if top_k is None:
        return torch.log_softmax(zs, dim=-1), torch.log_softmax(zt, dim=-1)
    idx = zs.detach().topk(top_k, dim=-1).indices
    return _restrict(zs, idx, add_tail), _restrict(zt, idx, add_tail)


def kl_per_token(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)`` over the last dim; entries with ``p_v = 0`` add exactly 0.

    Entries where ``log p_v = −inf`` (masked vocabulary) are excluded before the product so that neither the
    value nor the gradient becomes NaN.
    """
    diff = p_logprobs - q_logprobs
    dead = torch.isneginf(p_logprobs)
    if bool(dead.any()):
        diff = torch.where(dead, torch.zeros((), dtype=diff.dtype, device=diff.device), diff)
    return (torch.exp(p_logprobs) * diff).sum(-1)


def cross_entropy_per_token(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """``H(p, q) = −Σ_v p_v log q_v`` over the last dim; entries with ``log p_v = −inf`` add exactly 0.

    ``H(p, p)`` is the entropy of ``p``. Dead entries are zeroed before the product (no NaN value or gradient).
    """
    dead = torch.isneginf(p_logprobs)
    zero = torch.zeros((), dtype=q_logprobs.dtype, device=q_logprobs.device)
    return -(torch.exp(p_logprobs) * torch.where(dead, zero, q_logprobs)).sum(-1)
