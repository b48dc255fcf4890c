"""Hypothesis properties: non-negativity, symmetry, identities, extreme logits, masked vocab, empty masks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crf_distill import (
    entropy_opd_loss,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    taid_loss,
    token_logprobs,
)

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def logit_pairs(draw, extreme: bool = False):  # type: ignore[no-untyped-def]
    b = draw(st.integers(1, 3))
    t = draw(st.integers(1, 4))
    v = draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    scale = 1e4 if extreme else draw(st.floats(0.1, 8.0))
    s = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * scale
    te = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * scale
    if extreme:
        s = s.clamp(-1e4, 1e4)
        te = te.clamp(-1e4, 1e4)
    mask = (torch.rand(b, t, generator=gen) > 0.3).double()
    return s, te, mask


ALPHAS = st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])
TOPK = st.sampled_from([None, 1, 2])


@SETTINGS
@given(pair=logit_pairs(), alpha=ALPHAS, top_k=TOPK)
def test_divergences_are_non_negative(pair, alpha, top_k) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = pair
    assert generalized_jsd(s, t, mask, alpha=alpha, top_k=top_k).item() >= -1e-12
    assert entropy_opd_loss(s, t, mask, h_max=0.5, top_k=top_k).item() >= -1e-12
    assert taid_loss(s, t, mask, t=0.5, objective="kl").item() >= -1e-12


@SETTINGS
@given(pair=logit_pairs(), alpha=st.floats(0.05, 0.95))
def test_jsd_is_symmetric_at_half(pair, alpha) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = pair
    # symmetry holds on a shared support (full vocabulary); the student top-k support is not symmetric
    assert torch.allclose(generalized_jsd(s, t, mask, alpha=0.5), generalized_jsd(t, s, mask, alpha=0.5), atol=1e-10)
    # swapping student and teacher mirrors alpha: gJSD_a(S, T) = gJSD_{1-a}(T, S)
    assert torch.allclose(
        generalized_jsd(s, t, mask, alpha=alpha), generalized_jsd(t, s, mask, alpha=1 - alpha), atol=1e-9
    )


@SETTINGS
@given(pair=logit_pairs(), alpha=ALPHAS, top_k=TOPK)
def test_identical_distributions_give_zero(pair, alpha, top_k) -> None:  # type: ignore[no-untyped-def]
    s, _, mask = pair
    assert abs(generalized_jsd(s, s.clone(), mask, alpha=alpha, top_k=top_k).item()) < 1e-9
    assert abs(entropy_opd_loss(s, s.clone(), mask, h_max=0.0, top_k=top_k).item()) < 1e-9
    assert abs(taid_loss(s, torch.randn_like(s), mask, t=0.0, objective="kl").item()) < 1e-9
    # a shift of the logits does not change the distribution
    assert abs(forward_kl(s, s + 3.0, mask).item()) < 1e-9


def _finite_value_and_grad(fn, s, t, mask) -> None:  # type: ignore[no-untyped-def]
    s = s.clone().requires_grad_(True)
    out = fn(s, t, mask)
    assert torch.isfinite(out)
    out.backward()
    assert s.grad is not None
    assert bool(torch.isfinite(s.grad).all())


LOSSES = [
    lambda s, t, m: generalized_jsd(s, t, m, alpha=0.5),
    lambda s, t, m: generalized_jsd(s, t, m, alpha=0.3, top_k=2),
    lambda s, t, m: forward_kl(s, t, m),
    lambda s, t, m: reverse_kl(s, t, m),
    lambda s, t, m: entropy_opd_loss(s, t, m, h_max=0.3),
    lambda s, t, m: taid_loss(s, t, m, t=0.5),
    lambda s, t, m: taid_loss(s, t, m, t=0.5, interpolation="probability", anchor_logits=0.5 * t - 1.0),
]


@SETTINGS
@given(pair=logit_pairs(extreme=True), which=st.integers(0, len(LOSSES) - 1))
def test_finite_under_extreme_logits(pair, which) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = pair
    _finite_value_and_grad(LOSSES[which], s, t, mask)


@SETTINGS
@given(pair=logit_pairs(), which=st.integers(0, len(LOSSES) - 1), data=st.data())
def test_finite_with_masked_vocab_entries(pair, which, data) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = pair
    v = s.shape[-1]
    dead = data.draw(st.lists(st.integers(0, v - 1), min_size=1, max_size=max(1, v - 2), unique=True))
    if len(dead) >= v:
        dead = dead[: v - 1]
    s, t = s.clone(), t.clone()
    s[..., dead] = float("-inf")
    t[..., dead] = float("-inf")
    _finite_value_and_grad(LOSSES[which], s, t, mask)
    labels = torch.full(s.shape[:-1], next(i for i in range(v) if i not in dead), dtype=torch.long)
    assert bool(torch.isfinite(token_logprobs(s, labels)).all())


@SETTINGS
@given(pair=logit_pairs(), which=st.integers(0, len(LOSSES) - 1))
def test_all_zero_mask_gives_zero(pair, which) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = pair
    s = s.clone().requires_grad_(True)
    out = LOSSES[which](s, t, torch.zeros_like(mask))
    assert out.item() == 0.0
    out.backward()
    assert s.grad is not None
    assert bool((s.grad == 0).all())
