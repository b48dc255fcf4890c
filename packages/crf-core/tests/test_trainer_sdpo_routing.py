"""SRPO's sample routing and SC-SDPO's group weights: the rule against a plain reference, and the trainer's use."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crf_core.trainer.sdpo_routing import SDPO_GROUP_WEIGHTS, SDPO_ROUTINGS, route_samples


def _reference(rewards: list[float], g: int, threshold: float, routing: str, weighting: str) -> tuple[list, list]:
    """Written from the papers' words, sharing nothing with the package."""
    weights, kept = [], []
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        ok = [r == r and r >= threshold for r in group]  # NaN != NaN: never a success
        p = sum(ok) / g
        for success in ok:
            w = (p * (1 - p)) ** 0.5 if weighting == "success_variance" else 1.0
            if routing == "srpo":
                weights.append(0.0 if success else w)
                kept.append(success)
            elif routing == "failures":
                weights.append(0.0 if success else w)
                kept.append(True)
            else:
                weights.append(w)
                kept.append(True)
    return weights, kept


@pytest.mark.parametrize("routing", SDPO_ROUTINGS)
@pytest.mark.parametrize("weighting", SDPO_GROUP_WEIGHTS)
def test_routing_matches_the_reference_on_random_rewards(routing: str, weighting: str) -> None:
    rng = random.Random(7)
    for _ in range(50):
        g = rng.randint(1, 6)
        rewards = [rng.choice([0.0, 0.25, 1.0, 1.5, math.nan, rng.random() * 2]) for _ in range(g * rng.randint(1, 4))]
        threshold = rng.choice([0.5, 1.0])
        got = route_samples(rewards, g, threshold, routing, weighting)  # type: ignore[arg-type]
        weights, kept = _reference(rewards, g, threshold, routing, weighting)
        assert got.sdpo_weight == pytest.approx(weights, abs=1e-15)
        assert list(got.grpo_kept) == kept


def test_defaults_are_plain_sdpo() -> None:
    got = route_samples([1.0, 0.0, 0.0, 0.0], 2, 1.0)
    assert got.sdpo_weight == (1.0,) * 4
    assert got.grpo_kept == (True,) * 4


def test_sc_sdpo_weights_a_half_solved_group_one_half_and_a_solved_one_zero() -> None:
    got = route_samples([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], 2, 1.0, "all", "success_variance")
    assert got.sdpo_weight == (0.5, 0.5, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"routing": "SRPO"}, "sdpo_routing must be one of"),
        ({"group_weight": "sqrt"}, "sdpo_group_weight must be one of"),
        ({"num_generations": 3}, "not a positive multiple"),
        ({"num_generations": 0}, "not a positive multiple"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"rewards": [1.0, 0.0], "num_generations": 2, "threshold": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        route_samples(**args)


# ----------------------------------------------------------------------------------------------- in the trainer
def _trainer(tiny_config: Callable[..., Any], tmp_path: Path, **overrides: Any) -> Any:
    pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
    from datasets import Dataset

    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
    from crf_core.trainer import ComposerReplicationTrainer

    def half_success(completions: list[str], **kwargs: Any) -> list[float]:
        kwargs["log_extra"]("feedback", [None if i % 2 else f"wrong answer #{i}" for i in range(len(completions))])
        return [float(i % 2) for i in range(len(completions))]

    tokenizer = build_char_tokenizer()
    config = tiny_config(
        tmp_path,
        sdpo_environment_feedback_only_without_solution=False,
        **overrides,
    )
    return ComposerReplicationTrainer(
        model=build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2),
        reward_funcs=half_success,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "def add(a, b):\n    return"}] * 8),
        processing_class=tokenizer,
    )


def _batch(trainer: Any) -> dict[str, Any]:
    import torch

    trainer.model.train()
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([{"prompt": "def add(a, b):\n    return"}] * 4)


def test_sc_sdpo_scales_the_sdpo_loss_by_the_group_weight(tiny_config: Callable[..., Any], tmp_path: Path) -> None:
    """Every group is half solved (weight √¼ = ½) and only failures have a signal, so the SC-SDPO loss is ½ of
    SDPO's on the same batch (the mean still counts the same tokens)."""
    trainer = _trainer(tiny_config, tmp_path, sdpo_group_weight="success_variance")
    batch = _batch(trainer)
    assert batch["sdpo_mask"].tolist() == [0.5, 0.0, 0.5, 0.0]
    weighted = trainer.sdpo_channel_loss(trainer.model, batch)
    plain = trainer.sdpo_channel_loss(trainer.model, {**batch, "sdpo_mask": (batch["sdpo_mask"] > 0).float()})
    assert float(plain) > 0
    assert float(weighted) == pytest.approx(0.5 * float(plain), rel=1e-6)


def test_srpo_routes_failures_to_sdpo_and_successes_to_grpo(tiny_config: Callable[..., Any], tmp_path: Path) -> None:
    import torch

    trainer = _trainer(tiny_config, tmp_path, sdpo_routing="srpo")
    batch = _batch(trainer)
    # failures (even rows) keep their SDPO signal and lose their GRPO advantage; successes the reverse
    assert batch["sdpo_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]
    advantages = batch["advantages"]
    assert advantages[0] == 0
    assert advantages[2] == 0
    assert bool((advantages[1::2] > 0).all())

    plain = _trainer(tiny_config, tmp_path / "plain")
    plain_batch = _batch(plain)
    torch.testing.assert_close(plain_batch["advantages"][1::2], advantages[1::2])
    assert bool((plain_batch["advantages"][0::2] < 0).all())


def test_srpo_needs_grpo(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
    from crf_core.trainer import ComposerConfig

    with pytest.raises(ValueError, match="sdpo_routing='srpo' sends successful rollouts to GRPO"):
        ComposerConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], grpo_weight=0.0, sdpo_routing="srpo")
