"""Sandboxed unit-test evaluations per second against the same programs in a plain subprocess.

What is measured
    ``--programs`` MBPP-style candidate programs (right and wrong implementations of a few small
    functions, three asserts each) are scored one after another:

    * ``sandboxed``: ``UnitTestReward(isolation="bwrap").score(code, tests)``, the reward as training
      runs it: bubblewrap (fresh namespaces, tmpfs, seccomp, rlimits) per evaluation, the tests split
      on the trainer side, the record read back strictly;
    * ``plain``: the peer, what an unsandboxed RL loop does: ``subprocess.run([python, "-c", code +
      asserts])`` with a timeout, pass/fail from the exit status;
    * ``pool``: ``UnitTestReward(isolation="bwrap", warm_pool=True)``: the same reward scored in warm
      bubblewrap workers that fork a freshly namespaced process per evaluation (``SandboxPool``);
    * for reference, ``plain -I -S`` (the same peer with the interpreter flags the sandbox uses) and
      ``rlimits`` (``UnitTestReward(isolation="rlimits")``, no namespaces).

    Each round scores every program with every variant, one program at a time with the variants in
    rotating order, so all variants see the same machine load; a variant's throughput in a round is
    programs / its summed seconds, and the figure is the median over ``--rounds`` rounds. Both the
    sandboxed and the plain results are checked to agree on which programs pass. Targets: sandboxed
    >= 0.6x plain (issue 11), pool >= 1.5x plain (issue 21).

    ``--batch N`` (default 8) also scores the programs in batches of N, the way TRL calls a reward:
    ``reward(prompts, completions, tests=...)`` with ``max_workers=2`` for the sandboxed variants, and a
    thread pool of 2 running the plain peer's ``subprocess.run`` calls; the figure is programs / seconds
    per batch round, with the variants in rotating order per batch.

Run: ``python benchmarks/sandbox.py`` (``--rounds 3 --programs 20`` for a quick look). Needs bubblewrap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from crf_core.rewards import UnitTestReward, bubblewrap_problem
from crf_core.rewards.sandbox import Isolation

TASKS = [
    ("add", ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-1, 8) == 7"], "a + b", "a - b"),
    ("largest", ["assert largest([3, 9, 2]) == 9", "assert largest([1]) == 1", "assert largest([-5, -2]) == -2"],
     "max(xs)", "xs[0]"),
    ("rev", ["assert rev('abc') == 'cba'", "assert rev('') == ''", "assert rev('xy') == 'yx'"], "s[::-1]", "s"),
    ("evens", ["assert evens([1, 2, 4]) == [2, 4]", "assert evens([]) == []", "assert evens([3]) == []"],
     "[x for x in xs if x % 2 == 0]", "[x for x in xs if x % 2]"),
]  # fmt: skip
ARGS = {"add": "a, b", "largest": "xs", "rev": "s", "evens": "xs"}


def programs(n: int) -> list[tuple[str, list[str], bool]]:
    """``n`` (code, tests, is the code right) triples, alternating right and wrong implementations."""
    out = []
    for i in range(n):
        name, tests, right, wrong = TASKS[i % len(TASKS)]
        good = (i // len(TASKS)) % 2 == 0
        code = f"def {name}({ARGS[name]}):\n    return {right if good else wrong}\n"
        out.append((code, tests, good))
    return out


def plain(flags: list[str]) -> Callable[[str, list[str]], bool]:
    def run(code: str, tests: list[str]) -> bool:
        program = code + "\n" + "\n".join(tests) + "\n"
        try:
            done = subprocess.run([sys.executable, *flags, "-c", program], capture_output=True, timeout=5.0)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    return run


def reward(isolation: Isolation, warm_pool: bool = False) -> Callable[[str, list[str]], bool]:
    scorer = UnitTestReward(prepend_prompt=False, timeout_s=5.0, isolation=isolation, warm_pool=warm_pool)
    return lambda code, tests: scorer.score(code, tests).reward == 1.0


Batch = Callable[[list[tuple[str, list[str], bool]]], list[bool]]


def plain_batch(workers: int) -> Batch:
    one = plain([])
    executor = ThreadPoolExecutor(max_workers=workers)
    return lambda batch: list(executor.map(lambda job: one(job[0], job[1]), batch))


def reward_batch(isolation: Isolation, warm_pool: bool, workers: int) -> Batch:
    scorer = UnitTestReward(
        prepend_prompt=False, timeout_s=5.0, isolation=isolation, warm_pool=warm_pool, max_workers=workers
    )

    def run(batch: list[tuple[str, list[str], bool]]) -> list[bool]:
        rewards = scorer(["" for _ in batch], [code for code, _, _ in batch], tests=[tests for _, tests, _ in batch])
        return [value == 1.0 for value in rewards]

    return run


def measure_batches(work: list[tuple[str, list[str], bool]], size: int, rounds: int) -> dict[str, list[float]]:
    """Throughput per round of each batch variant (programs / summed seconds), variants rotating per batch."""
    variants = {
        "sandboxed (bwrap)": reward_batch("bwrap", False, 2),
        "pool": reward_batch("bwrap", True, 2),
        "plain subprocess": plain_batch(2),
    }
    names = list(variants)
    batches = [work[i : i + size] for i in range(0, len(work), size)]
    for run in variants.values():
        run(batches[0][:2])
    rates: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        seconds = dict.fromkeys(names, 0.0)
        for i, batch in enumerate(batches):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                verdicts = variants[name](batch)
                seconds[name] += time.perf_counter() - start
                if verdicts != [good for _, _, good in batch]:
                    raise SystemExit(f"{name} judged batch {i} {verdicts}")
        for name in names:
            rates[name].append(len(work) / seconds[name])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=40, help="programs scored per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    parser.add_argument("--batch", type=int, default=8, help="programs per batch in the batch measurement (0: skip)")
    opts = parser.parse_args()
    problem = bubblewrap_problem()
    if problem is not None:
        raise SystemExit(f"bubblewrap is not usable here ({problem}); install the `bubblewrap` package")
    work = programs(opts.programs)
    variants = {
        "sandboxed (bwrap)": reward("bwrap"),
        "pool": reward("bwrap", warm_pool=True),
        "plain subprocess": plain([]),
        "plain -I -S": plain(["-I", "-S"]),
        "rlimits only": reward("rlimits"),
    }
    for run in variants.values():  # warm caches (bubblewrap probe, page cache) outside the timing
        run(*work[0][:2])
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(opts.rounds):
        seconds = dict.fromkeys(names, 0.0)
        for i, (code, tests, good) in enumerate(work):
            for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate who goes first
                start = time.perf_counter()
                verdict = variants[name](code, tests)
                seconds[name] += time.perf_counter() - start
                if verdict != good:
                    raise SystemExit(f"{name} judged program {i} {verdict}, expected {good}:\n{code}")
        for name in names:
            rates[name].append(len(work) / seconds[name])
    load = loadavg()
    print(f"{len(work)} programs x {opts.rounds} rounds, {os.cpu_count()} cores, load average {' '.join(load)}")
    report("sequential", rates)
    if opts.batch > 0:
        batch_rates = measure_batches(work, opts.batch, opts.rounds)
        load = loadavg()
        print(f"batches of {opts.batch}, 2 workers, load average {' '.join(load)}")
        report("batches", batch_rates)


def loadavg() -> list[str]:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg writes them."""
    return Path("/proc/loadavg").read_text().split()[:3]


def report(title: str, rates: dict[str, list[float]]) -> None:
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"{title}:")
    for name, value in median.items():
        print(f"  {name:<20} {value:7.1f} evaluations/s (rounds: {', '.join(f'{v:.1f}' for v in rates[name])})")
    plain_rate = median["plain subprocess"]
    print(f"  ratio sandboxed / plain subprocess: {median['sandboxed (bwrap)'] / plain_rate:.2f}x (target >= 0.6x)")
    print(f"  ratio pool / plain subprocess:      {median['pool'] / plain_rate:.2f}x (target >= 1.5x)")
    if "plain -I -S" in median:
        print(f"  ratio pool / plain -I -S:           {median['pool'] / median['plain -I -S']:.2f}x")


if __name__ == "__main__":
    main()
