"""Chunked fused-linear losses: ``lm_head`` matmul + loss without materialising ``(N, V)`` logits.

Inputs are last hidden states ``(N, H)`` and the ``lm_head`` weight ``(V, H)`` (+ optional bias ``(V,)``); rows
are processed ``chunk_size`` at a time by :func:`crf_distill.head_scores`, so peak extra memory is about one
``(chunk, V)`` block (plus its float32 temporaries), in the forward and in the backward, never ``(N, V)``.

* :func:`chunked_token_logprobs` — per-token log-probs of labels (for CE, DPO, SimPO, IS ratios).
* :func:`chunked_fused_loss` — several token-decomposable terms (CE, generalised JSD, KL, TAID,
  Entropy-OPD: pass their ``*_per_token`` functions) sharing one chunked lm_head pass. Because the total is a
  fixed weighted sum of the rows, its gradient w.r.t. hidden states, weight and bias is computed chunk by chunk
  *inside the forward* (Liger-Kernel's ``FlexChunkLoss`` strategy: one matmul per chunk for the logits, two for
  the gradients, the same count as unchunked autograd) and only scaled in the backward. Each term's value is
  returned too and keeps its own gradient: backpropagating through a single term recomputes the chunks for it.
  :func:`chunked_distillation_loss` is its one-term token-mean form.

Normalisation: ``chunked_distillation_loss`` is ``Σ_rows ℓ_r·m_r / D`` with ``D = Σ m`` (token mean) unless
``num_items`` is given, identical to :func:`crf_distill.aggregate` with ``mode="token_mean"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from crf_distill._checks import check_float_tensor, check_mask
from crf_distill.head_scores import (
    RowTerm,
    accumulate_head_grads,
    check_chunk_size,
    check_head,
    check_row_terms,
    check_temperature,
    grad_operand,
    head_logits,
    head_scores,
    weighted_vjp,
)
from crf_distill.logprobs import compute_dtype
from crf_distill.precision import autocast_off, projection_dtype

__all__ = [
    "ChunkTerm",
    "PerTokenLoss",
    "TeacherFn",
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


TeacherFn = Callable[[torch.Tensor], torch.Tensor]
"""``fn(rows (n,) index tensor) -> (n, V)`` teacher logits of those rows (called under ``no_grad``)."""


def _teacher_source(
    n: int,
    vocab: int,
    teacher_logits: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    teacher_fn: TeacherFn | None,
) -> TeacherFn | None:
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
    teacher_fn: TeacherFn | None = None,
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
    row_terms = [RowTerm(_with_teacher(term, source), active=term.weights != 0) for term in terms]
    return chunked_weighted_sums(
        hidden,
        weight,
        row_terms,
        [term.weights for term in terms],
        [float(term.scale) for term in terms],
        bias=bias,
        chunk_size=chunk_size,
    )


def chunked_weighted_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    terms: Sequence[RowTerm],
    weights: Sequence[torch.Tensor],
    scales: Sequence[float],
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    precision: torch.dtype | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``values[k] = Σ_r weights[k][r]·terms[k].fn(z_r)`` and ``total = Σ_k scales[k]·values[k]`` over the rows of
    ``z = (h Wᵀ + b) / τ``, chunked, with the total's gradient taken in the forward (see the module docstring).

    Args:
        hidden: ``(N, H)``. weight: ``(V, H)``; bias: ``(V,)``. terms: the row functions (their ``active``
            masks skip rows). weights: one ``(N,)`` tensor per term (e.g. a normalised mask). scales: one float
            per term. temperature: ``τ > 0``. chunk_size: rows per chunk. precision: the dtype of the head
            product (``crf_distill.precision``; None follows autocast and the weight).

    Returns:
        ``(total, values)``, all differentiable 0-d tensors (no double backward).
    """
    check_head(hidden, weight, bias)
    check_chunk_size(chunk_size, optional=False)
    if not (len(terms) == len(weights) == len(scales)) or not terms:
        raise ValueError("pass one weights tensor and one scale per term, and at least one term")
    check_row_terms(terms, hidden.shape[0])
    for k, w in enumerate(weights):
        check_mask(f"weights[{k}]", w, hidden.shape[:1])
    check_temperature(temperature)
    out = _ChunkedFused.apply(
        hidden,
        weight,
        bias,
        tuple(terms),
        tuple(weights),
        tuple(float(s) for s in scales),
        float(temperature),
        chunk_size,
        projection_dtype(hidden, weight, precision),
    )
    return out[0], list(out[1:])


