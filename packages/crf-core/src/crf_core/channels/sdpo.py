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
  With ``truncate_below`` (first-error truncation, crf) ``m`` is also zeroed after each row's first token
  whose teacher probability is below it (:func:`first_error_mask`).

The channel is one :class:`~crf_distill.RowTerm` (``D·w`` per row) scored in the same LM-head pass as the
student's other rows (see ``crf_core.channels.head``), so it never needs its own ``(B, C, V)`` logits, then a
token mean. Used unchanged by ``compose_loss`` and by ``ComposerReplicationTrainer``, which both build the
channel's inputs with :func:`sdpo_targets` (one home for the teacher forward, the slice at the completion offset,
the row mapping to the teacher, the old log-prob alignment, the row layout and the first-error truncation of
the token weights) and score it with
:meth:`SDPOChannel.term_at`.

Row layout: :class:`SDPOTargets` hold one row per completion token, row ``b·C + j`` for token ``j`` of sample ``b``
(``B`` samples, ``C`` completion tokens). A caller whose head pass scores other rows (``compose_loss`` every
next-token prediction, the trainer the real completion tokens) names each scored row's ``(sample, position)``.

With top-k (no wrapper) and a teacher that is a :class:`~crf_core.channels.head.RowLogits` (what
:func:`sdpo_targets` builds, and :meth:`SDPOTargets.rows` keeps), the term also comes in support form
(:class:`~crf_distill.RowSupport`, a field of the same :class:`~crf_distill.RowTerm`): ``D`` reads the student at
its top-k ids (and the label, for the IS weight) plus its log-normaliser, and the teacher's log-probs there,
``z_T[ids] − logsumexp(z_T)``, from the teacher's log-normaliser (one no-grad pass) and its logits at those ids; no
``(n, V)`` teacher logits and no second student softmax exist, and the chunked backward reuses the forward's ids.
Same value, same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from crf_core._checks import is_number
from crf_core.channels._validate import check_choice, check_number, check_optional_int, check_unit
from crf_core.channels.head import HeadStates, LMHead, RowLogits, RowSource, hidden_source, logits_source
from crf_distill import (
    RowSupport,
    RowTerm,
    TAIDSchedule,
    entropy_opd_per_token,
    generalized_jsd_on_support,
    generalized_jsd_per_token,
    is_ratio_weight,
    taid_linear_t,
    taid_target_logprobs,
    token_logprobs,
    top_k_ids,
)
from crf_distill.entropy_opd import ENTROPY_GATES, EntropyGate

__all__ = [
    "SDPO_WRAPPERS",
    "EntropyGate",
    "SDPOChannel",
    "SDPOConfig",
    "SDPOTargets",
    "SDPOWrapper",
    "TeacherForward",
    "first_error_mask",
    "sdpo_targets",
]

SDPOWrapper = Literal["taid", "entropy_opd"]
"""A distillation wrapper of the SDPO divergence (None: the plain generalised JSD)."""
SDPO_WRAPPERS: tuple[SDPOWrapper | None, ...] = (None, *get_args(SDPOWrapper))


