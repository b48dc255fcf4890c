"""The EMA self-teacher of a PEFT policy holds the adapter's EMA only, over the shared frozen base.

Checked against an independent full-copy EMA teacher (``EmaTeacher`` of the whole PeftModel, updated by its own
callback from the same policy): the adapter EMA equals the copy's adapter weights exactly, the copy's base equals
the policy's, and the teacher's logits and SDPO loss equal the copy's. The teacher holds no base weight (bytes and
tensors counted), its checkpoint file holds only the adapter tensors, and a resume restores the EMA exactly.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
pytest.importorskip("peft", reason="these tests train a PEFT adapter")

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerCallback

from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.state import STATE_FILE, TEACHER_FILE, ChannelState
from crf_core.trainer.teacher import AdapterEmaTeacher, EmaTeacher

PROMPTS = ["def add(a, b):\n    return", "def sub(a, b):\n    return", "def neg(x):\n    return"]
LOGGER = "crf_core.trainer.trainer"


def feedback_reward(completions: list[str], **kwargs: Any) -> list[float]:
    kwargs["log_extra"]("feedback", [None if i % 2 else f"wrong #{i}" for i in range(len(completions))])
    return [float(i % 2) for i in range(len(completions))]


def _trainer(output_dir: Path, **overrides: Any) -> ComposerReplicationTrainer:
    from peft import LoraConfig

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=5).double()
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 6,
        "max_steps": 2,
        "save_strategy": "no",
        "logging_steps": 1,
        "learning_rate": 5e-2,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 11,
        "data_seed": 11,
        "sdpo_top_k": 5,
        "sdpo_teacher_update_rate": 0.3,
        "sdpo_environment_feedback_only_without_solution": False,
    }
    return ComposerReplicationTrainer(
        model=model,
        reward_funcs=feedback_reward,
        args=ComposerConfig(**{**settings, **overrides}),
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS] * 8),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
        ),
    )


def _trainable(trainer: ComposerReplicationTrainer) -> dict[str, torch.Tensor]:
    return {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _reachable_tensors(obj: Any) -> tuple[list[torch.Tensor], list[torch.nn.Module]]:
    """Every tensor (and module) reachable from ``obj`` through attributes, dicts, lists and tuples."""
    tensors: list[torch.Tensor] = []
    modules: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, torch.nn.Module):
            modules.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return tensors, modules


class _FullCopyEma(TrainerCallback):
    """An independent full-copy EMA teacher of the PeftModel, moved after every step like the trainer's."""

    def __init__(self, trainer: ComposerReplicationTrainer) -> None:
        self.trainer = trainer
        self.teacher = EmaTeacher(trainer.accelerator.unwrap_model(trainer.model), trainer.sdpo_teacher.rate)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.teacher.update(self.trainer.accelerator.unwrap_model(self.trainer.model))


def test_peft_ema_teacher_holds_only_the_adapter(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer = _trainer(tmp_path)
    teacher = trainer.sdpo_teacher
    assert isinstance(teacher, AdapterEmaTeacher)
    trainable = _trainable(trainer)
    assert set(teacher.tensors) == set(trainable)
    assert trainable
    assert all("lora_" in name for name in trainable)
    adapter_bytes = _nbytes(trainable.values())
    base_bytes = _nbytes(p for p in trainer.model.parameters() if not p.requires_grad)
    assert teacher.nbytes == adapter_bytes
    assert adapter_bytes < base_bytes / 4  # the check below means something
    tensors, modules = _reachable_tensors(teacher)
    assert not modules  # no model copy
    assert _nbytes(tensors) == adapter_bytes  # no base weight, in any form
    params = {p.data_ptr() for p in trainer.model.parameters()}
    assert not params & {t.data_ptr() for t in tensors}  # copies, not the live adapter
    for name, value in teacher.tensors.items():
        assert torch.equal(value, trainable[name])  # starts at the initial adapter
    cost = next(c for c in trainer.channel_costs if c.name == "sdpo_jsd")
    assert cost.copy_bytes == adapter_bytes
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("crf channels:"))
    assert f"sdpo_jsd ×1 (EMA teacher, adapter only over the shared base: {adapter_bytes} B (" in line
    assert f"extra model memory {adapter_bytes} B" in line


