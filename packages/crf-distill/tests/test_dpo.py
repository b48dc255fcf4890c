"""DPO loss types (TRL names) against float64 references written from the formulas."""

from __future__ import annotations

import pytest
import torch

from crf_distill import DPO_LOSS_TYPES, dpo_loss

CASES = [
    ("sigmoid", 0.0),
    ("sigmoid", 0.1),
    ("hinge", 0.0),
    ("ipo", 0.0),
    ("robust", 0.0),
    ("robust", 0.2),
    ("exo_pair", 1e-3),
    ("nca_pair", 0.0),
    ("sigmoid_norm", 0.0),
]


def test_every_loss_type_is_covered() -> None:
    assert {c[0] for c in CASES} == set(DPO_LOSS_TYPES)


@pytest.mark.parametrize(("loss_type", "eps"), CASES)
def test_dpo_matches_reference(check_against_ref, ref, gen, rand, loss_type: str, eps: float) -> None:  # type: ignore[no-untyped-def]
    p = 6
    lw, ll = rand(gen, p, scale=5.0, grad=True), rand(gen, p, scale=5.0, grad=True)
    rw, rl = rand(gen, p, scale=5.0), rand(gen, p, scale=5.0)
    len_w = torch.randint(1, 20, (p,), generator=gen).double()
    len_l = torch.randint(1, 20, (p,), generator=gen).double()
    beta = 0.3
    got = dpo_loss(
        lw,
        ll,
        rw,
        rl,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=eps,
        chosen_lengths=len_w,
        rejected_lengths=len_l,  # type: ignore[arg-type]
    )
    want = ref.dpo(lw, ll, rw, rl, beta, loss_type, eps, len_w, len_l)
    check_against_ref(got, want, [lw, ll])


def test_dpo_reference_is_detached_and_sigmoid_is_standard_dpo() -> None:
    lw = torch.tensor([-10.0], requires_grad=True)
    rw = torch.tensor([-12.0], requires_grad=True)
    loss = dpo_loss(lw, torch.tensor([-11.0]), rw, torch.tensor([-11.0]), beta=0.1)
    assert torch.allclose(loss, -torch.nn.functional.logsigmoid(torch.tensor(0.1 * 2.0)))
    loss.backward()
    assert rw.grad is None
    assert lw.grad is not None


def test_robust_with_zero_smoothing_equals_sigmoid(gen, rand) -> None:  # type: ignore[no-untyped-def]
    args = [rand(gen, 5) for _ in range(4)]
    assert torch.allclose(dpo_loss(*args, loss_type="robust"), dpo_loss(*args, loss_type="sigmoid"))


def test_dpo_errors(gen, rand) -> None:  # type: ignore[no-untyped-def]
    args = [rand(gen, 3) for _ in range(4)]
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(*args, loss_type="ipo")
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*args, loss_type="kto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        dpo_loss(*args, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="recommended 1e-3"):
        dpo_loss(*args, loss_type="exo_pair")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*args, beta=-0.1)
    with pytest.raises(ValueError, match=r"shape \(P,\)"):
        dpo_loss(args[0], args[1][:2], args[2], args[3])
    with pytest.raises(ValueError, match="positive"):
        dpo_loss(*args, loss_type="ipo", chosen_lengths=torch.zeros(3), rejected_lengths=torch.ones(3))
    assert dpo_loss(*(torch.zeros(0) for _ in range(4))).item() == 0.0
