"""Entropy-aware OPD against the float64 reference (hard/soft gates, additive and convex forms)."""

from __future__ import annotations

import pytest
import torch

from crf_distill import entropy_opd_loss, reverse_kl, token_entropy

B, T, V = 3, 6, 9


def _inputs(logit_batch):  # type: ignore[no-untyped-def]
    s, t, mask = logit_batch(B, T, V, drop=0.2)
    # mixed teacher sharpness so that some tokens are above and some below the threshold
    return s, t * torch.linspace(0.1, 3.0, T, dtype=torch.float64)[None, :, None], mask


@pytest.mark.parametrize(
    ("gate", "combine", "top_k"),
    [
        ("hard", "add", None),
        ("sigmoid", "add", None),
        ("linear", "add", None),
        ("linear", "convex", None),
        ("hard", "add", 4),
    ],
)
def test_entropy_opd_matches_reference(check_against_ref, logit_batch, ref, gate, combine, top_k) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = _inputs(logit_batch)
    h_max = 1.2
    got = entropy_opd_loss(
        s, t, mask, h_max=h_max, gate=gate, combine=combine, top_k=top_k, forward_weight=0.7, sharpness=3.0
    )
    want = ref.token_mean(ref.eopd(s, t, h_max, gate, 3.0, 0.7, combine, top_k), mask)
    check_against_ref(got, want, [s])


def test_hard_gate_splits_tokens(logit_batch, ref) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = _inputs(logit_batch)
    h = ref.entropy(ref.softmax(t))
    h_max = float(h.median())
    assert bool((h > h_max).any())
    assert bool((h <= h_max).any())
    # above every entropy the loss is pure reverse KL (on-policy distillation)
    assert torch.allclose(entropy_opd_loss(s, t, mask, h_max=float(h.max()) + 1), reverse_kl(s, t, mask))
    assert entropy_opd_loss(s, t, mask, h_max=h_max) > reverse_kl(s, t, mask)
    assert torch.allclose(token_entropy(torch.log_softmax(t, -1)), h)


def test_entropy_opd_errors(logit_batch) -> None:  # type: ignore[no-untyped-def]
    s, t, mask = _inputs(logit_batch)
    with pytest.raises(ValueError, match="h_max"):
        entropy_opd_loss(s, t, mask, h_max=-1.0)
    with pytest.raises(ValueError, match="h_max"):
        entropy_opd_loss(s, t, mask, h_max=0.0, gate="linear")
    with pytest.raises(ValueError, match="gate"):
        entropy_opd_loss(s, t, mask, h_max=1.0, gate="soft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="combine"):
        entropy_opd_loss(s, t, mask, h_max=1.0, combine="mix")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="forward_weight"):
        entropy_opd_loss(s, t, mask, h_max=1.0, forward_weight=-1.0)
