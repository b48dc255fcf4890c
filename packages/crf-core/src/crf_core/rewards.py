"""Unit-test rewards for generated Python functions, run in the sandbox, with SDPO feedback.

``UnitTestReward`` is a TRL reward function (``f(prompts, completions, **kwargs) -> list[float]``).
For each completion it assembles ``program = code + tests harness`` and runs it with
``crf_core.sandbox.run_python`` (separate process, time and memory limits, scrubbed env, temp dir).
The reward is the fraction of the sample's tests that pass (0 on a crash or timeout). The failure
account (the first failing test and its error, a traceback, or "Timed out …") is the sample's
environment feedback: it is passed to TRL's ``log_extra(feedback_key, values)`` hook, which
``ComposerReplicationTrainer`` turns into the SDPO teacher's feedback.

The harness reads a random nonce from stdin before running the candidate and prints its tally on
one line tagged with it, so a program cannot fake its score by accident (a program written to
inspect the harness could; the sandbox protects the host, not the reward).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from crf_core.sandbox import SandboxResult, run_python

__all__ = ["TestOutcome", "UnitTestReward", "extract_code"]

_FENCE_RE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", flags=re.DOTALL)

_HARNESS = """
import sys as _crf_sys
_crf_nonce = _crf_sys.stdin.readline().strip()
_crf_tests = {tests}
_crf_ns = {{"__name__": "__candidate__"}}
_crf_passed = 0
_crf_first_failure = None
try:
    exec(compile({code}, "<candidate>", "exec"), _crf_ns)
except BaseException as _crf_exc:
    _crf_first_failure = "The code does not run: " + type(_crf_exc).__name__ + ": " + str(_crf_exc)
else:
    for _crf_test in _crf_tests:
        try:
            exec(compile(_crf_test, "<test>", "exec"), _crf_ns)
            _crf_passed += 1
        except BaseException as _crf_exc:
            if _crf_first_failure is None:
                _crf_first_failure = "Test `" + _crf_test + "` failed: " + type(_crf_exc).__name__ + (
                    (": " + str(_crf_exc)) if str(_crf_exc) else "")
print("CRF-RESULT", _crf_nonce, _crf_passed, len(_crf_tests), flush=True)
if _crf_first_failure is not None:
    print(_crf_first_failure, file=_crf_sys.stderr, flush=True)
"""


@dataclass(frozen=True)
class TestOutcome:
    """Tests passed out of ``total`` for one completion, and the feedback text (empty on success)."""

    passed: int
    total: int
    feedback: str

    @property
    def reward(self) -> float:
        """Fraction of tests passed, in [0, 1]."""
        return self.passed / self.total


def extract_code(completion: str) -> str:
    """The first fenced ```python block of ``completion`` if there is one, else the completion itself."""
    match = _FENCE_RE.search(completion)
    return match.group(1) if match else completion


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    raise TypeError(f"a completion must be a str or a list of messages, got {type(completion).__name__}")


class UnitTestReward:
    """TRL reward function: fraction of unit tests a generated function passes, run in the sandbox.

    Args:
        tests_key: dataset column holding each row's tests (a list of Python statements, e.g.
            ``"assert add(1, 2) == 3"``); TRL passes it as a keyword argument.
        prepend_prompt: run ``prompt + completion`` (the prompt holds the function signature and the
            completion its body, HumanEval style) instead of the completion alone.
        timeout_s, memory_mb: sandbox limits per completion.
        feedback_key: column name given to TRL's ``log_extra`` (the trainer's ``sdpo_feedback_key``).
        max_workers: completions scored in parallel (each in its own process).
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
    ) -> None:
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        self.tests_key = tests_key
        self.prepend_prompt = prepend_prompt
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.feedback_key = feedback_key
        self.max_workers = max_workers

    def score(self, code: str, tests: Sequence[str]) -> TestOutcome:
        """Run ``code`` against ``tests`` in the sandbox."""
        if isinstance(tests, str) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"tests must be a non-empty list of Python statements (str), got {tests!r}")
        nonce = secrets.token_hex(8)
        program = _HARNESS.format(tests=repr(list(tests)), code=repr(code))
        result = run_python(program, stdin=nonce + "\n", timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        return _parse(result, nonce, len(tests))

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
        programs = []
        for prompt, completion in zip(prompts, completions, strict=True):
            code = extract_code(_completion_text(completion))
            if self.prepend_prompt:
                if not isinstance(prompt, str):
                    raise TypeError("prepend_prompt=True needs plain-text prompts; set prepend_prompt=False for chat")
                code = prompt + code
            programs.append(code)
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            outcomes = list(pool.map(self.score, programs, tests_per_row))
        log_extra: Callable[[str, list[Any]], None] | None = kwargs.get("log_extra")
        if log_extra is not None:
            log_extra(self.feedback_key, [o.feedback for o in outcomes])
        return [o.reward for o in outcomes]


def _parse(result: SandboxResult, nonce: str, total: int) -> TestOutcome:
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "CRF-RESULT" and parts[1] == nonce:
            passed = min(int(parts[2]), total)
            if passed == total and result.ok:
                return TestOutcome(passed, total, "")
            failure = result.describe() if not result.ok or not result.stderr.strip() else result.stderr.strip()
            return TestOutcome(passed if result.ok else 0, total, failure)
    return TestOutcome(0, total, result.describe())
