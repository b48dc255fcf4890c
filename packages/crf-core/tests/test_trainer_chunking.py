"""Every trainer channel, chunked and materialised, on real tiny Hugging Face models (and with a PEFT adapter).

One trainer with every channel on (GRPO, SDPO with an EMA teacher, trace-replay DPO) builds a batch; its loss
is computed twice on it, once with the LM head chunked two tokens at a time and once materialised. Values of
the total and of every logged channel, and every parameter gradient, must agree (float64 models).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
from datasets import Dataset

from crf_core._testing.tiny_model import build_char_tokenizer
from crf_core.channels import ChunkPlan
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

PROMPTS = ["def add(a, b):\n    return", "def sub(a, b):\n    return"]
PAIRS = [
    {"prompt": PROMPTS[0], "chosen": " a + b", "rejected": " a - b"},
    {"prompt": "def neg(x):\n    return", "chosen": " -x", "rejected": " x"},
    {"prompt": "def sq(x):\n    return", "chosen": " x * x", "rejected": " x + x"},
]


def feedback_reward(completions: list[str], **kwargs: Any) -> list[float]:
    kwargs["log_extra"]("feedback", [None if i % 2 else f"wrong #{i}" for i in range(len(completions))])
    return [float(i % 2) for i in range(len(completions))]


def _model(arch: str, tokenizer: Any) -> Any:
    import transformers

    torch.manual_seed(0)
    v = len(tokenizer)
    if arch == "gpt2":  # tied input/output embeddings
        config = transformers.GPT2Config(vocab_size=v, n_embd=16, n_layer=1, n_head=2, n_positions=256)
        model = transformers.GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight
    else:
        config_cls, model_cls = {
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        }[arch]
        config = config_cls(
            vocab_size=v,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
        model = model_cls(config)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model.double()


def _trainer(tmp_path: Path, arch: str, peft: bool, **overrides: Any) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer()
    peft_config = None
    if peft:
        from peft import LoraConfig

        targets = ["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj"]
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    settings: dict[str, Any] = {"sdpo_top_k": 7, **overrides}
    args = ComposerConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        trace_replay_dpo_weight=0.5,
        trace_replay_batch_size=2,
        sdpo_environment_feedback_only_without_solution=False,
        disable_dropout=True,  # GPT-2 has dropout: two passes must see the same network
        **settings,
    )
    return ComposerReplicationTrainer(
        model=_model(arch, tokenizer),
        reward_funcs=feedback_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS] * 4),
        processing_class=tokenizer,
        trace_replay_pairs=PAIRS,
        peft_config=peft_config,
    )


def _loss_and_grads(
    trainer: ComposerReplicationTrainer, batch: dict[str, Any], plan: ChunkPlan
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, float]]:
    trainer._chunk_plan = plan
    cursor = copy.deepcopy(trainer.pair_cursor.state_dict()) if trainer.pair_cursor else None
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    if cursor is not None:
        trainer.pair_cursor.load_state_dict(cursor)  # the next call sees the same pairs
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = list(torch.autograd.grad(loss, params))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize(
    ("arch", "peft", "wrapper"),
    [
        ("llama", False, {}),
        ("qwen2", False, {}),
        ("gpt2", False, {}),
        ("llama", True, {}),
        ("gpt2", True, {}),
        ("qwen2", False, {"sdpo_wrapper": "taid"}),
        ("llama", False, {"sdpo_wrapper": "entropy_opd", "entropy_opd_h_max": 3.0, "entropy_opd_gate": "sigmoid"}),
        ("llama", False, {"dpo_variant": "simpo", "sdpo_top_k": None, "sdpo_alpha": 0.2}),
    ],
    ids=["llama", "qwen2", "gpt2-tied", "llama-peft", "gpt2-peft", "taid", "entropy-opd", "simpo-fullvocab"],
)
def test_every_channel_chunked_equals_materialised(tmp_path: Path, arch: str, peft: bool, wrapper: dict) -> None:
    trainer = _trainer(tmp_path, arch, peft, **wrapper)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(2)])
    assert bool(batch["sdpo_mask"].any())
    loss_c, grads_c, metrics_c = _loss_and_grads(trainer, batch, ChunkPlan("on", chunk_size=2))
    loss_m, grads_m, metrics_m = _loss_and_grads(trainer, batch, ChunkPlan("off"))
    assert torch.allclose(loss_c, loss_m, rtol=1e-9, atol=1e-12)
    for name in ("grpo", "sdpo_jsd", "trace_replay_dpo"):
        assert metrics_c[name] == pytest.approx(metrics_m[name], rel=1e-6, abs=1e-9), name
        # (on-policy GRPO's value is 0 when the group's advantages cancel; its gradient is not)
        assert name == "grpo" or metrics_c[name] != 0.0, name
    assert any(bool((g != 0).any()) for g in grads_c)
    for a, b in zip(grads_c, grads_m, strict=True):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-10)
    if peft:  # the adapter trains, the base stays frozen, the DPO reference is the adapter-free policy
        assert trainer.trace_replay_reference == "adapter"
        assert all("lora" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    if wrapper.get("sdpo_wrapper") == "taid":
        assert metrics_c["taid_t"] == pytest.approx(0.4)
