"""UnitTestReward: honest programs score 1.0, wrong ones 0.0, feedback reaches SDPO, bad datasets are refused."""

from __future__ import annotations

from typing import Any

import pytest

import crf_core.rewards.sandbox as sandbox_module
from crf_core.rewards import SandboxUnavailableError, UnitTestReward, UnsplittableTestError
from crf_core.trainer.reprompt import build_reprompts

pytestmark = pytest.mark.usefixtures("bwrap")
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]

# name: (right program, wrong program that fails every test, MBPP/HumanEval-style tests)
TASKS: dict[str, tuple[str, str, list[str]]] = {
    "tuple-and-set": (
        "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n",
        "def similar_elements(a, b):\n    return tuple(sorted(set(a) ^ set(b)))\n",
        [
            "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
            "assert similar_elements((1, 2, 3, 4), (5, 4, 3, 7)) == (3, 4)",
        ],
    ),
    "truthiness": (
        "def is_not_prime(n):\n    return any(n % d == 0 for d in range(2, n))\n",
        "def is_not_prime(n):\n    return n == 2\n",
        ["assert is_not_prime(10)", "assert not is_not_prime(2)", "assert is_not_prime(4) == True"],
    ),
    "lists": (
        "import heapq\ndef largest(xs, n):\n    return heapq.nlargest(n, xs)\n",
        "def largest(xs, n):\n    return sorted(xs)[:n]\n",
        ["assert largest([25, 35, 22, 85, 14, 65, 75, 22, 58], 3) == [85, 75, 65]", "assert largest([1, 2], 1) == [2]"],
    ),
    "floats": (
        "import math\ndef circle_area(r):\n    return math.pi * r * r\n",
        "def circle_area(r):\n    return 3 * r * r\n",
        [
            "import math",
            "assert math.isclose(circle_area(2), 12.566370614359172, rel_tol=1e-9)",
            "assert abs(circle_area(1) - 3.14159) < 1e-3",
            "assert circle_area(10) > 314",
        ],
    ),
    "dict-subclass": (
        "from collections import Counter\ndef count_chars(s):\n    return Counter(s)\n",
        "def count_chars(s):\n    return {c: 1 for c in s}\n",
        ["assert count_chars('abca') == {'a': 2, 'b': 1, 'c': 1}", "assert count_chars('zz') == {'z': 2}"],
    ),
    "none-and-identity": (
        "def find(xs, x):\n    return xs.index(x) if x in xs else None\n",
        "def find(xs, x):\n    return -1\n",
        ["assert find([1, 2], 3) is None", "assert find([1, 2], 2) == 1"],
    ),
    "big-int": (
        "import math\ndef factorial(n):\n    return math.factorial(n)\n",
        "def factorial(n):\n    return n ** n\n",
        ["assert factorial(30) == 265252859812191058636308480000000", "assert factorial(3) == 6"],
    ),
    "strings-and-membership": (
        "def split_words(s):\n    return s.split()\n",
        "def split_words(s):\n    return [s]\n",
        [
            "assert 'b' in split_words('a b c')",
            "assert split_words('a b') == ['a', 'b']",
            "assert 'a b' not in split_words('a b')",
        ],
    ),
    "isinstance-and-bytes": (
        "def encode(s):\n    return s.encode()\n",
        "def encode(s):\n    return list(s)\n",
        ["assert isinstance(encode('hi'), bytes)", "assert encode('hi') == b'hi'"],
    ),
    "fraction-equals-float": (
        "from fractions import Fraction\ndef half(n):\n    return Fraction(n, 2)\n",
        "def half(n):\n    return n // 2\n",
        ["assert half(3) == 1.5", "assert half(5) == 2.5"],
    ),
    "namedtuple-and-nesting": (
        "from collections import namedtuple\nP = namedtuple('P', 'a b')\n"
        "def pairs(xs):\n    return [P(a, b) for a, b in zip(xs, xs[1:])]\n",
        "def pairs(xs):\n    return [[a, b] for a, b in zip(xs, xs[1:])]\n",
        ["assert pairs([1, 2, 3]) == [(1, 2), (2, 3)]", "assert pairs([4, 5]) == [(4, 5)]"],
    ),
    "prints-and-recursion": (
        "def fib(n):\n    print('computing', n)\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "def fib(n):\n    print('x' * 10000)\n    return n * 2\n",
        ["assert fib(10) == 55", "assert fib(15) == 610"],
    ),
    "expected-on-the-left": (
        "def double(x):\n    return 2 * x\n",
        "def double(x):\n    return x + 3\n",
        ["assert 8 == double(4)", "assert -2 == double(-1)"],
    ),
}


