"""Per-row scores of an LM head, with or without materialising the ``(N, V)`` logits.

For ``N`` rows of last hidden states ``h`` (``(N, H)``), an lm_head ``W`` (``(V, H)``, optional bias ``b``) and a
sampling temperature ``τ``, the logits of row ``r`` are ``z_r = (h_r Wᵀ + b) / τ``. :func:`head_scores` returns,
per row, every quantity a training step needs from them:

* ``logprobs[r] = z_r[y_r] − logsumexp(z_r)`` (the label's log-probability; GRPO, DPO, CE, IS ratios);
* ``entropy[r] = logsumexp(z_r) − Σ_v softmax(z_r)_v z_r,v`` (TRL's entropy, nats), when asked;
* ``values[k][r] = term_k.fn(z_r, r)`` for any per-row function (a divergence to a teacher, a TAID or
  Entropy-OPD target, ...), 0 on rows the term leaves out. A term that reads ``z_r`` only at a few ids
  ``I_r`` and through its log-normaliser (a top-k divergence) can say so (:class:`RowSupport`): it is then
  evaluated as ``support.fn(z_r[I_r], logsumexp(z_r), I_r, r)`` with the head's own ``logsumexp``, and its
  gradient ``∂/∂z_r = scatter_{I_r}(∂/∂z_r[I_r]) + (∂/∂lse_r)·softmax(z_r)`` joins the label log-prob's
  softmax term, so it costs no ``(n, V)`` work beyond choosing ``I_r`` (kept from the forward for the backward).
  The support form is a field of the same :class:`RowTerm` (``RowTerm.support``), evaluated in the one chunk loop
  by both chunked executions: chunked :func:`head_scores` as above; :func:`chunked_weighted_sums`, whose gradient
  is one autograd pass over the chunk's logits anyway, differentiates ``support.fn(z[I], logsumexp(z), I, r)``
  there (no ``(n, V)`` teacher logits either). The materialised execution keeps ``fn`` (plain autograd).

Every output is an ordinary differentiable ``(N,)`` tensor, so the caller combines them with any
(non-linear, batch-coupled) loss math, e.g. TRL's GRPO normalisation, and each loss part keeps its own gradient.

This is crf-distill's one chunked API: a loss is a :class:`RowTerm` (its teacher, if any, a :data:`RowSource`
looked up by row), and three executions share the math and the one chunk loop (``_chunks``):

* ``head_scores(..., chunk_size=None)``: materialised, plain autograd through ``(N, V)`` logits (small
  vocabularies).
* ``head_scores(..., chunk_size=n)``: rows are processed ``n`` at a time in a custom autograd function. The
  forward keeps only ``(N,)`` statistics (logsumexp, entropy); the backward recomputes one chunk's logits at a
  time and turns the upstream gradients into ``∂L/∂z`` (``g_lp·(onehot(y) − p) − g_H·p·(log p + H)`` plus each
  term's vector-Jacobian product), then ``∂L/∂h = (∂L/∂z) W / τ`` and ``∂L/∂W += (∂L/∂z)ᵀ h / τ``. At most one
  chunk of logits (and its temporaries) is alive at a time, in the forward and in the backward (the recompute
  strategy of TRL's ``ChunkedLogProbFunction`` and of activation checkpointing).
* :func:`chunked_weighted_sums`: for a loss that is a fixed weighted sum of row terms, the total's gradient
  w.r.t. hidden states, weight and bias is taken chunk by chunk *inside the forward* (Liger-Kernel's
  ``FlexChunkLoss`` strategy: one matmul per chunk for the logits, two for the gradients, the same count as
  unchunked autograd) and only scaled in the backward. Each term's value is returned too and keeps its own
  gradient: backpropagating through a single term recomputes the chunks for it.

``crf_distill.chunked`` keeps the first release's per-token entry points as thin adapters over these.

Precision (``crf_distill.precision``, TRL 1.16's fused head): the product ``h Wᵀ`` runs in the projection dtype
``d`` (``precision``, else the autocast dtype when autocast is on, else a half weight's dtype, else float32;
float64 stays float64). A half ``d`` rounds the logits to ``d``; everything after the product is float32 with
autocast off, and the backward rounds ``∂L/∂z`` to ``d`` before float32-accumulated products. ``d`` is decided
once per call, so a backward run outside autocast recomputes the chunks exactly as the forward saw them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from crf_distill._checks import check_float_tensor, check_index_tensor, check_mask, is_int, is_number
from crf_distill.logprobs import compute_dtype
from crf_distill.precision import (
    HALF_DTYPES,
    autocast_off,
    half_head_grads,
    half_logits,
    projection_dtype,
    rounded_projection,
    rounded_weight,
)

__all__ = [
    "HeadScores",
    "RowFn",
    "RowSource",
    "RowSupport",
    "RowTerm",
    "SupportFn",
    "SupportIds",
    "chunked_weighted_sums",
    "head_logits",
    "head_logits_at",
    "head_scores",
    "logit_scores",
]

RowFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(logits (n, V), rows (n,) long) -> (n,)``: a per-row function of temperature-scaled logits; ``rows``
index the ``N`` rows (use them to look up per-row extras such as teacher logits)."""

