"""SDPO reprompting (pure Python, no TRL): demonstration choice, feedback rules, masking, chat prompts."""

from __future__ import annotations

import math

import pytest

from crf_core.trainer.reprompt import RepromptConfig, build_reprompts, message_text, strip_thinking

SHORT = RepromptConfig(
    reprompt_template="{prompt}|{solution}|{feedback}|",
    solution_template="S:{successful_previous_attempt}",
    feedback_template="F:{feedback_raw}",
)


def test_demonstration_is_first_peer_success_excluding_self() -> None:
    batch = build_reprompts(["p"] * 4, ["a", "b", "c", "d"], [0.0, 1.0, 1.0, 0.0], None, 4, SHORT)
    texts = [r.prompt for r in batch.reprompts]
    # sample 1 succeeded itself: its demo is the *other* success (c), not its own response
    assert texts == ["p|S:b||", "p|S:c||", "p|S:b||", "p|S:b||"]
    assert all(r.has_signal and r.used_demonstration and not r.used_feedback for r in batch.reprompts)


def test_self_success_allowed_when_switch_is_off() -> None:
    cfg = RepromptConfig(**{**SHORT.__dict__, "dont_reprompt_on_self_success": False})
    batch = build_reprompts(["p"] * 2, ["a", "b"], [1.0, 0.0], None, 2, cfg)
    assert batch.reprompts[0].prompt == "p|S:a||"


def test_groups_do_not_share_demonstrations() -> None:
    batch = build_reprompts(["p", "p", "q", "q"], ["a", "b", "c", "d"], [1.0, 0.0, 0.0, 0.0], None, 2, SHORT)
    assert batch.reprompts[1].prompt == "p|S:a||"
    assert [r.has_signal for r in batch.reprompts] == [False, True, False, False]
    assert batch.reprompts[2].prompt == "q"  # no signal: the original prompt, masked out
    assert batch.metrics["success_group_fraction"] == 0.5
    assert batch.metrics["reprompt_sample_fraction"] == 0.25


def test_feedback_used_only_without_solution_by_default() -> None:
    feedback = ["err a", "", "err c", None]
    batch = build_reprompts(["p"] * 2 + ["q"] * 2, ["a", "b", "c", "d"], [0.0, 1.0, 0.0, 0.0], feedback, 2, SHORT)
    r = batch.reprompts
    assert r[0].prompt == "p|S:b||"
    assert not r[0].used_feedback
    assert r[2].prompt == "q||F:err c|"
    assert r[2].used_feedback
    assert not r[2].used_demonstration
    assert not r[3].has_signal  # None feedback and no success
    assert batch.metrics["feedback_available_fraction"] == 0.5
    assert batch.metrics["feedback_used_fraction"] == 0.25


def test_feedback_with_solution_and_feedback_off() -> None:
    both = RepromptConfig(**{**SHORT.__dict__, "environment_feedback_only_without_solution": False})
    batch = build_reprompts(["p"] * 2, ["a", "b"], [0.0, 1.0], ["bad", None], 2, both)
    assert batch.reprompts[0].prompt == "p|S:b|F:bad|"
    off = RepromptConfig(**{**SHORT.__dict__, "include_environment_feedback": False})
    batch = build_reprompts(["p"] * 2, ["a", "b"], [0.0, 0.0], ["bad", "worse"], 2, off)
    assert not any(r.has_signal for r in batch.reprompts)


def test_nan_reward_is_never_a_success_and_threshold_applies() -> None:
    batch = build_reprompts(["p"] * 3, ["a", "b", "c"], [math.nan, 0.49, 0.5], None, 3, SHORT)
    assert [r.has_signal for r in batch.reprompts] == [False, False, False]  # threshold 1.0: no success
    cfg = RepromptConfig(**{**SHORT.__dict__, "success_reward_threshold": 0.5})
    batch = build_reprompts(["p"] * 3, ["a", "b", "c"], [math.nan, 0.49, 0.5], None, 3, cfg)
    assert [r.has_signal for r in batch.reprompts] == [True, True, False]  # c's only success is its own
    assert batch.metrics["success_sample_fraction"] == pytest.approx(1 / 3)


def test_thinking_is_stripped_from_demonstrations() -> None:
    assert strip_thinking("<think>plan\nmore</think>  answer ") == "answer"
    batch = build_reprompts(["p"] * 2, ["x", "<think>hmm</think>ok"], [0.0, 1.0], None, 2, SHORT)
    assert batch.reprompts[0].prompt == "p|S:ok||"


def test_chat_prompt_rewrites_last_user_message_only() -> None:
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "solve"}]
    completions = [[{"role": "assistant", "content": "no"}], [{"role": "assistant", "content": "yes"}]]
    batch = build_reprompts([prompt, prompt], completions, [0.0, 1.0], None, 2, SHORT)
    teacher = batch.reprompts[0].prompt
    assert teacher == [{"role": "system", "content": "sys"}, {"role": "user", "content": "solve|S:yes||"}]
    assert prompt[1]["content"] == "solve"  # the input is not mutated
    assert message_text(completions[1]) == "yes"


def test_default_templates_match_the_reference() -> None:
    batch = build_reprompts(["Q"] * 2, ["A", "B"], [1.0, 0.0], None, 2)
    assert batch.reprompts[1].prompt == "Q\nCorrect solution:\n\nA\n\n\n\nCorrectly solve the original question.\n"


def test_braces_in_demonstrations_are_kept_verbatim() -> None:
    batch = build_reprompts(["p"] * 2, ["{x}", "d = {}"], [1.0, 0.0], None, 2, SHORT)
    assert batch.reprompts[1].prompt == "p|S:{x}||"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reprompt_template": "{prompt}{solution}"}, "exactly the placeholders"),
        ({"solution_template": "{demo}"}, "successful_previous_attempt"),
        ({"feedback_template": "{feedback_raw"}, "not a valid str.format"),
        ({"success_reward_threshold": math.inf}, "finite"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RepromptConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of num_generations"):
        build_reprompts(["p"] * 3, ["a"] * 3, [0.0] * 3, None, 2)
    with pytest.raises(ValueError, match="same length"):
        build_reprompts(["p"] * 2, ["a"], [0.0] * 2, None, 2)
    with pytest.raises(ValueError, match="one entry per rollout"):
        build_reprompts(["p"] * 2, ["a"] * 2, [0.0] * 2, ["x"], 2)
    with pytest.raises(TypeError, match="feedback"):
        build_reprompts(["p"] * 2, ["a"] * 2, [0.0] * 2, [3, None], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="end with a user message"):
        build_reprompts([[{"role": "assistant", "content": "x"}]] * 2, ["a", "b"], [1.0, 0.0], None, 2)


def test_strip_thinking_matches_the_regex_and_is_linear() -> None:
    import random
    import re

    regex = re.compile(r"<think>.*?</think>", flags=re.DOTALL)
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "a", " ", "\n", "<", "think>", "</", "x</think>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        assert strip_thinking(text) == regex.sub("", text).strip(), text
    hostile = "<think>" * 300_000  # the regex takes hours on this; the scan is linear
    assert strip_thinking(hostile) == hostile
