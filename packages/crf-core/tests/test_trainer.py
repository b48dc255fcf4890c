"""ComposerReplicationTrainer on a tiny offline model: channels on/off, values vs crf-distill/compose_loss, SDPO behaviour."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
from datasets import Dataset

from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.pairs import collate_pairs

PROMPT = "def add(a, b):\n    return"
PROMPT_2 = "def sub(a, b):\n    return"  # same length: no left padding, so positions agree across code paths
PAIRS = [
    {"prompt": PROMPT, "chosen": " a + b", "rejected": " a - b"},
    {"prompt": "def neg(x):\n    return", "chosen": " -x", "rejected": " x"},
    {"prompt": "def sq(x):\n    return", "chosen": " x * x", "rejected": " x + x"},
]


def response_logits(
    model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Logits scoring each completion token, the way TRL's GRPO forward runs the policy (no position ids)."""
    c = ids.shape[1]
    logits = model(input_ids=torch.cat([prompt_ids, ids], 1), attention_mask=torch.cat([prompt_mask, mask], 1)).logits
    return logits[:, -c - 1 : -1]


def pair_logps(model: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs of a collated pair batch, from plain materialised logits."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    lp = torch.log_softmax(logits.double(), -1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    total = (lp * batch.response_mask[:, 1:]).sum(-1)
    p = batch.input_ids.shape[0] // 2
    return total[:p], total[p:]


def half_success(completions: list[str], **kwargs: Any) -> list[float]:
    """Deterministic reward: every second completion of a group succeeds, the others get feedback."""
    kwargs["log_extra"]("feedback", [None if i % 2 else f"wrong answer #{i}" for i in range(len(completions))])
    return [float(i % 2) for i in range(len(completions))]


def _config(tmp_path: Path, **overrides: Any) -> ComposerConfig:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 8,
        "max_steps": 2,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "learning_rate": 5e-3,
        "gradient_checkpointing": False,
        "disable_tqdm": True,
        "seed": 0,
        "sdpo_top_k": 8,
        "bf16": False,  # float32, like the plain-PyTorch references below (GRPOConfig's default is bf16 autocast)
    }
    base.update(overrides)
    return ComposerConfig(**base)


def _trainer(tmp_path: Path, pairs: list[dict[str, str]] | None = None, **overrides: Any) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    dataset = Dataset.from_list([{"prompt": PROMPT}, {"prompt": PROMPT_2}] * 4)
    return ComposerReplicationTrainer(
        model=model,
        reward_funcs=half_success,
        args=_config(tmp_path, **overrides),
        train_dataset=dataset,
        processing_class=tokenizer,
        trace_replay_pairs=pairs,
    )


@pytest.mark.parametrize(
    ("weights", "channels"),
    [
        ({"sdpo_weight": 0.0}, {"grpo"}),
        ({"grpo_weight": 0.0}, {"sdpo_jsd"}),
        ({"grpo_weight": 0.0, "sdpo_weight": 0.0, "trace_replay_dpo_weight": 1.0}, {"trace_replay_dpo"}),
        ({"trace_replay_dpo_weight": 0.5}, {"grpo", "sdpo_jsd", "trace_replay_dpo"}),
    ],
    ids=["grpo-only", "sdpo-only", "dpo-only", "all"],
)
def test_channels_on_and_off_train_a_few_steps(tmp_path: Path, weights: dict[str, float], channels: set[str]) -> None:
    pairs = PAIRS if weights.get("trace_replay_dpo_weight", 0.0) > 0 else None
    trainer = _trainer(tmp_path, pairs, **weights)
    before = copy.deepcopy(trainer.model.state_dict())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for name in ("grpo", "sdpo_jsd", "trace_replay_dpo"):
        present = all(name in entry for entry in logs)
        assert present == (name in channels), name
    for entry in logs:
        assert all(torch.isfinite(torch.tensor(entry[name])) for name in channels)
        # TRL's own logging keeps working next to the channels
        assert {"reward", "rewards/half_success/mean"} <= set(entry)
        assert ("entropy" in entry) == ("grpo" in channels)  # TRL logs entropy inside its GRPO loss
        if "sdpo_jsd" in channels:
            # successes (odd rows) have no successful peer and no feedback: masked out
            assert entry["self_distillation/reprompt_sample_fraction"] == 0.5
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert changed


def _batch(trainer: ComposerReplicationTrainer) -> dict[str, Any]:
    trainer.model.train()
    rows = [{"prompt": PROMPT}] * 2 + [{"prompt": PROMPT_2}] * 2
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(rows)


