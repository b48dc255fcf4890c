"""Shared helpers for crf-primerl tests: random per-sample inputs in PRIME-RL's shape."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

SampleFactory = Callable[..., dict[str, Tensor]]


def random_sample(
    seq: int = 257,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    teacher: bool = False,
    weights: bool = False,
    prompt_len: int = 17,
    spread: float = 0.25,
) -> dict[str, Tensor]:
    """One packed sample: prompt masked out, probabilities moved by ``N(0, spread)`` so both DPPO bounds bind.

    Returns ``trainer_logprobs`` (a leaf that requires grad), ``inference_logprobs``, ``advantages``
    (per-token, mixed signs, some exact zeros), ``loss_mask`` (bool) and optionally ``teacher_logprobs``
    and ``loss_weights`` (some exact zeros).
    """
    gen = torch.Generator().manual_seed(seed)
    p_mu = torch.rand(seq, generator=gen, dtype=torch.float64) * 0.96 + 0.02
    p_theta = (p_mu + spread * torch.randn(seq, generator=gen, dtype=torch.float64)).clamp(1e-3, 0.999)
    advantages = torch.randn(seq, generator=gen, dtype=torch.float64)
    advantages[torch.rand(seq, generator=gen) < 0.1] = 0.0
    loss_mask = torch.rand(seq, generator=gen) < 0.85
    loss_mask[:prompt_len] = False
    sample: dict[str, Tensor] = {
        "trainer_logprobs": p_theta.log().to(dtype).requires_grad_(True),
        "inference_logprobs": p_mu.log().to(dtype),
        "advantages": advantages.to(dtype),
        "loss_mask": loss_mask,
    }
    if teacher:
        p_teacher = (p_theta + 0.3 * torch.randn(seq, generator=gen, dtype=torch.float64)).clamp(1e-3, 0.999)
        sample["teacher_logprobs"] = p_teacher.log().to(dtype)
    if weights:
        w = torch.rand(seq, generator=gen, dtype=torch.float64) * 2
        w[torch.rand(seq, generator=gen) < 0.2] = 0.0
        sample["loss_weights"] = w.to(dtype)
    return sample


@pytest.fixture
def make_sample() -> SampleFactory:
    """Factory fixture for :func:`random_sample`."""
    return random_sample


@pytest.fixture
def prime_rl_loss() -> object:
    """PRIME-RL's own ``prime_rl.trainer.rl.loss`` module; skips only when ``prime_rl`` is not importable.

    With ``CRF_REQUIRE_PRIME_RL=1`` (the ``primerl_parity`` nox session) a missing prime-rl fails instead.
    """
    if importlib.util.find_spec("prime_rl") is None:
        if os.environ.get("CRF_REQUIRE_PRIME_RL") == "1":
            pytest.fail("CRF_REQUIRE_PRIME_RL=1 but prime_rl is not importable: install the prime-rl checkout first")
        pytest.skip("prime_rl is not importable: install a prime-rl checkout (Python 3.12) to run upstream parity")
    import prime_rl.trainer.rl.loss as upstream  # a broken prime-rl install fails here instead of skipping

    return upstream
