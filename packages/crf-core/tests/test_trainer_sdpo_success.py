"""SDPO success on the weighted reward GRPO uses, the one-time warning when it never varies, ``sdpo_jsd`` 0.0 (not
NaN) without a teacher signal, and the start-up line naming each channel and the bytes of its model copy."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from crf_core.trainer.success import SuccessMonitor, effective_success_threshold

PROMPT = "def add(a, b):\n    return"
LOGGER = "crf_core.trainer.trainer"


# ----------------------------------------------------------------------------------------------- the rule alone
def test_effective_threshold_absolute_is_the_value_and_relative_scales_by_the_weights() -> None:
    assert effective_success_threshold(1.0, "absolute", [1.0, 0.5]) == 1.0
    assert effective_success_threshold(1.0, "relative", [1.0, 0.5]) == 1.5
    assert effective_success_threshold(0.5, "relative", [2.0]) == 1.0
    with pytest.raises(ValueError, match=r"sum\(reward_weights\), which is 0.0.*use positive reward weights"):
        effective_success_threshold(0.5, "relative", [1.0, -1.0])
    with pytest.raises(ValueError, match="sdpo_success_threshold_mode must be one of"):
        effective_success_threshold(0.5, "percent", [1.0])


def _feed(monitor: SuccessMonitor, batches: Sequence[Sequence[float]]) -> list[str]:
    return [m for m in (monitor.observe(b) for b in batches) if m is not None]


def test_monitor_warns_once_when_no_rollout_succeeds_for_patience_batches() -> None:
    monitor = SuccessMonitor(1.0, "sdpo_success_reward_threshold=1 (absolute)", patience=3)
    assert _feed(monitor, [[0.5, 0.25]] * 2) == []
    warnings = _feed(monitor, [[0.5, 0.0], [0.5, math.nan]] + [[0.5, 0.5]] * 10)
    assert len(warnings) == 1
    assert "no rollout reached the success threshold in the last 3 generation batches" in warnings[0]
    assert ">= 1," in warnings[0]
    assert "sdpo_success_reward_threshold=1 (absolute)" in warnings[0]
    assert "observed weighted rewards [0, 0.5]" in warnings[0]
    assert "Fix: lower sdpo_success_reward_threshold" in warnings[0]


def test_monitor_warns_once_when_every_rollout_succeeds() -> None:
    monitor = SuccessMonitor(1.0, "sdpo_success_reward_threshold=1 (absolute)", patience=2)
    warnings = _feed(monitor, [[1.1, 1.05], [1.12, 1.08]] * 5)
    assert len(warnings) == 1
    assert "every rollout reached the success threshold" in warnings[0]
    assert "observed weighted rewards [1.05, 1.12]" in warnings[0]
    assert "Fix: raise sdpo_success_reward_threshold" in warnings[0]


def test_monitor_is_silent_on_mixed_batches_and_a_mixed_batch_resets_the_count() -> None:
    monitor = SuccessMonitor(1.0, "x", patience=3)
    assert _feed(monitor, [[1.0, 0.0]] * 20) == []
    assert _feed(monitor, [[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]] * 5) == []
    assert _feed(monitor, [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]] * 5) == []
    assert _feed(SuccessMonitor(1.0, "x", patience=0), [[0.0, 0.0]] * 50) == []  # 0 never warns
    both = SuccessMonitor(1.0, "x", patience=2)  # each kind warns once
    assert len(_feed(both, [[0.0]] * 3 + [[2.0]] * 3 + [[0.0]] * 3)) == 2


# ----------------------------------------------------------------------------------------------- in the trainer
def _reward(name: str, values: Sequence[float]) -> Callable[..., list[float]]:
    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(values[i % len(values)]) for i in range(len(completions))]

    reward.__name__ = name
    return reward


def _trainer(
    tiny_config: Callable[..., Any],
    tmp_path: Path,
    rewards: Sequence[Sequence[float]],
    model: Any = None,
    **overrides: Any,
) -> Any:
    pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
    from datasets import Dataset

    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
    from crf_core.trainer import ComposerReplicationTrainer

    tokenizer = build_char_tokenizer()
    config = tiny_config(
        tmp_path,
        **overrides,
    )
    return ComposerReplicationTrainer(
        model=model
        if model is not None
        else build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2),
        reward_funcs=[_reward(f"r{i}", values) for i, values in enumerate(rewards)],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 8),
        processing_class=tokenizer,
    )


def _batch(trainer: Any) -> dict[str, Any]:
    import torch

    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer sets inside its loop
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([{"prompt": PROMPT}] * 4)


def _success_fraction(trainer: Any) -> float:
    return float(trainer._metrics["train"]["self_distillation/success_sample_fraction"][-1])


# Two reward functions weighted [1, 0.5]: weighted rewards 1.5, 1.0, 0.5, 0.0 (raw sums 2, 1, 1, 0).
WEIGHTED = ([1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0])


@pytest.mark.parametrize(
    ("overrides", "fraction", "mask"),
    [
        ({}, 0.5, [1.0, 1.0, 0.0, 0.0]),  # absolute 1.0 on the weighted reward: rows 0 and 1
        ({"sdpo_success_threshold_mode": "relative"}, 0.25, [0.0, 1.0, 0.0, 0.0]),  # ≥ 1.0 × 1.5: row 0 only
        ({"sdpo_success_threshold_mode": "relative", "sdpo_success_reward_threshold": 0.5}, 0.5, [1.0, 1.0, 0.0, 0.0]),
        ({"success_reward_threshold": 1.5}, 0.25, [0.0, 1.0, 0.0, 0.0]),  # TRL's name, TRL's meaning
        # SRPO routes on the same effective threshold: row 0 (the one success) leaves SDPO, row 1 keeps its demo
        ({"sdpo_success_threshold_mode": "relative", "sdpo_routing": "srpo"}, 0.25, [0.0, 1.0, 0.0, 0.0]),
        ({"sdpo_routing": "srpo"}, 0.5, [0.0, 0.0, 0.0, 0.0]),  # absolute 1.0: rows 0 and 1 succeed, go to GRPO
    ],
)
def test_success_is_judged_on_the_weighted_reward(
    tiny_config: Callable[..., Any], tmp_path: Path, overrides: dict[str, Any], fraction: float, mask: list[float]
) -> None:
    trainer = _trainer(tiny_config, tmp_path, WEIGHTED, reward_weights=[1.0, 0.5], **overrides)
    batch = _batch(trainer)
    assert _success_fraction(trainer) == fraction
    # a rollout has a teacher signal when a *peer* of its group succeeded (no feedback here)
    assert batch["sdpo_mask"].tolist() == mask


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_rewards_near_1_1_all_succeed_at_the_default_and_the_warning_fires_once(
    tiny_config: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = _trainer(tiny_config, tmp_path, [[1.1, 1.05, 1.12, 1.08]], sdpo_success_warning_steps=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(4):
            _batch(trainer)
    assert _success_fraction(trainer) == 1.0
    found = [m for m in _warnings(caplog) if "success threshold" in m]
    assert len(found) == 1, found
    assert "every rollout reached the success threshold in the last 2 generation batches" in found[0]
    assert "sdpo_success_reward_threshold=1 (absolute)" in found[0]
    assert "observed weighted rewards [1.05, 1.12]" in found[0]


def test_rewards_near_1_1_split_at_threshold_1_1_and_nothing_is_warned(
    tiny_config: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = _trainer(
        tiny_config,
        tmp_path,
        [[1.1, 1.05, 1.12, 1.08]],
        sdpo_success_reward_threshold=1.1,
        sdpo_success_warning_steps=2,
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(4):
            _batch(trainer)
    assert _success_fraction(trainer) == 0.5
    assert not [m for m in _warnings(caplog) if "success threshold" in m]


def test_weights_1_and_half_none_succeed_and_the_warning_names_threshold_and_range(
    tiny_config: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: reward_weights=[1, 0.5], the first reward 0 and the second 1 -> weighted 0.5 < 1."""
    trainer = _trainer(tiny_config, tmp_path, [[0.0], [1.0]], reward_weights=[1.0, 0.5], sdpo_success_warning_steps=3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(5):
            _batch(trainer)
    assert _success_fraction(trainer) == 0.0
    found = [m for m in _warnings(caplog) if "success threshold" in m]
    assert len(found) == 1, found
    assert "no rollout reached the success threshold in the last 3 generation batches" in found[0]
    assert "observed weighted rewards [0.5, 0.5]" in found[0]
    assert "sdpo_success_threshold_mode='relative'" in found[0]
    relative = _trainer(
        tiny_config,
        tmp_path / "rel",
        [[0.0], [1.0]],
        reward_weights=[1.0, 0.5],
        sdpo_success_reward_threshold=0.3,
        sdpo_success_threshold_mode="relative",
    )
    _batch(relative)
    assert _success_fraction(relative) == 1.0  # 0.5 ≥ 0.3 × 1.5


@pytest.mark.parametrize("grpo_weight", [1.0, 0.0])
def test_a_step_without_teacher_signal_logs_zero_and_a_finite_loss(
    tiny_config: Callable[..., Any], tmp_path: Path, grpo_weight: float
) -> None:
    trainer = _trainer(
        tiny_config, tmp_path, [[0.0]], grpo_weight=grpo_weight
    )  # nobody succeeds, no feedback: no signal
    batch = _batch(trainer)
    assert batch["sdpo_mask"].sum() == 0
    loss = trainer.compute_loss(trainer.model, batch)
    assert math.isfinite(float(loss))
    loss.backward()  # still connected to the parameters
    logged = trainer._metrics["train"]["sdpo_jsd"]
    assert logged == [0.0]

    solved = _trainer(tiny_config, tmp_path / "solved", [[1.0]], grpo_weight=grpo_weight)  # every peer a demonstration
    solved_batch = _batch(solved)
    assert bool(solved_batch["sdpo_mask"].all())
    assert math.isfinite(float(solved.compute_loss(solved.model, solved_batch)))
    assert all(v > 0 and math.isfinite(v) for v in solved._metrics["train"]["sdpo_jsd"])


# ----------------------------------------------------------------------------------------------- start-up line
def _startup(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("crf channels:")]


def _bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_startup_line_names_each_channel_its_weight_and_the_ema_and_reference_bytes(
    tiny_config: Callable[..., Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm

    saved = tmp_path / "policy"  # TRL loads its reference model (beta != 0) from the policy's path
    build_tiny_causal_lm(build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=2).save_pretrained(saved)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer = _trainer(tiny_config, tmp_path, [[1.0]], model=str(saved), beta=0.04, sdpo_weight=0.5)
    lines = _startup(caplog)
    assert len(lines) == 1, lines
    ema, ref = _bytes(trainer.sdpo_teacher.module), _bytes(trainer.ref_model)
    assert ema == _bytes(trainer.model)  # a full copy of the policy
    assert ema > 0
    assert f"grpo ×1 (reference model, beta=0.04: {ref} B (" in lines[0]
    assert f"sdpo_jsd ×0.5 (EMA teacher: {ema} B (" in lines[0]
    assert "off trace_replay_dpo" in lines[0]
    assert f"extra model memory {ema + ref} B" in lines[0]
    assert [(c.name, c.weight, c.copy_bytes) for c in trainer.channel_costs] == [
        ("grpo", 1.0, ref),
        ("sdpo_jsd", 0.5, ema),
    ]
    assert "crf channels" not in capsys.readouterr().out  # logged, not printed


def test_startup_line_counts_the_actual_dtype_and_names_copy_free_channels(
    tiny_config: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm

    half = build_tiny_causal_lm(build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=2).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer = _trainer(tiny_config, tmp_path, [[1.0]], model=half)
    assert trainer.sdpo_teacher.module.dtype == torch.bfloat16
    numel = sum(p.numel() for p in half.parameters())
    assert f"sdpo_jsd ×1 (EMA teacher: {2 * numel} B (" in _startup(caplog)[0]  # bf16: 2 bytes a parameter
    assert "grpo ×1 (beta=0, no reference model)" in _startup(caplog)[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _trainer(tiny_config, tmp_path / "live", [[1.0]], sdpo_teacher="live")
    assert "sdpo_jsd ×1 (live teacher = the policy, no copy)" in _startup(caplog)[0]
    assert "extra model memory 0 B" in _startup(caplog)[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _trainer(tiny_config, tmp_path / "off", [[1.0]], sdpo_weight=0.0)
    assert "off sdpo_jsd, trace_replay_dpo" in _startup(caplog)[0]


# ----------------------------------------------------------------------------------------------- bad config
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sdpo_success_threshold_mode": "percent"}, "sdpo_success_threshold_mode must be one of"),
        ({"sdpo_success_threshold_mode": "relative", "sdpo_success_reward_threshold": 1.5}, r"fraction in \(0, 1\]"),
        ({"sdpo_success_threshold_mode": "relative", "sdpo_success_reward_threshold": 0.0}, r"fraction in \(0, 1\]"),
        ({"sdpo_success_reward_threshold": math.nan}, "sdpo_success_reward_threshold must be a finite number"),
        ({"sdpo_success_reward_threshold": math.inf}, "sdpo_success_reward_threshold must be a finite number"),
        ({"sdpo_success_reward_threshold": "1"}, "sdpo_success_reward_threshold must be a finite number"),
        ({"success_reward_threshold": math.nan}, "success_reward_threshold must be a finite number"),
        (
            {"success_reward_threshold": 0.5, "sdpo_success_reward_threshold": 0.7},
            "disagree; set only one of them",
        ),
        (
            {"sdpo_success_threshold_mode": "relative", "reward_weights": [1.0, -1.0]},
            r"use positive reward weights or sdpo_success_threshold_mode='absolute'",
        ),
        ({"sdpo_success_warning_steps": -1}, r"sdpo_success_warning_steps must be an int ≥ 0"),
        ({"sdpo_success_warning_steps": 2.5}, r"sdpo_success_warning_steps must be an int ≥ 0"),
        ({"sdpo_success_warning_steps": True}, r"sdpo_success_warning_steps must be an int ≥ 0"),
    ],
)
def test_bad_success_settings_are_rejected_with_the_fix(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
    from crf_core.trainer import ComposerConfig

    with pytest.raises(ValueError, match=message):
        ComposerConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_relative_threshold_uses_the_trainers_weights_when_none_are_given(
    tiny_config: Callable[..., Any], tmp_path: Path
) -> None:
    """reward_weights=None means one per reward function (TRL); the trainer scales by their sum."""
    trainer = _trainer(tiny_config, tmp_path, [[1.0], [1.0]], sdpo_success_threshold_mode="relative")
    assert trainer.success.threshold == 2.0  # 1.0 × (1 + 1)
