"""SDPO reprompting: the self-teacher's prompt built from a peer's success and environment feedback.

Source: SDPO (Hübotter et al., arXiv 2601.20802), reference code lasgroup/SDPO
``ray_trainer.py::_maybe_build_self_distillation_batch``. For every rollout ``i`` of a group of
``G`` rollouts of the same prompt:

* the **demonstration** is the first *other* successful rollout of the group (reward ≥
  ``success_reward_threshold``; the sample's own response is excluded when
  ``dont_reprompt_on_self_success``), with ``<think>…</think>`` removed when asked; of a multi-turn,
  tool-calling rollout it is what the assistant did (``crf_core.messages.action_text``: each turn's text and
  ``name(arguments)`` per tool call, tool results left out);
* the **feedback** is the non-empty string a reward function reported for rollout ``i`` (or the rollout's
  environment, for TRL's ``environment_factory``: ``crf_core.trainer.episodes``), used when
  ``include_environment_feedback`` (and, with ``environment_feedback_only_without_solution``, only
  when there is no demonstration);
* the teacher prompt is ``reprompt_template.format(prompt=…, solution=…, feedback=…)``. For chat
  prompts it replaces the content of the last user message (earlier messages are kept);
* a rollout with neither a demonstration nor used feedback has no teacher signal: its teacher prompt
  is the original prompt and it is masked out of the SDPO loss.

Pure Python (no torch, no TRL): prompts and completions are either strings or chat message lists.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from crf_core.messages import PromptLike, action_text, content_text, message_text

__all__ = [
    "DEFAULT_FEEDBACK_TEMPLATE",
    "DEFAULT_REPROMPT_TEMPLATE",
    "DEFAULT_SOLUTION_TEMPLATE",
    "Reprompt",
    "RepromptBatch",
    "RepromptConfig",
    "build_reprompts",
    "message_text",
    "strip_thinking",
]

#: The three templates of the SDPO reference implementation (verbatim defaults of its config).
DEFAULT_REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
DEFAULT_SOLUTION_TEMPLATE = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
DEFAULT_FEEDBACK_TEMPLATE = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _field_names(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def _check_template(name: str, template: Any, required: set[str]) -> None:
    if not isinstance(template, str):
        raise TypeError(f"{name} must be a str, got {type(template).__name__}")
    try:
        fields = _field_names(template)
    except ValueError as exc:
        raise ValueError(
            f"{name} is not a valid str.format template ({exc}); escape literal braces as '{{' '}}'"
        ) from exc
    if fields != required:
        raise ValueError(
            f"{name} must use exactly the placeholders {sorted(required)}, found {sorted(fields)}; "
            "escape literal braces as '{{' and '}}'"
        )


@dataclass(frozen=True)
class RepromptConfig:
    """How teacher prompts are built. Defaults follow the SDPO paper's run configuration (``actor.yaml``).

    Attributes:
        reprompt_template: needs ``{prompt}``, ``{solution}`` and ``{feedback}``.
        solution_template: needs ``{successful_previous_attempt}``.
        feedback_template: needs ``{feedback_raw}``.
        success_reward_threshold: a rollout whose total reward is ≥ this is a success (NaN never is).
        dont_reprompt_on_self_success: exclude the sample's own response from its demonstrations.
        remove_thinking_from_demonstration: strip ``<think>…</think>`` blocks from the demonstration.
        include_environment_feedback: use the feedback reward functions report.
        environment_feedback_only_without_solution: use feedback only when there is no demonstration.
    """

    reprompt_template: str = DEFAULT_REPROMPT_TEMPLATE
    solution_template: str = DEFAULT_SOLUTION_TEMPLATE
    feedback_template: str = DEFAULT_FEEDBACK_TEMPLATE
    success_reward_threshold: float = 1.0
    dont_reprompt_on_self_success: bool = True
    remove_thinking_from_demonstration: bool = True
    include_environment_feedback: bool = True
    environment_feedback_only_without_solution: bool = True

    def __post_init__(self) -> None:
        _check_template("reprompt_template", self.reprompt_template, {"prompt", "solution", "feedback"})
        _check_template("solution_template", self.solution_template, {"successful_previous_attempt"})
        _check_template("feedback_template", self.feedback_template, {"feedback_raw"})
        if not isinstance(self.success_reward_threshold, (int, float)) or not math.isfinite(
            self.success_reward_threshold
        ):
            raise ValueError(f"success_reward_threshold must be a finite number, got {self.success_reward_threshold!r}")


@dataclass(frozen=True)
class Reprompt:
    """The teacher prompt of one rollout.

    Attributes:
        prompt: same shape as the original prompt (str, or a message list whose last user message was
            rewritten); the original prompt when ``has_signal`` is False.
        has_signal: whether the teacher saw a demonstration or feedback (the SDPO mask of the sample).
        used_demonstration: a peer's successful rollout was included.
        used_feedback: environment feedback was included.
    """

    prompt: PromptLike
    has_signal: bool
    used_demonstration: bool
    used_feedback: bool


@dataclass(frozen=True)
class RepromptBatch:
    """Teacher prompts for a batch plus the reference implementation's ``self_distillation/*`` metrics."""

    reprompts: list[Reprompt]
    metrics: dict[str, float]


