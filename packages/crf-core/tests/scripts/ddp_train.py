"""One rank of the DDP test: every channel on, a PEFT adapter, gradient checkpointing; writes what it saw.

Run by ``accelerate launch --multi_gpu --num_processes 2 ddp_train.py OUT_DIR`` on CPU (test_trainer_ddp.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import PrinterCallback

from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

PROMPTS = [
    "def add(a, b):\n    return",
    "def sub(a, b):\n    return",
    "def neg(x):\n    return",
    "def sq(x):\n    return",
]
PAIRS = [{"prompt": f"def f{i}(x):\n    return", "chosen": f" x + {i}", "rejected": f" x - {i}"} for i in range(8)]


def feedback_reward(completions: list[str], **kwargs: Any) -> list[float]:
    kwargs["log_extra"]("feedback", [None if len(c) % 2 else "even length" for c in completions])
    return [float(len(c) % 2) for c in completions]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out = Path(sys.argv[1])
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=3)
    args = ComposerConfig(
        output_dir=str(out / "run"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        gradient_checkpointing=True,
        trace_replay_dpo_weight=0.5,
        trace_replay_batch_size=2,
        sdpo_top_k=8,
        lm_head_chunking="on",
        chunk_size=5,
    )
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=feedback_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS] * 8),
        processing_class=tokenizer,
        trace_replay_pairs=PAIRS,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    trainer.remove_callback(PrinterCallback)
    seen: list[list[int]] = []
    cursor = trainer.pair_cursor
    assert cursor is not None
    draw = cursor.next

    def recording_next() -> list[int]:
        idx = draw()
        seen.append(idx)
        return idx

    cursor.next = recording_next  # type: ignore[method-assign]
    trainer.train()
    rank = trainer.accelerator.process_index
    policy = trainer.accelerator.unwrap_model(trainer.model)
    teacher = trainer.sdpo_teacher
    assert teacher is not None
    record = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "policy": digest({k: v for k, v in policy.state_dict().items()}),
        "trainable": sorted(n for n, p in policy.named_parameters() if p.requires_grad)[:3],
        "teacher": digest(teacher.state_dict()),
        "pairs": seen,
        "logs": [
            {k: v for k, v in entry.items() if k in ("grpo", "sdpo_jsd", "trace_replay_dpo", "loss")}
            for entry in trainer.state.log_history
            if "loss" in entry
        ],
        "reference": trainer.trace_replay_reference,
        "checkpointing": bool(getattr(policy, "is_gradient_checkpointing", False)),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Everything is written and the process group is gone. Skip the interpreter's teardown: with torch 2.14
    # (Python 3.10's lock) a background thread is now and then destroyed while joinable there, std::terminate
    # aborts the process (SIGABRT, "terminate called without an active exception") and the launcher reports a
    # failed rank for a run that finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
