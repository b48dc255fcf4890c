"""``UnitTestReward``: the share of a row's unit tests a completion passes, decided outside its process.

For each completion: the code is extracted (``extract_code``, after the prompt when
``prepend_prompt``), the row's tests are split on the trainer side into probes and expected values
(``crf_core.rewards.asserts``), the sandbox runs the code and evaluates only the probes
(``crf_core.rewards._harness`` under ``run_python``), and the trainer reads the returned data
strictly (``crf_core.rewards.record``) and compares it with the expected values it alone holds.

Reward: ``passed tests / total tests`` in [0, 1]; a test passes when all its asserts pass. Anything
abnormal (the program did not load, crashed the harness, timed out, was killed, or wrote a record
that does not parse) scores 0. ``__call__`` never raises for anything a completion contains; it
raises only for a malformed call or dataset (missing tests column, lengths that disagree, a test
that cannot be split), before any code runs. Within one call, identical (code, tests, entry point)
jobs run once and share the outcome (a GRPO group or an evaluation often repeats a completion).

Feedback for SDPO is built from the harness's record, never from the program's output beyond a
bound: which tests failed, expected vs got, the exception and a bounded traceback; for crashes, the
exit status and at most ``_OUTPUT_TAIL_CHARS`` of the program's stderr. It is reported through TRL's
``log_extra(feedback_key, values)`` (one string per completion, empty on success), which
``ComposerReplicationTrainer`` reads as the SDPO environment feedback.
"""

from __future__ import annotations

import logging
import marshal
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crf_core.messages import message_text
from crf_core.rewards import _harness
from crf_core.rewards._pool import SandboxPool
from crf_core.rewards.asserts import UNSPLITTABLE, Check, UnitTest, Unsplittable, parse_tests
from crf_core.rewards.extract import extract_code
from crf_core.rewards.record import MalformedRecord, NotData, Raised, Returned, bounded_repr, parse_record
from crf_core.rewards.sandbox import Isolation, SandboxResult, require_isolation, run_python

__all__ = ["TestOutcome", "UnitTestReward"]

_log = logging.getLogger(__name__)
_HARNESS_SOURCE = Path(_harness.__file__).read_text(encoding="utf-8")
_RECORD_BUDGET_CHARS = 16_000_000  # the harness spends at most this, plus LINE_RESERVE per line
_OUTPUT_TAIL_CHARS = 300
_STDERR_CHARS = 64_000  # of the program's stderr kept (feedback shows the last _OUTPUT_TAIL_CHARS of it)
_VALUE_CHARS = 200
_FAILURES_SHOWN = 3


@dataclass(frozen=True)
class TestOutcome:
    """Tests passed out of ``total`` for one completion, and the feedback text (empty on success)."""

    __test__ = False  # not a pytest test class

    passed: int
    total: int
    feedback: str

    @property
    def reward(self) -> float:
        """Fraction of tests passed, in [0, 1]."""
        return self.passed / self.total


