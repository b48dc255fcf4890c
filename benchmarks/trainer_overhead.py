"""Steps per second of ComposerReplicationTrainer (every channel on) against TRL's plain GRPOTrainer.

Same tiny offline model (2-layer Llama, character vocabulary), same data, same reward, same GRPO
settings, and every rollout forced to the full 16 tokens so both trainers generate the same amount;
each trainer runs ``--steps`` timed optimizer steps after ``--warmup`` untimed ones (timed by a
step-end callback inside one run), ``--repeats`` times interleaved, and the best time is kept. Target: ratio ≥ 0.8 (the Composer trainer does the GRPO step, with the SDPO student
scored in the same pass, plus a no-grad teacher forward on the longer reprompts and a DPO forward/backward on
pairs).

    python benchmarks/trainer_overhead.py            # about a minute on 2 idle CPU cores
    python benchmarks/trainer_overhead.py --vocab 151936 --steps 4 --repeats 2   # Qwen's vocabulary

With ``--vocab`` the model's vocabulary is that large (ids past the character tokenizer decode to nothing), so
the LM head dominates and crf runs it chunked while TRL 1.16 runs its own fused head.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from typing import Any

from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm

PROMPTS = [
    "def add(a, b):\n    return",
    "def sub(a, b):\n    return",
    "def neg(x):\n    return",
    "def sq(x):\n    return",
]
PAIRS = [{"prompt": p, "chosen": " a + b", "rejected": " a - b"} for p in PROMPTS]


def parity_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Cheap deterministic reward with feedback, so that SDPO has teacher signal on every step."""
    if "log_extra" in kwargs:
        kwargs["log_extra"]("feedback", [None if len(c) % 2 else "the answer has even length" for c in completions])
    return [float(len(c) % 2) for c in completions]


def common(out: str, steps: int) -> dict[str, Any]:
    return {
        "output_dir": out,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 16,
        # every rollout is exactly 16 tokens in both trainers, so generation costs the same
        "generation_kwargs": {"min_new_tokens": 16},
        "max_steps": steps,
        "learning_rate": 1e-4,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "gradient_checkpointing": False,
        "seed": 0,
    }


class StepClock(TrainerCallback):
    """Records the wall-clock time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter())


def run(kind: str, model: Any, tokenizer: Any, warmup: int, steps: int) -> float:
    """Seconds for ``steps`` optimizer steps after ``warmup`` untimed ones, in one training run."""
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS] * 64)
    with tempfile.TemporaryDirectory() as out:
        if kind == "grpo":
            trainer: GRPOTrainer = GRPOTrainer(
                model=copy.deepcopy(model),
                reward_funcs=parity_reward,
                args=GRPOConfig(**common(out, warmup + steps)),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        else:
            trainer = ComposerReplicationTrainer(
                model=copy.deepcopy(model),
                reward_funcs=parity_reward,
                args=ComposerConfig(**common(out, warmup + steps), trace_replay_dpo_weight=1.0, sdpo_top_k=20),
                train_dataset=dataset,
                processing_class=tokenizer,
                trace_replay_pairs=PAIRS,
            )
        trainer.remove_callback(PrinterCallback)
        clock = StepClock()
        trainer.add_callback(clock)
        trainer.train()
        return clock.times[-1] - clock.times[warmup - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=None, help="model vocabulary (default: the tokenizer's)")
    opts = parser.parse_args()
    if opts.warmup < 1 or opts.steps < 1 or opts.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be >= 1")
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=64, num_layers=2, num_heads=4, vocab_size=opts.vocab)
    print(f"vocabulary {model.config.vocab_size}, load average {os.getloadavg()[0]:.2f}")
    best: dict[str, float] = {}
    for _ in range(opts.repeats):
        for kind in ("grpo", "composer"):  # interleaved so machine load affects both alike
            best[kind] = min(best.get(kind, float("inf")), run(kind, model, tokenizer, opts.warmup, opts.steps))
    rate = {k: opts.steps / v for k, v in best.items()}
    print(f"{'trainer':<44} {'steps':>5} {'seconds':>8} {'steps/s':>8}")
    print(f"{'TRL GRPOTrainer':<44} {opts.steps:>5} {best['grpo']:>8.2f} {rate['grpo']:>8.3f}")
    print(
        f"{'ComposerReplicationTrainer (GRPO+SDPO+DPO)':<44} {opts.steps:>5} {best['composer']:>8.2f} {rate['composer']:>8.3f}"
    )
    ratio = rate["composer"] / rate["grpo"]
    print(f"ratio composer/TRL = {ratio:.2f}x (target >= 0.80x): {'PASS' if ratio >= 0.8 else 'BELOW TARGET'}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
