"""TAID: interpolated target, loss and adaptive schedule against the paper's formulas."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from crf_distill import TAIDSchedule, taid_loss, taid_target_logprobs

B, T, V = 2, 4, 11


@pytest.mark.parametrize("interpolation", ["logit", "probability"])
@pytest.mark.parametrize("with_anchor", [False, True])
def test_target_matches_reference(logit_batch, ref, gen, rand, interpolation, with_anchor) -> None:  # type: ignore[no-untyped-def]
    s, t, _ = logit_batch(B, T, V)
    anchor = rand(gen, B, T, V) if with_anchor else None
    got = taid_target_logprobs(s, t, 0.3, anchor_logits=anchor, interpolation=interpolation)
    assert not got.requires_grad
    assert torch.allclose(got.exp(), ref.taid_target(s, t, 0.3, anchor, interpolation), atol=1e-12)


def test_target_endpoints(logit_batch) -> None:  # type: ignore[no-untyped-def]
    s, t, _ = logit_batch(B, T, V)
    assert torch.allclose(taid_target_logprobs(s, t, 1.0), torch.log_softmax(t, -1))
    assert torch.allclose(taid_target_logprobs(s, t, 0.0), torch.log_softmax(s.detach(), -1))
    # logit-space interpolation is not the probability mixture
    assert not torch.allclose(
        taid_target_logprobs(s, t, 0.5), taid_target_logprobs(s, t, 0.5, interpolation="probability")
    )


@pytest.mark.parametrize("objective", ["cross_entropy", "kl"])
@pytest.mark.parametrize("interpolation", ["logit", "probability"])
def test_loss_values_and_grads(check_against_ref, logit_batch, ref, gen, rand, objective, interpolation) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    anchor = rand(gen, B, T, V) if interpolation == "probability" else None
    got = taid_loss(s, t, mask, t=0.6, anchor_logits=anchor, interpolation=interpolation, objective=objective)
    want = ref.token_mean(ref.taid(s, t, 0.6, anchor, interpolation, objective), mask)
    check_against_ref(got, want, [s])


def test_kl_and_cross_entropy_share_gradient(logit_batch) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    (g_ce,) = torch.autograd.grad(taid_loss(s, t, mask, t=0.4), s)
    (g_kl,) = torch.autograd.grad(taid_loss(s, t, mask, t=0.4, objective="kl"), s)
    assert torch.allclose(g_ce, g_kl, atol=1e-12)
    assert taid_loss(s, t, mask, t=0.0, objective="kl").abs().item() < 1e-12  # current student: identity


def test_schedule_follows_paper_algorithm(ref) -> None:
    losses = [5.0, 4.0, 3.9, 4.2, 3.0, 2.5, 2.6, 1.0]
    total = 100
    sched = TAIDSchedule(t_start=0.2, t_end=0.9, alpha=0.05, beta=0.9)
    got = [sched.update(loss, step, total) for step, loss in enumerate(losses)]
    want = ref.taid_schedule_trace(losses, list(range(len(losses))), total, 0.2, 0.9, 0.05, 0.9)
    assert got == pytest.approx(want, abs=1e-15)
    assert got[-1] > 0.2 + 0.7 * 7 / 100  # the adaptive step moved t above its linear floor
    assert all(b >= a for a, b in itertools.pairwise(got))


def test_schedule_linear_floor_cap_and_state() -> None:
    sched = TAIDSchedule(disable_adaptive=True)
    assert sched.t == 0.4
    assert sched.update(1.0, 50, 100) == pytest.approx(0.7)
    assert sched.update(1.0, 500, 100) == 1.0
    adaptive = TAIDSchedule(t_start=0.5, t_end=0.6, alpha=1.0)
    for step in range(5):
        adaptive.update(10.0 / (step + 1), step, 1000)
    assert adaptive.t == 0.6  # capped at t_end
    clone = TAIDSchedule(t_start=0.5, t_end=0.6, alpha=1.0)
    clone.load_state_dict(adaptive.state_dict())
    assert clone.state_dict() == adaptive.state_dict()
    assert math.isinf(TAIDSchedule().prev_loss)


def test_taid_errors(logit_batch) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V)
    with pytest.raises(ValueError, match="`t`"):
        taid_loss(s, t, mask, t=1.2)
    with pytest.raises(ValueError, match="interpolation"):
        taid_loss(s, t, mask, t=0.5, interpolation="geometric")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="objective"):
        taid_loss(s, t, mask, t=0.5, objective="jsd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="anchor_logits"):
        taid_loss(s, t, mask, t=0.5, anchor_logits=t[:1])
    with pytest.raises(ValueError, match="t_start"):
        TAIDSchedule(t_start=1.0)
    with pytest.raises(ValueError, match="must not exceed"):
        TAIDSchedule(t_start=0.8, t_end=0.5)
    with pytest.raises(ValueError, match="total_steps"):
        TAIDSchedule().update(1.0, 1, 0)
    with pytest.raises(KeyError, match="momentum"):
        TAIDSchedule().load_state_dict({"t": 0.5, "prev_loss": 1.0})