class _ChunkedFused(torch.autograd.Function):
    """Outputs ``(total, value_1, …, value_K)``; see :func:`chunked_fused_loss`."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        terms: tuple[RowTerm, ...],
        weights: tuple[torch.Tensor, ...],
        scales: tuple[float, ...],
        temperature: float,
        chunk_size: int,
        precision: torch.dtype,
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        with autocast_off(hidden.device):
            return _ChunkedFused._forward(
                ctx, hidden, weight, bias, terms, weights, scales, temperature, chunk_size, precision
            )

    @staticmethod
    def _forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        terms: tuple[RowTerm, ...],
        weights: tuple[torch.Tensor, ...],
        scales: tuple[float, ...],
        temperature: float,
        chunk_size: int,
        precision: torch.dtype,
    ) -> tuple[torch.Tensor, ...]:
        dtype = compute_dtype(hidden)
        grads = _grad_buffers(hidden, weight, bias, ctx.needs_input_grad[:3], dtype)
        values = [torch.zeros((), dtype=dtype, device=hidden.device) for _ in terms]
        live = list(zip(terms, weights, scales, strict=True))
        operand = grad_operand(weight, precision)
        for start, stop, h, z, rows in _chunks(hidden, weight, bias, temperature, chunk_size, precision):
            dz, sums = weighted_vjp(z, rows, start, stop, live)
            for total, part in zip(values, sums, strict=True):
                total += part
            if dz is not None:
                accumulate_head_grads(dz, h, operand, temperature, *_rows_of(grads, start, stop), precision=precision)
        ctx.save_for_backward(hidden, weight, bias, *weights, *(g if g is not None else torch.empty(0) for g in grads))
        ctx.present = tuple(g is not None for g in grads)
        ctx.terms, ctx.scales, ctx.temperature, ctx.chunk_size = terms, scales, temperature, chunk_size
        ctx.precision, ctx.device = precision, hidden.device
        total = sum((s * v for s, v in zip(scales, values, strict=True)), torch.zeros((), dtype=dtype))
        return (total.to(hidden.device), *values)

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor | None, *grad_values: torch.Tensor | None) -> tuple[Any, ...]:
        with autocast_off(ctx.device):
            return _ChunkedFused._backward(ctx, grad_total, *grad_values)

    @staticmethod
    def _backward(ctx: Any, grad_total: torch.Tensor | None, *grad_values: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, bias, *rest = ctx.saved_tensors
        k = len(ctx.terms)
        weights, saved = rest[:k], rest[k:]
        out: list[torch.Tensor | None] = []
        for grad, present in zip(saved, ctx.present, strict=True):  # the total's gradient, computed in forward
            out.append(grad * grad_total.to(grad.dtype) if present and grad_total is not None else None)
        live = [(t, w, g) for t, w, g in zip(ctx.terms, weights, grad_values, strict=True) if g is not None]
        if live:  # a term's own value was used: recompute its chunks
            dtype = compute_dtype(hidden)
            grads = _grad_buffers(hidden, weight, bias, ctx.needs_input_grad[:3], dtype)
            operand = grad_operand(weight, ctx.precision)
            chunks = _chunks(hidden, weight, bias, ctx.temperature, ctx.chunk_size, ctx.precision)
            for start, stop, h, z, rows in chunks:
                dz, _ = weighted_vjp(z, rows, start, stop, live)
                if dz is not None:
                    accumulate_head_grads(
                        dz, h, operand, ctx.temperature, *_rows_of(grads, start, stop), precision=ctx.precision
                    )
            out = [a if b is None else b if a is None else a + b for a, b in zip(out, grads, strict=True)]
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        result = [None if g is None or d is None else g.to(d) for g, d in zip(out, dtypes, strict=True)]
        return (*result, None, None, None, None, None, None)


def _grad_buffers(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    needed: tuple[bool, ...],
    dtype: torch.dtype,
) -> list[torch.Tensor | None]:
    """Zeroed accumulators for ``∂/∂hidden``, ``∂/∂weight``, ``∂/∂bias`` (None where not needed)."""
    shapes = (hidden.shape, weight.shape, None if bias is None else bias.shape)
    return [
        torch.zeros(shape, dtype=dtype, device=hidden.device) if need and shape is not None else None
        for shape, need in zip(shapes, needed, strict=True)
    ]


def _rows_of(
    grads: list[torch.Tensor | None], start: int, stop: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    grad_h, grad_w, grad_b = grads
    return (None if grad_h is None else grad_h[start:stop]), grad_w, grad_b


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int,
    precision: torch.dtype,
) -> Any:
    """``(start, stop, h, logits, rows)`` for each chunk of rows."""
    n = hidden.shape[0]
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        h = hidden[start:stop]
        z = head_logits(h, weight, bias, temperature, precision=precision)
        yield start, stop, h, z, torch.arange(start, stop, device=hidden.device)


def _with_teacher(term: ChunkTerm, source: TeacherFn | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``term.per_token`` as a row function: the teacher's logits of the same rows are looked up (no grad)."""

    def fn(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        teacher = None
        if term.needs_teacher:
            assert source is not None
            with torch.no_grad():
                teacher = source(rows)
        return term.per_token(logits, teacher, rows)

    return fn


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
