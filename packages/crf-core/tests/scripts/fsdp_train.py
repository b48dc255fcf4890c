"""One run of the FSDP2 parity test: every channel on, either sharded (one rank of ``accelerate launch`` with an
FSDP2 config) or the single-process reference; writes what it saw to ``OUT_DIR/<mode>-rank<r>.json`` (+ weights).

    accelerate launch --config_file fsdp2.yaml fsdp_train.py OUT_DIR fsdp [--gpu]    # each rank
    python fsdp_train.py OUT_DIR single [--gpu]                                     # the reference

GRPO's KL term (``beta > 0``) and the DPO pairs' reference score TRL's reference model, which TRL shards like the
policy under FSDP2. Both runs see the same 8 rollouts per step: they come from a deterministic ``rollout_func`` keyed by the step and
the sample's place in the global batch (rank r of 2 holds samples 4r..4r+3), not from sampling, whose random
stream differs between one process and two. Every completion is 8 tokens and every reward call logs feedback, so
each rank holds the same number of GRPO and SDPO tokens and the ranks' per-rank token means average to the
single-process mean. The optimiser is SGD: the final weights then reflect the gradients' float32 agreement
(Adam's normalisation would turn rounding-level differences of near-zero gradients into steps of ±lr).

On CPU, accelerate 1.15 turns FSDP off (its ``AcceleratorState`` enables the FSDP plugin only for accelerator
devices and otherwise runs ``MULTI_CPU``, i.e. DDP). This script lifts that one check before the trainer builds
its accelerator (and keeps it with ``accelerator_config={"use_configured_state": True}``), so accelerate's own
FSDP2 preparation (``fsdp2_prepare_model``: per-layer units, the embedding,
``[final norm, lm_head]`` as one unit, the root) runs on gloo; nothing else about accelerate is changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

GROUP = 4  # rollouts per prompt (one group per rank in the sharded run)
LOCAL = 4  # samples per rank in the sharded run; the reference holds both ranks' 8
COMPLETION = 8
STEPS = 3
PROMPTS = [
    "def add(a, b):\n    return",
    "def sub(a, b):\n    return",
    "def neg(x):\n    return",
    "def sq(x):\n    return",
]
PAIRS = [{"prompt": f"def f{i}(x):\n    return", "chosen": f" x + {i}", "rejected": f" x - {i}"} for i in range(8)]


def _enable_fsdp_on_cpu() -> None:
    """accelerate 1.15 enables FSDP only for accelerator devices: present the CPU process group as one (see above)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """Deterministic completions: sample ``i`` of the global batch at step ``s`` gets ``COMPLETION`` character ids
    drawn from a generator seeded with ``(s, i)``."""
    tokenizer = trainer.processing_class
    first = trainer.accelerator.process_index * len(prompts)
    low, high = len(tokenizer.all_special_ids), len(tokenizer)
    completions = []
    for i in range(len(prompts)):
        gen = torch.Generator().manual_seed(1000 * int(trainer.state.global_step) + first + i)
        completions.append(torch.randint(low, high, (COMPLETION,), generator=gen).tolist())
    prompt_ids = [list(tokenizer(p)["input_ids"]) for p in prompts]
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def feedback_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Reward = share of vowels; feedback on every completion, so every sample carries an SDPO teacher signal."""
    kwargs["log_extra"]("feedback", [f"{sum(c in 'aeiou' for c in text)} vowels, want more" for text in completions])
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().float()


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    gpu = "--gpu" in sys.argv[3:]
    if mode not in ("fsdp", "single"):
        raise SystemExit(f"mode must be 'fsdp' or 'single', got {mode!r}")
    if mode == "fsdp" and not gpu:
        _enable_fsdp_on_cpu()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    from datasets import Dataset
    from transformers import PrinterCallback

    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
    from crf_core.channels import LMHead
    from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=3)
    initial = {k: v.detach().cpu().float().clone() for k, v in model.state_dict().items()}
    # beta > 0: TRL loads a reference model from the policy's path (sharded by its prepare_fsdp under FSDP2), which
    # GRPO's KL term and the DPO pairs' reference ("ref_model") then score
    rank = int(os.environ.get("RANK", "0"))
    if torch.distributed.is_initialized():  # (the CPU shim set up the process group): transformers saves on rank 0
        folder = out / f"{mode}-model"
        if rank == 0:
            model.save_pretrained(folder)
        torch.distributed.barrier()
    else:
        folder = out / f"{mode}-model-{rank}"
        model.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    world = 2 if mode == "fsdp" else 1
    args = ComposerConfig(
        output_dir=str(out / f"{mode}-run"),
        per_device_train_batch_size=LOCAL * 2 // world,
        num_generations=GROUP,
        max_completion_length=COMPLETION,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=0.5,
        optim="sgd",
        beta=0.04,
        report_to=[],
        use_cpu=not gpu,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        trace_replay_dpo_weight=0.5,
        trace_replay_batch_size=4 // world,
        sdpo_top_k=8,
        sdpo_teacher_update_rate=0.5,
        lm_head_chunking="on",
        chunk_size=5,
        # keep the state set up by _enable_fsdp_on_cpu (TrainingArguments otherwise resets accelerate's state)
        accelerator_config={"use_configured_state": mode == "fsdp" and not gpu},
    )
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=feedback_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS] * 8),
        processing_class=tokenizer,
        trace_replay_pairs=PAIRS,
        rollout_func=rollout,
    )
    trainer.remove_callback(PrinterCallback)
    masks: list[list[float]] = []
    produce = trainer._generate_and_score_completions

    def recording(inputs: Any) -> dict[str, Any]:
        batch = produce(inputs)
        masks.append([float(v) for v in batch["sdpo_mask"].tolist()])
        return batch

    trainer._generate_and_score_completions = recording  # type: ignore[method-assign]
    trainer.train()

    rank = trainer.accelerator.process_index
    policy = trainer.accelerator.unwrap_model(trainer.model)
    head = LMHead(policy, unwrap=None)
    weights = {k: full(v) for k, v in policy.state_dict().items()}
    teacher = trainer.sdpo_teacher
    assert teacher is not None
    teacher_state = {k: v.detach().cpu().float() for k, v in teacher.state_dict().items()}
    record = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "sharded": head.sharded,
        "head_weight_type": type(policy.get_output_embeddings().weight).__name__,
        "teacher_sharded": bool(getattr(teacher, "sharded", False)),
        "reference": trainer.trace_replay_reference,
        "reference_sharded": LMHead(trainer.ref_model).sharded,
        "separable": head.separable,
        "warnings": sorted(trainer._warned),
        "sdpo_masks": masks,
        "logs": [
            {k: v for k, v in entry.items() if k in ("grpo", "sdpo_jsd", "trace_replay_dpo", "loss")}
            for entry in trainer.state.log_history
            if "loss" in entry
        ],
        "policy": digest(weights),
    }
    if rank == 0:
        torch.save({"initial": initial, "policy": weights, "teacher": teacher_state}, out / f"{mode}-weights.pt")
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # As in ddp_train.py: everything is written; skip the interpreter's teardown (a joinable background thread can
    # abort the process there with torch 2.14 and fail a finished run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