RowSource = Callable[[torch.Tensor], torch.Tensor]
"""``source(rows (n,) long) -> (n, V)``: logits of some rows of the scored layout (no grad), e.g. a teacher's or a
TAID anchor's, looked up by a :class:`RowTerm`'s function."""

SupportIds = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``ids(logits (n, V), rows (n,)) -> (n, k) long``: the vocabulary ids ``I`` a support term reads (no grad)."""

SupportFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(values (n, k), lse (n,), ids (n, k), rows (n,)) -> (n,)`` with ``values = z.gather(-1, ids)`` and
``lse = logsumexp(z)``; differentiable w.r.t. ``values`` and ``lse``."""


@dataclass(frozen=True)
class RowSupport:
    """A row function in support form: ``fn(z, rows) = support.fn(z.gather(-1, I), logsumexp(z), I, rows)`` with
    ``I = support.ids(z, rows)`` (see the module docstring); ``ids`` must be deterministic given the logits."""

    ids: SupportIds
    fn: SupportFn


@dataclass(frozen=True)
class RowTerm:
    """A per-row function scored in the same pass as the label log-probs.

    Attributes:
        fn: see :data:`RowFn`. It must be differentiable w.r.t. the logits (it is re-run under autograd in the
            chunked backward) and deterministic given its inputs.
        active: optional ``(N,)`` bool/0-1 mask; rows outside it are not evaluated and score 0.
        support: optional :class:`RowSupport`, the same function read at a few ids; the chunked executions
            (:func:`head_scores` with a ``chunk_size``, :func:`chunked_weighted_sums`) then use it instead of ``fn``
            (materialised scoring uses ``fn``).
    """

    fn: RowFn
    active: torch.Tensor | None = None
    support: RowSupport | None = None


@dataclass(frozen=True)
class HeadScores:
    """What :func:`head_scores` returns; every tensor is ``(N,)`` and differentiable."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    values: tuple[torch.Tensor, ...]


def head_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    precision: torch.dtype | None = None,
) -> torch.Tensor:
    """``(h Wᵀ + b) / τ`` ``(n, V)`` in float32 (float64 for float64 inputs), the product in the projection dtype
    ``d = projection_dtype(hidden, weight, precision)`` (a half ``d`` rounds the logits to it; see the module
    docstring)."""
    dtype = compute_dtype(hidden)
    d = projection_dtype(hidden, weight, precision)
    with autocast_off(hidden.device):
        if d in HALF_DTYPES:
            project = rounded_projection if torch.is_grad_enabled() else half_logits
            z = project(hidden, weight, bias, d).to(dtype)
        else:
            z = hidden.to(d) @ weight.to(d).t()
            if bias is not None:
                z = z + bias.to(d)
            z = z.to(dtype)
        return z if temperature == 1.0 else z / temperature


def head_logits_at(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    precision: torch.dtype | None = None,
) -> torch.Tensor:
    """``z[r, j] = (h_r · W[ids[r, j]] + b[ids[r, j]]) / τ`` ``(n, k)``: :func:`head_logits` at ``ids`` ``(n, k)`` only,
    without the ``(n, V)`` product (the ``(n, k, H)`` rows of ``W`` meet each hidden row in one batched product, in
    the same projection dtype ``d``; a half ``d`` rounds the logits to it). No grad: for teacher-side reads."""
    check_head(hidden, weight, bias)
    check_support_ids(ids, hidden.shape[0])
    dtype = compute_dtype(hidden)
    d = projection_dtype(hidden, weight, precision)
    with torch.no_grad(), autocast_off(hidden.device):
        rows = weight.detach()[ids].to(d)
        z = torch.bmm(rows, hidden.detach().to(d).unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            z = z + bias.detach()[ids].to(d)
        z = z.to(dtype)
    return z if temperature == 1.0 else z / temperature


def check_support_ids(ids: torch.Tensor, rows: int) -> None:
    """``ids`` is an ``(n, k)`` integer tensor with one row per scored row."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.dim() != 2 or ids.shape[0] != rows:
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"support ids must be an (n={rows}, k) torch.long tensor of vocabulary ids, got {got}")


