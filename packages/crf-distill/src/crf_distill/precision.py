"""The precision an LM head projects in, and the projection itself in half precision (TRL 1.16's numerics).

TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``) multiplies hidden states by the head weight in
the *projection dtype* ``d``: the autocast dtype when autocast is on for the device, else the hidden states'
dtype; with ``cast_lm_head_to_fp32`` autocast is switched off and ``d = float32``. For a half ``d`` (bf16/fp16)
the logits are rounded to ``d`` by the product and everything after it (log-softmax, entropy, every loss term)
is float32. In the backward the logits' gradient ``∂L/∂z`` (float32) is rounded to ``d`` and meets the
``d``-rounded weight and hidden states in a float32-accumulated product:

    z   = float32( round_d(h) · round_d(W)ᵀ + round_d(b) )           (n, V), rounded to d by the product
    ∂h  = round_d(∂z) · round_d(W)      ∂W += round_d(∂z)ᵀ · round_d(h)      ∂b += Σ_rows round_d(∂z)

:func:`projection_dtype` decides ``d`` (one rule for every caller); :func:`autocast_off` lets the code after the
product run exactly as written, whatever autocast is on around it. float64 stays float64 (as under
``torch.autocast``, which leaves float64 alone), so float64 references are unaffected. Without autocast and
with a float32 weight, ``d`` is float32 and nothing here changes a single bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from crf_distill.logprobs import compute_dtype

__all__ = [
    "HALF_DTYPES",
    "autocast_off",
    "check_projection_dtype",
    "half_head_grads",
    "half_logits",
    "projection_dtype",
    "rounded_projection",
    "rounded_weight",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)
_PROJECTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_projection_dtype(dtype: torch.dtype | None) -> None:
    """``None`` (decide with :func:`projection_dtype`) or one of float16, bfloat16, float32, float64."""
    if dtype is not None and dtype not in _PROJECTION_DTYPES:
        raise ValueError(
            f"`projection_dtype` must be None (follow autocast and the weight) or one of torch.float16, "
            f"torch.bfloat16, torch.float32, torch.float64; got {dtype!r}"
        )


def projection_dtype(hidden: torch.Tensor, weight: torch.Tensor, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype ``d`` the head product ``h Wᵀ`` runs in (see the module docstring).

    ``requested`` wins (``torch.float32`` is TRL's ``cast_lm_head_to_fp32``); else float64 hidden states stay
    float64; else the autocast dtype of ``hidden``'s device when autocast is on there; else a half weight's own
    dtype; else float32.
    """
    check_projection_dtype(requested)
    if requested is not None:
        return requested
    if hidden.dtype == torch.float64:
        return torch.float64
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if weight.dtype in HALF_DTYPES:
        return weight.dtype
    return compute_dtype(hidden)


@contextmanager
def autocast_off(device: torch.device) -> Iterator[None]:
    """Autocast switched off on ``device`` for the duration (nothing is entered when it is already off)."""
    if not torch.is_autocast_enabled(device.type):
        yield
        return
    with torch.autocast(device.type, enabled=False):
        yield


def rounded_projection(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``float32(round_d(h) round_d(W)ᵀ + round_d(b))`` ``(n, V)`` for a half ``dtype`` ``d``, differentiable with
    the float32-accumulated backward of the module docstring (TRL's)."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"rounded_projection is for float16/bfloat16 products, got {dtype!r}")
    out: torch.Tensor = _RoundedProjection.apply(hidden, weight, bias, dtype)
    return out


def half_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The forward of :func:`rounded_projection` (no autograd): ``(n, V)`` float32 logits."""
    z = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        z = z + bias.to(dtype)
    return z.float()


def half_head_grads(
    dz: torch.Tensor,
    h: torch.Tensor,
    rounded_weight: torch.Tensor,
    dtype: torch.dtype,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
) -> None:
    """The backward of the module docstring for one chunk: ``∂z`` ``(n, V)`` float32 is rounded to ``dtype``;
    ``rounded_weight`` is ``round_d(W)`` already in float32 (``(V, H)``, rounded once per pass). Writes ``∂h`` into
    ``grad_h`` (the chunk's rows) and adds into ``grad_w`` / ``grad_b`` (float32 buffers)."""
    g = dz.to(dtype).to(rounded_weight.dtype)
    if grad_h is not None:
        grad_h.copy_(g @ rounded_weight)
    if grad_w is not None:
        grad_w.addmm_(g.t().to(grad_w.dtype), h.to(dtype).to(grad_w.dtype))
    if grad_b is not None:
        grad_b.add_(g.sum(0).to(grad_b.dtype))


def rounded_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``round_d(W)`` as float32, the operand of the backward products (one copy per pass)."""
    return weight.detach().to(dtype).float()


class _RoundedProjection(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        ctx.dtype = dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        with autocast_off(hidden.device):
            return half_logits(hidden, weight, bias, dtype)

    @staticmethod
    def backward(ctx: Any, dz: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        buffers = [
            torch.zeros(shape, dtype=torch.float32, device=dz.device) if need else None
            for shape, need in ((hidden.shape, need_h), (weight.shape, need_w), (weight.shape[:1], need_b))
        ]
        grad_h, grad_w, grad_b = buffers
        with autocast_off(dz.device):
            half_head_grads(dz.float(), hidden, rounded_weight(weight, ctx.dtype), ctx.dtype, grad_h, grad_w, grad_b)
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None or ctx.bias_dtype is None else grad_b.to(ctx.bias_dtype),
            None,
        )
