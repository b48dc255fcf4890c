"""Chunked fused-linear losses written per token: thin adapters over the one chunked API, :class:`RowTerm`.

New losses are written as a :class:`~crf_distill.RowTerm` (``fn(logits (n, V), rows) -> (n,)``, teacher logits
looked up through a :data:`~crf_distill.RowSource`) and scored by :func:`crf_distill.head_scores` (label log-probs,
entropies and term values; any loss math afterwards) or :func:`crf_distill.chunked_weighted_sums` (a fixed weighted
sum of terms, its gradient taken in the forward, Liger-Kernel's ``FlexChunkLoss`` strategy). Both run the one chunk
loop of ``crf_distill.head_scores``; peak extra memory is about one ``(chunk, V)`` block, never ``(N, V)``.

The functions here keep the per-token form of the first release and translate it, nothing more:

* :func:`chunked_token_logprobs` — ``head_scores``' log-probs, with an ``ignore_index``.
* :class:`ChunkTerm` + :func:`chunked_fused_loss` — per-token losses ``fn(student, teacher, rows)`` with row
  weights and scales, the teacher given as logits, hidden states + head, or a :data:`RowSource`; each
  :class:`ChunkTerm` becomes a :class:`RowTerm` (:meth:`ChunkTerm.row_term`) for ``chunked_weighted_sums``.
* :func:`chunked_distillation_loss` — the one-term token-mean form: ``Σ_rows ℓ_r·m_r / D`` with ``D = Σ m``
  unless ``num_items`` is given, identical to :func:`crf_distill.aggregate` with ``mode="token_mean"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from crf_distill._checks import check_float_tensor, check_mask
from crf_distill.head_scores import (
    RowSource,
    RowTerm,
    check_chunk_size,
    check_head,
    chunked_weighted_sums,
    head_logits,
    head_scores,
)
from crf_distill.logprobs import compute_dtype
from crf_distill.precision import projection_dtype

__all__ = [
    "ChunkTerm",
    "PerTokenLoss",
    "chunked_distillation_loss",
    "chunked_fused_loss",
    "chunked_token_logprobs",
    "chunked_weighted_sums",
]

PerTokenLoss = Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]
"""``fn(student_logits (n, V), teacher_logits (n, V) or None, rows (n,) index tensor) -> (n,)``."""


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int | None = -100,
) -> torch.Tensor:
    """``log softmax(h W^T + b)[y]`` per row, chunked; equals ``token_logprobs(hidden @ weight.T + bias, labels)``.

    Args:
        hidden: ``(N, H)`` last hidden states (flatten ``(B, T, H)`` first).
        weight: ``(V, H)`` lm_head weight; bias: optional ``(V,)``.
        labels: ``(N,)`` ids in ``[0, V)``; ``ignore_index`` positions give 0 and no gradient.
        chunk_size: rows per chunk.

    Returns:
        ``(N,)`` float32 (float64 for float64 hidden) log-probs, differentiable w.r.t. hidden/weight/bias.
    """
    check_chunk_size(chunk_size, optional=False)
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"`labels` must be a torch.Tensor of token ids, got {type(labels).__name__}")
    ignored = labels == ignore_index if ignore_index is not None else torch.zeros_like(labels, dtype=torch.bool)
    safe = torch.where(ignored, torch.zeros_like(labels), labels)
    lp = head_scores(hidden, weight, safe, bias=bias, chunk_size=chunk_size).logprobs
    return torch.where(ignored, torch.zeros((), dtype=lp.dtype, device=lp.device), lp)


@dataclass(frozen=True)
class ChunkTerm:
    """One token-decomposable loss term of :func:`chunked_fused_loss`.

    Attributes:
        per_token: ``fn(student_logits (n, V), teacher_logits (n, V) | None, rows) -> (n,)``; ``rows`` is a
            ``(n,)`` index tensor into the ``N`` flattened rows (use it to index per-row extras).
        weights: ``(N,)`` normalised row weights (e.g. ``mask / mask.sum()``); rows with weight 0 are skipped.
        scale: multiplier of this term inside the differentiable total (a channel weight).
        needs_teacher: whether ``per_token`` reads the teacher logits (only then are they computed).
    """

    per_token: PerTokenLoss
    weights: torch.Tensor
    scale: float = 1.0
    needs_teacher: bool = True

    def row_term(self, teacher: RowSource | None) -> RowTerm:
        """This term as a :class:`RowTerm` on the rows of nonzero weight: the teacher's logits of the same rows are
        looked up (no grad) when it ``needs_teacher``."""
        per_token, needs_teacher = self.per_token, self.needs_teacher

        def fn(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            target = None
            if needs_teacher:
                assert teacher is not None
                with torch.no_grad():
                    target = teacher(rows)
            return per_token(logits, target, rows)

        return RowTerm(fn, active=self.weights != 0)


def _teacher_source(
    n: int,
    vocab: int,
    teacher_logits: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    teacher_fn: RowSource | None,
) -> RowSource | None:
    if sum(x is not None for x in (teacher_logits, teacher_hidden, teacher_fn)) > 1:
        raise ValueError(
            "pass only one teacher: `teacher_logits` (N, V), `teacher_hidden` (N, H) + `teacher_weight`, or `teacher_fn`"
        )
    if teacher_fn is not None:
        return teacher_fn
    if teacher_logits is not None:
        check_float_tensor("teacher_logits", teacher_logits, ndim=2)
        if teacher_logits.shape != (n, vocab):
            raise ValueError(f"`teacher_logits` must be (N={n}, V={vocab}), got {tuple(teacher_logits.shape)}")
        fixed = teacher_logits.detach()
        return lambda rows: fixed[rows]
    if teacher_hidden is None:
        return None
    if teacher_weight is None:
        raise ValueError("`teacher_hidden` needs `teacher_weight` (the teacher lm_head weight, (V, H))")
    check_head(teacher_hidden, teacher_weight, teacher_bias, prefix="teacher_")
    if teacher_hidden.shape[0] != n or teacher_weight.shape[0] != vocab:
        raise ValueError(
            f"teacher rows/vocab ({teacher_hidden.shape[0]}, {teacher_weight.shape[0]}) must match the student's ({n}, {vocab})"
        )
    th, tw = teacher_hidden.detach(), teacher_weight.detach()
    tb = None if teacher_bias is None else teacher_bias.detach()
    d = projection_dtype(th, tw)  # decided here, in the caller's autocast state, not inside the chunked pass
    return lambda rows: head_logits(th[rows], tw, tb, precision=d)


def chunked_fused_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    terms: Sequence[ChunkTerm],
    *,
    bias: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_fn: RowSource | None = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Several token-decomposable losses sharing one chunked lm_head pass.

    Computes ``total = Σ_k scale_k · Σ_r weights_k[r] · ℓ_k(r)`` where ``ℓ_k(r) = term_k.per_token`` on the
    logits of row ``r`` (``h_r W^T + b``). Each chunk's logits are computed once and shared by all terms, and the
    total's gradient is taken chunk by chunk in the same pass (see the module docstring). Teacher logits are
    computed (``no_grad``) only for rows where a term that needs them has non-zero weight.

    Args:
        hidden: ``(N, H)`` student last hidden states. weight/bias: student lm_head ``(V, H)`` / ``(V,)``.
        terms: the :class:`ChunkTerm` s.
        teacher_logits: ``(N, V)`` precomputed, **or** ``teacher_hidden`` ``(N, H_T)`` + ``teacher_weight``
            ``(V, H_T)`` (+ ``teacher_bias``), **or** ``teacher_fn(rows) -> (n, V)``; required when a term
            ``needs_teacher``.
        chunk_size: rows per chunk.

    Returns:
        ``(total, values)``: ``total`` is a differentiable 0-d tensor (gradient precomputed in the forward; no
        double backward); ``values[k] = Σ_r weights_k[r]·ℓ_k(r)`` is differentiable too (recomputed on demand).
    """
    check_head(hidden, weight, bias)
    check_chunk_size(chunk_size, optional=False)
    n, vocab = hidden.shape[0], weight.shape[0]
    if not terms:
        raise ValueError("`terms` is empty; pass at least one ChunkTerm")
    for k, term in enumerate(terms):
        check_mask(f"terms[{k}].weights", term.weights, (n,))
    source = _teacher_source(n, vocab, teacher_logits, teacher_hidden, teacher_weight, teacher_bias, teacher_fn)
    if source is None and any(term.needs_teacher for term in terms):
        raise ValueError(
            "a term needs the teacher: pass `teacher_logits` (N, V) or `teacher_hidden` + `teacher_weight`"
        )
    row_terms = [term.row_term(source) for term in terms]
    return chunked_weighted_sums(
        hidden,
        weight,
        row_terms,
        [term.weights for term in terms],
        [float(term.scale) for term in terms],
        bias=bias,
        chunk_size=chunk_size,
    )


