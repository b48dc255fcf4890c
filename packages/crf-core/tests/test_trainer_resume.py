"""Checkpoint and resume: the EMA self-teacher, TAID's schedule and the pair cursor survive a restart.

An uninterrupted run of four steps (checkpointing at step two) against a fresh trainer resumed from that
checkpoint: the policy, the EMA teacher, TAID's state and the pair cursor end identical. Resuming with other
channel settings, or a run that keeps state from a plain TRL checkpoint, is a ``ValueError`` naming the difference.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
from datasets import Dataset

from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.state import STATE_FILE, STATE_VERSION, TEACHER_FILE, ChannelState

PROMPTS = ["def add(a, b):\n    return", "def sub(a, b):\n    return", "def neg(x):\n    return"]
PAIRS = [{"prompt": p, "chosen": " a + b", "rejected": " a - b"} for p in PROMPTS] + [
    {"prompt": "def sq(x):\n    return", "chosen": " x * x", "rejected": " x + x"}
]


def feedback_reward(completions: list[str], **kwargs: Any) -> list[float]:
    kwargs["log_extra"]("feedback", [None if len(c) % 2 else "even length" for c in completions])
    return [float(len(c) % 2) for c in completions]


def _trainer(output_dir: Path, **overrides: Any) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=5)
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 6,
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "learning_rate": 5e-3,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 11,
        "data_seed": 11,
        "trace_replay_dpo_weight": 0.5,
        "trace_replay_batch_size": 3,
        "sdpo_top_k": 5,
        "sdpo_teacher_update_rate": 0.3,
        "sdpo_wrapper": "taid",
        "taid_step_size": 0.2,
        "lm_head_chunking": "on",
        "chunk_size": 4,
    }
    pairs = overrides.pop("trace_replay_pairs", PAIRS)
    return ComposerReplicationTrainer(
        model=model,
        reward_funcs=feedback_reward,
        args=ComposerConfig(**{**settings, **overrides}),
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS] * 8),
        processing_class=tokenizer,
        trace_replay_pairs=pairs,
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> ComposerReplicationTrainer:
    """An uninterrupted four-step run, checkpointed at steps 2 and 4."""
    trainer = _trainer(tmp_path_factory.mktemp("straight"))
    trainer.train()
    return trainer


def _checkpoint(trainer: ComposerReplicationTrainer, step: int = 2) -> Path:
    return Path(trainer.args.output_dir) / f"checkpoint-{step}"


def test_resumed_run_equals_uninterrupted_run(straight: ComposerReplicationTrainer, tmp_path: Path) -> None:
    checkpoint = _checkpoint(straight)
    assert (checkpoint / STATE_FILE).exists()
    assert (checkpoint / TEACHER_FILE).exists()
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    assert saved["version"] == STATE_VERSION
    assert saved["config"] == straight.channel_config()
    assert saved["config"]["sdpo_teacher_state"] == "full"
    assert saved["pairs"]["position"] > 0
    assert saved["taid"]["t"] >= 0.4

    resumed = _trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for name, a in straight.sdpo_teacher.state_dict().items():
        assert torch.equal(a, resumed.sdpo_teacher.state_dict()[name]), name
    assert straight.taid_schedule.state_dict() == resumed.taid_schedule.state_dict()
    assert straight.pair_cursor.state_dict() == resumed.pair_cursor.state_dict()
    assert straight.taid_schedule.t > 0.4  # the schedule really moved during the run


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sdpo_weight": 0.5}, r"sdpo_weight: checkpoint \S+ has 1\.0, this run has 0\.5"),
        ({"sdpo_teacher_update_rate": 0.1}, r"sdpo_teacher_update_rate: checkpoint \S+ has 0\.3, this run has 0\.1"),
        ({"sdpo_teacher": "live"}, r"sdpo_teacher: checkpoint \S+ has 'ema', this run has 'live'"),
        (
            {"sdpo_weight": 0.0},
            r"sdpo_weight: .*has 1\.0, this run has 0\.0.*sdpo_wrapper: .*has 'taid', this run has None",
        ),
        ({"sdpo_wrapper": None}, r"sdpo_wrapper: checkpoint \S+ has 'taid', this run has None"),
        ({"taid_step_size": 0.1}, r"taid_step_size: checkpoint \S+ has 0\.2, this run has 0\.1"),
        (
            {"trace_replay_dpo_weight": 0.0, "trace_replay_pairs": None},
            r"trace_replay_dpo_weight: checkpoint \S+ has 0\.5, this run has 0\.0",
        ),
    ],
    ids=["sdpo-weight", "ema-rate", "live-teacher", "sdpo-off", "taid-off", "taid-step", "dpo-off"],
)
def test_resume_with_other_channel_settings_raises(
    straight: ComposerReplicationTrainer, tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    resumed = _trainer(tmp_path / "resumed", **overrides)
    with pytest.raises(ValueError, match=message) as err:
        resumed.train(resume_from_checkpoint=str(_checkpoint(straight)))
    assert "resume with the same ComposerConfig" in str(err.value)
    assert "start a fresh run" in str(err.value)
    assert resumed.state.global_step == 2  # refused before any step


def _plain_grpo_checkpoint(output_dir: Path) -> Path:
    """A checkpoint written by TRL's own GRPOTrainer (one step, same tiny policy)."""
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = build_char_tokenizer()
    trainer = GRPOTrainer(
        model=build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=5),
        reward_funcs=lambda completions, **kwargs: [float(len(c) % 2) for c in completions],
        args=GRPOConfig(
            output_dir=str(output_dir),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=6,
            max_steps=1,
            save_strategy="steps",
            save_steps=1,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=11,
        ),
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS] * 8),
        processing_class=tokenizer,
    )
    trainer.train()
    checkpoint = output_dir / "checkpoint-1"
    assert (checkpoint / "trainer_state.json").exists()
    assert not (checkpoint / STATE_FILE).exists()
    return checkpoint


