"""The head's projection dtype under autocast (``crf_distill.precision``): TRL 1.16's fused-head numerics.

Checked against an independent float64 plain-PyTorch reference of those numerics (bf16 operands, logits rounded
to bf16, float64 softmax; the logits' gradient rounded to bf16 before float64 products with the rounded weight
and hidden states), chunked and materialised; a backward run outside autocast recomputes in the forward's
dtype; float64 ignores autocast; ``precision=torch.float32`` under autocast is the float32 path bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from crf_distill import chunked_weighted_sums, head_logits, head_scores
from crf_distill.head_scores import RowTerm
from crf_distill.precision import projection_dtype, rounded_projection

N, H, V = 11, 8, 40
BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g) * 0.1
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, bias, labels


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 log-probs, entropies and ∂(Σ lp + Σ H)/∂(h, W) of TRL's bf16 fused head (no crf code)."""
    hb, wb, bb = (t.bfloat16().double() for t in (hidden, weight, bias))
    z = ((hb @ wb.t()).bfloat16().double() + bb).bfloat16().double().requires_grad_(True)
    log_p = torch.log_softmax(z, dim=-1)
    lp = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    (dz,) = torch.autograd.grad(lp.sum() + ent.sum(), [z])
    dz = dz.float().bfloat16().double()  # TRL rounds the logits' gradient to the product dtype
    return lp.detach(), ent.detach(), dz @ wb, dz.t() @ hb


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_autocast_bf16_matches_the_float64_reference(inputs, chunk_size) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, bias, labels = inputs
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with BF16:
        out = head_scores(h, w, labels, bias=bias, entropy=True, chunk_size=chunk_size)
    assert out.logprobs.dtype == torch.float32
    assert out.entropy is not None
    gh, gw = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), [h, w])  # backward outside autocast
    want_lp, want_ent, want_gh, want_gw = _reference(hidden, weight, bias, labels)
    torch.testing.assert_close(out.logprobs.double(), want_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.entropy.double(), want_ent, rtol=0, atol=5e-5)
    torch.testing.assert_close(gh.double(), want_gh, rtol=0, atol=2e-3 * float(want_gh.abs().max()))
    torch.testing.assert_close(gw.double(), want_gw, rtol=0, atol=2e-3 * float(want_gw.abs().max()))
    # float32 is far from this reference: the check sees the regime
    plain = head_scores(hidden, weight, labels, bias=bias, chunk_size=chunk_size)
    assert float((plain.logprobs.double() - want_lp).abs().max()) > 1e-3


def test_backward_outside_autocast_recomputes_in_the_forward_dtype(inputs) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, bias, labels = inputs
    grads = []
    for backward_in_autocast in (True, False):
        h = hidden.clone().requires_grad_(True)
        with BF16:
            lp = head_scores(h, weight, labels, bias=bias, chunk_size=3).logprobs
            if backward_in_autocast:
                (g,) = torch.autograd.grad(lp.sum(), [h])
        if not backward_in_autocast:
            (g,) = torch.autograd.grad(lp.sum(), [h])
        grads.append(g)
    assert torch.equal(grads[0], grads[1])


def test_chunked_weighted_sums_follow_autocast(inputs) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, bias, _ = inputs
    term = RowTerm(lambda z, rows: torch.logsumexp(z, dim=-1))
    w = torch.full((N,), 1.0 / N)
    with BF16:
        total, _ = chunked_weighted_sums(hidden, weight, [term], [w], [1.0], bias=bias, chunk_size=4)
        z = head_logits(hidden, weight, bias)
    want = (torch.logsumexp(z, dim=-1) * w).sum()
    torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-6)
    plain, _ = chunked_weighted_sums(hidden, weight, [term], [w], [1.0], bias=bias, chunk_size=4)
    assert not torch.equal(plain, total)


def test_float64_ignores_autocast_and_float32_request_is_the_float32_path(inputs) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, bias, labels = inputs
    h64, w64 = hidden.double(), weight.double()
    plain64 = head_scores(h64, w64, labels, entropy=True, chunk_size=4)
    with BF16:
        amp64 = head_scores(h64, w64, labels, entropy=True, chunk_size=4)
        cast32 = head_scores(hidden, weight, labels, bias=bias, entropy=True, precision=torch.float32)
    assert torch.equal(plain64.logprobs, amp64.logprobs)
    plain32 = head_scores(hidden, weight, labels, bias=bias, entropy=True)
    assert torch.equal(plain32.logprobs, cast32.logprobs)
    assert plain32.entropy is not None
    assert cast32.entropy is not None
    assert torch.equal(plain32.entropy, cast32.entropy)


def test_projection_dtype_rule(inputs) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _, _ = inputs
    assert projection_dtype(hidden, weight) == torch.float32
    assert projection_dtype(hidden, weight.bfloat16()) == torch.bfloat16
    assert projection_dtype(hidden.double(), weight) == torch.float64
    with BF16:
        assert projection_dtype(hidden, weight) == torch.bfloat16
        assert projection_dtype(hidden.double(), weight) == torch.float64
        assert projection_dtype(hidden, weight, torch.float32) == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        assert projection_dtype(hidden, weight) == torch.float16


BAD_PRECISIONS = [torch.int64, torch.bool, torch.float8_e4m3fn, "bf16", 16, torch.complex64]


@pytest.mark.parametrize("bad", BAD_PRECISIONS, ids=str)
def test_bad_precision_is_refused_with_the_fix(inputs, bad) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _, labels = inputs
    for call in (
        lambda: head_scores(hidden, weight, labels, precision=bad),
        lambda: head_scores(hidden, weight, labels, precision=bad, chunk_size=3),
        lambda: head_logits(hidden, weight, precision=bad),
        lambda: projection_dtype(hidden, weight, bad),
    ):
        with pytest.raises(ValueError, match=r"`projection_dtype` must be None"):
            call()


def test_rounded_projection_refuses_full_precision(inputs) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, bias, _ = inputs
    with pytest.raises(ValueError, match="float16/bfloat16"):
        rounded_projection(hidden, weight, bias, torch.float32)
