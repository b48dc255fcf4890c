"""PRIME-RL custom loss: PRIME-RL's default DPPO + KL plus Composer teacher and CE channels.

Select it in a PRIME-RL trainer config::

    [trainer.loss]
    type = "custom"
    import_path = "crf_primerl.composer_loss.loss_fn"

    [trainer.loss.kwargs]
    teacher_weight = 0.5

PRIME-RL calls ``loss_fn(inputs, **kwargs)`` once per packed sample: every tensor of ``inputs`` is
1-D ``(seq,)`` over that sample's prompt+completion tokens (prompt masked out by ``loss_mask``), and
the driver sums the returned per-sample ``loss`` and normalises it by a token count. Both PRIME-RL
``LossInputs`` generations are accepted: ``teacher_logprobs`` (up to 46653c1, 2026-05) and
``ref_logprobs`` + ``loss_weights`` (from 0be5ac4, 2026-06; HEAD 559b447 calls it through
``setup_rl_loss_fn`` and ``compute_loss``).

The teacher channels (``teacher_tau``, ``teacher_weight``) need teacher log-probs in the *rl* loss's
inputs. The 46653c1 generation passes ``teacher_logprobs`` there when a teacher model is configured.
From 0be5ac4 on, only the ``opd``/``opsd`` algorithms fill ``ref_logprobs`` and prime-rl routes them to
its own ``ref_kl`` loss component: a GRPO-family run passes ``None``, and in a mixed GRPO + OPD batch
the GRPO samples carry ``0.0`` on every token (a filler). ``loss_fn`` refuses both with a message
rather than skipping the channel; for teacher distillation at HEAD use prime-rl's own
``[orchestrator.algo] type = "opd"``.

Per-token loss (symbols in :mod:`crf_primerl.dppo` and :mod:`crf_primerl.channels`)::

    A'  = adv_tau · A + teacher_tau · sg(lp_T − lp_θ)
    ℓ_t = w_t · [ −keep_t · A'_t · r_t + kl_tau · m_t · log_r_t²           (PRIME-RL default)
                  − teacher_weight · keep_T,t · sg(lp_T,t − lp_θ,t) · r_t   (teacher distillation)
                  − ce_weight · m_t · lp_θ,t ]                              (sampled-token CE)
    loss = Σ_t ℓ_t

With the default keywords the composer channels are off and ``loss`` and ``metrics`` are PRIME-RL's
``default_loss_fn`` with its ``DefaultLossConfig`` defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from crf_primerl.channels import (
    cross_entropy_token_loss,
    teacher_distill_token_loss,
    teacher_keep_mask,
    teacher_log_gap,
    teacher_signal,
)
from crf_primerl.dppo import dppo_kl_token_loss, dppo_metrics, dppo_terms, masked_mean
from crf_primerl.validation import Sample, check_bounds, check_teacher_arrives, read_sample

__all__ = ["LOSS_KWARGS", "LossInputs", "LossOutputs", "loss_fn"]

LOSS_KWARGS: dict[str, float] = {
    "dppo_mask_low": 0.2,
    "dppo_mask_high": 0.2,
    "adv_tau": 1.0,
    "kl_tau": 1e-3,
    "teacher_tau": 0.0,
    "teacher_weight": 0.0,
    "teacher_mask_low": 0.2,
    "ce_weight": 0.0,
}
"""Every keyword ``loss_fn`` accepts, with its default (the ``[trainer.loss.kwargs]`` table)."""


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """One sample's inputs, field-compatible with both generations of PRIME-RL's ``LossInputs``.

    PRIME-RL passes its own ``LossInputs``; this class is for calling ``loss_fn`` yourself.
    Fields are keyword-only because the two upstream generations order them differently.

    Attributes:
        trainer_logprobs: ``(seq,)`` float, log π_θ of each token (carries the gradient).
        inference_logprobs: ``(seq,)`` float, log μ of each token from the sampler.
        advantages: ``(seq,)`` float, per-token advantage (the sequence advantage broadcast).
        loss_mask: ``(seq,)`` bool, True on trainable (completion) tokens.
        teacher_logprobs: ``(seq,)`` float or None, teacher log-prob of each token (PRIME-RL ≤ 2026-05).
        ref_logprobs: ``(seq,)`` float or None, the same signal under PRIME-RL's later name.
        loss_weights: ``(seq,)`` float ``>= 0`` or None (1.0 everywhere), scales each token's loss.
    """

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    teacher_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    loss_weights: Tensor | None = None


@dataclass
class LossOutputs:
    """``loss``: 0-d per-sample *sum* (PRIME-RL normalises); ``metrics``: 0-d tensors, averaged over samples."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def loss_fn(
    inputs: LossInputs | Any,
    *,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    teacher_tau: float = 0.0,
    teacher_weight: float = 0.0,
    teacher_mask_low: float = 0.2,
    ce_weight: float = 0.0,
    **unknown: Any,
) -> LossOutputs:
    """PRIME-RL custom loss for one sample: DPPO + KL, plus optional teacher and CE channels.

    Args:
        inputs: PRIME-RL's ``LossInputs`` (either generation) or :class:`LossInputs`; 1-D ``(seq,)`` tensors.
        dppo_mask_low: drop ``A ≤ 0`` tokens whose probability fell by more than this (absolute
            probability, not a PPO ratio ε); ``>= 0``, ``1e6`` disables.
        dppo_mask_high: drop ``A > 0`` tokens whose probability rose by more than this; ``>= 0``, ``1e6`` disables.
        adv_tau: advantage scale.
        kl_tau: weight of the trainer↔sampler drift penalty ``log_r²`` over the whole loss mask.
        teacher_tau: teacher advantage bonus ``teacher_tau · sg(lp_T − lp_θ)`` (PRIME-RL's old knob).
        teacher_weight: weight of the teacher distillation channel (reverse KL as policy gradient).
        teacher_mask_low: one-sided trust region of the distillation channel (PRIME-RL uses 0.2).
        ce_weight: weight of the sampled-token cross-entropy channel.

    Returns:
        ``LossOutputs`` with the 0-d per-sample summed loss and 0-d metrics: PRIME-RL's default
        metric names, plus ``teacher_kl`` when teacher log-probs are given and ``composer/*`` for the
        channels that are on.

    Raises:
        TypeError: unknown keyword, non-numeric keyword, or ``inputs`` without the required fields.
        ValueError: ``(B, T)`` or other non-1-D tensors, mismatched lengths or devices, a non-bool
            ``loss_mask``, NaN/inf inputs, negative ``loss_weights`` or keywords, or a teacher
            channel switched on where teacher log-probs cannot arrive (``None``, or PRIME-RL's
            all-zero filler on the loss mask).
    """
    if unknown:
        _raise_unknown(unknown)
    knobs = _LossKnobs(
        dppo_mask_low=dppo_mask_low,
        dppo_mask_high=dppo_mask_high,
        adv_tau=adv_tau,
        kl_tau=kl_tau,
        teacher_tau=teacher_tau,
        teacher_weight=teacher_weight,
        teacher_mask_low=teacher_mask_low,
        ce_weight=ce_weight,
    )
    sample = read_sample(inputs)
    if teacher_tau > 0 or teacher_weight > 0:
        check_teacher_arrives(sample)
    return _composed_loss(sample, knobs)


