"""Per-token log-probabilities of given labels and per-sequence log-likelihoods.

``token_logprobs`` computes ``log softmax(z)[y] = z_y − logsumexp(z)`` by a gather and a logsumexp, so no
full ``(…, V)`` log-softmax copy is kept for backward (autograd saves the logits and the ``(…,)``
logsumexp only). Half-precision logits are upcast to float32 for the reduction.
"""

from __future__ import annotations

import torch

from crf_distill._checks import check_float_tensor, check_index_tensor, check_mask
from crf_distill.aggregate import masked_values

__all__ = ["avg_sequence_logprob", "compute_dtype", "sequence_logprob", "token_logprobs"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int | None = -100) -> torch.Tensor:
    """Log-probability of each label under its logits.

    Formula: ``lp[..., i] = z[..., i, y_i] − logsumexp_v z[..., i, v]``.

    Args:
        logits: ``(..., V)`` floating tensor (already aligned with ``labels``: position i scores token y_i;
            for a causal LM pass ``logits[:, :-1]`` and ``input_ids[:, 1:]``).
        labels: ``(...)`` integer ids in ``[0, V)``; entries equal to ``ignore_index`` get log-prob 0.
        ignore_index: id marking ignored positions (HF's -100), or ``None`` to allow none.

    Returns:
        ``(...)`` log-probs in float32 (float64 for float64 logits).
    """
    check_float_tensor("logits", logits, min_ndim=1)
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"`labels` must be a torch.Tensor of token ids, got {type(labels).__name__}")
    ignored = labels == ignore_index if ignore_index is not None else torch.zeros_like(labels, dtype=torch.bool)
    safe_labels = torch.where(ignored, torch.zeros_like(labels), labels)
    check_index_tensor("labels", safe_labels, shape=logits.shape[:-1], upper=logits.shape[-1])
    z = logits.to(compute_dtype(logits))
    picked = z.gather(-1, safe_labels.unsqueeze(-1).long()).squeeze(-1)
    lp = picked - torch.logsumexp(z, dim=-1)
    return torch.where(ignored, torch.zeros((), dtype=lp.dtype, device=lp.device), lp)


def sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-likelihood of each sequence: ``Σ_t lp_t · m_t`` over the last dim.

    Args:
        logprobs: ``(B, T)`` per-token log-probs. mask: ``(B, T)``, 1 on response tokens.

    Returns:
        ``(B,)`` — the sequence log-prob DPO uses (TRL: sum over completion tokens).
    """
    check_float_tensor("logprobs", logprobs, min_ndim=1)
    check_mask("mask", mask, logprobs.shape)
    return masked_values(logprobs, mask).sum(-1)


def avg_sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised log-likelihood (SimPO's reward without β): ``Σ_t lp_t·m_t / max(Σ_t m_t, 1)``.

    The denominator is the number of response tokens of each row (``mask.sum(-1).clamp_min(1)``), never
    the padded length ``T``; a row without response tokens gives 0.

    Args:
        logprobs: ``(B, T)`` per-token log-probs. mask: ``(B, T)``, 1 on response tokens, 0 on prompt/padding.

    Returns:
        ``(B,)`` average per-token log-prob of each response.
    """
    total = sequence_logprob(logprobs, mask)
    return total / mask.to(total.dtype).sum(-1).clamp_min(1.0)
