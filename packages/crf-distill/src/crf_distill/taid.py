"""TAID: Temporally Adaptive Interpolated Distillation (Shing et al., ICLR 2025, arXiv 2501.16937).

Paper algorithm (default here; matches SakanaAI/TAID ``src/distil_losses/taid.py``):

* target ``p_t = softmax((1 − t)·sg(z_S) + t·z_T)`` — a *logit-space* interpolation between the current,
  detached student ``z_S`` and the teacher ``z_T`` (not a probability mixture, not a frozen step-0 snapshot);
* loss ``J = −Σ_v p_t(v)·log q_θ(v)`` (cross-entropy, ``objective="cross_entropy"``, the official code) or
  ``KL(p_t ‖ q_θ)`` (``objective="kl"``, same gradient, 0 at ``t = 0``), token mean over the mask;
* ``t`` follows :class:`TAIDSchedule`: linear floor from ``t_start`` to ``t_end`` plus a momentum-driven
  adaptive step (defaults ``t_start=0.4, t_end=1.0, alpha=5e-4, beta=0.99``).

Deviation available as an option (the seed framework's variant, *not* the paper's algorithm): anchor on
``anchor_logits`` (e.g. ``student_init_logits`` captured at step 0) instead of the current student, and/or
mix in probability space (``interpolation="probability"``: ``p_t = (1 − t)·softmax(z_A) + t·softmax(z_T)``).

Shapes: logits ``(..., V)``, mask ``(...)``; ``t`` a float in [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from crf_distill._checks import check_finite_float, check_float_tensor, check_in_range, check_same_leading, is_int
from crf_distill._support import check_logit_pair, cross_entropy_per_token, kl_per_token
from crf_distill.aggregate import Aggregation, aggregate
from crf_distill.logprobs import compute_dtype

__all__ = [
    "TAIDInterpolation",
    "TAIDObjective",
    "TAIDSchedule",
    "taid_linear_t",
    "taid_loss",
    "taid_per_token",
    "taid_target_logprobs",
]

TAIDInterpolation = Literal["logit", "probability"]
TAIDObjective = Literal["cross_entropy", "kl"]


def taid_target_logprobs(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    t: float,
    *,
    anchor_logits: torch.Tensor | None = None,
    interpolation: TAIDInterpolation = "logit",
) -> torch.Tensor:
    """Detached log-probs of the interpolated target ``p_t``; ``(..., V)``.

    ``anchor_logits=None`` anchors on the detached ``student_logits`` (paper); otherwise on the given tensor
    (same shape). ``t = 0`` returns the anchor distribution, ``t = 1`` the teacher's exactly.
    """
    check_logit_pair(student_logits, teacher_logits)
    t = check_in_range("t", t, 0.0, 1.0)
    if anchor_logits is not None:
        check_float_tensor("anchor_logits", anchor_logits)
        check_same_leading("anchor_logits", anchor_logits, "teacher_logits", teacher_logits)
    dtype = compute_dtype(student_logits)
    anchor = (student_logits if anchor_logits is None else anchor_logits).detach().to(dtype)
    teacher = teacher_logits.detach().to(dtype)
    if t == 1.0:
        return torch.log_softmax(teacher, dim=-1)
    if t == 0.0:
        return torch.log_softmax(anchor, dim=-1)
    if interpolation == "logit":
        return torch.log_softmax((1.0 - t) * anchor + t * teacher, dim=-1)
    if interpolation == "probability":
        return torch.logaddexp(
            torch.log_softmax(anchor, dim=-1) + math.log1p(-t), torch.log_softmax(teacher, dim=-1) + math.log(t)
        )
    raise ValueError(f"`interpolation` must be 'logit' (paper) or 'probability' (seed variant), got {interpolation!r}")


def taid_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    t: float,
    anchor_logits: torch.Tensor | None = None,
    interpolation: TAIDInterpolation = "logit",
    objective: TAIDObjective = "cross_entropy",
) -> torch.Tensor:
    """Per-token TAID loss ``(...)`` against the target of :func:`taid_target_logprobs`."""
    target = taid_target_logprobs(
        student_logits, teacher_logits, t, anchor_logits=anchor_logits, interpolation=interpolation
    )
    student = torch.log_softmax(student_logits.to(target.dtype), dim=-1)
    if objective == "kl":
        return kl_per_token(target, student)
    if objective == "cross_entropy":
        return cross_entropy_per_token(target, student)
    raise ValueError(f"`objective` must be 'cross_entropy' (official code) or 'kl', got {objective!r}")


def taid_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    t: float,
    anchor_logits: torch.Tensor | None = None,
    interpolation: TAIDInterpolation = "logit",
    objective: TAIDObjective = "cross_entropy",
    aggregation: Aggregation = "token_mean",
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """TAID distillation loss aggregated over ``mask`` (token mean by default); returns a 0-d tensor."""
    per_token = taid_per_token(
        student_logits,
        teacher_logits,
        t=t,
        anchor_logits=anchor_logits,
        interpolation=interpolation,
        objective=objective,
    )
    return aggregate(per_token, mask, aggregation, num_items=num_items)


def taid_linear_t(step: int, total_steps: int, t_start: float, t_end: float) -> float:
    """Linear schedule ``t_start + (t_end − t_start)·min(step/total_steps, 1)`` (TAID's floor; ``disable_adaptive``)."""
    if not is_int(step) or step < 0:
        raise ValueError(f"`step` must be an int >= 0, got {step!r}")
    if not is_int(total_steps) or total_steps <= 0:
        raise ValueError(f"`total_steps` must be an int > 0, got {total_steps!r}")
    t_start = check_in_range("t_start", t_start, 0.0, 1.0)
    t_end = check_in_range("t_end", t_end, 0.0, 1.0)
    if t_start > t_end:
        raise ValueError(f"`t_start` ({t_start}) must not exceed `t_end` ({t_end})")
    return t_start + (t_end - t_start) * min(step / total_steps, 1.0)


@dataclass
class TAIDSchedule:
    """TAID's adaptive interpolation schedule (paper Alg. 1; SakanaAI/TAID ``update_t``).

    State: ``t`` (starts at ``t_start``), ``prev_loss`` (``inf`` until the first update) and ``momentum``
    (0). One :meth:`update` per training step, after the loss of that step is known:

    * first call: only record ``prev_loss = J``;
    * ``δ = (J_prev − J) / (J_prev + 1e-15)``; ``m ← β·m + (1 − β)·δ``;
    * ``Δt = alpha·sigmoid(m)·(1 − t)``; ``t_lin = t_start + (t_end − t_start)·step/total_steps``;
    * ``t ← min(t_end, max(t_lin, t + Δt))`` (``disable_adaptive``: ``t = t_lin``).

    Attributes ``t_start``/``t_end`` are the seed's ``alpha_min``/``alpha_max``; ``alpha`` is the step size
    of ``t`` and ``beta`` the momentum coefficient.
    """

    t_start: float = 0.4
    t_end: float = 1.0
    alpha: float = 5e-4
    beta: float = 0.99
    disable_adaptive: bool = False
    t: float = field(init=False)
    prev_loss: float = field(init=False, default=math.inf)
    momentum: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        check_in_range("t_start", self.t_start, 0.0, 1.0, high_inclusive=False)
        check_in_range("t_end", self.t_end, 0.0, 1.0, low_inclusive=False)
        if self.t_start > self.t_end:
            raise ValueError(f"`t_start` ({self.t_start}) must not exceed `t_end` ({self.t_end})")
        check_in_range("alpha", self.alpha, 0.0, 1.0)
        check_in_range("beta", self.beta, 0.0, 1.0)
        self.t = float(self.t_start)

    def linear_t(self, step: int, total_steps: int) -> float:
        """The linear floor at ``step`` (see :func:`taid_linear_t`)."""
        return taid_linear_t(step, total_steps, self.t_start, self.t_end)

    def update(self, loss: float | torch.Tensor, step: int, total_steps: int) -> float:
        """Advance the schedule with this step's loss ``J``; returns the new ``t`` (used from the next step)."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else check_finite_float("loss", loss)
        t_lin = self.linear_t(step, total_steps)
        if self.disable_adaptive:
            self.t = min(self.t_end, t_lin)
            return self.t
        if math.isinf(self.prev_loss):
            self.prev_loss = value
            return self.t
        delta = (self.prev_loss - value) / (self.prev_loss + 1e-15)
        self.momentum = self.beta * self.momentum + (1.0 - self.beta) * delta
        step_t = self.alpha * (1.0 / (1.0 + math.exp(-self.momentum))) * (1.0 - self.t)
        self.t = min(self.t_end, max(t_lin, self.t + step_t))
        self.prev_loss = value
        return self.t

    def state_dict(self) -> dict[str, float]:
        """Checkpointable state (``t``, ``prev_loss``, ``momentum``)."""
        return {"t": self.t, "prev_loss": self.prev_loss, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` returned."""
        missing = {"t", "prev_loss", "momentum"} - set(state)
        if missing:
            raise KeyError(f"TAIDSchedule state is missing {sorted(missing)}")
        self.t = check_in_range("t", state["t"], 0.0, 1.0)
        self.prev_loss = float(state["prev_loss"])
        self.momentum = float(state["momentum"])