def test_peft_teacher_equals_a_full_copy_ema_teacher(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    reference = _FullCopyEma(trainer)
    trainer.add_callback(reference)
    trainer.train()
    teacher = trainer.sdpo_teacher
    assert isinstance(teacher, AdapterEmaTeacher)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    full = dict(reference.teacher.module.named_parameters())
    live = dict(policy.named_parameters())
    for name, param in full.items():  # the same EMA: adapter moved identically, base untouched
        expected = teacher.tensors[name] if name in teacher.tensors else live[name]
        assert torch.equal(param, expected), name
    assert any(not torch.equal(teacher.tensors[n], live[n]) for n in teacher.tensors)  # EMA lags the policy

    torch.manual_seed(0)
    ids = torch.randint(3, len(trainer.processing_class), (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    policy.train()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    head, states = trainer.teacher_states(trainer.model, ids, mask)
    assert all(m.training for m in policy.modules())  # modes restored
    for name, param in policy.named_parameters():  # the policy's own weights are back
        assert torch.equal(param, before[name]), name
    assert not states.is_logits
    logits = head.project(states.tensor.reshape(-1, states.tensor.shape[-1])).reshape(*ids.shape, -1)
    with torch.no_grad():
        expected = reference.teacher.module(input_ids=ids, attention_mask=mask).logits / trainer.temperature
        policy.eval()
        own = policy(input_ids=ids, attention_mask=mask).logits / trainer.temperature
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(own[real], expected[real], atol=1e-6)  # the live adapter differs

    # The SDPO loss of a batch, with this teacher and with the full copy in its place, is the same.
    policy.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(1)
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(2)])
    assert bool(batch["sdpo_mask"].any())
    loss = trainer.sdpo_channel_loss(trainer.model, batch)
    trainer.sdpo_teacher = reference.teacher
    loss_full = trainer.sdpo_channel_loss(trainer.model, batch)
    trainer.sdpo_teacher = teacher
    assert loss is not None
    assert loss_full is not None
    torch.testing.assert_close(loss, loss_full, rtol=1e-12, atol=1e-12)


def test_peft_resume_round_trips_the_adapter_ema(tmp_path: Path) -> None:
    checkpointing = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}
    straight = _trainer(tmp_path / "straight", **checkpointing)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    names = set(_trainable(straight))
    stored = load_file(str(checkpoint / TEACHER_FILE))
    assert set(stored) == names  # adapter tensors only
    assert _nbytes(stored.values()) == straight.sdpo_teacher.nbytes
    assert (checkpoint / TEACHER_FILE).stat().st_size < 2 * straight.sdpo_teacher.nbytes + 4096
    assert '"sdpo_teacher_state": "adapter"' in (checkpoint / STATE_FILE).read_text()

    loaded = _trainer(tmp_path / "loaded", **checkpointing)  # the file loads back exactly
    state = ChannelState.load(str(checkpoint))
    assert state is not None
    loaded.load_channel_state(state)
    for name, value in stored.items():
        assert torch.equal(loaded.sdpo_teacher.tensors[name], value), name

    resumed = _trainer(tmp_path / "resumed", **checkpointing)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for name, value in straight.sdpo_teacher.tensors.items():
        assert torch.equal(resumed.sdpo_teacher.tensors[name], value), name
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    full = _trainer(tmp_path / "other")  # a full-copy teacher's state does not fit a PEFT run
    with pytest.raises(ValueError, match="sdpo_teacher_state: the checkpoint has 'full', this run has 'adapter'"):
        full.load_channel_state(
            ChannelState(teacher=stored, config={**full.channel_config(), "sdpo_teacher_state": "full"})
        )


def test_adapter_teacher_validates_its_inputs(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    with pytest.raises(ValueError, match=r"EMA rate must be a number in \[0, 1\]"):
        AdapterEmaTeacher(policy, 1.5)
    frozen = copy.deepcopy(policy).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        AdapterEmaTeacher(frozen, 0.1)
    head_trained = copy.deepcopy(policy)
    head_trained.get_base_model().lm_head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="lm_head is trainable"):
        AdapterEmaTeacher(head_trained, 0.1)
    state = trainer.sdpo_teacher.state_dict()
    with pytest.raises(ValueError, match="missing"):
        trainer.sdpo_teacher.load_state_dict(dict(list(state.items())[1:]))
