"""Per-sample call time of ``crf_primerl.composer_loss.loss_fn`` against the plain formula reference.

PRIME-RL calls the loss once per packed sample, so the per-call overhead (validation, metrics) is
what matters. Both functions run side by side in one process on the same float32 inputs (trainer
log-probs requiring grad, as in training), alternating A/B, after a warm-up; each timing is the
median over ``--repeats`` rounds of ``--calls`` back-to-back calls. The reference is the independent
formula transcription used by the shadow-parity test (loss + PRIME-RL's metrics); when ``prime_rl``
is importable, PRIME-RL's own ``default_loss_fn`` is timed as well.

    python benchmarks/primerl_loss.py [--seqs 512 8192] [--device cpu|cuda] [--backward]

Target: ``loss_fn`` at most 1.2x the reference per call.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from crf_primerl.composer_loss import LossInputs, loss_fn

TESTS = Path(__file__).resolve().parent.parent / "packages" / "crf-primerl" / "tests"
TARGET_RATIO = 1.2


def _load_reference() -> Callable[..., Any]:
    spec = importlib.util.spec_from_file_location("_crf_primerl_reference", TESTS / "test_composer_loss.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"reference not found at {TESTS / 'test_composer_loss.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference: Callable[..., Any] = module.reference_loss
    return reference


def _sample(seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq)
    p_mu = torch.rand(seq, generator=gen) * 0.96 + 0.02
    p_theta = (p_mu + 0.1 * torch.randn(seq, generator=gen)).clamp(1e-3, 0.999)
    mask = torch.rand(seq, generator=gen) < 0.9
    mask[: seq // 8] = False  # the prompt
    advantage = torch.randn((), generator=gen).expand(seq).contiguous()  # one advantage per sample, broadcast
    return {
        "trainer_logprobs": p_theta.log().to(device).requires_grad_(True),
        "inference_logprobs": p_mu.log().to(device),
        "advantages": advantage.to(device),
        "loss_mask": mask.to(device),
    }


def _time_us(fn: Callable[[], torch.Tensor], calls: int, device: torch.device, backward: bool) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        loss = fn()
        if backward:
            loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backward", action="store_true", help="time loss + backward instead of the call alone")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)

    reference = _load_reference()
    contenders: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
        "crf loss_fn": lambda s: loss_fn(LossInputs(**s)).loss,
        "reference": lambda s: reference(
            s["trainer_logprobs"], s["inference_logprobs"], s["advantages"], s["loss_mask"]
        )[0],
    }
    if importlib.util.find_spec("prime_rl") is not None:
        from prime_rl.configs.trainer import DefaultLossConfig
        from prime_rl.trainer.rl import loss as upstream

        fields = {f.name for f in upstream.LossInputs.__dataclass_fields__.values()}
        teacher = "teacher_logprobs" if "teacher_logprobs" in fields else "ref_logprobs"
        config = DefaultLossConfig()
        contenders["prime-rl default_loss_fn"] = lambda s: (
            upstream.default_loss_fn(upstream.LossInputs(**s, **{teacher: None}), config).loss
        )

    mode = "call+backward" if args.backward else "call"
    print(
        f"device={device} torch={torch.__version__} threads=1 calls/round={args.calls} rounds={args.repeats} mode={mode}"
    )
    header = f"{'seq':>6} " + " ".join(f"{name + ' (us)':>28}" for name in contenders) + f" {'ratio crf/ref':>14}"
    print(header)
    worst = 0.0
    for seq in args.seqs:
        sample = _sample(seq, device)
        bound = {name: (lambda fn=fn, s=sample: fn(s)) for name, fn in contenders.items()}
        for _ in range(args.warmup):
            for fn in bound.values():
                _time_us(fn, args.calls, device, args.backward)
        rounds: dict[str, list[float]] = {name: [] for name in bound}
        for _ in range(args.repeats):  # alternate contenders so drift hits them alike
            for name, fn in bound.items():
                rounds[name].append(_time_us(fn, args.calls, device, args.backward))
        medians = {name: statistics.median(times) for name, times in rounds.items()}
        ratio = medians["crf loss_fn"] / medians["reference"]
        worst = max(worst, ratio)
        extra = ""
        if "prime-rl default_loss_fn" in medians:
            extra = f"  (crf/prime-rl {medians['crf loss_fn'] / medians['prime-rl default_loss_fn']:.2f}x)"
        print(f"{seq:>6} " + " ".join(f"{medians[name]:>28.1f}" for name in contenders) + f" {ratio:>13.2f}x{extra}")
    verdict = "meets" if worst <= TARGET_RATIO else "MISSES"
    print(f"worst ratio {worst:.2f}x: {verdict} the {TARGET_RATIO}x target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
