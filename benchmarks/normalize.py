"""Benchmark: crf-replaysim's native normaliser versus data-juicer 1.6.1 on the default recipe.

Writes ``--pairs`` synthetic DPO pairs (duplicates, junk, unicode, edge lengths; ``crf_replaysim._synthetic``)
to a JSONL file, then runs ``normalize_jsonl`` once per backend, each in a fresh Python process so the wall
time includes interpreter start-up and imports. Prints records/s, wall time, peak RSS, the speed-up, whether
both backends wrote identical kept records, and native peak RSS at 1/4 and 1x the input size (flat memory).

    python benchmarks/normalize.py                  # 20,000 pairs, both backends
    python benchmarks/normalize.py --native-only    # no data-juicer needed

Target: native wall time at most 1/25 of data-juicer's; native peak RSS flat in the input size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CHILD = """
import json, resource, sys
from crf_replaysim.normalize import normalize_jsonl
summary = normalize_jsonl(sys.argv[1], sys.argv[2], backend=sys.argv[3])
usage, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"read": summary.read, "kept": summary.kept, "malformed": len(summary.malformed),
                  "maxrss_kib": usage.ru_maxrss,
                  "cpu_s": usage.ru_utime + usage.ru_stime + kids.ru_utime + kids.ru_stime}))
"""


def _write_corpus(path: Path, pairs: int, seed: int) -> None:
    from crf_replaysim._synthetic import synthetic_dj_records

    with path.open("w", encoding="utf-8") as handle:
        for record in synthetic_dj_records(pairs, seed=seed):
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def _run(backend: str, src: Path, dst: Path, repeats: int = 1) -> dict[str, Any]:
    """Run one backend ``repeats`` times in fresh processes; keep the run with the median wall time."""
    runs = sorted((_run_once(backend, src, dst) for _ in range(repeats)), key=lambda r: float(r["wall_s"]))
    return runs[len(runs) // 2]


def _run_once(backend: str, src: Path, dst: Path) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst), backend], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{backend} run failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20_000, help="number of synthetic pairs (default 20000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--native-only", action="store_true", help="skip the data-juicer run")
    parser.add_argument("--repeats", type=int, default=3, help="native runs per size; the median is shown")
    args = parser.parse_args(argv)
    if args.pairs < 4:
        parser.error("--pairs must be at least 4")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    with tempfile.TemporaryDirectory(prefix="crf-bench-normalize-") as tmp:
        work = Path(tmp)
        src, quarter = work / "pairs.jsonl", work / "pairs_quarter.jsonl"
        _write_corpus(src, args.pairs, args.seed)
        _write_corpus(quarter, args.pairs // 4, args.seed)

        rows: list[tuple[str, dict[str, Any]]] = [("native", _run("native", src, work / "native.jsonl", args.repeats))]
        small = _run("native", quarter, work / "native_quarter.jsonl", args.repeats)
        if not args.native_only:
            rows.append(("data-juicer", _run("data-juicer", src, work / "dj.jsonl")))

        print(f"default recipe, {args.pairs} synthetic pairs (seed {args.seed}), fresh process per run")
        print(f"{'backend':<12} {'wall s':>8} {'CPU s':>7} {'records/s':>10} {'kept':>7} {'peak RSS MiB':>13}")
        for name, r in rows:
            rate = r["read"] / r["wall_s"]
            print(
                f"{name:<12} {r['wall_s']:>8.2f} {r['cpu_s']:>7.2f} {rate:>10.0f} {r['kept']:>7} "
                f"{r['maxrss_kib'] / 1024:>13.1f}"
            )
        native = rows[0][1]
        print(
            f"native memory: peak RSS {small['maxrss_kib'] / 1024:.1f} MiB at {args.pairs // 4} pairs, "
            f"{native['maxrss_kib'] / 1024:.1f} MiB at {args.pairs} pairs"
        )
        if not args.native_only:
            dj = rows[1][1]
            same = (work / "native.jsonl").read_bytes() == (work / "dj.jsonl").read_bytes()
            ratio = dj["wall_s"] / native["wall_s"]
            print(f"kept records identical: {same}")
            print(
                f"native CPU time = 1/{dj['cpu_s'] / native['cpu_s']:.1f} of data-juicer's (its worker processes included)"
            )
            verdict = "ok" if ratio >= 25 else "MISSED"
            print(f"native wall time = 1/{ratio:.1f} of data-juicer's (target: at most 1/25) -> {verdict}")
            return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
