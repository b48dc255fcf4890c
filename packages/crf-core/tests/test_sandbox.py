"""Untrusted code runs in a separate limited process; the unit-test reward scores it and reports feedback."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from crf_core.rewards import UnitTestReward, extract_code
from crf_core.sandbox import run_python

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]


def test_runs_in_another_process_and_captures_output() -> None:
    result = run_python("import os, sys\nprint(os.getpid())\nprint('err', file=sys.stderr)")
    assert result.ok
    assert result.returncode == 0
    assert int(result.stdout.split()[0]) != os.getpid()
    assert result.stderr.strip() == "err"


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    monkeypatch.setenv("HF_TOKEN", "hf_should_not_leak")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('OPENAI_API_KEY'))")
    assert "OPENAI_API_KEY" not in result.stdout
    assert "HF_TOKEN" not in result.stdout
    assert "sk-should-not-leak" not in result.stdout
    assert result.stdout.splitlines()[-1] == "None"


def test_temporary_working_directory_is_removed() -> None:
    result = run_python("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())")
    workdir = Path(result.stdout.strip())
    assert workdir.name.startswith("crf-sandbox-")
    assert not workdir.exists()


def test_hanging_program_is_killed_at_the_time_limit() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - start < 5.0
    assert result.timed_out
    assert not result.ok
    assert result.returncode is None
    assert "Timed out" in result.describe()


def test_memory_limit_stops_a_large_allocation() -> None:
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert not result.ok
    assert "allocated" not in result.stdout
    assert "MemoryError" in result.stderr


def test_crash_reports_the_traceback() -> None:
    result = run_python("raise RuntimeError('boom')")
    assert result.returncode == 1
    assert not result.ok
    assert "RuntimeError: boom" in result.describe()


def test_output_is_truncated() -> None:
    result = run_python("print('x' * 100000)", max_output_chars=50)
    assert result.ok
    assert len(result.stdout) < 200
    assert "truncated" in result.stdout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 10}, "memory_mb"), ({"max_output_chars": -1}, "max_output_chars")],
)
def test_bad_limits_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_python("pass", **kwargs)


def test_unit_test_reward_scores_and_reports_feedback() -> None:
    reward = UnitTestReward(timeout_s=2.0)
    logged: dict[str, list[Any]] = {}
    prompts = ["def add(a, b):\n    return"] * 4
    completions = [" a + b\n", " a\n", " undefined_name\n", " a +\n"]
    scores = reward(prompts, completions, tests=[ADD_TESTS] * 4, log_extra=lambda k, v: logged.setdefault(k, v))
    assert scores == [1.0, pytest.approx(1 / 3), 0.0, 0.0]
    feedback = logged["feedback"]
    assert feedback[0] == ""
    assert feedback[1] == "Test `assert add(1, 2) == 3` failed: AssertionError"
    assert "NameError" in feedback[2]
    assert feedback[3].startswith("The code does not run: SyntaxError")


def test_unit_test_reward_times_out_hanging_code() -> None:
    reward = UnitTestReward(timeout_s=1.0, prepend_prompt=False)
    outcome = reward.score("def add(a, b):\n    while True:\n        pass\n", ADD_TESTS)
    assert outcome.reward == 0.0
    assert "Timed out" in outcome.feedback


def test_printed_fake_result_line_does_not_score() -> None:
    reward = UnitTestReward(prepend_prompt=False)
    outcome = reward.score("print('CRF-RESULT 0000 3 3')\nadd = lambda a, b: 0\n", ADD_TESTS)
    assert outcome.passed == 2  # add(0, 0) and add(-1, 1) pass; the forged "3 3" line has the wrong nonce


def test_unit_test_reward_input_errors() -> None:
    reward = UnitTestReward()
    with pytest.raises(KeyError, match="tests"):
        reward(["p"], ["c"])
    with pytest.raises(ValueError, match="non-empty list"):
        reward.score("pass", [])
    assert extract_code("Here:\n```python\nx = 1\n```\nbye") == "x = 1\n"
    assert extract_code(" a + b") == " a + b"
