"""token_logprobs, sequence log-probs and masked aggregation against float64 references."""

from __future__ import annotations

import pytest
import torch

from crf_distill import aggregate, sequence_logprob, token_logprobs


def test_token_logprobs_values_and_grads(ref, gen, rand) -> None:  # type: ignore[no-untyped-def]
    logits = rand(gen, 3, 5, 11, grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    got = token_logprobs(logits, labels)
    want = ref.token_logprobs(logits, labels)
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, atol=1e-12)
    w = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    (g1,) = torch.autograd.grad((got * w).sum(), logits)
    (g2,) = torch.autograd.grad((want * w).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-12)


def test_token_logprobs_ignore_index_and_low_precision(gen, rand) -> None:  # type: ignore[no-untyped-def]
    logits = rand(gen, 2, 4, 9)
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    labels[0, 1] = -100
    lp = token_logprobs(logits, labels)
    assert lp[0, 1] == 0.0
    assert bool((lp[labels != -100] < 0).all())
    half = token_logprobs(logits.to(torch.bfloat16), labels)
    assert half.dtype == torch.float32  # reductions upcast half precision
    assert torch.allclose(half.double(), lp, atol=0.1)


def test_sequence_logprob_sums_response_tokens(gen, rand) -> None:  # type: ignore[no-untyped-def]
    lp = rand(gen, 3, 6)
    mask = (torch.rand(3, 6, generator=gen) > 0.5).long()
    assert torch.allclose(sequence_logprob(lp, mask), torch.stack([lp[i][mask[i] == 1].sum() for i in range(3)]))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "sum"])
def test_aggregate_modes_match_reference(ref, gen, rand, mode: str) -> None:  # type: ignore[no-untyped-def]
    values = rand(gen, 4, 7, grad=True)
    mask = (torch.rand(4, 7, generator=gen) > 0.4).double()
    mask[2] = 0.0  # an empty sequence is excluded from seq_mean
    mask[0, 0] = 1.0
    got = aggregate(values, mask, mode)  # type: ignore[arg-type]
    want = {"token_mean": ref.token_mean, "seq_mean": ref.seq_mean, "sum": lambda v, m: (v * m).sum()}[mode](
        values, mask
    )
    assert torch.allclose(got, want, atol=1e-12)
    (g1,) = torch.autograd.grad(got, values)
    (g2,) = torch.autograd.grad(want, values)
    assert torch.allclose(g1, g2, atol=1e-12)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "sum"])
def test_aggregate_all_zero_mask_is_zero_not_nan(gen, rand, mode: str) -> None:  # type: ignore[no-untyped-def]
    values = rand(gen, 2, 3, grad=True)
    out = aggregate(values, torch.zeros(2, 3), mode)  # type: ignore[arg-type]
    assert out.item() == 0.0
    out.backward()
    assert values.grad is not None
    assert bool((values.grad == 0).all())


def test_aggregate_ignores_inf_at_masked_positions(gen, rand) -> None:  # type: ignore[no-untyped-def]
    values = rand(gen, 2, 3, grad=True)
    poisoned = values + torch.tensor([[0.0, float("inf"), 0.0], [float("nan"), 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    out = aggregate(poisoned, mask)
    assert torch.isfinite(out)
    out.backward()
    assert values.grad is not None
    assert bool(torch.isfinite(values.grad).all())


def test_aggregate_num_items_and_errors(gen, rand) -> None:  # type: ignore[no-untyped-def]
    values = rand(gen, 2, 3)
    mask = torch.ones(2, 3)
    assert torch.allclose(aggregate(values, mask, num_items=12.0), values.sum() / 12.0)
    with pytest.raises(ValueError, match="mode"):
        aggregate(values, mask, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        aggregate(values, mask[:, :2])
    with pytest.raises(ValueError, match="num_items"):
        aggregate(values, mask, "sum", num_items=3.0)
    with pytest.raises(ValueError, match="num_items"):
        aggregate(values, mask, num_items=0.0)
    with pytest.raises(ValueError, match="negative"):
        aggregate(values, -mask)
    with pytest.raises(ValueError, match="sequence dim"):
        aggregate(values[0], mask[0], "seq_mean")
    with pytest.raises(TypeError, match="floating"):
        aggregate(torch.ones(2, 3, dtype=torch.long), mask)


def test_token_logprobs_errors(gen, rand) -> None:  # type: ignore[no-untyped-def]
    logits = rand(gen, 2, 4, 9)
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(logits, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"outside \[0, 9\)"):
        token_logprobs(logits, torch.full((2, 4), 9))
    with pytest.raises(ValueError, match="ignore_index"):
        token_logprobs(logits, torch.full((2, 4), -100), ignore_index=None)
    with pytest.raises(TypeError, match="floating"):
        token_logprobs(torch.ones(2, 4, 9, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
