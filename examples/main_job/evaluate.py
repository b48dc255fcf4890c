"""Held-out pass rate: sample the policy on tasks it never trained on and run their unit tests in the sandbox.

A completion *passes* when it passes every test of its task (``UnitTestReward`` scores 1.0). Each task
gets ``samples`` completions, sampled like the rollouts (same temperature, no top-k/top-p cut) under a
fixed seed, so before and after RL draw the same random numbers. The unit of the interval is the task
(the held-out tasks are a sample of the family): a rate is the mean of the per-task rates, its standard
error ``sd(per-task rates) / sqrt(n_tasks)``; a change is the mean of the per-task differences (paired),
with ``sd(differences) / sqrt(n_tasks)``. Intervals are 95% normal intervals, ``mean ± 1.96 · se``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from main_job.tasks import CodingTask

__all__ = ["Z95", "Change", "PassRate", "evaluate"]

Z95 = 1.959964
"""The 97.5% quantile of the standard normal: mean ± Z95 · se is a 95% interval."""


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _interval(mean: float, se: float) -> tuple[float, float]:
    return mean - Z95 * se, mean + Z95 * se


def _text(mean: float, se: float, spec: str) -> str:
    lo, hi = _interval(mean, se)
    return f"{mean:{spec}} [{lo:{spec}}, {hi:{spec}}]"


@dataclass(frozen=True)
class PassRate:
    """Per-task pass rates of one evaluation (``samples`` completions per task, tasks in a fixed order)."""

    tasks: tuple[str, ...]
    per_task: tuple[float, ...]
    samples: int

    def __post_init__(self) -> None:
        if not self.tasks or len(self.tasks) != len(self.per_task):
            raise ValueError(f"need one rate per task, got {len(self.per_task)} rates for {len(self.tasks)} tasks")
        if not all(0.0 <= r <= 1.0 for r in self.per_task):
            raise ValueError("per-task pass rates must lie in [0, 1]")

    @property
    def mean(self) -> float:
        return _mean_se(self.per_task)[0]

    @property
    def se(self) -> float:
        return _mean_se(self.per_task)[1]

    @property
    def interval(self) -> tuple[float, float]:
        return _interval(self.mean, self.se)

    def text(self) -> str:
        """``mean [low, high]``."""
        return _text(self.mean, self.se, ".3f")

    def subset(self, names: Iterable[str]) -> PassRate:
        """The rates of the tasks named in ``names`` only (in this evaluation's order)."""
        keep = set(names)
        rows = [(t, r) for t, r in zip(self.tasks, self.per_task, strict=True) if t in keep]
        if not rows:
            raise ValueError("the subset names none of the evaluated tasks")
        return PassRate(tuple(t for t, _ in rows), tuple(r for _, r in rows), self.samples)


@dataclass(frozen=True)
class Change:
    """``after − before`` on the same tasks: the mean of the per-task differences and its 95% interval."""

    mean: float
    se: float
    n_tasks: int

    @classmethod
    def between(cls, before: PassRate, after: PassRate) -> Change:
        if before.tasks != after.tasks:
            raise ValueError("before and after must be evaluated on the same tasks in the same order")
        diffs = [a - b for a, b in zip(after.per_task, before.per_task, strict=True)]
        mean, se = _mean_se(diffs)
        return cls(mean, se, len(diffs))

    @property
    def interval(self) -> tuple[float, float]:
        return _interval(self.mean, self.se)

    def text(self) -> str:
        """``+mean [+low, +high]``."""
        return _text(self.mean, self.se, "+.3f")


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[CodingTask],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    isolation: str,
    timeout_s: float = 3.0,
    batch_tasks: int = 64,
) -> PassRate:
    """Pass rate of ``model`` on ``tasks``: ``samples`` sampled completions per task, each run against its tests."""
    import torch

    from crf_core.rewards import UnitTestReward

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    device = next(model.parameters()).device
    completions: list[str] = []
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(tasks), batch_tasks):
            chunk = tasks[start : start + batch_tasks]
            encoded = tokenizer([t.prompt for t in chunk], return_tensors="pt", padding=True).to(device)
            out = model.generate(
                **encoded,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=samples,  # generate() keeps a prompt's samples together
                pad_token_id=tokenizer.pad_token_id,
            )
            completions += tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    repeated = [t for t in tasks for _ in range(samples)]
    reward = UnitTestReward(timeout_s=timeout_s, max_workers=2, isolation=isolation)  # type: ignore[arg-type]
    scores = reward([t.prompt for t in repeated], completions, tests=[list(t.tests) for t in repeated])
    passed = [s == 1.0 for s in scores]
    per_task = tuple(sum(passed[i * samples : (i + 1) * samples]) / samples for i in range(len(tasks)))
    return PassRate(tuple(t.name for t in tasks), per_task, samples)
