"""Feedback for the warm start: a wrong attempt at each train task and the sandbox's own account of it.

A pretrained LLM arrives able to read a failing test ("Test `assert or_17(40) == 57, '40 | 17'` failed:
or_17(40) returned 40; expected 57.") and fix its answer; a tiny model built from a config cannot read anything. The warm start gives
it that ability the way pretraining gives it to an LLM, by example: it also trains on SDPO's reprompt
format holding the feedback of a wrong attempt, followed by the right answer. The attempts are the weak
student's (`tasks.weak_answer`: a wrong operation or constant); the feedback is what `UnitTestReward`
reports for them, built in the sandbox from the same record it builds the RL feedback from, so the warm
start shows the exact text SDPO's teacher reads later. Easy train tasks and drills only: nothing here
reaches a held-out task or a hard one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from main_job.tasks import CodingTask, weak_answer

__all__ = ["FEEDBACK_CHARS", "FeedbackExample", "feedback_examples"]

FEEDBACK_CHARS = 240
"""Bound on each feedback string (`UnitTestReward.max_feedback_chars`) in the warm start and in RL alike: about
the first failure and its exception, which keeps a reprompt near 350 characters for the tiny model."""


@dataclass(frozen=True)
class FeedbackExample:
    """A train task, a wrong ``attempt`` at it, the sandbox's ``feedback`` on that attempt and the right answer."""

    task: str
    prompt: str
    attempt: str
    feedback: str
    completion: str


def feedback_examples(
    tasks: Sequence[CodingTask], *, isolation: str, timeout_s: float, seed: int
) -> list[FeedbackExample]:
    """One `FeedbackExample` per task of ``tasks``, the attempts drawn under ``seed`` and run in the sandbox."""
    from crf_core.rewards import UnitTestReward

    rng = random.Random(seed)
    attempts = [weak_answer(task, rng) for task in tasks]
    logged: dict[str, list[str]] = {}
    reward = UnitTestReward(
        timeout_s=timeout_s,
        max_workers=2,
        isolation=isolation,  # type: ignore[arg-type]
        max_feedback_chars=FEEDBACK_CHARS,
    )
    scores = reward(
        [t.prompt for t in tasks],
        attempts,
        tests=[list(t.tests) for t in tasks],
        log_extra=lambda key, values: logged.__setitem__(key, values),
    )
    out = []
    for task, attempt, score, text in zip(tasks, attempts, scores, logged[reward.feedback_key], strict=True):
        if score < 1.0 and text:  # a weak answer that happens to pass teaches nothing about feedback
            out.append(FeedbackExample(task.name, task.prompt, attempt, text, task.solution))
    return out