@dataclass(frozen=True)
class _LossKnobs:
    """``loss_fn``'s keywords, checked ``>= 0`` on construction (the defaults live in ``loss_fn``/`LOSS_KWARGS`)."""

    dppo_mask_low: float
    dppo_mask_high: float
    adv_tau: float
    kl_tau: float
    teacher_tau: float
    teacher_weight: float
    teacher_mask_low: float
    ce_weight: float

    def __post_init__(self) -> None:
        check_bounds(**{name: getattr(self, name) for name in LOSS_KWARGS})


def _composed_loss(sample: Sample, knobs: _LossKnobs) -> LossOutputs:
    trainer, mask, teacher = sample.trainer_logprobs, sample.loss_mask, sample.teacher_logprobs
    terms = dppo_terms(
        trainer, sample.inference_logprobs, sample.advantages, mask, knobs.dppo_mask_low, knobs.dppo_mask_high
    )
    metrics = dppo_metrics(terms, sample.advantages, mask)

    scaled_advantages = knobs.adv_tau * sample.advantages
    signal = None
    if teacher is not None:
        metrics["teacher_kl"] = masked_mean(teacher_log_gap(teacher, trainer.detach()), mask)
        if knobs.teacher_tau > 0 or knobs.teacher_weight > 0:
            signal = teacher_signal(teacher, trainer)
    if signal is not None and knobs.teacher_tau > 0:
        scaled_advantages = scaled_advantages + knobs.teacher_tau * signal
    per_token = dppo_kl_token_loss(terms, scaled_advantages, mask, knobs.kl_tau)

    if signal is not None and knobs.teacher_weight > 0:
        teacher_keep = teacher_keep_mask(terms.probs_diff, mask, knobs.teacher_mask_low)
        per_token = per_token + knobs.teacher_weight * teacher_distill_token_loss(signal, terms.ratio, teacher_keep)
        metrics["composer/teacher_is_masked"] = masked_mean(mask & ~teacher_keep, mask)
    if knobs.ce_weight > 0:
        per_token = per_token + knobs.ce_weight * cross_entropy_token_loss(trainer, mask)
        metrics["composer/nll"] = masked_mean(-trainer.detach(), mask)

    if sample.loss_weights is not None:
        per_token = per_token * sample.loss_weights
    return LossOutputs(loss=per_token.sum(), metrics=metrics)


def _raise_unknown(unknown: dict[str, Any]) -> None:
    import difflib  # only on the error path: keeps the module import light

    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, LOSS_KWARGS, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"loss_fn got unknown keyword(s) {', '.join(hints)}; [trainer.loss.kwargs] accepts {sorted(LOSS_KWARGS)}"
    )
