"""SDPO's reprompt templates in the main job: the demonstration or the feedback first, the signature last.

SDPO's reference template (``{prompt}{solution}{feedback}`` then "Correctly solve the original question.")
puts the task's signature a few hundred characters before the answer. A pretrained LLM reads it from there;
a tiny 2-layer character model reads what is close to the answer far better than what is far from it. Code
models complete code, so these templates end on the signature itself, as a file would: what the teacher
knows more than the student (a peer's correct answer, or the sandbox's account of a failed attempt) stands
in comments right above it. The warm start and every trainer of the job (crf's, TRL's SDPOTrainer) use
them, through `reprompt_config` and `TEMPLATE_FIELDS`.
"""

from __future__ import annotations

from crf_core.trainer.reprompt import RepromptConfig

__all__ = ["FEEDBACK_TEMPLATE", "REPROMPT_TEMPLATE", "SOLUTION_TEMPLATE", "TEMPLATE_FIELDS", "reprompt_config"]

REPROMPT_TEMPLATE = "{solution}{feedback}{prompt}"
SOLUTION_TEMPLATE = "# A correct answer: return {successful_previous_attempt}\n"
FEEDBACK_TEMPLATE = "# An earlier answer failed:\n{feedback_raw}\n"

TEMPLATE_FIELDS = {
    "reprompt_template": REPROMPT_TEMPLATE,
    "solution_template": SOLUTION_TEMPLATE,
    "feedback_template": FEEDBACK_TEMPLATE,
}
"""The three templates under the names ``RepromptConfig`` and TRL's ``SDPOConfig`` give them."""


def reprompt_config() -> RepromptConfig:
    """The reprompt configuration the warm start shows and the trainers use (defaults otherwise)."""
    return RepromptConfig(**TEMPLATE_FIELDS)