def _reward(**kwargs: Any) -> UnitTestReward:
    return UnitTestReward(prepend_prompt=False, timeout_s=5.0, **kwargs)


def test_unit_test_reward_scores_and_reports_feedback() -> None:
    reward = UnitTestReward(timeout_s=3.0)
    logged: dict[str, list[Any]] = {}
    prompts = ["def add(a, b):\n    return"] * 4
    completions = [" a + b\n", " a\n", " undefined_name\n", " a +\n"]
    scores = reward(prompts, completions, tests=[ADD_TESTS] * 4, log_extra=lambda k, v: logged.setdefault(k, v))
    assert scores == [1.0, pytest.approx(1 / 3), 0.0, 0.0]
    feedback = logged["feedback"]
    assert feedback[0] == ""
    assert feedback[1].startswith("2 of 3 tests failed.")
    assert "Test `assert add(1, 2) == 3` failed: add(1, 2) returned 1; expected 3." in feedback[1]
    assert "NameError: name 'undefined_name' is not defined" in feedback[2]
    assert "return undefined_name" in feedback[2]  # the candidate's line in the bounded traceback
    assert feedback[3].startswith("The code does not run: SyntaxError")


def test_identical_completions_in_one_call_run_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeated (program, tests) job runs one sandbox; every copy gets its score and its feedback."""
    import crf_core.rewards.unit_tests as unit_tests

    runs: list[str] = []
    real = unit_tests.run_python

    def counting(*args: Any, **kwargs: Any) -> Any:
        runs.append(kwargs["stdin"])
        return real(*args, **kwargs)

    monkeypatch.setattr(unit_tests, "run_python", counting)
    logged: dict[str, list[Any]] = {}
    prompts = ["def add(a, b):\n    return"] * 5
    completions = [" a + b\n", " a\n", " a + b\n", " a\n", " a + b\n"]
    other_tests = [*ADD_TESTS[:2], "assert add(2, 2) == 4"]
    tests = [ADD_TESTS, ADD_TESTS, ADD_TESTS, ADD_TESTS, other_tests]  # the last row has other tests
    scores = UnitTestReward(timeout_s=3.0)(
        prompts, completions, tests=tests, log_extra=lambda k, v: logged.setdefault(k, v)
    )
    assert scores == [1.0, pytest.approx(1 / 3), 1.0, pytest.approx(1 / 3), 1.0]
    assert len(runs) == 3  # (a + b, ADD_TESTS), (a, ADD_TESTS), (a + b, other_tests)
    assert logged["feedback"][1] == logged["feedback"][3] != ""


@pytest.mark.parametrize("task", sorted(TASKS))
def test_honest_right_programs_score_one_and_wrong_ones_zero(task: str) -> None:
    right, wrong, tests = TASKS[task]
    reward = _reward()
    logged: dict[str, list[Any]] = {}
    scores = reward(["", ""], [right, wrong], tests=[tests, tests], log_extra=lambda k, v: logged.setdefault(k, v))
    assert scores == [1.0, 0.0], logged["feedback"]
    assert logged["feedback"][0] == ""
    assert "failed" in logged["feedback"][1]


def test_fenced_chat_completions_are_extracted() -> None:
    completion = [{"role": "assistant", "content": "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."}]
    assert _reward()([[{"role": "user", "content": "add"}]], [completion], tests=[ADD_TESTS]) == [1.0]


def test_humaneval_entry_point_is_bound_to_candidate() -> None:
    tests = ["assert candidate(1, 2) == 3", "assert candidate(2, 2) == 4"]
    code = "def helper(a, b):\n    return a + b\ndef plus(a, b):\n    return helper(a, b)\n"
    reward = _reward()
    assert reward([""], [code], tests=[tests], entry_point=["plus"]) == [1.0]
    logged: dict[str, list[Any]] = {}
    assert reward([""], [code], tests=[tests], entry_point=["minus"], log_extra=lambda k, v: logged.update({k: v})) == [
        0.0
    ]
    assert "does not define 'minus'" in logged["feedback"][0]


def test_hanging_code_scores_zero_with_a_timeout_account() -> None:
    outcome = UnitTestReward(timeout_s=1.0, prepend_prompt=False).score(
        "def add(a, b):\n    while True:\n        pass\n", ADD_TESTS
    )
    assert outcome.reward == 0.0
    assert "Timed out" in outcome.feedback


def test_a_test_holding_several_asserts_passes_only_if_all_do() -> None:
    test = "assert add(1, 1) == 2\nassert add(2, 2) == 5"
    outcome = _reward().score("def add(a, b):\n    return a + b\n", [test, "assert add(0, 1) == 1"])
    assert (outcome.passed, outcome.total) == (1, 2)
    assert "add(2, 2) returned 4; expected 5" in outcome.feedback


def test_feedback_reaches_the_sdpo_teacher_prompt() -> None:
    """The contract with the trainer: log_extra("feedback", one str per completion) -> the reprompt's feedback."""
    reward = UnitTestReward()
    logged: dict[str, list[Any]] = {}
    prompts = ["def add(a, b):\n    return"] * 2
    scores = reward(
        prompts, [" a - b\n", " a * b\n"], tests=[ADD_TESTS] * 2, log_extra=lambda k, v: logged.update({k: v})
    )
    batch = build_reprompts(prompts, [" a - b\n", " a * b\n"], scores, logged["feedback"], num_generations=2)
    assert all(r.used_feedback for r in batch.reprompts)
    assert "add(1, 2) returned -1; expected 3" in str(batch.reprompts[0].prompt)


