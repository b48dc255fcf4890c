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
    ("bco_pair", 0.0),
    ("sppo_hard", 0.0),
    ("aot", 0.0),
    ("aot", 0.2),
    ("aot_unpaired", 0.0),
    ("aot_unpaired", 0.2),
    ("apo_zero", 0.0),
    ("apo_down", 0.0),
    ("discopop", 0.0),
    ("sft", 0.0),
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
    check_against_ref(got, want, [lw] if loss_type == "sft" else [lw, ll])  # sft ignores the rejected side


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


def test_loss_type_list_is_the_weighted_sum(gen, rand) -> None:  # type: ignore[no-untyped-def]
    args = [rand(gen, 4, scale=3.0) for _ in range(4)]
    lengths = {"chosen_lengths": torch.full((4,), 3.0), "rejected_lengths": torch.full((4,), 5.0)}
    parts = {t: dpo_loss(*args, loss_type=t, **lengths) for t in ("sigmoid", "ipo", "sft")}  # type: ignore[arg-type]
    got = dpo_loss(*args, loss_type=["sigmoid", "ipo", "sft"], loss_weights=[0.5, 2.0, -1.0], **lengths)
    assert torch.allclose(got, 0.5 * parts["sigmoid"] + 2.0 * parts["ipo"] - parts["sft"], atol=1e-12)
    assert torch.allclose(dpo_loss(*args, loss_type=["hinge", "hinge"]), 2 * dpo_loss(*args, loss_type="hinge"))
    per_pair = dpo_loss(*args, loss_type=["bco_pair", "apo_down"], loss_weights=[1.0, 3.0], reduction="none")
    assert per_pair.shape == (4,)
    assert torch.allclose(per_pair.mean(), dpo_loss(*args, loss_type=["bco_pair", "apo_down"], loss_weights=[1, 3]))


def test_new_options_errors(gen, rand) -> None:  # type: ignore[no-untyped-def]
    args = [rand(gen, 3) for _ in range(4)]
    with pytest.raises(ValueError, match="2 entries but `loss_type` names 3"):
        dpo_loss(*args, loss_type=["sigmoid", "hinge", "bco_pair"], loss_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        dpo_loss(*args, loss_type=[])
    with pytest.raises(ValueError, match="got 'kto'"):
        dpo_loss(*args, loss_type=["sigmoid", "kto"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"loss_weights\[1\]"):
        dpo_loss(*args, loss_type=["sigmoid", "hinge"], loss_weights=[1.0, float("nan")])
    with pytest.raises(TypeError, match="one per loss type"):
        dpo_loss(*args, loss_type=["sigmoid"], loss_weights=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="discopop_tau"):
        dpo_loss(*args, loss_type="discopop", discopop_tau=0.0)
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(*args, loss_type="sft")
    with pytest.raises(ValueError, match="recommended 1e-3"):
        dpo_loss(*args, loss_type=["sigmoid", "exo_pair"])
    with pytest.raises(ValueError, match="reduction"):
        dpo_loss(*args, reduction="max")  # type: ignore[arg-type]
    for i in range(4):
        for bad in (float("nan"), float("-inf")):
            broken = [a.clone() for a in args]
            broken[i][1] = bad
            with pytest.raises(ValueError, match="NaN or inf"):
                dpo_loss(*broken, loss_type="aot")
    with pytest.raises(ValueError, match=r"shape \(P,\)"):
        dpo_loss(args[0], args[1], args[2][:2], args[3], loss_type="sppo_hard")
    with pytest.raises(ValueError, match="dimension"):
        dpo_loss(args[0].reshape(3, 1), args[1], args[2], args[3], loss_type="apo_zero")
    for t in DPO_LOSS_TYPES:  # zero pairs: a finite 0 for every type
        z = torch.zeros(0, dtype=torch.float64)
        out = dpo_loss(z, z, z, z, loss_type=t, label_smoothing=1e-3, chosen_lengths=z, rejected_lengths=z)  # type: ignore[arg-type]
        assert out.item() == 0.0
