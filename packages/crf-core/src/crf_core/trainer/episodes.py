"""Multi-turn, tool-using rollouts in the trainer: the environment's feedback for SDPO's reprompt.

TRL (1.16) runs tool-calling rollouts with ``GRPOTrainer(tools=..., environment_factory=...)``: after generation,
``trainer.environments`` holds this batch's environment instances, one per local rollout, in rollout order. An
environment reports feedback for SDPO through a ``feedback`` attribute holding a string or ``None`` (a property: TRL
would expose a method as a tool). ``crf_core.rewards.CodingEnvironment`` reports what its last ``run_tests`` call
returned when it found failures. ``ComposerReplicationTrainer`` merges it with the feedback reward functions log
through ``log_extra(sdpo_feedback_key, ...)``, and the self-teacher's reprompt carries it
(``crf_core.trainer.reprompt``). Environments without the attribute report none.

Tool-result tokens are never trained: TRL marks them 0 in ``tool_mask``, the GRPO loss (TRL's own) and the SDPO
student term multiply by ``completion_mask * tool_mask``; trace-replay DPO scores assistant turns only
(``crf_core.trainer.conversation``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["environment_feedback"]


def environment_feedback(environments: Sequence[Any] | None, n: int) -> list[str | None] | None:
    """The ``feedback`` of each of the ``n`` local rollouts' environments, or ``None`` when there are no environments
    or none of them has a ``feedback`` attribute.

    Raises:
        ValueError: ``environments`` does not hold one environment per rollout.
        TypeError: a ``feedback`` is a method or holds something other than ``str``/``None``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be the number of local rollouts (an int >= 0), got {n!r}")
    if not environments:
        return None
    if len(environments) != n:
        raise ValueError(
            f"got {len(environments)} environments for {n} rollouts; TRL's environment_factory gives one per rollout"
        )
    values: list[str | None] = []
    reported = False
    for environment in environments:
        if not hasattr(environment, "feedback"):
            values.append(None)
            continue
        value = environment.feedback
        if callable(value):
            raise TypeError(
                f"{type(environment).__name__}.feedback is a method; make it a property holding a str or None "
                "(TRL exposes an environment's public methods to the policy as tools)"
            )
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{type(environment).__name__}.feedback must be a str or None, got {type(value).__name__}")
        reported = True
        values.append(value)
    return values if reported else None
