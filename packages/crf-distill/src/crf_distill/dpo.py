"""Direct Preference Optimization and TRL's ``loss_type`` variants.

Papers: DPO (Rafailov et al., arXiv 2305.18290); IPO (Azar et al., arXiv 2310.12036); robust DPO
(Chowdhury et al., arXiv 2403.00409); EXO (Ji et al., arXiv 2402.00856); NCA (Chen et al., arXiv
2402.05369). Names and formulas follow TRL 1.x ``DPOTrainer`` (``f_divergence_type="reverse_kl"``).

Symbols: sequence log-probs are *sums* over completion tokens (:func:`crf_distill.sequence_logprob`);
``ρ_w = lp_w − lp_ref_w``, ``ρ_l = lp_l − lp_ref_l``, ``Δ = ρ_w − ρ_l``, β the inverse temperature,
ε = ``label_smoothing``, ``|y|`` the completion token count. Per pair:

========== ============================================================================================
sigmoid    ``−(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)`` (ε = 0: plain DPO, TRL 1.x; ε > 0: conservative DPO, TRL 0.x)
hinge      ``relu(1 − βΔ)``
ipo        ``((ρ_w/|y_w| − ρ_l/|y_l|) − 1/(2β))²`` (length-normalised; needs the lengths)
robust     ``[−(1−ε)·logσ(βΔ) + ε·logσ(−βΔ)] / (1 − 2ε)``, ε ∈ [0, 0.5)
exo_pair   ``σ(βΔ)(logσ(βΔ) − log(1−ε)) + σ(−βΔ)(logσ(−βΔ) − log ε)``, ε ∈ (0, 1) (TRL recommends 1e-3)
nca_pair   ``−logσ(βρ_w) − ½·logσ(−βρ_w) − ½·logσ(−βρ_l)``
sigmoid_norm ``−logσ(β·(ρ_w/|y_w| − ρ_l/|y_l|))``
========== ============================================================================================

Shapes: every log-prob ``(P,)`` for P pairs; lengths ``(P,)`` positive. Returns the mean over pairs
(``reduction="mean"``, 0 for P = 0), the sum, or the ``(P,)`` losses.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from crf_distill._checks import check_finite_float, check_in_range
from crf_distill._pairs import Reduction, check_pair_tensors, reduce_pairs

__all__ = ["DPO_LOSS_TYPES", "DPOLossType", "dpo_loss"]

DPOLossType = Literal["sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sigmoid_norm"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sigmoid_norm")
_LENGTH_NORMALISED = ("ipo", "sigmoid_norm")


def _lengths(name: str, value: torch.Tensor | None, like: torch.Tensor, loss_type: str) -> torch.Tensor:
    if value is None:
        raise ValueError(
            f"loss_type={loss_type!r} is length-normalised and needs `{name}` (completion token count per pair, "
            "e.g. response_mask.sum(-1))"
        )
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        raise ValueError(
            f"`{name}` must be a tensor of shape {tuple(like.shape)}, got {getattr(value, 'shape', value)}"
        )
    lengths = value.to(like.dtype)
    if lengths.numel() and bool((lengths <= 0).any()):
        raise ValueError(f"`{name}` must be positive (a pair with an empty completion cannot be scored)")
    return lengths


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """DPO-family loss on summed sequence log-probs (see the module docstring for every formula).

    Args:
        policy_chosen_logps, policy_rejected_logps: ``(P,)`` policy sequence log-probs (with grad).
        ref_chosen_logps, ref_rejected_logps: ``(P,)`` reference sequence log-probs (detached).
        beta: β > 0 (TRL default 0.1).
        loss_type: one of :data:`DPO_LOSS_TYPES`.
        label_smoothing: ε; used by sigmoid (cDPO), robust and exo_pair.
        chosen_lengths, rejected_lengths: ``(P,)`` completion token counts, required by ipo and sigmoid_norm.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
    """
    check_pair_tensors(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    beta = check_finite_float("beta", beta)
    if beta <= 0:
        raise ValueError(f"`beta` must be > 0, got {beta}")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    eps = check_in_range("label_smoothing", label_smoothing, 0.0, 1.0)
    rho_w = policy_chosen_logps - ref_chosen_logps.detach()
    rho_l = policy_rejected_logps - ref_rejected_logps.detach()
    if loss_type in _LENGTH_NORMALISED:
        rho_w = rho_w / _lengths("chosen_lengths", chosen_lengths, rho_w, loss_type)
        rho_l = rho_l / _lengths("rejected_lengths", rejected_lengths, rho_l, loss_type)
    delta = rho_w - rho_l
    z = beta * delta
    if loss_type == "sigmoid":
        losses = -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - z)
    elif loss_type == "ipo":
        losses = (delta - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "robust":
        if eps >= 0.5:
            raise ValueError(f"loss_type='robust' needs label_smoothing in [0, 0.5), got {eps}")
        losses = (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    elif loss_type == "exo_pair":
        if not 0.0 < eps < 1.0:
            raise ValueError(f"loss_type='exo_pair' needs label_smoothing in (0, 1) (recommended 1e-3), got {eps}")
        eps_t = torch.tensor(eps, dtype=z.dtype, device=z.device)
        losses = torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps_t)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - torch.log(eps_t)
        )
    elif loss_type == "nca_pair":
        losses = -F.logsigmoid(beta * rho_w) - 0.5 * F.logsigmoid(-beta * rho_w) - 0.5 * F.logsigmoid(-beta * rho_l)
    else:  # sigmoid_norm
        losses = -F.logsigmoid(z)
    return reduce_pairs(losses, reduction)
