"""Checkpoint and resume: the EMA self-teacher, TAID's schedule and the pair cursor survive a restart.

An uninterrupted run of four steps (checkpointing at step two) against a fresh trainer resumed from that
checkpoint: the policy, the EMA teacher, TAID's state and the pair cursor end identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
from datasets import Dataset

from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.state import STATE_FILE, TEACHER_FILE, ChannelState
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm

PROMPTS = ["def add(a, b):\n    return", "def sub(a, b):\n    return", "def neg(x):\n    return"]
PAIRS = [{"prompt": p, "chosen": " a + b", "rejected": " a - b"} for p in PROMPTS] + [
    {"prompt": "def sq(x):\n    return", "chosen": " x * x", "rejected": " x + x"}
]


def feedback_reward(completions: list[str], **kwargs: Any) -> list[float]:
    kwargs["log_extra"]("feedback", [None if len(c) % 2 else "even length" for c in completions])
    return [float(len(c) % 2) for c in completions]


def _trainer(output_dir: Path) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=5)
    args = ComposerConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        learning_rate=5e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=11,
        data_seed=11,
        trace_replay_dpo_weight=0.5,
        trace_replay_batch_size=3,
        sdpo_top_k=5,
        sdpo_teacher_update_rate=0.3,
        sdpo_wrapper="taid",
        taid_step_size=0.2,
        lm_head_chunking="on",
        chunk_size=4,
    )
    return ComposerReplicationTrainer(
        model=model,
        reward_funcs=feedback_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS] * 8),
        processing_class=tokenizer,
        trace_replay_pairs=PAIRS,
    )


def test_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    straight = _trainer(tmp_path / "straight")
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    assert (checkpoint / STATE_FILE).exists()
    assert (checkpoint / TEACHER_FILE).exists()
    saved = json.loads((checkpoint / STATE_FILE).read_text())
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


def test_resume_refuses_state_that_does_not_fit(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "a")
    state = trainer.channel_state()
    with pytest.raises(ValueError, match="no EMA self-teacher state"):
        trainer.load_channel_state(ChannelState(teacher=None, taid=state.taid, pairs=state.pairs))
    with pytest.raises(ValueError, match="same trace-replay pairs"):
        trainer.load_channel_state(
            ChannelState(teacher=state.teacher, taid=state.taid, pairs={**state.pairs, "num_pairs": 99})
        )
    bad_teacher = {k: v[..., :1] if v.dim() else v for k, v in state.teacher.items()}
    with pytest.raises(ValueError, match="shape"):
        trainer.load_channel_state(ChannelState(teacher=bad_teacher, taid=state.taid, pairs=state.pairs))
    corrupt = {**state.pairs, "order": [0, 0, 1, 2], "position": 1}
    with pytest.raises(ValueError, match="corrupt"):
        trainer.load_channel_state(ChannelState(teacher=state.teacher, taid=state.taid, pairs=corrupt))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / STATE_FILE).write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version"):
        ChannelState.load(str(tmp_path / "ckpt"))
    assert ChannelState.load(str(tmp_path)) is None  # a checkpoint without crf state
