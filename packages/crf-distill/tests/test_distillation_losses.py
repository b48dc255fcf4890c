"""Seed-named SimPO tests (failure mode 4) plus SimPO against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from crf_distill import avg_sequence_logprob, simpo_loss
from crf_distill.simpo import avg_sequence_logprob as avg_from_simpo_module


def test_avg_sequence_logprob() -> None:
    logprobs = torch.tensor([[-9.0, -1.0, -2.0, -3.0, -50.0], [-7.0, -7.0, -0.5, -1.5, -4.0]])
    # prompt tokens (first) and padding (last of row 0) are masked out
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    got = avg_sequence_logprob(logprobs, mask)
    assert torch.allclose(got, torch.tensor([-2.0, -2.0]))
    # the divisor is the response length, not the padded length T
    assert not torch.allclose(got, (logprobs * mask).sum(-1) / logprobs.shape[-1])
    # an empty response gives 0, not NaN
    assert avg_sequence_logprob(logprobs, torch.zeros_like(mask)).tolist() == [0.0, 0.0]
    assert avg_from_simpo_module is avg_sequence_logprob


def test_simpo_loss_returns_scalar() -> None:
    chosen = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    rejected = torch.tensor([-1.5, -1.0, -3.0])
    loss = simpo_loss(chosen, rejected, beta=2.0, gamma=1.0)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()
    assert chosen.grad is not None
    assert bool((chosen.grad < 0).all())  # raising a chosen log-prob lowers the loss


def test_simpo_loss_lower_for_better_separation() -> None:
    rejected = torch.tensor([-2.0, -2.0])
    weak = simpo_loss(torch.tensor([-1.9, -1.8]), rejected, beta=2.0, gamma=1.0)
    strong = simpo_loss(torch.tensor([-0.5, -0.2]), rejected, beta=2.0, gamma=1.0)
    reversed_ = simpo_loss(torch.tensor([-3.0, -3.5]), rejected, beta=2.0, gamma=1.0)
    assert strong < weak < reversed_


@pytest.mark.parametrize(("eps", "loss_type"), [(0.0, "sigmoid"), (0.2, "sigmoid"), (0.0, "hinge")])
def test_simpo_matches_reference(check_against_ref, ref, gen, rand, eps: float, loss_type: str) -> None:  # type: ignore[no-untyped-def]
    lp_w = rand(gen, 4, 7, scale=1.0, grad=True)
    lp_l = rand(gen, 4, 9, scale=1.0, grad=True)
    m_w = (torch.rand(4, 7, generator=gen) > 0.3).double()
    m_l = (torch.rand(4, 9, generator=gen) > 0.3).double()
    m_w[:, 0], m_l[:, 0] = 1.0, 1.0
    got = simpo_loss(
        avg_sequence_logprob(lp_w, m_w),
        avg_sequence_logprob(lp_l, m_l),
        beta=2.5,
        gamma=0.7,
        label_smoothing=eps,
        loss_type=loss_type,  # type: ignore[arg-type]
    )
    want = ref.simpo((lp_w * m_w).sum(-1) / m_w.sum(-1), (lp_l * m_l).sum(-1) / m_l.sum(-1), 2.5, 0.7, eps, loss_type)
    check_against_ref(got, want, [lp_w, lp_l], atol=1e-12)


def test_simpo_gamma_is_absolute_margin() -> None:
    c, r = torch.tensor([-1.0]), torch.tensor([-1.0])
    # equal rewards: loss = -log sigmoid(-gamma), independent of beta
    for beta in (0.5, 2.0, 10.0):
        assert torch.allclose(
            simpo_loss(c, r, beta=beta, gamma=1.3), -torch.nn.functional.logsigmoid(torch.tensor(-1.3))
        )


def test_simpo_reduction_and_errors() -> None:
    c, r = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    per_pair = simpo_loss(c, r, beta=2.0, gamma=0.5, reduction="none")
    assert per_pair.shape == (2,)
    assert torch.allclose(simpo_loss(c, r, beta=2.0, gamma=0.5, reduction="sum"), per_pair.sum())
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(c, r, beta=0.0, gamma=0.5)
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(c, r, beta=2.0, gamma=-1.0)
    with pytest.raises(ValueError, match="shape"):
        simpo_loss(c, r[:1], beta=2.0, gamma=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        simpo_loss(c, r, beta=2.0, gamma=0.5, label_smoothing=0.5)
    with pytest.raises(TypeError, match="missing"):
        simpo_loss(c, r)  # type: ignore[call-arg]  # beta and gamma are explicit on purpose