def _token_mean_weights(mask: torch.Tensor, dtype: torch.dtype, num_items: float | torch.Tensor | None) -> torch.Tensor:
    weights = mask.to(dtype)
    if num_items is None:
        den = weights.sum()
        return weights / torch.where(den > 0, den, torch.ones((), dtype=dtype, device=den.device))
    den = torch.as_tensor(num_items, dtype=dtype, device=mask.device)
    if den.dim() != 0 or not bool(den > 0):
        raise ValueError(f"`num_items` must be a positive scalar, got {num_items!r}")
    return weights / den


def chunked_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    per_token_fn: PerTokenLoss,
    mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Token mean of one distillation loss over ``mask`` with the student lm_head fused in, chunk by chunk.

    Args:
        hidden: ``(N, H)`` student last hidden states (with grad). weight/bias: student lm_head.
        per_token_fn: ``fn(student_logits (n, V), teacher_logits (n, V), rows) -> (n,)``, e.g.
            ``lambda s, t, rows: generalized_jsd_per_token(s, t, alpha=0.5)``.
        mask: ``(N,)`` token weights (1 on response tokens of samples with teacher signal).
        teacher_logits: ``(N, V)`` precomputed teacher logits, **or** ``teacher_hidden`` ``(N, H_T)`` with
            ``teacher_weight`` ``(V, H_T)`` (+ ``teacher_bias``), projected per chunk under ``no_grad``.
        chunk_size: rows per chunk (Liger uses 1024).
        num_items: denominator override (default ``mask.sum()``; an all-zero mask gives 0).

    Returns:
        0-d tensor equal to ``aggregate(per_token_fn(h W^T + b, teacher, :), mask, "token_mean")``.
    """
    check_head(hidden, weight, bias)
    check_mask("mask", mask, hidden.shape[:1])
    if (teacher_logits is None) == (teacher_hidden is None):
        raise ValueError("pass exactly one of `teacher_logits` (N, V) or `teacher_hidden` (N, H) + `teacher_weight`")
    dtype = compute_dtype(hidden)
    term = ChunkTerm(per_token_fn, _token_mean_weights(mask, dtype, num_items))
    total, _ = chunked_fused_loss(
        hidden,
        weight,
        [term],
        bias=bias,
        teacher_logits=teacher_logits,
        teacher_hidden=teacher_hidden,
        teacher_weight=teacher_weight,
        teacher_bias=teacher_bias,
        chunk_size=chunk_size,
    )
    return total
