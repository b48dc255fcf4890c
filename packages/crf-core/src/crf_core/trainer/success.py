"""When an SDPO rollout counts as a success, and a one-time warning when the answer never varies.

A rollout's reward is the one GRPO uses: ``R = Σ_i reward_weights[i] · r_i`` over the reward functions (NaN
scores skipped, as TRL's ``nansum``; a rollout every function left unscored is NaN and never a success). It is
a success when ``R ≥ t``, ``t`` the *effective threshold*:

* ``"absolute"`` (TRL ``SDPOConfig.success_reward_threshold``'s meaning, the default): ``t = threshold``, in
  the units of ``R``;
* ``"relative"``: ``t = threshold · Σ_i reward_weights[i]``, a fraction of the largest ``R`` when every reward
  function scores in [0, 1] (so re-weighting the functions does not move the bar).

:class:`SuccessMonitor` watches the share of successful rollouts per generation batch and returns one warning
(per kind, per run) once it stayed at 0 or at 1 for ``patience`` batches in a row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = ["SUCCESS_THRESHOLD_MODES", "SuccessMonitor", "SuccessThresholdMode", "effective_success_threshold"]

SuccessThresholdMode = Literal["absolute", "relative"]
SUCCESS_THRESHOLD_MODES: tuple[str, ...] = get_args(SuccessThresholdMode)


def effective_success_threshold(threshold: float, mode: str, reward_weights: Sequence[float]) -> float:
    """The weighted reward ``R`` a rollout must reach to be a success (see the module docstring)."""
    if mode not in SUCCESS_THRESHOLD_MODES:
        raise ValueError(f"sdpo_success_threshold_mode must be one of {SUCCESS_THRESHOLD_MODES}, got {mode!r}")
    if mode == "absolute":
        return float(threshold)
    total = float(sum(float(w) for w in reward_weights))
    if not math.isfinite(total) or total <= 0:
        raise ValueError(
            f"sdpo_success_threshold_mode='relative' scales the threshold by sum(reward_weights), which is {total} "
            f"(reward_weights={[float(w) for w in reward_weights]}); use positive reward weights or "
            "sdpo_success_threshold_mode='absolute'"
        )
    return float(threshold) * total


@dataclass
class SuccessMonitor:
    """Counts generation batches in a row whose success fraction is 0 (or 1) and warns once per kind.

    Attributes:
        threshold: the effective threshold (weighted-reward units).
        setting: how the user set it, quoted in the warning (e.g. ``"sdpo_success_reward_threshold=1.0"``).
        patience: batches in a row before the warning; 0 never warns.
    """

    threshold: float
    setting: str
    patience: int = 10
    _runs: dict[str, int] = field(default_factory=lambda: {"none": 0, "all": 0})
    _low: dict[str, float] = field(default_factory=dict)
    _high: dict[str, float] = field(default_factory=dict)
    _warned: set[str] = field(default_factory=set)

    def observe(self, rewards: Sequence[float]) -> str | None:
        """Record one generation batch of weighted rewards; returns the warning to log, at most once per kind."""
        values = [float(r) for r in rewards]
        finite = [r for r in values if not math.isnan(r)]
        share = sum(r >= self.threshold for r in finite) / len(values) if values else 0.0
        kind = "none" if share == 0.0 else "all" if share == 1.0 else None
        message = None
        for name in ("none", "all"):
            if name != kind:
                self._runs[name] = 0
                self._low.pop(name, None)
                self._high.pop(name, None)
                continue
            self._runs[name] += 1
            if finite:
                self._low[name] = min(self._low.get(name, math.inf), *finite)
                self._high[name] = max(self._high.get(name, -math.inf), *finite)
            if self.patience and self._runs[name] >= self.patience and name not in self._warned:
                self._warned.add(name)
                message = self._message(name)
        return message

    def _message(self, kind: str) -> str:
        span = f"[{self._low[kind]:.4g}, {self._high[kind]:.4g}]" if kind in self._low else "none (every reward NaN)"
        head = (
            f"SDPO: {'no' if kind == 'none' else 'every'} rollout reached the success threshold in the last "
            f"{self._runs[kind]} generation batches (success: weighted reward sum(reward_weights * rewards) >= "
            f"{self.threshold:.4g}, from {self.setting}; observed weighted rewards {span}). "
        )
        if kind == "none":
            return head + (
                "SDPO then has no demonstrations and learns only from environment feedback. Fix: lower "
                "sdpo_success_reward_threshold below the reward of a solved rollout, or give it as a fraction of "
                "sum(reward_weights) with sdpo_success_threshold_mode='relative'."
            )
        return head + (
            "Every rollout is then a demonstration, solved or not (and sdpo_routing='srpo' sends none to SDPO). "
            "Fix: raise sdpo_success_reward_threshold above the reward of a failed rollout, or give it as a "
            "fraction of sum(reward_weights) with sdpo_success_threshold_mode='relative'."
        )