def _support_value(
    support: RowSupport, z: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(support.fn(z[I], lse, I, rows), I)`` for the rows of ``z`` ``(n, V)`` (``lse`` ``(n,)``)."""
    ids = support.ids(z.detach(), rows)
    check_support_ids(ids, z.shape[0])
    return support.fn(z.gather(-1, ids), lse, ids, rows), ids


def _row_value(term: RowTerm, z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``term`` on the rows of ``z`` ``(n, V)``, differentiable w.r.t. ``z``: in its support form where it has one
    (the ids chosen here, the log-normaliser through autograd), else ``fn``."""
    if term.support is None:
        return term.fn(z, rows)
    value, _ = _support_value(term.support, z, torch.logsumexp(z, dim=-1), rows)
    return value


def _support_vjp(
    support: RowSupport,
    values: torch.Tensor,
    lse: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(∂/∂values, ∂/∂lse)`` of ``Σ_r grad_r·support.fn(values, lse, ids, rows)_r`` (None where unused)."""
    with torch.enable_grad():
        leaf_values = values.detach().requires_grad_(True)
        leaf_lse = lse.detach().requires_grad_(True)
        out = support.fn(leaf_values, leaf_lse, ids, rows)
        total = (out * grad.to(out.dtype)).sum()
        if not total.requires_grad:
            return None, None
        g_values, g_lse = torch.autograd.grad(total, (leaf_values, leaf_lse), allow_unused=True)
    return g_values, g_lse


def _support_grads(
    supported: Sequence[tuple[RowTerm, torch.Tensor, list[torch.Tensor | None]]],
    chunk: int,
    z: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor,
    start: int,
    stop: int,
) -> tuple[torch.Tensor | None, list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]]:
    """For one chunk ``[start, stop)`` of logits ``z`` ``(n, V)`` (``lse`` its ``(n,)`` log-normalisers), the support
    terms' ``∂(Σ_k g_k·term_k)/∂z = Σ_k scatter_{I_k}(∂/∂z[I_k]) + c·softmax(z)``, for ``(term_k, g_k (N,), ids_k)``
    in ``supported`` (``ids_k`` the forward's ids per chunk): ``(c (n,) or None, [(sel, I, ∂/∂z[I]), ...])``, where
    ``sel`` are the local active rows (None: all) the scatter's rows are."""
    c: torch.Tensor | None = None
    scatters: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
    for term, g, kept in supported:
        ids = kept[chunk]
        if ids is None:
            continue
        assert term.support is not None
        sel = _selected(term.active, start, stop)
        at = slice(None) if sel is None else sel
        g_values, g_lse = _support_vjp(term.support, z[at].gather(-1, ids), lse[at], ids, rows[at], g[start:stop][at])
        if g_values is not None:
            scatters.append((sel, ids, g_values.to(z.dtype)))
        if g_lse is not None:
            c = torch.zeros(stop - start, dtype=z.dtype, device=z.device) if c is None else c
            c[at] += g_lse.to(z.dtype)
    return c, scatters


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``lse − Σ_v softmax(z)_v z_v`` per row, without a second ``(n, V)`` product tensor."""
    p = torch.exp(z - lse.unsqueeze(-1))
    return lse - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).reshape(-1)


def _selected(active: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """Local indices of the active rows in ``[start, stop)``; ``None`` means all of them."""
    if active is None:
        return None
    return torch.nonzero(active[start:stop]).flatten()


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int,
    precision: torch.dtype,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The one chunk loop of every chunked pass: ``(start, stop, h, z, rows)`` per chunk of ``chunk_size`` rows,
    ``z`` the chunk's logits (``head_logits``) and ``rows`` its row indices. It holds no chunk while the caller works
    on the next one (the caller drops its own ``z`` before asking for the next chunk)."""
    n = hidden.shape[0]
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        h = hidden[start:stop]
        z = head_logits(h, weight, bias, temperature, precision=precision)
        yield start, stop, h, z, torch.arange(start, stop, device=hidden.device)
        del z


class _ChunkedHeadScores(torch.autograd.Function):
    """Outputs ``(logprobs, entropy, value_1, …, value_K)``; the backward recomputes the chunks (see
    :func:`head_scores`)."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        with autocast_off(args[0].device):
            return _ChunkedHeadScores._forward(ctx, *args)

    @staticmethod
    def _forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        terms: tuple[RowTerm, ...],
        want_entropy: bool,
        temperature: float,
        chunk_size: int,
        precision: torch.dtype,
    ) -> tuple[torch.Tensor, ...]:
        n = hidden.shape[0]
        dtype = compute_dtype(hidden)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = (torch.empty if want_entropy else torch.zeros)(n, dtype=dtype, device=hidden.device)
        values = [torch.zeros(n, dtype=dtype, device=hidden.device) for _ in terms]
        # support terms: their ids I of every chunk, kept for the backward (None where no row is active)
        support_ids: list[list[torch.Tensor | None]] = [[] for _ in terms]
        for start, stop, _, z, rows in _chunks(hidden, weight, bias, temperature, chunk_size, precision):
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            logprobs[start:stop] = z.gather(-1, labels[start:stop].unsqueeze(-1)).squeeze(-1) - lse[start:stop]
            if want_entropy:
                entropy[start:stop] = _entropy(z, lse[start:stop])
            for term, out, kept in zip(terms, values, support_ids, strict=True):
                sel = _selected(term.active, start, stop)
                if term.support is not None:
                    ids = None
                    if sel is None:
                        value, ids = _support_value(term.support, z, lse[start:stop], rows)
                        out[start:stop] = value.to(dtype)
                    elif sel.numel():
                        value, ids = _support_value(term.support, z[sel], lse[start + sel], rows[sel])
                        out[start + sel] = value.to(dtype)
                    kept.append(ids)
                elif sel is None:
                    out[start:stop] = term.fn(z, rows).to(dtype)
                elif sel.numel():
                    out[start + sel] = term.fn(z[sel], rows[sel]).to(dtype)
            del z
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.support_ids = support_ids
        ctx.terms = terms
        ctx.want_entropy = want_entropy
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.precision = precision
        ctx.device = hidden.device
        outputs = [logprobs, entropy, *values]
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        with autocast_off(ctx.device):
            return _ChunkedHeadScores._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        g_lp, g_h, *g_terms = grads
        if not ctx.want_entropy:
            g_h = None
        dtype = lse.dtype
        grad_h, grad_w, grad_b = _grad_buffers(hidden, weight, bias, ctx.needs_input_grad[:3], dtype)
        live = [(t, g, 1.0) for t, g in zip(ctx.terms, g_terms, strict=True) if g is not None]
        if g_lp is None and g_h is None and not live:
            return (None,) * 9
        dense = [item for item in live if item[0].support is None]
        supported = [
            (t, g, kept)
            for t, g, kept in zip(ctx.terms, g_terms, ctx.support_ids, strict=True)
            if g is not None and t.support is not None
        ]
        operand = grad_operand(weight, ctx.precision)
        chunks = _chunks(hidden, weight, bias, ctx.temperature, ctx.chunk_size, ctx.precision)
        for chunk, (start, stop, h, z, rows) in enumerate(chunks):
            dz, _ = weighted_vjp(z, rows, start, stop, dense)  # ∂(Σ_k g_k·term_k)/∂z, or None
            # support terms: ∂/∂z = scatter_I(∂/∂z[I]) + c·p with c = ∂/∂lse, p = softmax(z) (joined below)
            c, scatters = _support_grads(supported, chunk, z, lse[start:stop], rows, start, stop)
            if g_lp is not None or g_h is not None or c is not None:
                log_p = z.sub_(lse[start:stop].unsqueeze(-1))  # z is not needed any more: reuse its storage
                p = torch.exp(log_p)
                a = (
                    torch.zeros(stop - start, dtype=dtype, device=z.device)
                    if g_lp is None
                    else g_lp[start:stop].to(dtype)
                )
                b = a if c is None else a - c  # the coefficient of −p
                if g_h is not None:  # −g_H·p·(log p + H) − b·p, in log_p's storage
                    log_p.add_(entropy[start:stop].unsqueeze(-1)).mul_(g_h[start:stop].to(dtype).unsqueeze(-1))
                    log_p.add_(b.unsqueeze(-1)).mul_(p).neg_()
                else:
                    log_p.copy_(p).mul_(-b.unsqueeze(-1))
                del p
                log_p.scatter_add_(-1, labels[start:stop].unsqueeze(-1), a.unsqueeze(-1))
                dz = log_p if dz is None else dz.add_(log_p)
            for sel, ids, g_values in scatters:
                dz = torch.zeros_like(z) if dz is None else dz
                if sel is None:
                    dz.scatter_add_(-1, ids, g_values)
                else:
                    dz.index_put_((sel.unsqueeze(-1).expand_as(ids), ids), g_values, accumulate=True)
            if dz is None:  # nothing flows back through this chunk
                del z
                continue
            accumulate_head_grads(
                dz,
                h,
                operand,
                ctx.temperature,
                None if grad_h is None else grad_h[start:stop],
                grad_w,
                grad_b,
                precision=ctx.precision,
            )
            del z, dz
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def weighted_vjp(
    z: torch.Tensor,
    rows: torch.Tensor,
    start: int,
    stop: int,
    live: Sequence[tuple[RowTerm, torch.Tensor, float | torch.Tensor]],
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """For one chunk ``[start, stop)`` of logits ``z`` ``(n, V)``: ``∂(Σ_k s_k Σ_r c_k,r·term_k(z)_r)/∂z`` and the
    detached sums ``Σ_r c_k,r·term_k(z)_r``, for ``(term_k, c_k (N,), s_k)`` in ``live`` (autograd on a detached
    copy of the chunk; inactive rows are left out; a term with a support form is evaluated in it)."""
    sums: list[torch.Tensor] = []
    with torch.enable_grad():
        leaf = z.detach().requires_grad_(True)
        total: torch.Tensor | None = None
        for term, coeff, scale in live:
            sel = _selected(term.active, start, stop)
            if sel is not None and sel.numel() == 0:
                sums.append(torch.zeros((), dtype=z.dtype, device=z.device))
                continue
            picked = leaf if sel is None else leaf[sel]
            c = coeff[start:stop] if sel is None else coeff[start + sel]
            value = (_row_value(term, picked, rows if sel is None else rows[sel]) * c.to(z.dtype)).sum()
            sums.append(value.detach())
            total = value * scale if total is None else total + value * scale
        if total is None or not total.requires_grad:
            return None, sums
        (dz,) = torch.autograd.grad(total, leaf)
    return dz, sums


def grad_operand(weight: torch.Tensor, precision: torch.dtype) -> torch.Tensor:
    """The weight as :func:`accumulate_head_grads` multiplies it: ``round_d(W)`` in float32 for a half projection
    dtype ``d`` (made once per pass), else the weight itself."""
    return rounded_weight(weight, precision) if precision in HALF_DTYPES else weight


def accumulate_head_grads(
    dz: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    *,
    precision: torch.dtype | None = None,
) -> None:
    """Turn one chunk's ``∂L/∂z`` (temperature-scaled logits) into its ``∂L/∂h`` rows (written to ``grad_h``, the
    chunk's slice) and add its ``∂L/∂W`` and ``∂L/∂b`` contributions in place. For a half projection dtype
    ``precision`` the products are those of ``crf_distill.precision`` and ``weight`` is :func:`grad_operand`'s."""
    if temperature != 1.0:
        dz = dz / temperature
    if precision in HALF_DTYPES:
        assert precision is not None
        half_head_grads(dz, h, weight, precision, grad_h, grad_w, grad_b)
        return
    if grad_h is not None:
        torch.mm(dz, weight.to(dz.dtype), out=grad_h)
    if grad_w is not None:
        grad_w.addmm_(dz.t(), h.to(dz.dtype))
    if grad_b is not None:
        grad_b.add_(dz.sum(0))


def check_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prefix: str = "") -> None:
    """``hidden`` ``(N, H)``, ``weight`` ``(V, H)`` like ``nn.Linear.weight`` and an optional ``bias`` ``(V,)``."""
    check_float_tensor(f"{prefix}hidden", hidden, ndim=2)
    check_float_tensor(f"{prefix}weight", weight, ndim=2)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"`{prefix}weight` must be (V, H={hidden.shape[1]}) like nn.Linear.weight of the lm_head, "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None:
        check_float_tensor(f"{prefix}bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"`{prefix}bias` must be (V={weight.shape[0]},), got {tuple(bias.shape)}")


def check_row_terms(terms: Sequence[RowTerm], rows: int) -> None:
    """Every term is a :class:`RowTerm` whose ``active`` mask (if any) covers ``rows`` rows."""
    for k, term in enumerate(terms):
        if not isinstance(term, RowTerm):
            raise TypeError(f"`terms[{k}]` must be a RowTerm, got {type(term).__name__}")
        if term.active is not None:
            check_mask(f"terms[{k}].active", term.active, (rows,))


def check_temperature(temperature: float) -> None:
    if not is_number(temperature) or not temperature > 0:
        raise ValueError(f"`temperature` must be a float > 0, got {temperature!r}")


def check_chunk_size(chunk_size: int | None, *, optional: bool) -> None:
    """A positive int of rows per chunk (or None when ``optional``: materialise)."""
    if chunk_size is None and optional:
        return
    if not is_int(chunk_size) or chunk_size <= 0:
        extra = " or None" if optional else ""
        raise ValueError(f"`chunk_size` must be a positive int (rows per chunk){extra}, got {chunk_size!r}")


def head_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    terms: Sequence[RowTerm] = (),
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    precision: torch.dtype | None = None,
) -> HeadScores:
    """Label log-probs, entropies and per-row term values of ``z = (h Wᵀ + b) / τ`` (see the module docstring).

    Args:
        hidden: ``(N, H)`` last hidden states (flatten ``(B, T, H)`` first). weight: ``(V, H)``; bias: ``(V,)``.
        labels: ``(N,)`` token ids in ``[0, V)`` (the token each row predicts).
        terms: per-row functions scored in the same pass.
        entropy: also return the per-row entropy (differentiable).
        temperature: ``τ > 0``, applied to the logits every output sees.
        chunk_size: rows per chunk; ``None`` materialises the ``(N, V)`` logits.
        precision: the dtype of the head product; ``None`` follows autocast and the weight
            (:func:`crf_distill.precision.projection_dtype`); ``torch.float32`` is TRL's ``cast_lm_head_to_fp32``.

    Returns:
        :class:`HeadScores`; ``logprobs``/``entropy``/``values`` in float32 (float64 for float64 hidden).
    """
    terms = tuple(terms)
    check_head(hidden, weight, bias)
    check_index_tensor("labels", labels, shape=hidden.shape[:1], upper=weight.shape[0])
    check_row_terms(terms, hidden.shape[0])
    check_temperature(temperature)
    check_chunk_size(chunk_size, optional=True)
    labels = labels.long()
    d = projection_dtype(hidden, weight, precision)
    if chunk_size is None:
        z = head_logits(hidden, weight, bias, temperature, precision=d)
        with autocast_off(hidden.device):
            return _scores_of(z, labels, terms, entropy)
    out = _ChunkedHeadScores.apply(hidden, weight, bias, labels, terms, entropy, float(temperature), chunk_size, d)
    return HeadScores(out[0], out[1] if entropy else None, tuple(out[2:]))


def logit_scores(
    logits: torch.Tensor, labels: torch.Tensor, *, terms: Sequence[RowTerm] = (), entropy: bool = False
) -> HeadScores:
    """:func:`head_scores` of already materialised ``(N, V)`` logits (models whose head cannot be separated,
    e.g. with logit soft-capping); the logits must already include any temperature."""
    check_float_tensor("logits", logits, ndim=2)
    check_index_tensor("labels", labels, shape=logits.shape[:1], upper=logits.shape[1])
    terms = tuple(terms)
    check_row_terms(terms, logits.shape[0])
    with autocast_off(logits.device):
        return _scores_of(logits.to(compute_dtype(logits)), labels.long(), terms, entropy)


def _scores_of(z: torch.Tensor, labels: torch.Tensor, terms: tuple[RowTerm, ...], entropy: bool) -> HeadScores:
    """The materialised path: plain autograd through ``(N, V)`` logits."""
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    rows = torch.arange(z.shape[0], device=z.device)
    values = []
    for term in terms:
        if term.active is None:
            values.append(term.fn(z, rows).to(z.dtype))
            continue
        sel = torch.nonzero(term.active).flatten()
        out = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
        values.append(out.index_put((sel,), term.fn(z[sel], rows[sel]).to(z.dtype)) if sel.numel() else out)
    return HeadScores(logprobs, _entropy(z, lse) if entropy else None, tuple(values))


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
    """Outputs ``(total, value_1, …, value_K)``; the total's gradient is taken in the forward (see
    :func:`chunked_weighted_sums`)."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        with autocast_off(args[0].device):
            return _ChunkedFused._forward(ctx, *args)

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
