"""What each channel adds: the main job's held-out gain per arm and seed, at the same budget, beside TRL's trainers.

What is measured
    For every arm (``--arms``, default all of `ARMS`) and every seed (``--seeds``, default 0 1 2), one full run of
    ``examples/composer_main.py --seed <seed>`` plus the arm's flags (its defaults otherwise: the same warm start,
    steps, rollouts per step, DiLoCo schedule and evaluation draws in every arm), in a fresh process. Each run
    reports the held-out pass rate before and after RL on the 88 held-out tasks (16 samples each) and on their
    hard subset (the 28 bitwise ones, or/and/xor, a kind the warm start never shows as a task: the warm-started
    policy fails them all, so GRPO's groups there are all zeros and its advantage 0), each change with its 95%
    interval (task as the unit, paired).

    The arms: crf's composed recipe (GRPO + SDPO with the sandbox's feedback + trace-replay DPO), GRPO alone,
    GRPO + SDPO, GRPO + DPO, GRPO + SDPO as forward KL on the full vocabulary with a frozen teacher instead of the
    paper's divergence (generalised JSD on the student's top 20, EMA teacher), the composed recipe with SRPO's
    routing, with SDPO on failed rollouts only and with SC-SDPO's weights, and the peers at the same budget: TRL's
    ``GRPOTrainer`` and ``trl.experimental.sdpo.SDPOTrainer`` (``--trainer``; TRL's SDPO gets the job's SDPO
    settings).

Printed
    One row per arm: each seed's change [interval], the mean change over seeds and its spread (the sample standard
    deviation over seeds), the hard subset's mean change, whether the arm beat crf's GRPO alone on every seed, the
    mean wall time, the mean CPU time (the run's processes, replicas and sandboxes included, from ``wait4``) and its
    ratio to crf GRPO alone's, and the arm's mean change minus crf GRPO alone's over the same seeds with their
    ratio (none where GRPO alone's mean gain is below ``RATIO_FLOOR``: a ratio to ~0 says nothing). Also the load
    average.
    The changes are deterministic per seed (the same numbers on a quiet or a loaded machine, and on any x86-64 CPU:
    the job pins its CPU code paths, ``examples/main_job/numerics.py``); wall times are not, and are comparable only
    between runs made one after the other on the same machine (not with ``--parallel``); CPU times compare arms'
    cost under any load (to a few percent: a loaded machine shares caches).

Run: ``python benchmarks/main_job_ablation.py`` (24 runs, about 1.5 hours on 2 quiet cores), or e.g.
``--seeds 0 --arms composed grpo`` for a quick look. Results go to ``runs/ablation-<timestamp>/`` (each run's
report, ``ablation.json`` and ``ablation.md``); ``--update-docs`` also writes ``docs/ablation.json`` and the
table in ``docs/guide.md`` (between its ``ablation`` markers), which ``tests/test_docs.py`` checks against it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMPOSED = ["--channels", "grpo,sdpo_jsd,trace_replay_dpo"]
FKL_SDPO = ["--sdpo-alpha", "0", "--sdpo-top-k", "0", "--sdpo-teacher-update-rate", "0"]
"""SDPO as forward KL on the full vocabulary with the warm-started policy, frozen, as teacher (the job's own SDPO is
the paper's: generalised JSD on the student's top 20 with an EMA teacher; docs/guide.md)."""
ARMS: dict[str, tuple[str, list[str]]] = {
    "composed": ("crf composed (GRPO + SDPO + DPO)", COMPOSED),
    "grpo": ("crf GRPO alone", ["--channels", "grpo"]),
    "grpo+sdpo": ("crf GRPO + SDPO", ["--channels", "grpo,sdpo_jsd"]),
    "grpo+dpo": ("crf GRPO + trace-replay DPO", ["--channels", "grpo,trace_replay_dpo"]),
    "grpo+sdpo-fkl": (
        "crf GRPO + SDPO, forward KL, full vocabulary, frozen teacher",
        ["--channels", "grpo,sdpo_jsd", *FKL_SDPO],
    ),
    "composed+srpo": ("crf composed, SRPO routing", [*COMPOSED, "--sdpo-routing", "srpo"]),
    "composed+failures": ("crf composed, SDPO on failed rollouts", [*COMPOSED, "--sdpo-routing", "failures"]),
    "composed+sc": ("crf composed, SC-SDPO weights", [*COMPOSED, "--sdpo-group-weight", "success_variance"]),
    "trl-grpo": ("TRL GRPOTrainer", ["--trainer", "trl-grpo"]),
    "trl-sdpo": ("TRL SDPOTrainer", ["--trainer", "trl-sdpo"]),
}
PEER = "grpo"
RATIO_FLOOR = 0.01
"""GRPO alone's mean change below which a ratio to it says nothing (the difference is printed either way)."""
DOCS_JSON = ROOT / "docs" / "ablation.json"
GUIDE = ROOT / "docs" / "guide.md"
START, END = "<!-- ablation:start -->", "<!-- ablation:end -->"


