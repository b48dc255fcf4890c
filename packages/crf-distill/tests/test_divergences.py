"""Forward/reverse KL and SDPO's generalised JSD (full vocab and top-k + tail) against float64 references."""

from __future__ import annotations

import pytest
import torch

from crf_distill import forward_kl, generalized_jsd, reverse_kl, token_logprobs

B, T, V = 3, 5, 13


@pytest.mark.parametrize("top_k", [None, 4])
@pytest.mark.parametrize("add_tail", [True, False])
def test_forward_and_reverse_kl(check_against_ref, logit_batch, ref, top_k, add_tail) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    ps, pt = ref.support(s, t, top_k, add_tail)
    check_against_ref(forward_kl(s, t, mask, top_k=top_k, add_tail=add_tail), ref.token_mean(ref.kl(pt, ps), mask), [s])
    ps, pt = ref.support(s, t, top_k, add_tail)
    check_against_ref(reverse_kl(s, t, mask, top_k=top_k, add_tail=add_tail), ref.token_mean(ref.kl(ps, pt), mask), [s])


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize(("top_k", "add_tail"), [(None, True), (5, True), (5, False)])
def test_generalized_jsd_matches_reference(check_against_ref, logit_batch, ref, alpha, top_k, add_tail) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    got = generalized_jsd(s, t, mask, alpha=alpha, top_k=top_k, add_tail=add_tail)
    want = ref.token_mean(ref.gjsd(s, t, alpha, top_k, add_tail), mask)
    check_against_ref(got, want, [s])


def test_alpha_endpoints_are_forward_and_reverse_kl(logit_batch) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    assert torch.equal(generalized_jsd(s, t, mask, alpha=0.0), forward_kl(s, t, mask))
    assert torch.equal(generalized_jsd(s, t, mask, alpha=1.0), reverse_kl(s, t, mask))
    assert not torch.allclose(forward_kl(s, t, mask), reverse_kl(s, t, mask))


def test_teacher_gets_no_gradient(logit_batch) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    t.requires_grad_(True)
    generalized_jsd(s, t, mask, alpha=0.5).backward()
    assert t.grad is None
    assert s.grad is not None


def test_sample_mask_and_seq_mean(check_against_ref, logit_batch, ref) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    sample = torch.tensor([1.0, 0.0, 1.0])
    got = generalized_jsd(s, t, mask, alpha=0.5, sample_mask=sample)
    check_against_ref(got, ref.token_mean(ref.gjsd(s, t, 0.5), mask * sample[:, None]), [s])
    got = generalized_jsd(s, t, mask, alpha=0.5, aggregation="seq_mean")
    check_against_ref(got, ref.seq_mean(ref.gjsd(s, t, 0.5), mask), [s])


def test_is_clip_weights_tokens_by_detached_truncated_ratio(check_against_ref, logit_batch, ref, gen) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    labels = torch.randint(0, V, (B, T), generator=gen)
    old = ref.token_logprobs(s.detach(), labels) + torch.randn(B, T, generator=gen, dtype=torch.float64)
    got = generalized_jsd(s, t, mask, alpha=0.5, is_clip=1.5, labels=labels, old_logprobs=old)
    ratio = torch.clamp(torch.exp(ref.token_logprobs(s, labels).detach() - old), max=1.5)
    assert bool((ratio < 1.5).any())
    assert bool((ratio == 1.5).any())
    check_against_ref(got, ref.token_mean(ref.gjsd(s, t, 0.5) * ratio, mask), [s])
    # on-policy (old == current) the weight is exactly 1
    on_policy = generalized_jsd(
        s, t, mask, alpha=0.5, is_clip=2.0, labels=labels, old_logprobs=token_logprobs(s, labels).detach()
    )
    assert torch.allclose(on_policy, generalized_jsd(s, t, mask, alpha=0.5))


def test_divergence_errors(logit_batch) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    with pytest.raises(ValueError, match="same shape"):
        generalized_jsd(s, t[..., :-1], mask)
    with pytest.raises(ValueError, match="alpha"):
        generalized_jsd(s, t, mask, alpha=1.5)
    with pytest.raises(ValueError, match="top_k"):
        generalized_jsd(s, t, mask, top_k=V + 1)
    with pytest.raises(ValueError, match="is_clip"):
        generalized_jsd(s, t, mask, is_clip=2.0)
    with pytest.raises(ValueError, match="only used with `is_clip`"):
        generalized_jsd(s, t, mask, labels=torch.zeros(B, T, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        forward_kl(s, t, mask[:, :2])
    with pytest.raises(TypeError, match="floating"):
        reverse_kl(s, t.long(), mask)
