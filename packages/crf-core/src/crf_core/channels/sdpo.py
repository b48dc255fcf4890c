"""SDPO self-distillation channel: a divergence from the student to its feedback-conditioned self-teacher.

Paper: Hübotter et al., "Self-Distillation Policy Optimization" (arXiv 2601.20802); reference code
lasgroup/SDPO ``compute_self_distillation_loss``. Per completion token ``c`` of sample ``b`` with student logits
``S`` (the policy on ``[prompt ; completion]``) and teacher logits ``T`` (the same model, or its EMA copy,
under no-grad on ``[reprompt ; completion]``), both at the sampling temperature::

    ℓ_bc = D(S_bc, sg(T_bc)) · w_bc,    L = Σ_bc m_bc ℓ_bc / Σ_bc m_bc

* ``D`` is the generalised JSD with ``alpha`` (0 forward KL, 1 reverse KL; ``crf_distill.generalized_jsd``), on
  the full vocabulary or the student's top-k plus a tail bucket; with ``wrapper="taid"`` the target is TAID's
  logit-space interpolation ``softmax((1 − t)·sg(A) + t·T)`` between an anchor ``A`` (the current student, or a
  given step-0 snapshot) and the teacher (t = 1 is plain SDPO); with ``wrapper="entropy_opd"`` ``D`` is
  Entropy-OPD's reverse KL plus forward KL where the teacher's entropy exceeds ``h_max``.
* ``w_bc = min(exp(lp_bc − lp_old,bc), is_clip)`` is the detached truncated IS weight (1 on-policy; off when
  ``is_clip`` is None).
* ``m`` is the completion mask times the per-sample ``self_distillation_mask`` (samples with a teacher signal).

The channel is one :class:`~crf_distill.RowTerm` (``D·w`` per row) scored in the same LM-head pass as the
student's other rows (see ``crf_core.channels.head``), so it never needs its own ``(B, C, V)`` logits, then a
token mean. Used unchanged by ``compose_loss`` and by ``ComposerReplicationTrainer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from crf_core.channels._validate import check_choice, check_number, check_optional_int, check_unit
from crf_core.channels.head import RowSource
from crf_distill import (
    RowTerm,
    entropy_opd_per_token,
    generalized_jsd_per_token,
    is_ratio_weight,
    taid_target_logprobs,
    token_logprobs,
)

__all__ = ["SDPO_WRAPPERS", "SDPOChannel", "SDPOConfig", "SDPOTargets", "first_error_mask"]

SDPOWrapper = Literal["taid", "entropy_opd"]
SDPO_WRAPPERS: tuple[str | None, ...] = (None, "taid", "entropy_opd")
EntropyGate = Literal["hard", "sigmoid", "linear"]


@dataclass(frozen=True)
class SDPOConfig:
    """The SDPO divergence and its wrappers (validated on construction).

    Attributes:
        alpha: generalised-JSD interpolation in [0, 1] (0 forward KL, 1 reverse KL; SDPO's 0.5).
        top_k: distil on the student's top-k ids (full-vocabulary-normalised); None = full vocabulary.
        add_tail: with top-k, add a tail bucket holding the remaining mass (else renormalise the top-k).
        is_clip: cap of the detached truncated IS weight; None disables it.
        wrapper: None, ``"taid"`` or ``"entropy_opd"``.
        entropy_opd_h_max: teacher-entropy threshold in nats (required with ``entropy_opd``).
        entropy_opd_gate: ``"hard"`` ``1[H > h_max]``, ``"sigmoid"`` ``σ(s·(H − h_max))`` or ``"linear"``
            ``clamp(H / h_max, 0, 1)``.
        entropy_opd_sharpness: ``s`` of the sigmoid gate.
        entropy_opd_forward_weight: weight of the gated forward-KL term.
        truncate_below: first-error truncation (crf; see `first_error_mask`): a completion's first token to
            which the teacher gives a probability below this is where the rollout went wrong; SDPO trains on
            the tokens up to and including it and on none after it (the teacher there reads a context it would
            not have written). None (default) trains on every completion token, as SDPO does.
    """

    alpha: float = 0.5
    top_k: int | None = None
    add_tail: bool = True
    is_clip: float | None = None
    wrapper: SDPOWrapper | None = None
    entropy_opd_h_max: float | None = None
    entropy_opd_gate: EntropyGate = "hard"
    entropy_opd_sharpness: float = 5.0
    entropy_opd_forward_weight: float = 1.0
    truncate_below: float | None = None

    def __post_init__(self) -> None:
        if self.truncate_below is not None:
            check_number("sdpo_truncate_below", self.truncate_below, low=0.0, low_inclusive=False, none_means="off")
            if not self.truncate_below < 1.0:
                raise ValueError(
                    f"sdpo_truncate_below is a probability in (0, 1), got {self.truncate_below!r}; e.g. 0.1, or None "
                    "to train on every completion token"
                )
        check_unit("sdpo_alpha", self.alpha)
        check_optional_int("sdpo_top_k", self.top_k, low=1, none_means="the full vocabulary")
        if not isinstance(self.add_tail, bool):
            raise TypeError(f"sdpo_add_tail must be a bool, got {self.add_tail!r}")
        if self.is_clip is not None:
            check_number("sdpo_is_clip", self.is_clip, low=0.0, low_inclusive=False, none_means="disabled")
        check_choice("sdpo_wrapper", self.wrapper, SDPO_WRAPPERS)
        check_choice("entropy_opd_gate", self.entropy_opd_gate, ("hard", "sigmoid", "linear"))
        check_number("entropy_opd_sharpness", self.entropy_opd_sharpness)
        check_number("entropy_opd_forward_weight", self.entropy_opd_forward_weight, low=0.0)
        if self.wrapper == "entropy_opd":
            if self.entropy_opd_h_max is None:
                raise ValueError(
                    "sdpo_wrapper='entropy_opd' needs `entropy_opd_h_max`, the teacher-entropy threshold in nats above "
                    "which forward KL is added (a tunable; e.g. 1.0)"
                )
            low = 0.0 if self.entropy_opd_gate == "hard" else -math.inf
            check_number("entropy_opd_h_max", self.entropy_opd_h_max, low=low)
            if self.entropy_opd_gate == "linear" and not self.entropy_opd_h_max > 0:
                raise ValueError("entropy_opd_gate='linear' divides by `entropy_opd_h_max`, which must be > 0")
        elif self.entropy_opd_h_max is not None:
            raise ValueError(
                "`entropy_opd_h_max` was given but sdpo_wrapper is not 'entropy_opd'; set it or drop h_max"
            )


@dataclass(frozen=True)
class SDPOTargets:
    """What one step's SDPO term reads besides the student logits.

    Attributes:
        teacher: teacher logits of each scored row (no grad).
        taid_t: TAID's interpolation coefficient in [0, 1] (``wrapper="taid"`` only).
        anchor: TAID anchor logits of each scored row; None anchors on the current detached student (paper).
        labels: ``(N,)`` sampled token of each scored row (for ``is_clip``).
        old_logprobs: ``(N,)`` behaviour log-probs of those tokens; None is on-policy (the IS weight is then the
            constant ``min(1, is_clip)``).
    """

    teacher: RowSource
    taid_t: float | None = None
    anchor: RowSource | None = None
    labels: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None


class SDPOChannel:
    """The SDPO channel (see the module docstring): a row term for the head pass, token-averaged over the mask
    ``m`` (use :func:`crf_core.channels.head.token_mean` or :meth:`LMHead.weighted_sums` with
    :func:`~crf_core.channels.head.mean_weights`)."""

    def __init__(self, config: SDPOConfig) -> None:
        if not isinstance(config, SDPOConfig):
            raise TypeError(f"config must be an SDPOConfig, got {type(config).__name__}")
        self.config = config

    def term(self, targets: SDPOTargets, active: torch.Tensor) -> RowTerm:
        """The per-row loss ``D(S_r, target_r)·w_r`` on the ``active`` ``(N,)`` rows (before the token mean)."""
        cfg = self.config
        if cfg.wrapper == "taid":
            if targets.taid_t is None:
                raise ValueError("sdpo_wrapper='taid' needs the TAID coefficient t of this step")
            check_unit("taid t", targets.taid_t)
        elif targets.taid_t is not None or targets.anchor is not None:
            raise ValueError("a TAID coefficient or anchor was given but sdpo_wrapper is not 'taid'")

        clip = cfg.is_clip
        if clip is not None and targets.old_logprobs is not None and targets.labels is None:
            raise ValueError("sdpo_is_clip with behaviour log-probs needs the sampled token of each row (labels)")

        def per_row(student: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            value = divergence(student, rows)
            if clip is None:
                return value
            if targets.old_logprobs is None:  # on-policy: π_θ/π_old = 1
                return value * min(1.0, clip)
            assert targets.labels is not None
            lp = token_logprobs(student, targets.labels[rows], ignore_index=None)
            return value * is_ratio_weight(lp, targets.old_logprobs[rows].to(lp.dtype), clip)

        def divergence(student: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            target = targets.teacher(rows)
            if cfg.wrapper == "taid":
                assert targets.taid_t is not None
                anchor = None if targets.anchor is None else targets.anchor(rows)
                target = taid_target_logprobs(student, target, targets.taid_t, anchor_logits=anchor)
            if cfg.wrapper == "entropy_opd":
                assert cfg.entropy_opd_h_max is not None
                return entropy_opd_per_token(
                    student,
                    target,
                    h_max=cfg.entropy_opd_h_max,
                    gate=cfg.entropy_opd_gate,
                    sharpness=cfg.entropy_opd_sharpness,
                    forward_weight=cfg.entropy_opd_forward_weight,
                    top_k=cfg.top_k,
                    add_tail=cfg.add_tail,
                )
            return generalized_jsd_per_token(student, target, alpha=cfg.alpha, top_k=cfg.top_k, add_tail=cfg.add_tail)

        return RowTerm(per_row, active=active)


def first_error_mask(teacher_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """``mask`` with every token after each row's first error zeroed (first-error truncation, crf).

    A row's first error is its first token with ``mask > 0`` whose teacher log-prob is below ``log(threshold)``:
    the teacher, reading the feedback, would not have written it. The error itself is kept (there the teacher's
    distribution says what to write instead); later tokens are not, since the teacher's predictions there are
    conditioned on a prefix it would not have produced. Why it matters: a mass-covering divergence (forward KL)
    distilled on those later tokens teaches the student whatever the teacher makes of the wrong prefix, and with
    a self-teacher that tracks the student (EMA) the two feed each other.

    Args:
        teacher_logprobs: ``(B, C)`` teacher log-probs of the sampled completion tokens.
        mask: ``(B, C)`` 0/1 (or weights) on the tokens SDPO may train on.
        threshold: probability in (0, 1).

    Returns:
        ``(B, C)`` mask of ``mask``'s dtype.
    """
    if not isinstance(teacher_logprobs, torch.Tensor) or not teacher_logprobs.is_floating_point():
        raise TypeError("teacher_logprobs must be a floating-point tensor of log-probs")
    if teacher_logprobs.dim() != 2 or tuple(mask.shape) != tuple(teacher_logprobs.shape):
        raise ValueError(
            f"teacher_logprobs and mask must both be (B, C), got {tuple(teacher_logprobs.shape)} and {tuple(mask.shape)}"
        )
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be a probability in (0, 1), got {threshold!r}")
    error = ((teacher_logprobs.detach() < math.log(threshold)) & (mask > 0)).long()
    after = (error.cumsum(dim=1) - error) > 0  # strictly after the first error
    return mask * (~after).to(mask.dtype)
