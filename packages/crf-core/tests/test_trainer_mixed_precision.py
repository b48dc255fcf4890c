"""Mixed precision: the trainer's chunked scoring under ``bf16=True`` against TRL 1.16's own fused-head scorer.

TRL's ``GRPOTrainer`` scores under ``accelerator.autocast()``: the decoder runs in bf16 autocast and its fused LM
head multiplies in the autocast dtype (``hidden`` and ``weight`` cast to bf16, the product rounded to bf16) and
upcasts the logits to float32 for the log-softmax; with ``cast_lm_head_to_fp32=True`` the head multiplies in
float32 outside autocast. ``ComposerReplicationTrainer`` must reproduce that (CPU autocast supports bfloat16), with
its LM head chunked three rows at a time, for the no-grad passes and for ``compute_loss`` and its gradients; and
``bf16=True`` must change crf's numbers against ``bf16=False`` (the option was once silently dropped).

Tolerances. crf and TRL run the same decoder module calls under the same autocast, so they see the same hidden
states, and their LM heads multiply the same bf16 operands with the same GEMM routine; each logit is one dot
product over ``H`` whose rounding does not depend on how many rows share the call (crf chunks 3 rows, TRL takes
all of them), so the bf16 logits agree exactly and what is left is float32 rounding: TRL's online log-sum-exp and
``z·(1/τ)`` against ``torch.logsumexp`` and ``z/τ`` (a few float32 ulps of ``|log p| ≲ 10``, ~1e-6). Log-probs and
entropies are checked to 5e-5 absolute: 50x that, yet 7-20x below the gap bf16 opens against float32 here
(~1e-3 with a bf16 head, ~4e-4 with ``cast_lm_head_to_fp32``, from the autocast decoder alone), which the test also
checks, so a head that ignored autocast could not pass. The loss is checked to 1e-5 relative and each gradient
to 1e-4 of its norm (both backwards round ``∂L/∂z`` to bf16 and accumulate float32 products; measured ~1e-7).
Measured max abs differences are printed (``pytest -s``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
import trl as trl_package
from datasets import Dataset
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer

from crf_core.channels import ChunkPlan, LMHead, score_completions
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.pairs import collate_pairs
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm

B, P, C = 4, 5, 6
LOGP_ATOL = 5e-5
PAIRS = [
    {"prompt": "def neg(x):\n    return", "chosen": " -x", "rejected": " x"},
    {"prompt": "def sq(x):\n    return", "chosen": " x * x", "rejected": " x + x"},
]


def _zero_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def _common(output_dir: Path, *, bf16: bool, cast: bool) -> dict[str, Any]:
    return {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": B,
        "num_generations": 2,
        "max_completion_length": C,
        "loss_type": "grpo",
        "epsilon": 0.2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "bf16": bf16,
        "cast_lm_head_to_fp32": cast,
        "temperature": 0.7,
    }


def _model() -> Any:
    return build_tiny_causal_lm(build_char_tokenizer(), hidden_size=32, num_layers=2, num_heads=2, seed=3)


def _trl(tmp_path: Path, model: Any, *, bf16: bool, cast: bool) -> GRPOTrainer:
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=_zero_reward,
        args=GRPOConfig(**_common(tmp_path / "trl", bf16=bf16, cast=cast)),
        train_dataset=Dataset.from_list([{"prompt": "def f(x):"}] * 8),
        processing_class=build_char_tokenizer(),
    )
    return _ready(trainer)


def _crf(tmp_path: Path, model: Any, *, bf16: bool, cast: bool, **overrides: Any) -> ComposerReplicationTrainer:
    settings: dict[str, Any] = {"sdpo_weight": 0.0, "lm_head_chunking": "on", "chunk_size": 3, **overrides}
    trainer = ComposerReplicationTrainer(
        model=copy.deepcopy(model),
        reward_funcs=_zero_reward,
        args=ComposerConfig(**_common(tmp_path / f"crf-{bf16}-{cast}", bf16=bf16, cast=cast), **settings),
        train_dataset=Dataset.from_list([{"prompt": "def f(x):"}] * 8),
        processing_class=build_char_tokenizer(),
        trace_replay_pairs=PAIRS if settings.get("trace_replay_dpo_weight", 0.0) > 0 else None,
    )
    return _ready(trainer)


def _ready(trainer: Any) -> Any:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    trainer.beta = 0.04  # the batch carries ref_per_token_logps (TRL would load a reference model by name)
    return trainer


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[0, 4:] = 0  # right padding
    completion_mask[2, 2:] = 0
    return {
        "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (B, C), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1]),
        "old_per_token_logps": -torch.rand(B, C, generator=g) * 6.0 - 1.0,
        "ref_per_token_logps": -torch.rand(B, C, generator=g) * 6.0 - 1.0,
        "num_items_in_batch": completion_mask.sum().float(),
    }


def _scores(trainer: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion log-probs and entropies on the real completion tokens, through the trainer's own scorer."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, C, batch_size=3, compute_entropy=True
        )
    real = batch["completion_mask"].bool()
    return logps[real].double(), entropies[real].double()


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture
def model() -> Any:
    return _model()


@pytest.mark.skipif(
    Version(trl_package.__version__) < Version("1.16"), reason="the parity is with TRL 1.16's fused LM head"
)
@pytest.mark.parametrize(
    ("cast", "dtype"),
    [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)],
    ids=["bf16-head", "cast_lm_head_to_fp32", "bf16-model"],
)
def test_bf16_scores_loss_and_gradients_match_trls_own_scorer(
    tmp_path: Path, model: Any, cast: bool, dtype: torch.dtype
) -> None:
    model = model.to(dtype) if dtype != torch.float32 else model
    trl = _trl(tmp_path, model, bf16=True, cast=cast)
    ours = _crf(tmp_path, model, bf16=True, cast=cast)
    assert trl.accelerator.mixed_precision == ours.accelerator.mixed_precision == "bf16"
    assert ours._head_dtype == (torch.float32 if cast else torch.bfloat16)
    batch = _batch(trl.model.config.vocab_size)

    want_lp, want_h = _scores(trl, batch)
    got_lp, got_h = _scores(ours, batch)
    fp32_lp, _ = _scores(_crf(tmp_path, model, bf16=False, cast=False), batch)
    print(
        f"\n[cast_lm_head_to_fp32={cast} model {dtype}] max|crf-trl| logp {_max(got_lp, want_lp):.3g} entropy "
        f"{_max(got_h, want_h):.3g}; max|crf fp32 - trl bf16| logp {_max(fp32_lp, want_lp):.3g}"
    )
    assert _max(got_lp, want_lp) <= LOGP_ATOL
    assert _max(got_h, want_h) <= LOGP_ATOL
    if dtype == torch.float32:
        # the tolerance separates: crf in float32 is far outside it, so crf in bf16 follows TRL's rounding
        assert _max(fp32_lp, want_lp) > 5 * LOGP_ATOL

    want = trl.compute_loss(trl.model, dict(batch))
    got = ours.compute_loss(ours.model, dict(batch))
    print(
        f"[cast_lm_head_to_fp32={cast} model {dtype}] loss crf {float(got.detach()):.8g} trl {float(want.detach()):.8g}"
    )
    assert torch.allclose(got.detach().double(), want.detach().double(), rtol=1e-5, atol=1e-8)
    g_want = torch.autograd.grad(want, list(trl.model.parameters()))
    g_got = torch.autograd.grad(got, list(ours.model.parameters()))
    worst = 0.0
    for a, b in zip(g_got, g_want, strict=True):
        rel = float((a.double() - b.double()).norm()) / (float(b.double().norm()) + 1e-12)
        worst = max(worst, rel)
        assert float((a.double() - b.double()).norm()) <= 1e-4 * float(b.double().norm()) + 1e-9
    print(f"[cast_lm_head_to_fp32={cast} model {dtype}] worst relative gradient difference {worst:.3g}")


def test_bf16_changes_every_channel_and_fp32_is_unchanged(tmp_path: Path, model: Any) -> None:
    """``bf16=True`` moves GRPO's log-probs, SDPO's and DPO's losses off their float32 values (all scored under
    autocast with a bf16 head); ``bf16=False`` scores exactly as the plain chunked head does."""
    channels = {"sdpo_weight": 1.0, "sdpo_top_k": 8, "trace_replay_dpo_weight": 1.0}
    bf16 = _crf(tmp_path, model, bf16=True, cast=False, **channels)
    fp32 = _crf(tmp_path, model, bf16=False, cast=False, **channels)
    assert fp32._head_dtype is None
    assert fp32._autocast is None
    batch = _batch(bf16.model.config.vocab_size)

    # float32: bit for bit the plain chunked head (no autocast, no head dtype), i.e. the numbers before this change
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        plain = score_completions(
            LMHead(fp32.model, ChunkPlan("on", chunk_size=3), temperature=0.7), ids, mask, C, entropy=True
        )
        fp32_lp, fp32_h, _ = fp32._get_per_token_logps_and_entropies(fp32.model, ids, mask, C, compute_entropy=True)
    assert torch.equal(fp32_lp, plain.logps)
    assert fp32_h is not None
    assert plain.entropies is not None
    assert torch.equal(fp32_h, plain.entropies)

    bf16_lp, _ = _scores(bf16, batch)
    real = batch["completion_mask"].bool()
    print(f"\nmax|bf16 - fp32| GRPO logp {_max(bf16_lp, fp32_lp[real].double()):.3g}")
    assert _max(bf16_lp, fp32_lp[real].double()) > 1e-4
    assert _max(bf16_lp, fp32_lp[real].double()) < 0.1

    # every decoder forward of every channel runs under bf16 autocast
    seen: list[tuple[bool, torch.dtype]] = []

    def record(module: Any, args: Any) -> None:
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    teacher = {
        "sdpo_teacher_prompt_ids": torch.cat([batch["prompt_ids"], batch["prompt_ids"][:, :3]], 1),
        "sdpo_teacher_prompt_mask": torch.cat([batch["prompt_mask"], torch.ones(B, 3, dtype=torch.long)], 1),
        "sdpo_mask": torch.tensor([1.0, 0.0, 1.0, 1.0]),
    }
    values = {}
    for name, trainer in (("bf16", bf16), ("fp32", fp32)):
        hook = trainer.model.get_decoder().register_forward_pre_hook(record)
        try:
            sdpo = trainer.sdpo_channel_loss(trainer.model, {**batch, **teacher})
            # DPO's loss is log 2 here (policy = its 'initial' reference): compare its summed log-probs instead
            trainer.trace_replay_channel_loss(trainer.model, [0, 1])
            pairs = collate_pairs(trainer._pairs, trainer._pad_id(), trainer.accelerator.device)
            chosen, _ = trainer._pair_logps(trainer.model, pairs)
        finally:
            hook.remove()
        assert sdpo is not None
        values[name] = (float(sdpo), float(chosen.total.sum()))
    calls = len(seen) // 2
    assert calls >= 3  # SDPO's teacher and student, DPO's policy (its 'initial' reference is precomputed)
    assert seen[:calls] == [(True, torch.bfloat16)] * calls
    assert not any(enabled for enabled, _ in seen[calls:])
    print(
        f"SDPO bf16 {values['bf16'][0]:.8g} fp32 {values['fp32'][0]:.8g}; DPO chosen logps {values['bf16'][1]:.8g} "
        f"fp32 {values['fp32'][1]:.8g}"
    )
    for got, want in zip(values["bf16"], values["fp32"], strict=True):
        assert got != want
        assert got == pytest.approx(want, rel=5e-2, abs=1e-3)
    # the DPO 'initial' reference was scored at construction in the same regime
    assert bf16._pair_ref is not None
    assert fp32._pair_ref is not None
    assert not torch.equal(bf16._pair_ref[0], fp32._pair_ref[0])


def test_cast_lm_head_to_fp32_without_a_separable_head_names_the_fix(tmp_path: Path) -> None:
    model = _model()
    model.config.final_logit_softcapping = 30.0  # crf cannot run this head apart from the model
    with pytest.raises(ValueError, match=r"cast_lm_head_to_fp32=True cannot be honoured.*set cast_lm_head_to_fp32"):
        _crf(tmp_path, model, bf16=True, cast=True, sdpo_weight=1.0)
