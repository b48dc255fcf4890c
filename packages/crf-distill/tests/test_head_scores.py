"""head_scores: label log-probs, entropies and per-row terms of an LM head, materialised and chunked.

Checked against the float64 probability-space references of conftest (values and gradients), with the
upstream gradients of a non-linear, batch-coupled loss (the way GRPO uses the outputs), temperature, bias,
half-active terms, frozen heads and bad inputs.
"""

from __future__ import annotations

import pytest
import torch

from crf_distill import RowTerm, generalized_jsd_per_token, head_scores

N, H, V = 23, 5, 19


def _setup(gen, rand, bias: bool = True):  # type: ignore[no-untyped-def]
    hidden = rand(gen, N, H, scale=1.0, grad=True)
    weight = rand(gen, V, H, scale=1.0, grad=True)
    b = rand(gen, V, scale=1.0, grad=True) if bias else None
    labels = torch.randint(0, V, (N,), generator=gen)
    teacher = rand(gen, N, V)
    return hidden, weight, b, labels, teacher


def _reference(ref, hidden, weight, b, labels, teacher, temperature, active):  # type: ignore[no-untyped-def]
    """Probability-space float64 reference of every output."""
    z = (hidden @ weight.t() + (0.0 if b is None else b)) / temperature
    p = ref.softmax(z)
    lp = torch.log(p.gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    ent = ref.entropy(p)
    jsd = ref.gjsd(z, teacher, 0.5) * active.double()
    return lp, ent, jsd


def _loss(lp: torch.Tensor, ent: torch.Tensor, jsd: torch.Tensor) -> torch.Tensor:
    """A non-linear, batch-coupled combination, so every upstream gradient differs per row."""
    ratio = torch.exp(lp - lp.detach().mean())
    return -(torch.minimum(ratio * 0.7, ratio.clamp(0.8, 1.2) * 0.7)).mean() + 0.3 * ent.var() + jsd.sum() / 5.0


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_outputs_and_gradients_match_the_reference(gen, rand, ref, chunk_size, temperature, bias) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, b, labels, teacher = _setup(gen, rand, bias)
    active = torch.rand(N, generator=gen) > 0.4
    term = RowTerm(lambda z, rows: generalized_jsd_per_token(z, teacher[rows], alpha=0.5), active=active)
    out = head_scores(
        hidden, weight, labels, bias=b, terms=[term], entropy=True, temperature=temperature, chunk_size=chunk_size
    )
    assert out.entropy is not None
    lp, ent, jsd = _reference(ref, hidden, weight, b, labels, teacher, temperature, active)
    for got, want in ((out.logprobs, lp), (out.entropy, ent), (out.values[0], jsd)):
        assert got.dtype == torch.float64
        assert torch.allclose(got, want, atol=1e-10)
    assert bool((out.values[0][~active] == 0).all())
    params = [x for x in (hidden, weight, b) if x is not None]
    got_grads = torch.autograd.grad(_loss(out.logprobs, out.entropy, out.values[0]), params)
    want_grads = torch.autograd.grad(_loss(lp, ent, jsd), params)
    for a, w in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(a, w, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_each_output_has_its_own_gradient(gen, rand, ref, chunk_size) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, b, labels, teacher = _setup(gen, rand)
    term = RowTerm(lambda z, rows: generalized_jsd_per_token(z, teacher[rows], alpha=0.5))
    out = head_scores(hidden, weight, labels, bias=b, terms=[term], entropy=True, chunk_size=chunk_size)
    assert out.entropy is not None
    lp, ent, jsd = _reference(ref, hidden, weight, b, labels, teacher, 1.0, torch.ones(N, dtype=torch.bool))
    for got, want in ((out.logprobs, lp), (out.entropy, ent), (out.values[0], jsd)):
        g_got = torch.autograd.grad(got.sum(), [hidden, weight, b], retain_graph=True)
        g_want = torch.autograd.grad(want.sum(), [hidden, weight, b], retain_graph=True)
        for a, w in zip(g_got, g_want, strict=True):
            assert torch.allclose(a, w, atol=1e-10)


def test_chunks_bound_the_rows_a_term_sees(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _, labels, _ = _setup(gen, rand, bias=False)
    seen: list[int] = []

    def fn(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        seen.append(z.shape[0])
        return z.logsumexp(-1)

    out = head_scores(hidden, weight, labels, terms=[RowTerm(fn)], chunk_size=4)
    out.values[0].sum().backward()
    assert max(seen) == 4
    assert sum(seen) == 2 * N  # once in the forward, once in the backward recompute


def test_frozen_head_and_unused_outputs(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _, labels, _ = _setup(gen, rand, bias=False)
    frozen = weight.detach()
    out = head_scores(hidden, frozen, labels, chunk_size=5)
    assert out.entropy is None
    assert out.values == ()
    (g,) = torch.autograd.grad(out.logprobs.sum(), [hidden])
    want = torch.autograd.grad(head_scores(hidden, frozen, labels).logprobs.sum(), [hidden])[0]
    assert torch.allclose(g, want, atol=1e-12)


def test_float32_and_bfloat16_heads(gen) -> None:  # type: ignore[no-untyped-def]
    hidden = torch.randn(N, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen)
    labels = torch.randint(0, V, (N,), generator=gen)
    out = head_scores(hidden, weight.bfloat16(), labels, entropy=True, chunk_size=6)
    assert out.logprobs.dtype == torch.float32
    full = head_scores(hidden, weight.bfloat16(), labels, entropy=True)
    assert torch.allclose(out.logprobs, full.logprobs, atol=1e-5)
    (g,) = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), [hidden])
    assert g.dtype == torch.float32
    assert bool(torch.isfinite(g).all())
    # against an independent float64 plain-PyTorch reference of the same bf16 head: bf16 operands, the
    # logits rounded to bf16 (the head multiplies in its own dtype), the rounding passed straight through
    # for the gradient. Measured on this seed: logprobs 4.3e-7, entropies 2.4e-6 (float32 softmax at
    # |logprob| <= 12); the gradient 3.0e-3 of its largest entry (the upstream gradient is rounded to bf16
    # before it meets the bf16 weight). Tolerances are ~10x those.
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.bfloat16().double()
    exact = h64 @ w64.t()
    rounded = (h64.detach().bfloat16().double() @ w64.t()).bfloat16().double()
    log_p = torch.log_softmax(exact + (rounded - exact).detach(), dim=-1)
    want_lp = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    want_ent = -(log_p.exp() * log_p).sum(-1)
    (want_g,) = torch.autograd.grad(want_lp.sum() + want_ent.sum(), [h64])
    for got in (out, full):
        torch.testing.assert_close(got.logprobs.double(), want_lp, rtol=0, atol=5e-6)
        assert got.entropy is not None
        torch.testing.assert_close(got.entropy.double(), want_ent, rtol=0, atol=3e-5)
    torch.testing.assert_close(g.double(), want_g, rtol=0, atol=3e-2 * float(want_g.abs().max()))


def test_bad_inputs_name_the_problem(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _, labels, _ = _setup(gen, rand, bias=False)
    with pytest.raises(ValueError, match="lm_head"):
        head_scores(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match=r"\[0, 19\)"):
        head_scores(hidden, weight, labels + V)
    with pytest.raises(ValueError, match="temperature"):
        head_scores(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        head_scores(hidden, weight, labels, chunk_size=0)
    with pytest.raises(TypeError, match="RowTerm"):
        head_scores(hidden, weight, labels, terms=[lambda z, rows: z.sum(-1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="active"):
        head_scores(hidden, weight, labels, terms=[RowTerm(lambda z, r: z.sum(-1), active=torch.ones(N + 1))])
    with pytest.raises(TypeError, match="floating"):
        head_scores(hidden.long(), weight, labels)
