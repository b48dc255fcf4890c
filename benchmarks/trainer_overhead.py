"""Steps per second of ComposerReplicationTrainer against TRL: every channel vs ``GRPOTrainer``, GRPO + SDPO vs
``SDPOTrainer``.

Same tiny offline model (2-layer Llama, character vocabulary), same data, same reward, same GRPO
settings, and every rollout forced to the full 16 tokens so all trainers generate the same amount;
each trainer runs ``--steps`` timed optimizer steps after ``--warmup`` untimed ones (timed by a
step-end callback inside one run), ``--repeats`` times interleaved, and the best time is kept. The trainers
are `trainer_peers.py`'s: ``crf-all`` (GRPO + SDPO + DPO) against ``trl`` (target ≥ 0.8×: the Composer trainer
does the GRPO step, with the SDPO student scored in the same pass, plus a no-grad teacher forward on the longer
reprompts and a DPO forward/backward on pairs), ``crf-sdpo`` against ``trl-sdpo`` (target ≥ 1.0×).

    python benchmarks/trainer_overhead.py            # a few minutes on 2 idle CPU cores
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

from trainer_peers import PEER, build, dataset
from transformers import PrinterCallback, TrainerCallback

from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm

TARGET = {"crf-all": 0.8, "crf-sdpo": 1.0}


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
        "bf16": False,  # float32 for every trainer (GRPOConfig's default is bf16 autocast)
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
    with tempfile.TemporaryDirectory() as out:
        trainer = build(kind, copy.deepcopy(model), tokenizer, dataset(64), common(out, warmup + steps))
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
    kinds = [kind for ours in TARGET for kind in (PEER[ours], ours)]
    best: dict[str, float] = {}
    for _ in range(opts.repeats):
        for kind in kinds:  # interleaved so machine load affects every trainer alike
            best[kind] = min(best.get(kind, float("inf")), run(kind, model, tokenizer, opts.warmup, opts.steps))
    rate = {k: opts.steps / v for k, v in best.items()}
    print(f"{'trainer':<10} {'steps':>5} {'seconds':>8} {'steps/s':>8}")
    for kind in kinds:
        print(f"{kind:<10} {opts.steps:>5} {best[kind]:>8.2f} {rate[kind]:>8.3f}")
    for ours, target in TARGET.items():
        ratio = rate[ours] / rate[PEER[ours]]
        verdict = "PASS" if ratio >= target else "BELOW TARGET"
        print(f"ratio {ours}/{PEER[ours]} = {ratio:.2f}x (target >= {target:.2f}x): {verdict}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
