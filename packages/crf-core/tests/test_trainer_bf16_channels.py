"""The SDPO teacher's and the trace-replay DPO pairs' forwards take the trainer's precision regime.

Reference: TRL's own fused LM head (``trl.trainer.utils.add_fused_lm_head``, the scorer of ``GRPOTrainer``) on a
copy of the teacher (the EMA module, or the PEFT policy with the adapter's EMA swapped in), called under the
trainer's ``accelerator.autocast()`` as TRL calls it. Under ``bf16=True`` crf's teacher log-probs (scored
directly, and through ``LMHead.project``, the path SDPO's divergence reads) equal that reference; a float32
trainer's teacher is far from it. The DPO pairs' summed response log-probs equal the same reference on the
policy.
"""

from __future__ import annotations

import copy
import importlib.metadata
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
_TRL = importlib.metadata.version("trl")
if tuple(int(part) for part in _TRL.split(".")[:2]) < (1, 16):
    pytest.skip(
        f"crf's bf16 scoring follows TRL 1.16's fused LM head (bf16 product, float32 log-softmax); this interpreter "
        f"has trl {_TRL}, which scores bf16 another way (no trl.trainer.utils.add_fused_lm_head; Python 3.10 resolves trl 1.14)",
        allow_module_level=True,
    )

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer  # noqa: E402
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm  # noqa: E402

TOL = 2e-5


def _zero_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


PAIRS = [
    {"prompt": "def add(a, b):\n    return", "chosen": " a + b", "rejected": " a - b"},
    {"prompt": "def neg(x):\n    return", "chosen": " -x", "rejected": " x"},
]


def _trainer(tmp_path: Any, *, bf16: bool, peft: bool, **overrides: Any) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, architecture="qwen2", hidden_size=32, num_layers=2, num_heads=2, seed=4)
    extra: dict[str, Any] = {"trace_replay_pairs": overrides.pop("trace_replay_pairs", None)}
    if peft:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
        )
    return ComposerReplicationTrainer(
        model=model,
        reward_funcs=_zero_reward,
        args=ComposerConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=6,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            bf16=bf16,
            sdpo_teacher="ema",
            **overrides,
        ),
        train_dataset=Dataset.from_list([{"prompt": "def f(x):"}] * 8),
        processing_class=tokenizer,
        **extra,
    )


def _fused(model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRL's fused head on a copy of ``model``, in bf16 autocast: ``(B, T - 1)`` log-probs of ``labels[:, 1:]``."""
    ref = copy.deepcopy(model)
    for sub in ref.modules():  # instance forwards (TRL's own patch) close over the original module
        sub.__dict__.pop("forward", None)
    add_fused_lm_head(ref, cast_lm_head_to_fp32=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    log_probs: torch.Tensor = out.log_probs
    return log_probs


def _trl_reference(trainer: ComposerReplicationTrainer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, T - 1)`` log-probs of ``ids[:, 1:]`` under the teacher, by TRL's fused head in bf16 autocast (what
    ``accelerator.autocast()`` enters on CPU under ``bf16=True``)."""
    policy: Any = trainer.accelerator.unwrap_model(trainer.model)
    teacher = trainer.sdpo_teacher
    assert teacher is not None
    with torch.no_grad(), teacher.applied(policy) as model:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return _fused(base, ids, mask, ids)


def _crf_teacher(trainer: ComposerReplicationTrainer, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The teacher's log-probs of ``ids[:, 1:]``: scored by its head, and through ``project`` (SDPO's targets)."""
    head, states = trainer.teacher_states(trainer.model, ids, mask)
    rows = states.tensor[:, :-1].reshape(-1, states.tensor.shape[-1])
    labels = ids[:, 1:].reshape(-1)
    with torch.no_grad():
        scored = head.score(rows, labels, is_logits=states.is_logits).logprobs
        projected = torch.log_softmax(head.project(rows), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    return [scored.reshape(ids.shape[0], -1), projected.reshape(ids.shape[0], -1)]


@pytest.mark.parametrize("peft", [False, True], ids=["ema-copy", "peft-adapter-ema"])
def test_sdpo_teacher_forward_is_in_trls_bf16_regime(tmp_path: Any, peft: bool) -> None:
    if peft:
        pytest.importorskip("peft")
    g = torch.Generator().manual_seed(2)
    bf16 = _trainer(tmp_path / "bf16", bf16=True, peft=peft)
    ids = torch.randint(4, bf16.model.config.vocab_size, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    real = mask[:, 1:].bool()
    want = _trl_reference(bf16, ids, mask)
    for got in _crf_teacher(bf16, ids, mask):
        err = float((got - want)[real].abs().max())
        print(f"teacher peft={peft}: bf16 error against TRL's fused head {err:.3e}")
        assert err <= TOL
    fp32 = _trainer(tmp_path / "fp32", bf16=False, peft=peft)
    fp32_scored, _ = _crf_teacher(fp32, ids, mask)
    assert float((fp32_scored - _trl_reference(fp32, ids, mask))[real].abs().max()) > 10 * TOL


def test_trace_replay_pairs_are_scored_in_trls_bf16_regime(tmp_path: Any) -> None:
    from crf_core.trainer.pairs import collate_pairs

    errors = {}
    for bf16 in (True, False):
        trainer = _trainer(
            tmp_path / str(bf16),
            bf16=bf16,
            peft=False,
            sdpo_weight=0.0,
            trace_replay_dpo_weight=1.0,
            trace_replay_pairs=PAIRS,
            trace_replay_reference="initial",
        )
        batch = collate_pairs(trainer._pairs, trainer._pad_id())
        labels = batch.input_ids.masked_fill(batch.response_mask == 0, -100)
        want = _fused(trainer.model, batch.input_ids, batch.attention_mask, labels).sum(-1)
        with torch.no_grad():
            chosen, rejected = trainer._pair_logps(trainer.model, batch)
        errors[bf16] = float((torch.cat([chosen.total, rejected.total]) - want).abs().max())
    print(
        f"trace-replay pairs: error against TRL's bf16 fused head: bf16 {errors[True]:.3e}, float32 {errors[False]:.3e}"
    )
    assert errors[True] <= 4 * TOL
    assert errors[False] > 10 * TOL