class UnitTestReward:
    """TRL reward function: fraction of unit tests a generated function passes, verdict kept outside the sandbox.

    Args:
        tests_key: dataset column holding each row's tests, a list of assert statements (e.g.
            ``"assert add(1, 2) == 3"``); TRL passes it as a keyword argument.
        prepend_prompt: run ``prompt + completion`` (the prompt holds the function signature and the
            completion its body, HumanEval style) instead of the completion alone.
        timeout_s, memory_mb: sandbox limits per completion (all of its tests run in one process).
        feedback_key: column name given to TRL's ``log_extra`` (the trainer's ``sdpo_feedback_key``).
        max_workers: completions scored in parallel (each in its own sandbox).
        isolation: ``"bwrap"`` (default; refuses at construction when bubblewrap is not usable) or
            ``"rlimits"`` (explicit opt-in to resource limits only; see ``run_python``).
        unsplittable: ``"refuse"`` (default) a test that is not a supported assert shape, or
            ``"verdict_in_sandbox"``: run it whole in the sandbox and count "raised nothing" as a
            pass (weaker: a hostile program can fake it).
        entry_point_key: dataset column naming the function under test; when present, tests may call
            it as ``candidate(...)`` (HumanEval style).
        max_feedback_chars: bound on each feedback string.
        warm_pool: score in a ``SandboxPool`` of ``max_workers`` warm bubblewrap workers (opt-in, root trainers
            only; ``crf_core.rewards._pool`` lists the guarantees and what differs from a fresh sandbox per
            completion) instead of starting a sandbox per completion; needs ``isolation="bwrap"``.
    """

    __name__ = "unit_tests"

    def __init__(
        self,
        *,
        tests_key: str = "tests",
        prepend_prompt: bool = True,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        feedback_key: str = "feedback",
        max_workers: int = 2,
        isolation: Isolation = "bwrap",
        unsplittable: Unsplittable = "refuse",
        entry_point_key: str = "entry_point",
        max_feedback_chars: int = 2000,
        warm_pool: bool = False,
    ) -> None:
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if not (isinstance(memory_mb, int) and memory_mb >= 64):
            raise ValueError(f"memory_mb must be an int >= 64, got {memory_mb!r}")
        if unsplittable not in UNSPLITTABLE:
            raise ValueError(f"unsplittable must be 'refuse' or 'verdict_in_sandbox', got {unsplittable!r}")
        if not (isinstance(max_feedback_chars, int) and max_feedback_chars >= 200):
            raise ValueError(f"max_feedback_chars must be an int >= 200, got {max_feedback_chars!r}")
        if not isinstance(warm_pool, bool):
            raise TypeError(f"warm_pool must be a bool, got {type(warm_pool).__name__}")
        if warm_pool and isolation != "bwrap":
            raise ValueError(f"warm_pool=True runs under bubblewrap: it needs isolation='bwrap', got {isolation!r}")
        require_isolation(isolation)  # refuse now, not at the first training step
        self.pool = SandboxPool(max_workers, preload=[_HARNESS_SOURCE]) if warm_pool else None
        self.tests_key = tests_key
        self.prepend_prompt = prepend_prompt
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.feedback_key = feedback_key
        self.max_workers = max_workers
        self.isolation: Isolation = isolation
        self.unsplittable: Unsplittable = unsplittable
        self.entry_point_key = entry_point_key
        self.max_feedback_chars = max_feedback_chars

    def score(self, code: str, tests: Sequence[str], *, entry_point: str | None = None) -> TestOutcome:
        """Run ``code`` against ``tests`` in the sandbox and judge the returned values.

        Raises ``ValueError`` (``UnsplittableTestError``) for tests it cannot split; never for ``code``.
        """
        specs = parse_tests(tests, self.unsplittable)
        counted = sum(1 for spec in specs if spec.checks)
        if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
            raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
        if not isinstance(code, str):
            return TestOutcome(0, counted, "The completion is not text.")
        try:
            checks = [check for spec in specs for check in spec.checks]
            job = {
                "code": code,
                "setup": list(dict.fromkeys(s for spec in specs for s in spec.setup)),
                "probes": [(c.probe, "exec" if c.kind == "ran" else "eval") for c in checks],
                "entry_point": entry_point,
                "budget": _RECORD_BUDGET_CHARS,
            }
            result = run_python(
                _HARNESS_SOURCE,
                stdin=marshal.dumps(job),
                timeout_s=self.timeout_s,
                memory_mb=self.memory_mb,
                max_output_chars=_RECORD_BUDGET_CHARS + _harness.LINE_RESERVE * (len(checks) + 2),
                max_stderr_chars=_STDERR_CHARS,
                isolation=self.isolation,
                pool=self.pool,
            )
            return self._judge(specs, len(checks), result)
        except Exception:  # a bug or an OS failure here must not stop training
            _log.exception("crf UnitTestReward: scoring failed; the completion scores 0")
            return TestOutcome(0, counted, "The tests could not be run (an internal error; see the trainer log).")

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        if self.tests_key not in kwargs:
            raise KeyError(
                f"the dataset has no '{self.tests_key}' column; add one with each row's unit tests "
                f"or set tests_key to the column that holds them"
            )
        tests_per_row = kwargs[self.tests_key]
        if len(tests_per_row) != len(completions) or len(prompts) != len(completions):
            raise ValueError(
                f"got {len(prompts)} prompts, {len(completions)} completions and {len(tests_per_row)} test lists"
            )
        entry_points = kwargs.get(self.entry_point_key) or [None] * len(completions)
        if len(entry_points) != len(completions):
            raise ValueError(
                f"got {len(entry_points)} '{self.entry_point_key}' values for {len(completions)} completions"
            )
        for tests in tests_per_row:  # refuse a bad dataset row before running anything
            parse_tests(tests, self.unsplittable)
        programs = []
        for prompt, completion in zip(prompts, completions, strict=True):
            code = extract_code(message_text(completion))
            if self.prepend_prompt:
                if not isinstance(prompt, str):
                    raise TypeError("prepend_prompt=True needs plain-text prompts; set prepend_prompt=False for chat")
                code = prompt + code
            programs.append(code)
        # Identical (program, tests, entry point) jobs run once: a GRPO group or an evaluation often repeats a
        # completion, and the verdict of a program on fixed tests does not depend on which row asked.
        jobs = list(zip(programs, (tuple(t) for t in tests_per_row), entry_points, strict=True))
        unique = list(dict.fromkeys(jobs))
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            verdicts = dict(
                zip(unique, pool.map(lambda job: self.score(job[0], job[1], entry_point=job[2]), unique), strict=True)
            )
        outcomes = [verdicts[job] for job in jobs]
        log_extra: Callable[[str, list[Any]], None] | None = kwargs.get("log_extra")
        if log_extra is not None:
            log_extra(self.feedback_key, [o.feedback for o in outcomes])
        return [o.reward for o in outcomes]

    def _judge(self, specs: Sequence[UnitTest], probes: int, result: SandboxResult) -> TestOutcome:
        specs = [spec for spec in specs if spec.checks]  # import-only entries are setup, not tests
        total = len(specs)
        if result.error is not None:
            _log.warning("crf UnitTestReward: the sandbox failed: %s", result.error)
            return TestOutcome(0, total, self._bounded(result.describe()))
        if result.timed_out:
            return TestOutcome(0, total, result.describe())
        try:
            if result.returncode != 0:
                raise MalformedRecord("the program did not exit normally")
            record = parse_record(result.stdout, probes)
        except MalformedRecord:
            return TestOutcome(0, total, self._bounded(_crash_account(result)))
        if record.load_error is not None:
            return TestOutcome(0, total, self._bounded("The code does not run: " + _raised_text(record.load_error)))
        results = iter(record.results)
        passed = 0
        failures: list[str] = []
        for spec in specs:
            verdicts = [(check, next(results)) for check in spec.checks]
            failed = [(c, r) for c, r in verdicts if not (isinstance(r, Returned) and c.passes(r.value))]
            if failed:
                failures.append(_failure_text(*failed[0], with_traceback=not failures))
            else:
                passed += 1
        if not failures:
            return TestOutcome(passed, total, "")
        head = f"{len(failures)} of {total} tests failed."
        shown = "\n".join(failures[:_FAILURES_SHOWN])
        more = f"\n(and {len(failures) - _FAILURES_SHOWN} more)" if len(failures) > _FAILURES_SHOWN else ""
        return TestOutcome(passed, total, self._bounded(f"{head}\n{shown}{more}"))

    def _bounded(self, text: str) -> str:
        """``text`` within ``max_feedback_chars``, cut after its last whole line that fits (a cut line would
        show half a name or number as if it were the program's)."""
        limit = self.max_feedback_chars
        if len(text) <= limit:
            return text
        head = text[: limit - 14]
        line_end = head.rfind("\n")
        return (head[:line_end] if line_end > 0 else head) + "\n[... cut ...]"