def test_resume_from_a_plain_trl_checkpoint(tmp_path: Path) -> None:
    checkpoint = _plain_grpo_checkpoint(tmp_path / "trl")
    stateful = _trainer(tmp_path / "stateful")  # EMA teacher, TAID and the pair cursor: nothing to restore them from
    with pytest.raises(ValueError, match=r"has no crf_channel_state\.json") as err:
        stateful.train(resume_from_checkpoint=str(checkpoint))
    for part in ("EMA self-teacher", "TAID schedule", "trace-replay pair cursor", "start a fresh run"):
        assert part in str(err.value)
    ema_only = _trainer(tmp_path / "ema", sdpo_wrapper=None, trace_replay_dpo_weight=0.0, trace_replay_pairs=None)
    with pytest.raises(ValueError, match=r"this run keeps state across steps \(EMA self-teacher\)"):
        ema_only.train(resume_from_checkpoint=str(checkpoint))
    # A run that keeps no state across steps (live teacher, no TAID, no pairs) continues a TRL run.
    stateless = _trainer(
        tmp_path / "stateless",
        max_steps=2,
        save_strategy="no",
        sdpo_teacher="live",
        sdpo_wrapper=None,
        trace_replay_dpo_weight=0.0,
        trace_replay_pairs=None,
    )
    stateless.train(resume_from_checkpoint=str(checkpoint))
    assert stateless.state.global_step == 2


def test_resume_refuses_state_that_does_not_fit(straight: ComposerReplicationTrainer, tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "a")
    state = trainer.channel_state()
    with pytest.raises(ValueError, match="no EMA self-teacher state"):
        trainer.load_channel_state(replace(state, teacher=None))
    off = _trainer(tmp_path / "b", sdpo_teacher="live", sdpo_wrapper=None)
    with pytest.raises(ValueError, match="has EMA self-teacher state, but this run does not use one"):
        off.load_channel_state(replace(state, config=off.channel_config(), taid=None))
    with pytest.raises(ValueError, match="records no channel config"):
        trainer.load_channel_state(replace(state, config=None))
    with pytest.raises(ValueError, match="same trace-replay pairs"):
        trainer.load_channel_state(replace(state, pairs={**state.pairs, "num_pairs": 99}))
    bad_teacher = {k: v[..., :1] if v.dim() else v for k, v in state.teacher.items()}
    with pytest.raises(ValueError, match="shape"):
        trainer.load_channel_state(replace(state, teacher=bad_teacher))
    with pytest.raises(ValueError, match="dtype"):
        trainer.load_channel_state(replace(state, teacher={k: v.double() for k, v in state.teacher.items()}))
    corrupt = {**state.pairs, "order": [0, 0, 1, 2], "position": 1}
    with pytest.raises(ValueError, match="corrupt"):
        trainer.load_channel_state(replace(state, pairs=corrupt))

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / STATE_FILE).write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version 99"):
        ChannelState.load(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / STATE_FILE).write_text('{"version": 1, "teacher": false, "taid": null, "pairs": null}')
    with pytest.raises(ValueError, match="version 1, written by an older crf-core"):
        ChannelState.load(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / STATE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        ChannelState.load(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / STATE_FILE).write_text(json.dumps({"version": STATE_VERSION, "config": {}, "teacher": True}))
    with pytest.raises(ValueError, match="is missing"):
        ChannelState.load(str(tmp_path / "ckpt"))
    assert ChannelState.load(str(tmp_path)) is None  # a checkpoint without crf state

    saved = ChannelState.load(str(_checkpoint(straight)))  # what the run wrote loads back into a matching trainer
    assert saved is not None
    trainer.load_channel_state(saved)
    assert trainer.taid_schedule.state_dict() == saved.taid
