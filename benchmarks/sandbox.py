"""Sandboxed unit-test evaluations per second against the same programs in a plain subprocess.

What is measured
    ``--programs`` MBPP-style candidate programs (right and wrong implementations of a few small
    functions, three asserts each) are scored one after another:

    * ``sandboxed``: ``UnitTestReward(isolation="bwrap").score(code, tests)``, the reward as training
      runs it: bubblewrap (fresh namespaces, tmpfs, seccomp, rlimits) per evaluation, the tests split
      on the trainer side, the record read back strictly;
    * ``plain``: the peer, what an unsandboxed RL loop does: ``subprocess.run([python, "-c", code +
      asserts])`` with a timeout, pass/fail from the exit status;
    * for reference, ``plain -I -S`` (the same peer with the interpreter flags the sandbox uses) and
      ``rlimits`` (``UnitTestReward(isolation="rlimits")``, no namespaces).

    Each round scores every program with every variant, one program at a time with the variants in
    rotating order, so all variants see the same machine load; a variant's throughput in a round is
    programs / its summed seconds, and the figure is the median over ``--rounds`` rounds. Both the
    sandboxed and the plain results are checked to agree on which programs pass. Target (issue 11):
    sandboxed >= 0.6x plain.

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

from crf_core.rewards import UnitTestReward, bubblewrap_problem

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


def reward(isolation: str) -> Callable[[str, list[str]], bool]:
    scorer = UnitTestReward(prepend_prompt=False, timeout_s=5.0, isolation=isolation)  # type: ignore[arg-type]
    return lambda code, tests: scorer.score(code, tests).reward == 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=40, help="programs scored per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    opts = parser.parse_args()
    problem = bubblewrap_problem()
    if problem is not None:
        raise SystemExit(f"bubblewrap is not usable here ({problem}); install the `bubblewrap` package")
    work = programs(opts.programs)
    variants = {
        "sandboxed (bwrap)": reward("bwrap"),
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
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"{len(work)} programs x {opts.rounds} rounds, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    for name, value in median.items():
        print(f"  {name:<20} {value:7.1f} evaluations/s (rounds: {', '.join(f'{v:.1f}' for v in rates[name])})")
    print(f"ratio sandboxed / plain subprocess: {median['sandboxed (bwrap)'] / median['plain subprocess']:.2f}x "
          "(target >= 0.6x)")  # fmt: skip
    print(f"ratio sandboxed / plain -I -S:      {median['sandboxed (bwrap)'] / median['plain -I -S']:.2f}x")


if __name__ == "__main__":
    main()