def _failure_text(check: Check, result: Returned | Raised, *, with_traceback: bool) -> str:
    """One failed test in words; the traceback only for the first failure (the rest usually repeat it)."""
    where = f"Test `{_clip(check.assertion, 300)}` failed: "
    if isinstance(result, Raised):
        subject = _clip(check.probe, 200) if check.kind != "ran" else "it"
        detail = _raised_text(result) if with_traceback else _clip(result.describe(), 300)
        return where + f"{subject} raised {detail}"
    got = result.value
    if isinstance(got, NotData):
        return where + f"{_clip(check.probe, 200)} returned a value of type {got.type_name}, which is not plain data."
    return (
        where + f"{_clip(check.probe, 200)} returned {bounded_repr(got, _VALUE_CHARS)}; expected {check.expectation()}."
    )


def _raised_text(raised: Raised) -> str:
    text = _clip(raised.describe(), 500)
    if raised.traceback.strip():
        text += "\nTraceback (most recent call last):\n" + _clip(raised.traceback.rstrip(), 600, keep="tail")
    return text


def _crash_account(result: SandboxResult) -> str:
    if result.returncode is not None and result.returncode < 0:
        status = result.describe()
    else:
        status = f"The program ended before the tests finished (exit status {result.returncode})."
    tail = result.stderr.strip()
    if tail:
        status += "\nIts last output:\n" + _clip(tail, _OUTPUT_TAIL_CHARS, keep="tail")
    return status


def _clip(text: str, limit: int, keep: str = "head") -> str:
    if len(text) <= limit:
        return text
    return "..." + text[-(limit - 3) :] if keep == "tail" else text[: limit - 3] + "..."
