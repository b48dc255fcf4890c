"""Peak memory and forward+backward time of the composed token-level loss: naive vs crf-distill chunked.

What is measured
    The two token-level channels of ``compose_loss`` on ``N`` tokens: next-token cross-entropy (lm_ce) plus
    SDPO's generalised JSD (alpha 0.5) against a teacher that shares the lm_head, computed from last hidden
    states ``(N, H)`` and the lm_head weight ``(V, H)`` (float32), followed by ``backward()``. Default
    size: N = batch*tokens = 2048, H = 512, V = 32000.

Variants
    * ``naive``: plain PyTorch on materialised logits: ``logits = h @ W.T``; ``F.cross_entropy``; teacher
      logits under no_grad; JSD via full log-softmaxes, a stacked logsumexp mixture and ``F.kl_div``
      (the way TRL's GKD and most reference code write it).
    * ``crf``: crf-distill's unfused functions (``token_logprobs`` + ``generalized_jsd``) on materialised logits.
    * ``crf_chunked``: ``crf_distill.chunked_fused_loss`` with a CE term and a JSD term sharing one chunked
      lm_head pass (what ``compose_loss(chunk_size=...)`` runs); never holds more than one ``(chunk, V)`` block.
    * ``liger``: Liger-Kernel's ``LigerFusedLinearJSDLoss`` (JSD with ``weight_hard_loss`` CE), if importable.
    * ``naive_jsd`` / ``crf_chunked_jsd``: the JSD channel alone (for comparison with published figures).

How memory is measured (CPU, honest)
    Each variant runs in a fresh Python subprocess. glibc is told to serve every allocation above 64 KiB with
    its own ``mmap`` and to return freed memory at once (``MALLOC_MMAP_THRESHOLD_=65536``,
    ``MALLOC_TRIM_THRESHOLD_=0``), and PyTorch's CPU allocator does not cache, so the process's resident set
    tracks live tensor bytes. The figure reported is the kernel's resident-set high-water mark during the
    first (cold) forward+backward (``getrusage(RUSAGE_SELF).ru_maxrss``) minus the resident set just before it
    (inputs, weights and libraries already loaded). The script prints how far the high-water mark already
    exceeded the baseline before the run ("slack"); it should be ~0. ``tracemalloc`` would miss tensor
    storage entirely, and the torch profiler's CPU memory events do not give a reliable timeline, hence RSS.

Time
    Measured in a second fresh subprocess with the default allocator settings (the mmap setting above makes
    every allocation fault in fresh pages, which penalises many mid-sized chunk buffers and is not what a
    user runs): one warm-up run, then the median over ``--repeats`` runs of the wall time and of the
    process CPU time (``time.process_time``, all threads). On a shared machine the wall time swings with
    other load; the CPU time is the steadier cost figure, so both are printed with their ratios to naive.

Usage
    python benchmarks/loss_memory.py [--tokens 2048 --hidden 512 --vocab 32000 --chunk-size 256 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("naive", "crf", "crf_chunked", "liger", "naive_jsd", "crf_chunked_jsd")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _build(variant: str, n: int, h: int, v: int, chunk: int) -> Callable[[], Any] | None:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    # in-place scaling: no temporary copies, so the resident high-water mark starts at the baseline
    hidden = torch.randn(n, h, generator=gen).mul_(0.5).requires_grad_(True)
    weight = torch.randn(v, h, generator=gen).div_(h**0.5).requires_grad_(True)
    teacher_hidden = torch.randn(n, h, generator=gen).mul_(0.5)
    labels = torch.randint(0, v, (n,), generator=gen)
    mask = torch.ones(n)
    alpha = 0.5
    with_ce = not variant.endswith("_jsd")

    def zero_grads() -> None:
        hidden.grad = None
        weight.grad = None

    if variant.startswith("naive"):

        def run() -> Any:
            zero_grads()
            logits = hidden @ weight.t()
            with torch.no_grad():
                teacher = teacher_hidden @ weight.t()
            s = F.log_softmax(logits, dim=-1)
            t = F.log_softmax(teacher, dim=-1)
            mix = torch.logsumexp(
                torch.stack([s + torch.log(torch.tensor(1 - alpha)), t + torch.log(torch.tensor(alpha))]), dim=0
            )
            jsd = alpha * F.kl_div(mix, t, reduction="none", log_target=True) + (1 - alpha) * F.kl_div(
                mix, s, reduction="none", log_target=True
            )
            loss = jsd.sum(-1).mean()
            if with_ce:
                loss = loss + F.cross_entropy(logits, labels)
            loss.backward()
            return loss

        return run

    from crf_distill import ChunkTerm, aggregate, chunked_fused_loss, generalized_jsd, token_logprobs
    from crf_distill.jsd import generalized_jsd_per_token

    if variant == "crf":

        def run() -> Any:
            zero_grads()
            logits = hidden @ weight.t()
            with torch.no_grad():
                teacher = teacher_hidden @ weight.t()
            loss = generalized_jsd(logits, teacher, mask, alpha=alpha) - aggregate(
                token_logprobs(logits, labels), mask, "token_mean"
            )
            loss.backward()
            return loss

        return run

    if variant.startswith("crf_chunked"):
        weights = mask / mask.sum()
        terms = [ChunkTerm(lambda s, t, rows: generalized_jsd_per_token(s, t, alpha=alpha), weights)]
        if with_ce:
            terms.append(ChunkTerm(lambda s, t, rows: -token_logprobs(s, labels[rows]), weights, needs_teacher=False))

        def run() -> Any:
            zero_grads()
            loss, _ = chunked_fused_loss(
                hidden, weight, terms, teacher_hidden=teacher_hidden, teacher_weight=weight, chunk_size=chunk
            )
            loss.backward()
            return loss

        return run

    if variant == "liger":
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        except ImportError:
            return None
        liger = LigerFusedLinearJSDLoss(weight_hard_loss=1.0, weight_soft_loss=1.0, beta=alpha)

        def run() -> Any:
            zero_grads()
            loss = liger(hidden, weight, teacher_hidden, weight, labels)
            loss.backward()
            return loss

        return run
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def _worker(args: argparse.Namespace) -> None:
    run = _build(args.worker, args.tokens, args.hidden, args.vocab, args.chunk_size)
    if run is None:
        print(json.dumps({"variant": args.worker, "skipped": "not importable"}))
        return
    if args.measure == "memory":
        slack = _maxrss_bytes() - _rss_bytes()
        before = _rss_bytes()
        loss = run()
        peak = _maxrss_bytes() - before
        print(json.dumps({"peak_bytes": peak, "slack_bytes": max(slack, 0), "loss": float(loss.detach())}))
        return
    run()  # warm-up
    walls, cpus = [], []
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    print(json.dumps({"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}))


def _spawn(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"variant": variant}
    for measure in ("memory", "time"):
        env = dict(os.environ)
        if measure == "memory":  # make the resident set track live tensor bytes (see the module docstring)
            env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--measure", measure]
        for flag in ("tokens", "hidden", "vocab", "chunk_size", "repeats"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            return {"variant": variant, "skipped": f"failed: {out.stderr.strip().splitlines()[-1:]}"}
        part = json.loads(out.stdout.strip().splitlines()[-1])
        if "skipped" in part:
            return part
        result.update(part)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="batch*tokens N")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=("memory", "time"), default="time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    print(f"N={args.tokens} H={args.hidden} V={args.vocab} chunk={args.chunk_size} float32, CPU")
    results = {v: _spawn(v, args) for v in args.variants.split(",")}
    header = (
        f"{'variant':<16}{'peak MB':>9}{'slack MB':>9}{'wall s':>8}{'CPU s':>8}"
        f"{'mem/naive':>10}{'CPU/naive':>10}{'wall/naive':>11}{'loss':>10}"
    )
    print(header)
    for name, res in results.items():
        if "skipped" in res:
            print(f"{name:<16}skipped ({res['skipped']})")
            continue
        base = results["naive_jsd" if name.endswith("_jsd") else "naive"]
        ratios = [res[key] / base[key] if key in base else float("nan") for key in ("peak_bytes", "cpu_s", "wall_s")]
        print(
            f"{name:<16}{res['peak_bytes'] / 2**20:>9.1f}{res['slack_bytes'] / 2**20:>9.1f}{res['wall_s']:>8.2f}"
            f"{res['cpu_s']:>8.2f}{ratios[0]:>10.3f}{ratios[1]:>10.3f}{ratios[2]:>11.3f}{res['loss']:>10.5f}"
        )
    print("ratios: *_jsd rows against naive_jsd, the others against naive (the composed CE + JSD loss)")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
