"""Peak memory during ``train()``: TRL's ``GRPOTrainer`` and ``SDPOTrainer`` against ``ComposerReplicationTrainer``.

What is measured
    A random Qwen2 (hidden 64, 2 layers, 4 heads) whose vocabulary is ``--vocab`` (default Qwen's 151,936) and
    again at ``--small-vocab``; ``--rollouts`` rollouts of exactly ``--tokens`` completion tokens per step
    (``min_new_tokens``), ``--steps`` optimizer steps, AdamW, CPU, float32. The five trainers of
    ``trainer_peers.py``, each in a fresh process: ``trl`` (TRL ``GRPOTrainer``), ``crf-grpo`` (GRPO channel
    only) and ``crf-all`` (GRPO + SDPO with its EMA self-teacher + trace-replay DPO), each against ``trl``; and
    ``trl-sdpo`` (TRL ``SDPOTrainer``, top-100 + tail, EMA teacher, half policy gradient, half distillation)
    against ``crf-sdpo`` (crf's GRPO + SDPO at the same setting).

How memory is measured (CPU, honest)
    glibc serves every allocation above 64 KiB with its own ``mmap`` and returns freed memory at once
    (``MALLOC_MMAP_THRESHOLD_=65536``, ``MALLOC_TRIM_THRESHOLD_=0``) and PyTorch's CPU allocator does not
    cache, so the resident set tracks live tensor bytes. After the trainer is built (model, EMA teacher,
    tokenised pairs and reference log-probs included) the kernel's high-water mark is reset
    (``/proc/self/clear_refs``); the figure is the high-water mark during ``train()`` minus the resident set
    just before it: everything ``train()`` adds (optimizer state, gradients, activations, logits, generation).

Usage
    python benchmarks/trainer_memory.py                 # both vocabularies, 5 trainers, median of --repeats
    python benchmarks/trainer_memory.py --repeats 1 --only trl crf-grpo
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from trainer_peers import KINDS, PEER, build, dataset


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1))


def _child(args: argparse.Namespace) -> None:
    import gc

    import torch
    from transformers import PrinterCallback

    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(
        tokenizer, architecture="qwen2", hidden_size=64, num_layers=2, num_heads=4, vocab_size=args.vocab
    )
    with tempfile.TemporaryDirectory() as out:
        common: dict[str, Any] = {
            "output_dir": out,
            "per_device_train_batch_size": args.rollouts,
            "num_generations": args.rollouts,
            "max_completion_length": args.tokens,
            "generation_kwargs": {"min_new_tokens": args.tokens},
            "max_steps": args.steps,
            "learning_rate": 1e-5,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": [],
            "use_cpu": True,
            "bf16": False,  # float32 for every trainer (GRPOConfig's default is bf16 autocast)
            "disable_tqdm": True,
            "seed": 0,
        }
        trainer = build(args.child, model, tokenizer, dataset(16), common)
        trainer.remove_callback(PrinterCallback)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as fh:  # reset the high-water mark to the current resident set
            fh.write("5")
        before = _status_kib("VmRSS")
        trainer.train()
        peak = _status_kib("VmHWM")
    print(json.dumps({"trainer": args.child, "vocab": args.vocab, "peak_mb": (peak - before) / 1024}))


def _spawn(trainer: str, vocab: int, args: argparse.Namespace) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", trainer, "--vocab", str(vocab)]
    cmd += ["--steps", str(args.steps), "--rollouts", str(args.rollouts), "--tokens", str(args.tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{trainer} at V={vocab} failed:\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--small-vocab", type=int, default=1_024, help="second vocabulary (0 skips it)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per rollout")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per cell; the median is printed")
    parser.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    vocabs = [args.vocab] + ([args.small_vocab] if args.small_vocab else [])
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print(f"{'vocab':>8} {'trainer':<10} {'peak MB (median)':>17} {'runs':<28} {'x peer':>16}")
    for vocab in vocabs:
        medians: dict[str, float] = {}
        for trainer in args.only:
            runs = [_spawn(trainer, vocab, args) for _ in range(args.repeats)]
            medians[trainer] = statistics.median(runs)
            peer = PEER.get(trainer)
            ratio = f"{medians[trainer] / medians[peer]:.2f}x {peer}" if peer in medians else "-"
            shown = ", ".join(f"{r:.0f}" for r in runs)
            print(f"{vocab:>8} {trainer:<10} {medians[trainer]:>17.0f} {shown:<28} {ratio:>16}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print("targets at V=151,936: crf-all <= 0.50x trl, crf-grpo <= 0.35x trl, crf-sdpo <= 0.25x trl-sdpo")


if __name__ == "__main__":
    main()