def test_unsplittable_test_is_refused_naming_it() -> None:
    reward = _reward()
    with pytest.raises(UnsplittableTestError, match=r"assert add\(1, 2\) == add\(2, 1\).*verdict_in_sandbox"):
        reward([""], ["def add(a, b): return a + b"], tests=[["assert add(1, 2) == add(2, 1)"]])
    with pytest.raises(UnsplittableTestError, match="for i in range"):
        reward.score("", ["for i in range(3):\n    assert add(i, 0) == i"])


def test_verdict_in_sandbox_mode_runs_unsplittable_tests_whole() -> None:
    reward = _reward(unsplittable="verdict_in_sandbox")
    tests = ["for i in range(3):\n    assert add(i, 0) == i", "assert add(1, 2) == add(2, 1)", "assert add(1, 1) == 2"]
    assert reward.score("def add(a, b):\n    return a + b\n", tests).reward == 1.0
    wrong = reward.score("def add(a, b):\n    return a - b + 1\n", tests)
    assert wrong.reward == 0.0
    assert "raised AssertionError" in wrong.feedback


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, KeyError, "tests"),
        ({"tests": [ADD_TESTS, ADD_TESTS]}, ValueError, "1 prompts, 1 completions and 2 test lists"),
        ({"tests": [[]]}, ValueError, "non-empty list"),
        ({"tests": ["assert add(1, 2) == 3"]}, ValueError, "non-empty list"),
        ({"tests": [[3]]}, ValueError, "str"),
        ({"tests": [["assert add(1,"]]}, UnsplittableTestError, "not valid Python"),
        ({"tests": [["import math"]]}, UnsplittableTestError, "no assert"),
        ({"tests": [['"just a string"']]}, UnsplittableTestError, "no assert"),
        ({"tests": [ADD_TESTS], "entry_point": ["a", "b"]}, ValueError, "entry_point"),
    ],
)
def test_malformed_calls_and_datasets_are_refused(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _reward()(["p"], ["c"], **kwargs)


def test_bad_constructor_arguments_are_refused() -> None:
    for kwargs, message in (
        ({"max_workers": 0}, "max_workers"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"memory_mb": 8}, "memory_mb"),
        ({"unsplittable": "ignore"}, "unsplittable"),
        ({"isolation": "none"}, "isolation"),
        ({"max_feedback_chars": 10}, "max_feedback_chars"),
    ):
        with pytest.raises(ValueError, match=message):
            UnitTestReward(**kwargs)


def test_refused_at_construction_without_bubblewrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "find_bwrap", lambda: None)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        UnitTestReward()
    reward = UnitTestReward(isolation="rlimits", prepend_prompt=False)
    assert reward([""], ["def add(a, b):\n    return a + b\n"], tests=[ADD_TESTS]) == [1.0]