def _load() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "n/a"


def run(arm: str, seed: int, out: Path, extra: list[str]) -> dict[str, Any]:
    """One main-job run in its own process; returns its ``result.json`` plus the wall time."""
    folder = out / f"{arm}-seed{seed}"
    command = [sys.executable, str(ROOT / "examples" / "composer_main.py"), *ARMS[arm][1], "--seed", str(seed)]
    command += ["--output-dir", str(folder), *extra]
    start = time.monotonic()
    with open(out / f"{folder.name}.log", "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        # wait4: this run's CPU time, its replica and sandbox processes included (they are waited for below it),
        # which unlike wall time does not grow with what else the machine runs
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    result = json.loads((folder / "result.json").read_text())
    result["wall_s"] = time.monotonic() - start
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    result["arm"] = arm
    print(
        f"{arm:<14} seed {seed}: change {result['change']:+.3f} [{result['change_interval'][0]:+.3f}, "
        f"{result['change_interval'][1]:+.3f}], hard {result['subsets']['hard']['change']:+.3f}  "
        f"{result['wall_s']:.0f} s  (load {_load()})",
        flush=True,
    )
    return result


def _cell(change: float, interval: list[float]) -> str:
    return f"{change:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]"


def table(record: dict[str, Any]) -> str:
    """The markdown table of an ``ablation.json`` record (what ``--update-docs`` writes into the guide)."""
    seeds: list[int] = record["seeds"]
    runs: dict[str, list[dict[str, Any]]] = record["runs"]
    peer = {r["seed"]: r["change"] for r in runs.get(PEER, [])}
    header = "| arm | " + " | ".join(f"seed {s}: change [95% CI]" for s in seeds)
    header += " | mean change (spread) | hard subset: mean change | above GRPO alone on every seed | mean wall s "
    header += "| mean CPU s (× GRPO alone) | mean change − GRPO alone's (ratio) |"
    lines = [header, "|---" * (len(seeds) + 7) + "|"]
    peer_cpu = [r["cpu_s"] for r in runs.get(PEER, []) if "cpu_s" in r]
    for arm, rows in runs.items():
        rows = sorted(rows, key=lambda r: r["seed"])
        by_seed = {r["seed"]: r for r in rows}
        changes = [r["change"] for r in rows]
        mean = statistics.mean(changes)
        spread = f"{statistics.stdev(changes):.3f}" if len(changes) > 1 else "one seed"
        hard = statistics.mean(r["subsets"]["hard"]["change"] for r in rows)
        above = (
            "—" if arm == PEER or not peer else ("yes" if all(r["change"] > peer[r["seed"]] for r in rows) else "no")
        )
        if len(rows) < len(seeds) and above != "—":
            above += f" (seed{'s' if len(rows) > 1 else ''} {', '.join(str(r['seed']) for r in rows)} only)"
        # like with like: GRPO alone's mean over the seeds this arm ran; a ratio only where that mean is a gain
        same = [peer[r["seed"]] for r in rows if r["seed"] in peer]
        versus = "—"
        if arm != PEER and same and len(same) == len(rows):
            base = statistics.mean(same)
            ratio = f"{mean / base:.2f}×" if base >= RATIO_FLOOR else f"no ratio: GRPO alone {base:+.3f}"
            versus = f"{mean - base:+.3f} ({ratio})"
        cells = [_cell(by_seed[s]["change"], by_seed[s]["change_interval"]) if s in by_seed else "—" for s in seeds]
        cpu = "—"
        if all("cpu_s" in r for r in rows):
            cpu = f"{statistics.mean(r['cpu_s'] for r in rows):.0f}"
            if peer_cpu:
                cpu += f" ({statistics.mean(r['cpu_s'] for r in rows) / statistics.mean(peer_cpu):.2f}×)"
        lines.append(
            f"| {ARMS[arm][0] if arm in ARMS else arm} | " + " | ".join(cells) + f" | {mean:+.3f} ({spread}) | "
            f"{hard:+.3f} | {above} | {statistics.mean(r['wall_s'] for r in rows):.0f} | {cpu} | {versus} |"
        )
    befores = ", ".join(
        f"seed {r['seed']} {r['before']:.3f} (hard {r['subsets']['hard']['before']:.3f})"
        for r in sorted(next(iter(runs.values())), key=lambda r: r["seed"])
    )
    lines += [
        "",
        f"Held-out pass rate before RL (the same warm start in every arm): {befores}. "
        f"Load average {record['load_start']} at the start, {record['load_end']} at the end. "
        f"Command: `{record['command']}`.",
    ]
    return "\n".join(lines)


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from several (each run once per arm and seed; a later record's run replaces an earlier one)."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for record in records:
        for arm, rows in record["runs"].items():
            runs.setdefault(arm, {}).update({r["seed"]: r for r in rows})
    return {
        "command": " ; ".join(r["command"] for r in records),
        "seeds": sorted({s for r in records for s in r["seeds"]}),
        "load_start": records[0]["load_start"],
        "load_end": records[-1]["load_end"],
        "runs": {arm: [rows[s] for s in sorted(rows)] for arm, rows in runs.items()},
    }


def update_docs(record: dict[str, Any]) -> None:
    """Write ``docs/ablation.json`` and the guide's table from ``record``."""
    DOCS_JSON.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    text = GUIDE.read_text(encoding="utf-8")
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{GUIDE} has no {START} ... {END} block to replace")
    GUIDE.write_text(f"{head}{START}\n{table(record)}\n{END}{tail}", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (wall times are then not comparable)")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--update-docs", action="store_true", help="write docs/ablation.json and the guide's table")
    parser.add_argument(
        "--merge", nargs="+", default=[], metavar="ABLATION_JSON",
        help="instead of running, merge earlier runs' ablation.json records (later ones win per arm and seed)",
    )  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more flags for every run, after --")
    args = parser.parse_args()
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    if args.merge:
        record = merge([json.loads(Path(p).read_text(encoding="utf-8")) for p in args.merge])
        print(table(record))
        if args.update_docs:
            update_docs(record)
        return
    out = Path(args.output_dir or ROOT / "runs" / time.strftime("ablation-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load_start = _load()
    print(f"load average at start: {load_start}; output {out}", flush=True)
    jobs = [(arm, seed) for arm in args.arms for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(lambda job: run(job[0], job[1], out, args.extra), jobs))
    command = "python benchmarks/main_job_ablation.py " + " ".join(
        ["--seeds", *map(str, args.seeds), "--arms", *args.arms]
        + (["--parallel", str(args.parallel)] if args.parallel > 1 else [])
        + (["--", *args.extra] if args.extra else [])
    )
    record = {
        "command": command,
        "seeds": args.seeds,
        "load_start": load_start,
        "load_end": _load(),
        "runs": {arm: [r for r in results if r["arm"] == arm] for arm in args.arms},
    }
    (out / "ablation.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    text = table(record)
    (out / "ablation.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    if args.update_docs:
        update_docs(record)
        print(f"updated {DOCS_JSON.relative_to(ROOT)} and the table in {GUIDE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
