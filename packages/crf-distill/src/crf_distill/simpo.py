"""SimPO: Simple Preference Optimization with a reference-free reward (Meng et al., arXiv 2405.14734).

Reward ``r(y) = β · avg_lp(y)`` with ``avg_lp(y) = Σ_t log π_θ(y_t | x, y_<t) / |y|`` over response tokens
(:func:`avg_sequence_logprob`). With ``z = β·(avg_w − avg_l) − γ`` per pair:

* ``loss_type="sigmoid"``: ``−(1−ε)·logσ(z) − ε·logσ(−z)`` (ε = ``label_smoothing``, default 0);
* ``loss_type="hinge"``: ``relu(1 − z)``.

γ is the *absolute* target margin (TRL ``CPOTrainer.simpo_gamma``, Liger ``gamma``); the official repo's
``gamma_beta_ratio`` corresponds to ``gamma = beta * gamma_beta_ratio``. ``beta`` and ``gamma`` have no
defaults on purpose: SimPO's recommended β (2–10) is far from DPO's 0.1. No reference model is used.

Shapes: ``(P,)`` average log-probs; returns the mean over pairs (0-d), the sum, or ``(P,)``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from crf_distill._checks import check_finite_float, check_in_range
from crf_distill._pairs import Reduction, check_pair_tensors, reduce_pairs
from crf_distill.logprobs import avg_sequence_logprob

__all__ = ["SimPOLossType", "avg_sequence_logprob", "simpo_loss"]

SimPOLossType = Literal["sigmoid", "hinge"]


def simpo_loss(
    chosen_avg_logprobs: torch.Tensor,
    rejected_avg_logprobs: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
    loss_type: SimPOLossType = "sigmoid",
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """SimPO loss from length-normalised log-probs (never from summed ones: see failure mode "SimPO noise").

    Args:
        chosen_avg_logprobs, rejected_avg_logprobs: ``(P,)`` from :func:`avg_sequence_logprob`.
        beta: reward scale β > 0 (paper: 2.0–10).
        gamma: absolute margin γ >= 0 (e.g. β·0.5).
        label_smoothing: ε in [0, 0.5).
        loss_type: ``"sigmoid"`` (paper) or ``"hinge"``.
        reduction: ``"mean"`` (0-d scalar, default), ``"sum"`` or ``"none"``.
    """
    check_pair_tensors(chosen_avg_logprobs=chosen_avg_logprobs, rejected_avg_logprobs=rejected_avg_logprobs)
    beta = check_finite_float("beta", beta)
    if beta <= 0:
        raise ValueError(f"`beta` must be > 0, got {beta} (SimPO uses 2.0-10)")
    gamma = check_finite_float("gamma", gamma)
    if gamma < 0:
        raise ValueError(f"`gamma` is a target margin and must be >= 0, got {gamma}")
    eps = check_in_range("label_smoothing", label_smoothing, 0.0, 0.5, high_inclusive=False)
    z = beta * (chosen_avg_logprobs - rejected_avg_logprobs) - gamma
    if loss_type == "sigmoid":
        losses = -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - z)
    else:
        raise ValueError(f"`loss_type` must be 'sigmoid' or 'hinge', got {loss_type!r}")
    return reduce_pairs(losses, reduction)