def strip_thinking(text: str) -> str:
    """Remove every ``<think>…</think>`` block and surrounding whitespace.

    Same result as ``re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)``, in linear time: that lazy
    regex is quadratic on policy-written text with many unclosed ``<think>`` tags.
    """
    kept, pos = [], 0
    while True:
        start = text.find(_THINK_OPEN, pos)
        end = text.find(_THINK_CLOSE, start + len(_THINK_OPEN)) if start >= 0 else -1
        if end < 0:
            break
        kept.append(text[pos:start])
        pos = end + len(_THINK_CLOSE)
    kept.append(text[pos:])
    return "".join(kept).strip()


def _is_success(reward: float, threshold: float) -> bool:
    return not math.isnan(reward) and reward >= threshold


def _teacher_prompt(prompt: PromptLike, text: str) -> PromptLike:
    if isinstance(prompt, str):
        return text
    messages = list(prompt)
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("a chat prompt must end with a user message for SDPO reprompting; got another role last")
    return [*messages[:-1], {**messages[-1], "content": text}]


def build_reprompts(
    prompts: Sequence[PromptLike],
    completions: Sequence[PromptLike],
    rewards: Sequence[float],
    feedback: Sequence[str | None] | None,
    num_generations: int,
    config: RepromptConfig | None = None,
) -> RepromptBatch:
    """Build the SDPO teacher prompt of every rollout.

    Args:
        prompts, completions: ``N`` items (strings or chat message lists), grouped as consecutive
            blocks of ``num_generations`` rollouts of the same prompt (TRL's order).
        rewards: ``N`` total rewards (NaN = unscored, never a success).
        feedback: ``N`` optional feedback strings (``None``/empty = none), or ``None`` for no feedback.
        num_generations: group size ``G``; ``N`` must be a multiple of it.
        config: templates and switches; defaults to ``RepromptConfig()``.

    Returns:
        ``RepromptBatch`` with one ``Reprompt`` per rollout and the fractions
        ``success_group_fraction``, ``success_sample_fraction``, ``feedback_available_fraction``,
        ``feedback_used_fraction``, ``reprompt_sample_fraction``.
    """
    cfg = config or RepromptConfig()
    n = len(prompts)
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive int, got {num_generations!r}")
    if n == 0 or n % num_generations:
        raise ValueError(f"got {n} rollouts, which is not a positive multiple of num_generations={num_generations}")
    if len(completions) != n or len(rewards) != n:
        raise ValueError(
            f"prompts, completions and rewards must have the same length; got {n}, {len(completions)}, {len(rewards)}"
        )
    if feedback is not None and len(feedback) != n:
        raise ValueError(f"feedback must have one entry per rollout ({n}), got {len(feedback)}")
    values = [float(r) for r in rewards]
    success = [_is_success(r, cfg.success_reward_threshold) for r in values]

    out: list[Reprompt] = []
    groups_with_success = 0
    feedback_available = feedback_used = 0
    for start in range(0, n, num_generations):
        members = range(start, start + num_generations)
        groups_with_success += any(success[j] for j in members)
        for i in members:
            demo_index = next(
                (j for j in members if success[j] and not (cfg.dont_reprompt_on_self_success and j == i)), None
            )
            demo = None
            if demo_index is not None:
                demo = action_text(completions[demo_index])
                if cfg.remove_thinking_from_demonstration:
                    demo = strip_thinking(demo)
            raw = feedback[i] if feedback is not None else None
            if raw is not None and not isinstance(raw, str):
                raise TypeError(f"feedback[{i}] must be a str or None, got {type(raw).__name__}")
            has_feedback = bool(raw and raw.strip())
            feedback_available += has_feedback
            use_feedback = (
                has_feedback
                and cfg.include_environment_feedback
                and not (cfg.environment_feedback_only_without_solution and demo is not None)
            )
            feedback_used += use_feedback
            if demo is None and not use_feedback:
                out.append(Reprompt(prompts[i], False, False, False))
                continue
            text = cfg.reprompt_template.format(
                prompt=message_text(prompts[i]) if isinstance(prompts[i], str) else _last_user_text(prompts[i]),
                solution=cfg.solution_template.format(successful_previous_attempt=demo) if demo is not None else "",
                feedback=cfg.feedback_template.format(feedback_raw=raw) if use_feedback else "",
            )
            out.append(Reprompt(_teacher_prompt(prompts[i], text), True, demo is not None, use_feedback))
    metrics = {
        "success_group_fraction": groups_with_success / (n // num_generations),
        "success_sample_fraction": sum(success) / n,
        "feedback_available_fraction": feedback_available / n,
        "feedback_used_fraction": feedback_used / n,
        "reprompt_sample_fraction": sum(r.has_signal for r in out) / n,
    }
    return RepromptBatch(out, metrics)


def _last_user_text(prompt: PromptLike) -> str:
    messages = list(prompt)
    if not messages or not isinstance(messages[-1], Mapping) or messages[-1].get("role") != "user":
        raise ValueError("a chat prompt must end with a user message for SDPO reprompting; got another role last")
    return content_text(messages[-1].get("content"))
