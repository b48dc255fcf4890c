"""What each channel adds: the main job's held-out gain per channel set and seed, at the same budget.

What is measured
    For every channel set (``--arms``, default: the composed recipe, GRPO alone, GRPO + SDPO and
    GRPO + trace-replay DPO) and every seed (``--seeds``, default 0 1 2), one full run of
    ``examples/composer_main.py --channels <arm> --seed <seed>`` (its defaults otherwise: same warm start,
    same steps, same rollouts, same DiLoCo schedule), in a fresh process, one after the other. Each run
    reports the held-out pass rate before and after RL on the 60 held-out tasks (16 samples each) and the
    change with its 95% interval (task as the unit, paired).

Printed
    One row per arm: each seed's change [interval], the mean change over seeds, whether every seed rose
    with an interval above 0, the mean wall time, and the RATIO of the arm's mean change to GRPO alone's
    (the peer: ``1.00`` for GRPO alone). The warm start is the same in every arm of a seed (same seed, same
    demonstrations), so the "before" column repeats. Also the load average, since the machine may be shared.

Run: ``python benchmarks/main_job_ablation.py`` (12 runs, ~25-30 minutes on 2 cores), or e.g.
``--seeds 0 --arms grpo grpo,sdpo_jsd,trace_replay_dpo`` for a quick look. Results go to
``runs/ablation-<timestamp>/`` (each run's report, plus ``ablation.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSED = "grpo,sdpo_jsd,trace_replay_dpo"
ARMS = (COMPOSED, "grpo", "grpo,sdpo_jsd", "grpo,trace_replay_dpo")


def _load() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "n/a"


def run(arm: str, seed: int, out: Path, extra: list[str]) -> dict:
    """One main-job run in its own process; returns its ``result.json`` plus the wall time."""
    folder = out / f"{arm.replace(',', '+')}-seed{seed}"
    command = [sys.executable, str(ROOT / "examples" / "composer_main.py"), "--channels", arm, "--seed", str(seed)]
    command += ["--output-dir", str(folder), *extra]
    start = time.monotonic()
    with open(out / f"{folder.name}.log", "w", encoding="utf-8") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    result = json.loads((folder / "result.json").read_text())
    result["wall_s"] = time.monotonic() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), help="channel sets, each comma-separated")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("extra", nargs="*", help="more flags for every run, after --")
    args = parser.parse_args()
    out = Path(args.output_dir or ROOT / "runs" / time.strftime("ablation-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {_load()}; output {out}", flush=True)
    results: dict[str, list[dict]] = {}
    for arm in args.arms:
        for seed in args.seeds:
            r = run(arm, seed, out, args.extra)
            lo, hi = r["change_interval"]
            print(
                f"{arm:<32} seed {seed}: {r['before']:.3f} -> {r['after']:.3f}  change {r['change']:+.3f} "
                f"[{lo:+.3f}, {hi:+.3f}]  {r['wall_s']:.0f} s  (load {_load()})",
                flush=True,
            )
            results.setdefault(arm, []).append(r)
    peer = statistics.mean(r["change"] for r in results["grpo"]) if "grpo" in results else float("nan")
    header = "| channels | " + " | ".join(f"seed {s}: change [95% CI]" for s in args.seeds)
    header += " | mean change | every seed above 0 | mean wall s | ratio to GRPO alone |"
    lines = [header, "|---" * (len(args.seeds) + 5) + "|"]
    for arm, rows in results.items():
        cells = [f"{r['change']:+.3f} [{r['change_interval'][0]:+.3f}, {r['change_interval'][1]:+.3f}]" for r in rows]
        mean = statistics.mean(r["change"] for r in rows)
        rising = all(r["change_interval"][0] > 0 for r in rows)
        wall = statistics.mean(r["wall_s"] for r in rows)
        lines.append(
            f"| {arm.replace(',', ' + ')} | " + " | ".join(cells) + f" | {mean:+.3f} | {'yes' if rising else 'no'} | "
            f"{wall:.0f} | {mean / peer:.2f} |"
        )
    befores = ", ".join(f"seed {r['seed']} {r['before']:.3f}" for r in next(iter(results.values())))
    lines += ["", f"Held-out pass rate before RL (the same warm start in every arm): {befores}."]
    lines += [f"Load average at the end: {_load()}."]
    table = "\n".join(lines)
    (out / "ablation.md").write_text(table + "\n", encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
