"""The trainer's chunked GRPO channel against TRL's own ``GRPOTrainer.compute_loss`` on the same batch.

Two trainers over identical float64 copies of one tiny model: TRL's plain ``GRPOTrainer`` and
``ComposerReplicationTrainer`` with only the GRPO channel, its LM head chunked three tokens at a time (and, as a
control, materialised). One hand-built batch with left-padded prompts, right-padded completions, advantages of
both signs, off-policy old log-probs (so clipping bites) and, with KL, reference log-probs: loss values and
every parameter gradient must agree for each loss type TRL ships.

TRL 1.16 scores log-probs in float32 whatever the model's dtype, so the float64 comparison gives TRL's trainer
an independent float64 scorer (full logits, ``log_softmax``, plain PyTorch) and checks to 1e-10; a second test
compares with TRL's own scorer untouched, to float32 precision.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
B, P, C = 4, 5, 6


def _zero_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def _common(tmp_path: Path, loss_type: str) -> dict[str, Any]:
    return {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": B,
        "num_generations": 2,
        "max_completion_length": C,
        "loss_type": loss_type,
        "epsilon": 0.2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }


def _batch(vocab: int, beta: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(4, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    prompt_mask[3, :1] = 0
    completion_ids = torch.randint(4, vocab, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[0, 4:] = 0  # right padding
    completion_mask[2, 2:] = 0
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64),
        # off-policy behaviour log-probs, so importance ratios leave the clip range in both directions
        "old_per_token_logps": -torch.rand(B, C, generator=g, dtype=torch.float64) * 6.0 - 1.0,
        "num_items_in_batch": completion_mask.sum().to(torch.float64),
    }
    if beta:
        batch["ref_per_token_logps"] = -torch.rand(B, C, generator=g, dtype=torch.float64) * 6.0 - 1.0
    return batch


def _float64_scores(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Reference completion log-probs and entropies in float64 from the full logits (no crf code)."""
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    logits = model.lm_head(out[:, -logits_to_keep - 1 : -1]).double()
    logp = torch.log_softmax(logits, dim=-1)
    labels = input_ids[:, -logits_to_keep:]
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    real = attention_mask[:, -logits_to_keep:] > 0
    zero = torch.zeros((), dtype=lp.dtype)
    return (
        torch.where(real, lp, zero),
        torch.where(real, entropy, zero) if kwargs.get("compute_entropy") else None,
        None,
    )


def _trainers(tmp_path: Path, loss_type: str, beta: float, chunking: str) -> tuple[GRPOTrainer, GRPOTrainer]:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=3).double()
    dataset = Dataset.from_list([{"prompt": "def f(x):"}] * 8)
    trl = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=_zero_reward,
        args=GRPOConfig(**_common(tmp_path / "trl", loss_type)),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    ours = ComposerReplicationTrainer(
        model=copy.deepcopy(model),
        reward_funcs=_zero_reward,
        args=ComposerConfig(
            **_common(tmp_path / "crf", loss_type),
            sdpo_weight=0.0,
            lm_head_chunking=chunking,
            chunk_size=3,
        ),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    for trainer in (trl, ours):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
        # TRL would load a reference model by name for beta != 0; the batch carries ref_per_token_logps instead
        trainer.beta = beta
    return trl, ours


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("chunking", ["on", "off"])
def test_chunked_grpo_equals_trl_compute_loss(
    tmp_path: Path, loss_type: str, beta: float, chunking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    trl, ours = _trainers(tmp_path, loss_type, beta, chunking)
    monkeypatch.setattr(trl, "_get_per_token_logps_and_entropies", _float64_scores)
    batch = _batch(trl.model.config.vocab_size, beta)
    want = trl.compute_loss(trl.model, dict(batch))
    got = ours.compute_loss(ours.model, dict(batch))
    assert got.dtype == want.dtype == torch.float64
    assert torch.allclose(got.detach(), want.detach(), rtol=1e-10, atol=1e-12), (float(got), float(want))
    g_want = torch.autograd.grad(want, list(trl.model.parameters()))
    g_got = torch.autograd.grad(got, list(ours.model.parameters()))
    assert any(bool((g != 0).any()) for g in g_want)
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-12)
    # TRL's own metrics are computed from the same tensors (entropy, clip ratios, KL)
    for name in ("entropy", "clip_ratio/region_mean") if loss_type != "sapo" else ("entropy",):
        if name in trl._metrics["train"]:
            assert ours._metrics["train"][name][-1] == pytest.approx(trl._metrics["train"][name][-1], rel=1e-9)
    assert ours._metrics["train"]["grpo"][-1] == pytest.approx(float(want) * 2, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_chunked_grpo_equals_trl_with_its_own_scorer(tmp_path: Path, loss_type: str) -> None:
    trl, ours = _trainers(tmp_path, loss_type, 0.04, "on")
    batch = _batch(trl.model.config.vocab_size, 0.04)
    want = trl.compute_loss(trl.model, dict(batch))
    got = ours.compute_loss(ours.model, dict(batch))
    assert torch.allclose(got.detach(), want.detach().double(), rtol=1e-4)
    for a, b in zip(
        torch.autograd.grad(got, list(ours.model.parameters())),
        torch.autograd.grad(want, list(trl.model.parameters())),
        strict=True,
    ):
        # TRL accumulates in float32: compare whole gradients by relative norm
        assert float((a - b.double()).norm()) <= 1e-2 * float(b.double().norm()) + 1e-9


def test_trl_no_grad_passes_use_the_chunked_scoring(tmp_path: Path) -> None:
    """Old and reference log-prob passes (no grad) agree with TRL's, chunked."""
    trl, ours = _trainers(tmp_path, "grpo", 0.04, "on")
    batch = _batch(trl.model.config.vocab_size, 0.04)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        want, _, _ = _float64_scores(ours.model, ids, mask, C)
        got, ent, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, C, batch_size=3)
        trl_own, _, _ = trl._get_per_token_logps_and_entropies(trl.model, ids, mask, C, batch_size=3)
    assert ent is None
    real = batch["completion_mask"].bool()
    assert torch.allclose(got[real], want[real], rtol=1e-10, atol=1e-12)
    assert torch.allclose(got[real], trl_own[real].double(), atol=2e-3)  # TRL scores in reduced precision
    assert bool((got[~real] == 0).all())
