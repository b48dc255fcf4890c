"""``CodingEnvironment``: TRL's environment contract, the three tools, the episode record and its bounds.

The sandboxed tests need bubblewrap (skipped with the reason outside CI, failed when ``CI=true``); the config and
redaction tests run anywhere.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from crf_core.rewards import (
    CodingEnvConfig,
    CodingEnvironment,
    Episode,
    TestOutcome,
    ToolCall,
    demonstration_episode,
    redact_secrets,
    summarize_episodes,
)

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
ROW: dict[str, Any] = {"prompt": [{"role": "user", "content": "Write add."}], "tests": ADD_TESTS}


@pytest.fixture
def env(bwrap: None) -> CodingEnvironment:
    environment = CodingEnvironment.factory(max_result_chars=400, timeout_s=5.0)()
    environment.reset(**ROW)
    return environment


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"tests_key": ""}, "tests_key"),
        ({"hidden_tests_key": "tests"}, "hidden_tests_key"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"memory_mb": 32}, "memory_mb"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"max_result_chars": 50}, "max_result_chars"),
        ({"max_code_chars": True}, "max_code_chars"),
        ({"isolation": "none"}, "isolation"),
        ({"redact": ("",)}, "redact"),
    ],
)
def test_config_refuses_bad_settings(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CodingEnvConfig(**settings)


def test_config_refuses_a_string_for_a_tuple() -> None:
    with pytest.raises(TypeError, match="strip_strings"):
        CodingEnvConfig(strip_strings="<eos>")  # type: ignore[arg-type]


def test_factory_refuses_config_and_settings_together() -> None:
    with pytest.raises(ValueError, match="either"):
        CodingEnvironment.factory(CodingEnvConfig(), timeout_s=1.0)


def test_trl_sees_exactly_three_tools() -> None:
    """TRL exposes the public functions of the class but ``reset``/``get_reward``: the records are properties."""
    names = [
        name
        for name, _ in inspect.getmembers(CodingEnvironment, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]
    assert names == ["run_python", "run_tests", "submit"]


def test_tool_schemas_render_from_the_docstrings() -> None:
    get_json_schema = pytest.importorskip("transformers.utils", reason="tool schemas are transformers'").get_json_schema

    for tool in (CodingEnvironment.run_python, CodingEnvironment.run_tests, CodingEnvironment.submit):
        schema = get_json_schema(tool)
        assert schema["function"]["parameters"]["required"] == ["code"]
        assert schema["function"]["parameters"]["properties"]["code"]["type"] == "string"


def test_reset_refuses_a_malformed_row(bwrap: None) -> None:
    environment = CodingEnvironment()
    with pytest.raises(KeyError, match="'tests' column"):
        environment.reset(prompt="x")
    with pytest.raises(ValueError, match="non-empty list"):
        environment.reset(prompt="x", tests=[])
    with pytest.raises(ValueError, match="entry_point"):
        environment.reset(prompt="x", tests=ADD_TESTS, entry_point="not an identifier")


def test_tools_before_reset_refuse_without_raising(bwrap: None) -> None:
    environment = CodingEnvironment()
    assert "not reset" in environment.run_tests(RIGHT)
    assert environment.get_reward() == 0.0
    assert environment.episode.calls[0].refused is not None


def test_an_episode_drafts_tests_fixes_and_submits(env: CodingEnvironment) -> None:
    failing = env.run_tests(WRONG)
    assert failing.startswith("2 of 2 tests failed.")
    assert "add(1, 2) returned -1; expected 3" in failing
    assert env.feedback == failing
    assert env.run_tests(RIGHT) == "All 2 tests passed."
    assert env.feedback is None  # the last test run passed
    assert env.submit(RIGHT) == "Submitted."
    assert env.get_reward() == 1.0
    episode = env.episode
    assert [c.tool for c in episode.calls] == ["run_tests", "run_tests", "submit"]
    assert (episode.calls[0].passed, episode.calls[0].total) == (0, 2)
    assert episode.saw_failure
    assert episode.repaired
    assert episode.submission == RIGHT


def test_run_python_reports_status_and_output(env: CodingEnvironment) -> None:
    text = env.run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert text.startswith("exit status 3\nout\n")
    assert "[stderr]\nerr" in text
    assert env.run_python("while True:\n    pass").startswith("Timed out")


def test_code_in_a_fence_is_extracted(env: CodingEnvironment) -> None:
    assert env.run_tests("Here:\n```python\n" + RIGHT + "```") == "All 2 tests passed."


def test_only_the_first_submission_counts(env: CodingEnvironment) -> None:
    env.submit(WRONG)
    assert "already submitted" in env.submit(RIGHT)
    assert "already submitted" in env.run_tests(RIGHT)
    assert env.get_reward() == 0.0
    assert env.episode.submission == WRONG


def test_hidden_tests_grade_the_submission_only(bwrap: None) -> None:
    environment = CodingEnvironment.factory(hidden_tests_key="hidden")()
    environment.reset(tests=["assert add(1, 2) == 3"], hidden=["assert add(5, 5) == 10", "assert add(0, 0) == 0"])
    cheat = "def add(a, b):\n    return 3\n"
    assert environment.run_tests(cheat) == "All 1 tests passed."
    environment.submit(cheat)
    assert environment.get_reward() == pytest.approx(1 / 3)


def test_reset_starts_a_new_episode(env: CodingEnvironment) -> None:
    env.run_tests(WRONG)
    env.submit(RIGHT)
    assert env.reset(**ROW) is None
    assert env.episode == Episode()
    assert env.get_reward() == 0.0
    assert env.feedback is None


def test_instances_share_nothing(bwrap: None) -> None:
    make = CodingEnvironment.factory()
    first, second = make(), make()
    first.reset(**ROW)
    second.reset(**{**ROW, "tests": ["assert add(1, 1) == 2"]})
    first.submit(RIGHT)
    assert second.episode.calls == ()
    assert second.get_reward() == 0.0
    assert first._calls is not second._calls
    assert first.config is second.config  # only the frozen settings are shared


def test_instructions_are_returned_by_reset(bwrap: None) -> None:
    environment = CodingEnvironment.factory(instructions="\nUse run_tests, then submit.")()
    assert environment.reset(**ROW) == "\nUse run_tests, then submit."


def test_budget_counts_programs_not_refusals(bwrap: None) -> None:
    environment = CodingEnvironment.factory(max_tool_calls=2)()
    environment.reset(**ROW)
    environment.run_python("print(1)")
    environment.run_tests(WRONG)
    assert "budget" in environment.run_python("print(2)")
    assert environment.submit(RIGHT) == "Submitted."  # submitting is always possible
    assert environment.get_reward() == 1.0


@pytest.mark.parametrize("argument", [None, 3, {"code": "print(1)"}, ["print(1)"]])
def test_a_non_string_argument_is_refused(env: CodingEnvironment, argument: Any) -> None:
    text = env.run_python(argument)
    assert text.startswith("The code must be a string")
    assert env.episode.calls[-1].refused == text


def test_too_long_code_is_refused_unrun(bwrap: None) -> None:
    environment = CodingEnvironment.factory(max_code_chars=100)()
    environment.reset(**ROW)
    assert "too long" in environment.run_python("print('x')\n" * 20)
    assert environment.episode.calls[-1].refused is not None


def test_results_are_bounded(env: CodingEnvironment) -> None:
    text = env.run_python("print('line\\n' * 100000)")
    assert len(text) <= 400
    assert text.endswith("[... cut ...]")


def test_feedback_is_bounded_and_typed(env: CodingEnvironment) -> None:
    env.run_tests("def add(a, b):\n    raise ValueError('x' * 100000)\n")
    assert env.feedback is not None
    assert len(env.feedback) <= 400


def test_redact_secrets_covers_the_credential_shapes() -> None:
    text = (
        "key sk-or-v1-0123456789abcdef0123456789 hf_" + "a" * 34 + " ghp_" + "b" * 36 + " AKIA" + "C" * 16 + "\n"
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY----- tail mine-123456789"
    )
    out = redact_secrets(text, ["mine-123456789"])
    assert out == "key <secret> <secret> <secret> <secret>\n<secret> tail <secret>"
    assert redact_secrets("-----BEGIN PRIVATE KEY-----\nunterminated") == "<secret>"
    with pytest.raises(TypeError):
        redact_secrets("x", "not a list")


def test_trainer_secrets_are_redacted_from_results(bwrap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret the policy learnt (here: it is in the code) never comes back in a tool result, even split by
    control characters or a stripped string."""
    secret = "trainer-secret-5f2a9c71"
    monkeypatch.setenv("CRF_TEST_API_KEY", secret)
    environment = CodingEnvironment.factory(strip_strings=("<eos>",))()
    environment.reset(**ROW)
    text = environment.run_python(f"print({secret!r})\nprint('trainer-' + '\\x00' + 'secret-' + '<eos>' + '5f2a9c71')")
    assert secret not in text
    assert text.count("<secret>") == 2