@dataclass(frozen=True)
class SDPOConfig:
    """The SDPO divergence and its wrappers (validated on construction).

    Attributes:
        alpha: generalised-JSD interpolation in [0, 1] (0 forward KL, 1 reverse KL; SDPO's 0.5).
        top_k: distil on the student's top-k ids (full-vocabulary-normalised); None = full vocabulary.
        add_tail: with top-k, add a tail bucket holding the remaining mass (else renormalise the top-k).
        is_clip: cap of the detached truncated IS weight; None disables it.
        wrapper: None, ``"taid"`` or ``"entropy_opd"``.
        taid_alpha_min, taid_alpha_max: TAID's ``t`` at the start and at the end of training (the paper's
            ``t_start``/``t_end``, in [0, 1]; min <= max).
        taid_step_size, taid_momentum: the adaptive schedule's step size and momentum (the paper's α and β).
        taid_adaptive: the paper's adaptive schedule; False = the linear one.
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
    taid_alpha_min: float = 0.4
    taid_alpha_max: float = 1.0
    taid_step_size: float = 5e-4
    taid_momentum: float = 0.99
    taid_adaptive: bool = True
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
        t_min = check_unit("taid_alpha_min", self.taid_alpha_min)
        t_max = check_unit("taid_alpha_max", self.taid_alpha_max)
        if t_min > t_max:
            raise ValueError(f"`taid_alpha_min` ({t_min}) must not exceed `taid_alpha_max` ({t_max})")
        check_choice("entropy_opd_gate", self.entropy_opd_gate, ENTROPY_GATES)
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

    def taid_schedule(self) -> TAIDSchedule | None:
        """A fresh TAID schedule (state ``t``, previous loss, momentum) with ``wrapper="taid"``, else None (the
        schedule validates step size and momentum, and needs ``taid_alpha_min < 1``)."""
        if self.wrapper != "taid":
            return None
        return TAIDSchedule(
            t_start=self.taid_alpha_min,
            t_end=self.taid_alpha_max,
            alpha=self.taid_step_size,
            beta=self.taid_momentum,
            disable_adaptive=not self.taid_adaptive,
        )

    def taid_t(self, step: int | None, total: int | None, schedule: TAIDSchedule | None = None) -> float:
        """TAID's ``t`` of this step: ``schedule.t`` (whose bounds must be this config's), else the linear
        ``taid_alpha_min + (taid_alpha_max − taid_alpha_min)·step/total``."""
        if schedule is not None:
            if (schedule.t_start, schedule.t_end) != (self.taid_alpha_min, self.taid_alpha_max):
                raise ValueError(
                    f"taid_schedule has t_start/t_end = ({schedule.t_start}, {schedule.t_end}) but taid_alpha_min/max"
                    f" = ({self.taid_alpha_min}, {self.taid_alpha_max}); build the schedule with the same bounds"
                )
            return schedule.t
        if step is None or total is None:
            raise ValueError("TAID's linear t needs the current and the total number of training steps")
        return taid_linear_t(step, total, self.taid_alpha_min, self.taid_alpha_max)


@dataclass(frozen=True)
class SDPOTargets:
    """What one step's SDPO term reads besides the student logits, one row per completion token (built by
    :func:`sdpo_targets` in the row layout ``b·C + j``; :meth:`rows` re-indexes them onto other rows).

    Attributes:
        teacher: teacher logits of each row (no grad).
        taid_t: TAID's interpolation coefficient in [0, 1] (``wrapper="taid"`` only).
        anchor: TAID anchor logits of each row; None anchors on the current detached student (paper).
        labels: ``(N,)`` sampled token of each row (for ``is_clip``).
        old_logprobs: ``(N,)`` behaviour log-probs of those tokens; None is on-policy (the IS weight is then the
            constant ``min(1, is_clip)``).
        weights: ``(B, C)`` token weights the SDPO term is averaged over (the caller's, with every token after each
            row's first error zeroed under first-error truncation, see :func:`first_error_mask`); None when the
            caller gave none. Not carried by :meth:`rows`.
    """

    teacher: RowSource
    taid_t: float | None = None
    anchor: RowSource | None = None
    labels: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> SDPOTargets:
        """These targets seen from other rows: row ``i`` of the result is row ``index[i]`` ``(N',)`` of these (a
        :class:`~crf_core.channels.head.RowLogits` teacher stays one, for the support form)."""
        teacher, anchor = self.teacher, self.anchor
        return SDPOTargets(
            teacher=teacher.rows(index) if isinstance(teacher, RowLogits) else (lambda rows: teacher(index[rows])),
            taid_t=self.taid_t,
            anchor=None if anchor is None else (lambda rows: anchor(index[rows])),
            labels=None if self.labels is None else self.labels[index],
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs[index],
        )


TeacherForward = Callable[[torch.Tensor, torch.Tensor], tuple[LMHead, HeadStates]]
"""``forward(input_ids (n, L), attention_mask (n, L)) -> (head, states)``: the self-teacher's head and its decoder
states (or full logits) on ``n`` sequences, under no-grad (``LMHead.states`` of the teacher model)."""


def completion_states(states: HeadStates, completion: int) -> torch.Tensor:
    """The ``(n, C, H)`` rows of ``(n, L, H)`` states that predict the last ``completion`` tokens (position
    ``L − C − 1 + j`` predicts completion token ``j``)."""
    length = states.tensor.shape[1]
    return states.tensor[:, length - completion - 1 : length - 1]


def _no_teacher(rows: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(f"no sample has a teacher signal, yet teacher rows {rows.tolist()} were asked for")


def sdpo_targets(
    completion_ids: torch.Tensor,
    signal: torch.Tensor,
    *,
    teacher_logits: torch.Tensor | None = None,
    teacher: TeacherForward | None = None,
    teacher_input_ids: torch.Tensor | None = None,
    teacher_attention_mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    taid_t: float | None = None,
    anchor: RowSource | None = None,
    weights: torch.Tensor | None = None,
    truncate_below: float | None = None,
) -> SDPOTargets:
    """SDPO's targets for ``B`` samples of ``C`` completion tokens, in the row layout ``b·C + j``.

    The teacher is either precomputed ``teacher_logits`` ``(B, C, V)`` or ``teacher`` run under no-grad on
    ``teacher_input_ids`` / ``teacher_attention_mask`` ``(B, L)`` (the teacher prompt, then the same ``C``
    completion tokens) for the samples with a ``signal`` ``(B,)`` only; its states are sliced at the completion
    offset and projected row by row on demand. ``old_logprobs`` ``(B, C)`` are the behaviour log-probs of the
    completion tokens (for ``is_clip``); ``anchor`` is TAID's anchor over the same rows.

    ``weights`` ``(B, C)`` are the token weights the term is averaged over (the completion mask, tool results
    zeroed, times the per-sample signal); they come back as ``SDPOTargets.weights``, and with ``truncate_below``
    (``SDPOConfig.truncate_below``) every token after each signalled row's first error is zeroed there
    (:func:`first_error_mask` on the teacher's no-grad log-probs of the completion tokens).
    """
    batch, c = completion_ids.shape
    if signal.shape != (batch,):
        raise ValueError(f"signal must be (B={batch},), got {tuple(signal.shape)}")
    if weights is not None and tuple(weights.shape) != (batch, c):
        raise ValueError(f"weights must be (B={batch}, C={c}), got {tuple(weights.shape)}")
    if truncate_below is not None and weights is None:
        raise ValueError("first-error truncation (truncate_below) needs the (B, C) token weights it truncates")
    labels = completion_ids.reshape(-1)
    old = None if old_logprobs is None else old_logprobs.detach().reshape(-1)
    if teacher_logits is not None:
        flat_logits = teacher_logits.reshape(batch * c, -1)
        source = logits_source(flat_logits, lambda rows: rows)
        if truncate_below is not None:
            assert weights is not None
            with torch.no_grad():
                logprobs = token_logprobs(flat_logits.detach(), labels, ignore_index=None).reshape(batch, c)
            weights = first_error_mask(logprobs, weights, truncate_below)
        return SDPOTargets(source, taid_t, anchor, labels=labels, old_logprobs=old, weights=weights)
    if teacher is None or teacher_input_ids is None or teacher_attention_mask is None:
        raise ValueError("SDPO targets need teacher_logits, or a teacher with teacher_input_ids/attention_mask")
    length = teacher_input_ids.shape[1]
    if length <= c or not torch.equal(teacher_input_ids[:, length - c :], completion_ids):
        raise ValueError(
            "inputs['teacher_input_ids'] must end with the same C completion tokens as 'input_ids' "
            "(teacher prompt, then the student's completion); rebuild it as cat(teacher_prompt_ids, completion_ids)"
        )
    scored = signal.nonzero(as_tuple=True)[0]  # the teacher runs on the samples with a signal only
    if scored.numel() == 0:  # no row is active, so no teacher row is ever read
        return SDPOTargets(_no_teacher, taid_t, anchor, labels=labels, weights=weights)
    with torch.no_grad():
        head, states = teacher(teacher_input_ids[scored], teacher_attention_mask[scored])
        flat = completion_states(states, c).reshape(scored.numel() * c, -1)
        if truncate_below is not None:  # first-error truncation: nothing after the teacher's first disagreement
            assert weights is not None
            teacher_lp = head.score(flat, completion_ids[scored].reshape(-1), is_logits=states.is_logits).logprobs
            weights = weights.clone()
            weights[scored] = first_error_mask(
                teacher_lp.reshape(scored.numel(), c), weights[scored], truncate_below
            ).to(weights.dtype)
    slot = torch.full((batch,), -1, dtype=torch.long, device=signal.device)
    slot[scored] = torch.arange(scored.numel(), device=signal.device)

    def teacher_row(rows: torch.Tensor) -> torch.Tensor:  # row b·C + j -> row slot[b]·C + j of `flat`
        return slot[rows // c].clamp_min(0) * c + rows % c

    source = hidden_source(head, flat, teacher_row)
    return SDPOTargets(source, taid_t, anchor, labels=labels, old_logprobs=old, weights=weights)


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

        return RowTerm(per_row, active=active, support=self._support(targets))

    def term_at(
        self, targets: SDPOTargets, weights: torch.Tensor, sample: torch.Tensor, position: torch.Tensor
    ) -> RowTerm:
        """The term on scored rows given by their ``sample`` and completion ``position`` ``(N,)`` (a negative
        position: not a completion token), active where the ``(B, C)`` token ``weights`` are > 0; ``targets`` are
        :func:`sdpo_targets`' (row ``b·C + j``)."""
        c = weights.shape[1]
        inside = position >= 0
        at = position.clamp_min(0)
        active = inside & (weights[sample, at] > 0)
        return self.term(targets.rows(sample * c + at), active)

    def _support(self, targets: SDPOTargets) -> RowSupport | None:
        """The term in support form (see the module docstring), where it has one: top-k, no wrapper, a
        :class:`RowLogits` teacher."""
        cfg = self.config
        teacher = targets.teacher
        if cfg.wrapper is not None or cfg.top_k is None or not isinstance(teacher, RowLogits):
            return None
        k, clip, old, labels = cfg.top_k, cfg.is_clip, targets.old_logprobs, targets.labels
        weighted = clip is not None and old is not None  # the IS weight reads the label's log-prob too

        def ids(student: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            top = top_k_ids(student, k)
            if not weighted:
                return top
            assert labels is not None
            return torch.cat([top, labels[rows].unsqueeze(-1).to(top.device)], dim=-1)

        def per_row(values: torch.Tensor, lse: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            student = values[:, :k] - lse.unsqueeze(-1)
            value = generalized_jsd_on_support(
                student, teacher.logprobs_at(rows, at[:, :k]), alpha=cfg.alpha, add_tail=cfg.add_tail
            )
            if clip is None:
                return value
            if old is None:  # on-policy: π_θ/π_old = 1
                return value * min(1.0, clip)
            lp = values[:, k] - lse
            return value * is_ratio_weight(lp, old[rows].to(lp.dtype), clip)

        return RowSupport(ids, per_row)


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
    if not is_number(threshold) or not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be a probability in (0, 1), got {threshold!r}")
    error = ((teacher_logprobs.detach() < math.log(threshold)) & (mask > 0)).long()
    after = (error.cumsum(dim=1) - error) > 0  # strictly after the first error
    return mask * (~after).to(mask.dtype)