def test_composition_teacher_prompts_and_initial_reference(tmp_path: Path) -> None:
    """The trainer's wiring: teacher prompts from the group, the weighted/GA-scaled sum of the logged channels,
    and the 'initial' DPO reference equal to the untrained policy's summed log-probs (plain PyTorch). The channel
    math itself has one home (crf_core.channels) and its own float64-reference tests."""
    trainer = _trainer(
        tmp_path,
        PAIRS,
        trace_replay_dpo_weight=0.7,
        sdpo_weight=0.3,
        grpo_weight=1.0,
        trace_replay_batch_size=2,
        sdpo_environment_feedback_only_without_solution=False,
    )
    trainer.current_gradient_accumulation_steps = 2  # what Trainer sets inside its loop
    batch = _batch(trainer)
    # failures (even rows) get their peer's success as demonstration plus their feedback; the
    # successes have neither (their only peer failed, no feedback) and are masked out
    assert batch["sdpo_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]
    teacher_text = trainer.processing_class.batch_decode(batch["sdpo_teacher_prompt_ids"], skip_special_tokens=True)
    assert "Correct solution" in teacher_text[0]
    assert "wrong answer #0" in teacher_text[0]
    assert "wrong answer #2" in teacher_text[2]
    assert teacher_text[1] == PROMPT

    cursor = trainer.pair_cursor.state_dict()
    total = trainer.compute_loss(trainer.model, batch)
    metrics = trainer._metrics["train"]
    grpo, sdpo, dpo = metrics["grpo"][-1], metrics["sdpo_jsd"][-1], metrics["trace_replay_dpo"][-1]
    assert sdpo > 0
    assert dpo > 0
    # the composition: w_grpo·grpo + (w_sdpo·sdpo + w_dpo·dpo) / GA (grpo is logged before TRL's GA scaling)
    assert float(total.detach()) == pytest.approx((grpo + 0.3 * sdpo + 0.7 * dpo) / 2, rel=1e-5, abs=1e-7)

    # the DPO loss used the next two pairs of the cursor, against the initial policy as reference
    trainer.pair_cursor.load_state_dict(cursor)
    idx = trainer.pair_cursor.next()
    pb = collate_pairs([trainer._pairs[i] for i in idx], trainer._pad_id())
    ref_c, ref_r = (t[idx] for t in trainer._pair_ref)
    with torch.no_grad():
        c0, r0 = pair_logps(trainer.sdpo_teacher.module, pb)  # the EMA copy is still the initial policy
    torch.testing.assert_close(ref_c, c0.float())
    torch.testing.assert_close(ref_r, r0.float())
    with torch.no_grad():
        c, r = pair_logps(trainer.model, pb)
    want = -torch.nn.functional.logsigmoid(0.1 * ((c - ref_c.double()) - (r - ref_r.double()))).mean()
    assert dpo == pytest.approx(float(want), rel=1e-5)


def test_simpo_variant_is_reference_free(tmp_path: Path) -> None:
    trainer = _trainer(
        tmp_path, PAIRS, trace_replay_dpo_weight=1.0, sdpo_weight=0.0, dpo_variant="simpo", trace_replay_batch_size=3
    )
    assert trainer.trace_replay_reference == "none"
    assert trainer._pair_ref is None
    assert trainer.pair_cursor is not None
    trainer.model.train()
    loss = trainer.trace_replay_channel_loss(trainer.model, indices=[0, 1, 2])
    pb = collate_pairs(trainer._pairs, trainer._pad_id())
    c, r = pair_logps(trainer.model, pb)
    lengths = pb.response_mask[:, 1:].sum(-1).double()
    margin = 2.0 * (c / lengths[:3] - r / lengths[3:]) - 1.0  # SimPO: β·(avg_w − avg_l) − γ
    assert float(loss.detach()) == pytest.approx(float(-torch.nn.functional.logsigmoid(margin).mean()), rel=1e-5)


def test_precomputed_reference_is_used(tmp_path: Path) -> None:
    pairs = [dict(p, ref_chosen_logps=-3.0 - i, ref_rejected_logps=-4.0) for i, p in enumerate(PAIRS)]
    trainer = _trainer(tmp_path, pairs, trace_replay_dpo_weight=1.0)
    assert trainer.trace_replay_reference == "precomputed"
    torch.testing.assert_close(trainer._pair_ref[0], torch.tensor([-3.0, -4.0, -5.0]))


def test_ema_teacher_follows_the_rate(tmp_path: Path) -> None:
    frozen = _trainer(tmp_path / "frozen", sdpo_teacher_update_rate=0.0)
    initial = copy.deepcopy(frozen.sdpo_teacher.module.state_dict())
    frozen.train()
    assert all(torch.equal(initial[k], v) for k, v in frozen.sdpo_teacher.module.state_dict().items())

    moving = _trainer(tmp_path / "moving", sdpo_teacher_update_rate=0.5, max_steps=1)
    start = {k: v.clone() for k, v in moving.sdpo_teacher.module.state_dict().items()}
    moving.train()
    policy = moving.model.state_dict()
    for name, value in moving.sdpo_teacher.module.state_dict().items():
        torch.testing.assert_close(value, 0.5 * start[name] + 0.5 * policy[name])
    # the copy runs its own weights, not the live policy's (TRL 1.16 patches forward on the instance)
    assert not any(
        torch.equal(policy[k], v) for k, v in moving.sdpo_teacher.module.state_dict().items() if v.dim() == 2
    )


def test_missing_or_unused_pairs_fail_loudly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no pairs were given"):
        _trainer(tmp_path, None, trace_replay_dpo_weight=1.0)
    with pytest.raises(ValueError, match="would be ignored"):
        _trainer(tmp_path, PAIRS)
    with pytest.raises(ValueError, match="needs a string 'chosen'"):
        _trainer(tmp_path, [{"prompt": "p", "chosen": ["x"], "rejected": "y"}], trace_replay_dpo_weight=1.0)
    with pytest.raises(TypeError, match="ComposerConfig"):
        ComposerReplicationTrainer(model=build_tiny_causal_lm(build_char_tokenizer()), reward_funcs=half_success)


def _train_copy_model(steps: int = 60) -> tuple[Any, Any]:
    """A tiny model briefly trained on teacher-format strings ``P#D>D`` to copy the demonstration D.

    The loss is on the copied part only; after ~60 Adam steps the copy loss is ~0.005 nats/token.
    """
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=1)
    rng = random.Random(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    eos = tokenizer.eos_token_id
    for _ in range(steps):
        texts = []
        for _ in range(16):
            p = "".join(rng.choice("abcd") for _ in range(2)) + ":"
            d = "".join(rng.choice("efgh") for _ in range(3))
            texts.append(f"{p}#{d}>{d}")
        ids = torch.tensor([tokenizer(t)["input_ids"] + [eos] for t in texts])
        labels = ids.clone()
        labels[:, :-4] = -100  # train only the copied demonstration and EOS
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, tokenizer


def test_sdpo_teacher_with_demonstration_prefers_the_demonstrated_tokens(tmp_path: Path) -> None:
    model, tokenizer = _train_copy_model()
    config = _config(
        tmp_path,
        sdpo_teacher="live",
        sdpo_reprompt_template="{prompt}{solution}{feedback}>",
        sdpo_solution_template="#{successful_previous_attempt}",
        sdpo_feedback_template="!{feedback_raw}",
        sdpo_top_k=None,
        sdpo_alpha=1.0,
        grpo_weight=0.0,
    )
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=half_success,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "abc:"}] * 4),
        processing_class=tokenizer,
    )
    prompts, demo = ["ba:", "ba:", "cd:", "cd:"], ["hgf", "hgf", "efe", "efe"]
    trainer._capture = (prompts, demo, torch.ones(4, 1))  # every rollout succeeded: each peer is a demo
    prompt_ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])
    completion_ids = torch.tensor([tokenizer(d)["input_ids"] + [tokenizer.eos_token_id] for d in demo])
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones_like(completion_ids),
    }
    trainer.model.train()
    batch.update(trainer._teacher_inputs(batch))
    decoded = tokenizer.batch_decode(batch["sdpo_teacher_prompt_ids"], skip_special_tokens=True)
    assert decoded == ["ba:#hgf>", "ba:#hgf>", "cd:#efe>", "cd:#efe>"]

    def logprob_of_demo(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = response_logits(model, ids, mask, completion_ids, batch["completion_mask"])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        return lp[:, :3].mean()  # the three demonstrated characters

    student = logprob_of_demo(batch["prompt_ids"], batch["prompt_mask"])
    teacher = logprob_of_demo(batch["sdpo_teacher_prompt_ids"], batch["sdpo_teacher_prompt_mask"])
    assert teacher > student + 0.5, (float(teacher), float(student))

    # and the SDPO gradient moves the student toward the demonstration: descending the loss raises
    # the student's log-prob of the demonstrated tokens (negative directional derivative)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = trainer.sdpo_channel_loss(model, batch)
    assert loss is not None
    assert float(loss.detach()) > 0
    grad_loss = torch.autograd.grad(loss, params, allow_unused=True)
    logits = response_logits(model, batch["prompt_ids"], batch["prompt_mask"], completion_ids, batch["completion_mask"])
    lp = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)[:, :3].mean()
    grad_lp = torch.autograd.grad(lp, params, allow_unused=True)
    # both sides reach the same parameters: a gradient that vanished on one side is a bug, not a term to skip
    assert [a is None for a in grad_loss] == [b is None for b in grad_lp]
    assert any(a is not None for a in grad_loss)
    dot = sum((a * b).sum() for a, b in zip(grad_loss, grad_lp, strict=True) if a is not None)
    assert float(dot) < 0