def test_summarize_episodes() -> None:
    passed = TestOutcome(2, 2, "")
    failed_run = ToolCall("run_tests", WRONG, "failed", 0, 2)
    episodes = [
        Episode((failed_run, ToolCall("submit", RIGHT, "Submitted.", 2, 2)), RIGHT, passed),
        Episode((failed_run,), None, None),
        Episode((ToolCall("submit", RIGHT, "Submitted.", 2, 2),), RIGHT, passed),
    ]
    summary = summarize_episodes(episodes)
    assert summary.episodes == 3
    assert summary.pass_rate == pytest.approx(2 / 3)
    assert summary.mean_tool_calls == pytest.approx(4 / 3)
    assert summary.repair_rate == pytest.approx(1 / 2)
    assert summarize_episodes([Episode()]).repair_rate is None
    with pytest.raises(ValueError, match="non-empty"):
        summarize_episodes([])


def test_demonstration_episode_plays_actions_in_the_sandbox(bwrap: None) -> None:
    row = {**ROW, "prompt": [{"role": "user", "content": "Write add."}]}
    config = CodingEnvConfig(instructions=" Use the tools.")
    context, response, episode = demonstration_episode(
        row, [("run_tests", WRONG), ("submit", RIGHT)], config=config, final_text="done"
    )
    assert context == [{"role": "user", "content": "Write add. Use the tools."}]
    assert [m["role"] for m in response] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert response[0]["tool_calls"][0]["function"] == {"name": "run_tests", "arguments": {"code": WRONG}}
    assert response[1]["content"].startswith("2 of 2 tests failed.")
    assert response[1]["tool_call_id"] == response[0]["tool_calls"][0]["id"]
    assert response[3]["content"] == "Submitted."
    assert response[4] == {"role": "assistant", "content": "done"}
    assert episode.repaired
    assert episode.reward == 1.0


@pytest.mark.parametrize(
    ("row", "actions", "match"),
    [
        ({"prompt": "text", "tests": ADD_TESTS}, [("submit", RIGHT)], "conversational 'prompt'"),
        (ROW, [], "non-empty sequence"),
        (ROW, [("delete", RIGHT)], "action 0 must be"),
    ],
)
def test_demonstration_episode_refuses_bad_input(bwrap: None, row: Any, actions: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        demonstration_episode(row, actions)
