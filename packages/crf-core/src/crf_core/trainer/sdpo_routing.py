"""Which rollouts SDPO and GRPO learn from, and how much: SRPO's sample routing and SC-SDPO's group weights.

Both refine SDPO (Hübotter et al., arXiv 2601.20802) for long runs; both read only the rollouts' rewards,
grouped as TRL groups them (consecutive blocks of ``G`` rollouts of one prompt), and the success threshold
the reprompts use. A rollout *succeeds* when its total reward is ≥ the threshold (NaN never does).

* **SRPO** (Li et al., "Unifying Group-Relative and Self-Distillation Policy Optimization via Sample
  Routing", arXiv 2604.02288): successful rollouts train through GRPO only, failed ones through SDPO only.
  Here: a success gets SDPO weight 0, a failure keeps its SDPO weight and has its GRPO advantage set to 0.
  (SRPO's entropy-aware weighting of distillation targets is not implemented.)
* **SC-SDPO** (arXiv 2605.27765): each question's SDPO term is weighted by ``√(p·(1 − p))``, ``p`` the
  share of its group's rollouts that succeed, so questions the policy always or never solves weigh 0 and
  those at ``p = ½`` weigh ½. The weights scale the per-token losses; the token mean divides by the tokens
  of the rollouts whose weight is not 0, so the weights rank questions rather than shrink the whole term.
* **failures** (crf): SDPO on failed rollouts only, GRPO on every rollout. A successful rollout's self-teacher
  reads a peer's correct answer and can only pull it toward the teacher's own, possibly worse, rendering of
  that answer (measured with a frozen teacher in the main job: docs/guide.md); a failed one is where the
  teacher knows more than the student.

``weights`` multiply the reprompts' signal mask (1 where the self-teacher saw a demonstration or feedback).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["SDPO_GROUP_WEIGHTS", "SDPO_ROUTINGS", "SDPOGroupWeight", "SDPORouting", "SampleRouting", "route_samples"]

SDPORouting = Literal["all", "srpo", "failures"]
"""``all``: every rollout with a teacher signal trains through SDPO (and every rollout through GRPO), as in
SDPO; ``srpo``: SRPO's routing; ``failures``: SDPO on failed rollouts only (see the module docstring)."""
SDPO_ROUTINGS: tuple[str, ...] = get_args(SDPORouting)

SDPOGroupWeight = Literal["uniform", "success_variance"]
"""``uniform``: every rollout's SDPO term weighs 1 (SDPO); ``success_variance``: SC-SDPO's ``√(p(1 − p))``."""
SDPO_GROUP_WEIGHTS: tuple[str, ...] = get_args(SDPOGroupWeight)


@dataclass(frozen=True)
class SampleRouting:
    """Per rollout: ``sdpo_weight`` (factor of its SDPO term) and ``grpo_kept`` (False: its advantage is zeroed)."""

    sdpo_weight: tuple[float, ...]
    grpo_kept: tuple[bool, ...]


def route_samples(
    rewards: Sequence[float],
    num_generations: int,
    threshold: float,
    routing: SDPORouting = "all",
    group_weight: SDPOGroupWeight = "uniform",
) -> SampleRouting:
    """The `SampleRouting` of ``N`` rollouts (``N`` a multiple of ``num_generations``) with total ``rewards``."""
    if routing not in SDPO_ROUTINGS:
        raise ValueError(f"sdpo_routing must be one of {SDPO_ROUTINGS}, got {routing!r}")
    if group_weight not in SDPO_GROUP_WEIGHTS:
        raise ValueError(f"sdpo_group_weight must be one of {SDPO_GROUP_WEIGHTS}, got {group_weight!r}")
    n = len(rewards)
    if not isinstance(num_generations, int) or num_generations < 1 or n == 0 or n % num_generations:
        raise ValueError(f"got {n} rollouts, which is not a positive multiple of num_generations={num_generations!r}")
    success = [not math.isnan(float(r)) and float(r) >= threshold for r in rewards]
    weight = [1.0] * n
    if group_weight == "success_variance":
        for start in range(0, n, num_generations):
            p = sum(success[start : start + num_generations]) / num_generations
            weight[start : start + num_generations] = [math.sqrt(p * (1.0 - p))] * num_generations
    if routing in ("srpo", "failures"):
        weight = [0.0 if s else w for s, w in zip(success, weight, strict=True)]
    if routing == "srpo":
        kept = tuple(success)
    else:
        kept = (True,) * n
    return SampleRouting(tuple(weight), kept)
