"""Chunked fused-linear paths against the unchunked implementations (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from crf_distill import (
    ChunkTerm,
    aggregate,
    chunked_distillation_loss,
    chunked_fused_loss,
    chunked_token_logprobs,
    entropy_opd_per_token,
    generalized_jsd_per_token,
    is_ratio_weight,
    taid_per_token,
    token_logprobs,
)

N, H, V = 29, 6, 23


def _head(gen, rand, bias: bool = True):  # type: ignore[no-untyped-def]
    hidden = rand(gen, N, H, scale=1.0, grad=True)
    weight = rand(gen, V, H, scale=1.0, grad=True)
    b = rand(gen, V, scale=1.0, grad=True) if bias else None
    return hidden, weight, b


def _params(*xs):  # type: ignore[no-untyped-def]
    return [x for x in xs if x is not None]


def _assert_grads(out_a, out_b, params) -> None:  # type: ignore[no-untyped-def]
    ga = torch.autograd.grad(out_a, params, retain_graph=True)
    gb = torch.autograd.grad(out_b, params, retain_graph=True)
    for a, b in zip(ga, gb, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_token_logprobs_matches_unchunked(gen, rand, chunk: int, bias: bool) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, b = _head(gen, rand, bias)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[3] = -100
    got = chunked_token_logprobs(hidden, weight, labels, bias=b, chunk_size=chunk)
    logits = hidden @ weight.t() + (b if b is not None else 0.0)
    want = token_logprobs(logits, labels)
    assert torch.allclose(got, want, atol=1e-12)
    assert got[3] == 0.0
    w = torch.randn(N, generator=gen, dtype=torch.float64)
    _assert_grads((got * w).sum(), (want * w).sum(), _params(hidden, weight, b))


def test_chunked_token_logprobs_float32_hidden(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _ = _head(gen, rand, bias=False)
    h32 = hidden.detach().float().requires_grad_(True)
    w32 = weight.detach().float().requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=gen)
    got = chunked_token_logprobs(h32, w32, labels, chunk_size=5)
    assert got.dtype == torch.float32
    want = token_logprobs(h32 @ w32.t(), labels)
    assert torch.allclose(got, want, atol=1e-5)
    gh, gw = torch.autograd.grad(got.sum(), (h32, w32))
    assert gh.dtype == torch.float32
    assert gw.dtype == torch.float32
    # against an independent float64 plain-PyTorch reference on the same (float32-rounded) inputs.
    # Measured on this seed: values 1.0e-6 (|logprob| <= 12), gradients 1.1e-6; tolerances ~10x those.
    h64 = h32.detach().double().requires_grad_(True)
    w64 = w32.detach().double().requires_grad_(True)
    want64 = torch.log_softmax(h64 @ w64.t(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.double(), want64, rtol=0, atol=1e-5)
    for a, b in zip((gh, gw), torch.autograd.grad(want64.sum(), (h64, w64)), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


PER_TOKEN = {
    "jsd": lambda s, t, rows: generalized_jsd_per_token(s, t, alpha=0.5),
    "fkl_topk": lambda s, t, rows: generalized_jsd_per_token(s, t, alpha=0.0, top_k=6),
    "rkl": lambda s, t, rows: generalized_jsd_per_token(s, t, alpha=1.0),
    "taid": lambda s, t, rows: taid_per_token(s, t, t=0.4),
    "eopd": lambda s, t, rows: entropy_opd_per_token(s, t, h_max=2.5),
}


@pytest.mark.parametrize("name", sorted(PER_TOKEN))
@pytest.mark.parametrize("teacher_as", ["hidden", "logits"])
def test_chunked_distillation_matches_unchunked(gen, rand, name: str, teacher_as: str) -> None:  # type: ignore[no-untyped-def]
    fn = PER_TOKEN[name]
    hidden, weight, b = _head(gen, rand)
    t_hidden = rand(gen, N, H, scale=1.0)
    t_weight = rand(gen, V, H, scale=1.0)
    mask = (torch.rand(N, generator=gen) > 0.3).double()
    mask[:8] = 0.0  # a whole chunk without tokens is skipped
    teacher_logits = t_hidden @ t_weight.t()
    kwargs = (
        {"teacher_hidden": t_hidden, "teacher_weight": t_weight}
        if teacher_as == "hidden"
        else {"teacher_logits": teacher_logits}
    )
    got = chunked_distillation_loss(hidden, weight, fn, mask, bias=b, chunk_size=4, **kwargs)
    want = aggregate(fn(hidden @ weight.t() + b, teacher_logits, torch.arange(N)), mask, "token_mean")
    assert torch.allclose(got, want, atol=1e-12)
    _assert_grads(3.0 * got, 3.0 * want, [hidden, weight, b])


def test_chunked_distillation_row_extras_and_num_items(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _ = _head(gen, rand, bias=False)
    teacher = rand(gen, N, V)
    labels = torch.randint(0, V, (N,), generator=gen)
    old = torch.randn(N, generator=gen, dtype=torch.float64) - 3.0
    mask = torch.ones(N, dtype=torch.float64)

    def clipped(s, t, rows):  # type: ignore[no-untyped-def]
        lp = token_logprobs(s, labels[rows], ignore_index=None)
        return generalized_jsd_per_token(s, t, alpha=0.5) * is_ratio_weight(lp, old[rows], 2.0)

    got = chunked_distillation_loss(hidden, weight, clipped, mask, teacher_logits=teacher, chunk_size=6, num_items=40.0)
    want = aggregate(clipped(hidden @ weight.t(), teacher, torch.arange(N)), mask, "token_mean", num_items=40.0)
    assert torch.allclose(got, want, atol=1e-12)
    _assert_grads(got, want, [hidden, weight])


def test_chunked_distillation_zero_mask_and_frozen_weight(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _ = _head(gen, rand, bias=False)
    teacher = rand(gen, N, V)
    out = chunked_distillation_loss(hidden, weight, PER_TOKEN["jsd"], torch.zeros(N), teacher_logits=teacher)
    assert out.item() == 0.0
    out.backward()
    assert hidden.grad is not None
    assert bool((hidden.grad == 0).all())
    frozen = weight.detach()
    loss = chunked_distillation_loss(hidden, frozen, PER_TOKEN["jsd"], torch.ones(N), teacher_logits=teacher)
    (gh,) = torch.autograd.grad(loss, hidden)
    assert bool((gh != 0).any())


def test_chunked_errors(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _ = _head(gen, rand, bias=False)
    labels = torch.randint(0, V, (N,), generator=gen)
    with pytest.raises(ValueError, match="lm_head"):
        chunked_token_logprobs(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"\[0, 23\)"):
        chunked_token_logprobs(hidden, weight, labels + V)
    with pytest.raises(ValueError, match="exactly one"):
        chunked_distillation_loss(hidden, weight, PER_TOKEN["jsd"], torch.ones(N))
    with pytest.raises(ValueError, match="teacher_weight"):
        chunked_distillation_loss(hidden, weight, PER_TOKEN["jsd"], torch.ones(N), teacher_hidden=hidden)
    with pytest.raises(ValueError, match="teacher_logits"):
        chunked_distillation_loss(hidden, weight, PER_TOKEN["jsd"], torch.ones(N), teacher_logits=torch.ones(N, V + 1))


def test_chunked_fused_loss_shares_one_pass_between_terms(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, b = _head(gen, rand)
    teacher = rand(gen, N, V)
    labels = torch.randint(0, V, (N,), generator=gen)
    ce_mask = (torch.rand(N, generator=gen) > 0.2).double()
    kd_mask = torch.zeros(N, dtype=torch.float64)
    kd_mask[10:20] = 1.0  # the distillation term only covers some rows: the teacher is only needed there
    calls: list[int] = []

    def teacher_fn(rows):  # type: ignore[no-untyped-def]
        calls.extend(rows.tolist())
        return teacher[rows]

    terms = [
        ChunkTerm(lambda s, t, rows: -token_logprobs(s, labels[rows]), ce_mask / ce_mask.sum(), 0.5, False),
        ChunkTerm(PER_TOKEN["jsd"], kd_mask / kd_mask.sum(), 2.0, True),
    ]
    total, values = chunked_fused_loss(hidden, weight, terms, bias=b, teacher_fn=teacher_fn, chunk_size=6)
    assert sorted(calls) == list(range(10, 20))
    logits = hidden @ weight.t() + b
    ce = aggregate(-token_logprobs(logits, labels), ce_mask, "token_mean")
    kd = aggregate(generalized_jsd_per_token(logits, teacher, alpha=0.5), kd_mask, "token_mean")
    assert torch.allclose(values[0], ce, atol=1e-12)
    assert torch.allclose(values[1], kd, atol=1e-12)
    assert torch.allclose(total, 0.5 * ce + 2.0 * kd, atol=1e-12)
    calls.clear()
    _assert_grads(total, 0.5 * ce + 2.0 * kd, [hidden, weight, b])
    assert not calls  # the total's gradient was taken in the forward pass: nothing is recomputed
    # each term keeps its own gradient (recomputed on demand)
    _assert_grads(values[0], ce, [hidden, weight, b])
    _assert_grads(values[1], kd, [hidden, weight, b])
    assert sorted(calls) == list(range(10, 20))
    with pytest.raises(ValueError, match="needs the teacher"):
        chunked_fused_loss(hidden, weight, terms)
    with pytest.raises(ValueError, match="only one teacher"):
        chunked_fused_loss(hidden, weight, terms, teacher_fn=teacher_fn, teacher_logits=teacher)
