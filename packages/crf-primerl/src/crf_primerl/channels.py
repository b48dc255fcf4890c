"""Composer channels that fit PRIME-RL's per-sample contract (sampled-token log-probs only).

All tensors are ``(seq,)``; ``lp_T`` is the teacher log-prob of the sampled token (PRIME-RL's
``teacher_logprobs``, later ``ref_logprobs``), ``r = exp(lp_θ − lp_μ)``, ``m`` the loss mask.

- Teacher advantage bonus (PRIME-RL ≤ 46653c1, ``DefaultLossConfig.teacher_tau``):
  ``A' = adv_tau · A + teacher_tau · sg(lp_T − lp_θ)``, inside the DPPO policy-gradient term.
- Teacher distillation (on-policy distillation, Thinking Machines' OPD; PRIME-RL 559b447
  ``ref_kl_loss_fn``): the per-token reverse KL is the policy-gradient signal,
  ``ℓ_t = −keep_T,t · sg(lp_T,t − lp_θ,t) · r_t`` with a one-sided trust region
  ``keep_T = m ∧ ¬(Δp < −teacher_mask_low)``. Its gradient, ``(lp_θ − lp_T)·r·∇lp_θ``, is the
  importance-corrected score-function gradient of KL(π_θ ‖ π_T) on sampler tokens.
- Sampled-token cross-entropy (PRIME-RL's ``ce``/``sft`` loss): ``ℓ_t = −m_t · lp_θ,t``.

Filler teachers: from 0be5ac4 on, PRIME-RL packs samples that have no reference into a micro-batch
that has one with ``ref_logprobs = 0.0`` on every token. `crf_primerl.validation.check_teacher_arrives`
refuses such a sample when a teacher channel is on, so the channels here always see a real teacher.
"""

from __future__ import annotations

from torch import Tensor


def teacher_log_gap(teacher_logprobs: Tensor, trainer_logprobs: Tensor) -> Tensor:
    """``lp_T − lp_θ``: the per-token reverse-KL signal (positive where the teacher likes the token more)."""
    return teacher_logprobs - trainer_logprobs


def teacher_signal(teacher_logprobs: Tensor, trainer_logprobs: Tensor) -> Tensor:
    """``sg(lp_T − lp_θ)``: the teacher's per-token signal, without gradient."""
    return teacher_log_gap(teacher_logprobs, trainer_logprobs).detach()


def teacher_keep_mask(probs_diff: Tensor, loss_mask: Tensor, teacher_mask_low: float) -> Tensor:
    """One-sided trust region of the distillation channel: drop tokens whose probability fell by more than the bound."""
    return loss_mask & ~(probs_diff < -teacher_mask_low)


def teacher_distill_token_loss(signal: Tensor, ratio: Tensor, keep_mask: Tensor) -> Tensor:
    """``ℓ_t = −keep_T,t · sg(lp_T,t − lp_θ,t) · r_t`` given ``signal`` from :func:`teacher_signal`."""
    return -(keep_mask * signal * ratio)


def cross_entropy_token_loss(trainer_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """``ℓ_t = −m_t · lp_θ,t`` (negative log-likelihood of the sampled tokens)."""
    return -(loss_mask * trainer_logprobs)
