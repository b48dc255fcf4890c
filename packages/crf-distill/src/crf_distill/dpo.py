"""Direct Preference Optimization and every TRL 1.16 ``DPOTrainer`` ``loss_type``.

Papers: DPO (Rafailov et al., arXiv 2305.18290); IPO (Azar et al., arXiv 2310.12036); robust DPO
(Chowdhury et al., arXiv 2403.00409); EXO (Ji et al., arXiv 2402.00856); NCA (Chen et al., arXiv
2402.05369); BCO (Jung et al., arXiv 2404.04656); SPPO (Wu et al., arXiv 2405.00675, hard-label form);
AOT (Melnyk et al., arXiv 2406.05882); APO (D'Oosterlinck et al., arXiv 2408.06266, Eqs. 7 and 8);
DiscoPOP (Chris Lu et al., arXiv 2406.08414, Eq. 5); RPO's SFT term (Pang et al., arXiv 2404.19733).
Names and formulas follow TRL 1.16 ``DPOTrainer`` (``f_divergence_type="reverse_kl"``).

Symbols: sequence log-probs are *sums* over completion tokens (:func:`crf_distill.sequence_logprob`);
``ρ_w = lp_w − lp_ref_w``, ``ρ_l = lp_l − lp_ref_l``, ``Δ = ρ_w − ρ_l``, β the inverse temperature,
ε = ``label_smoothing``, ``|y|`` the completion token count, τ = ``discopop_tau``, ``sort`` ascending over the
batch. Per pair:

============ ============================================================================================
sigmoid      ``−(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)`` (ε = 0: plain DPO, TRL 1.x; ε > 0: conservative DPO, TRL 0.x)
hinge        ``relu(1 − βΔ)``
ipo          ``((ρ_w/|y_w| − ρ_l/|y_l|) − 1/(2β))²`` (length-normalised; needs the lengths)
robust       ``[−(1−ε)·logσ(βΔ) + ε·logσ(−βΔ)] / (1 − 2ε)``, ε ∈ [0, 0.5)
exo_pair     ``σ(βΔ)(logσ(βΔ) − log(1−ε)) + σ(−βΔ)(logσ(−βΔ) − log ε)``, ε ∈ (0, 1) (TRL recommends 1e-3)
nca_pair     ``−logσ(βρ_w) − ½·logσ(−βρ_w) − ½·logσ(−βρ_l)``
sigmoid_norm ``−logσ(β·(ρ_w/|y_w| − ρ_l/|y_l|))``
bco_pair     ``−logσ(βρ_w) − logσ(−βρ_l)`` (no running reward shift, as in TRL's DPOTrainer)
sppo_hard    ``(ρ_w − 1/(2β))² + (ρ_l + 1/(2β))²``
aot          ``d = sort(lp_w − lp_l) − sort(lp_ref_w − lp_ref_l)``; ``−(1−ε)·logσ(βd) − ε·logσ(−βd)``
aot_unpaired ``d = sort(ρ_w) − sort(ρ_l)``; ``−(1−ε)·logσ(βd) − ε·logσ(−βd)``
apo_zero     ``1 − σ(βρ_w) + σ(βρ_l)``
apo_down     ``σ(βρ_w) + 1 − σ(βΔ)``
discopop     ``m = σ(βΔ/τ)``; ``(1−m)·(−logσ(βΔ)) + m·exp(−βΔ)``
sft          ``−Σ lp_w / Σ |y_w|`` over the batch (the chosen token-mean NLL, the same value for every pair;
             needs ``chosen_lengths``)
============ ============================================================================================

The two AOT types sort across the batch, so their ``reduction="none"`` entries are per *sorted rank*, not per
input pair. A list of types with ``loss_weights`` (default all 1) gives ``Σ_k w_k · loss_k`` (TRL combines the
batch means the same way; with ``reduction="none"`` the weighted sum of the per-pair vectors).

Shapes: every log-prob ``(P,)`` for P pairs, finite; lengths ``(P,)`` positive. Returns the mean over pairs
(``reduction="mean"``, 0 for P = 0), the sum, or the ``(P,)`` losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from crf_distill._checks import check_finite_float, check_in_range
from crf_distill._pairs import REDUCTIONS, Reduction, check_pair_tensors, reduce_pairs

__all__ = ["DPO_LOSS_TYPES", "DPOLossType", "dpo_loss"]

DPOLossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "robust",
    "exo_pair",
    "nca_pair",
    "sigmoid_norm",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
]
DPO_LOSS_TYPES: tuple[DPOLossType, ...] = get_args(DPOLossType)
_LENGTH_NORMALISED = ("ipo", "sigmoid_norm")


def _lengths(name: str, value: torch.Tensor | None, like: torch.Tensor, loss_type: str) -> torch.Tensor:
    if value is None:
        raise ValueError(
            f"loss_type={loss_type!r} needs `{name}` (completion token count per pair, e.g. response_mask.sum(-1))"
        )
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        raise ValueError(
            f"`{name}` must be a tensor of shape {tuple(like.shape)}, got {getattr(value, 'shape', value)}"
        )
    lengths = value.to(like.dtype)
    if lengths.numel() and bool((lengths <= 0).any()):
        raise ValueError(f"`{name}` must be positive (a pair with an empty completion cannot be scored)")
    return lengths


def _smoothed_sigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _types_and_weights(loss_type: str | Sequence[str], loss_weights: Sequence[float] | None) -> list[tuple[str, float]]:
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    if not types:
        raise ValueError(f"`loss_type` must name at least one of {DPO_LOSS_TYPES}, got an empty list")
    for t in types:
        if t not in DPO_LOSS_TYPES:
            raise ValueError(f"`loss_type` must be one of {DPO_LOSS_TYPES} (or a list of them), got {t!r}")
    if loss_weights is None:
        return [(t, 1.0) for t in types]
    if isinstance(loss_weights, (str, bytes)) or not isinstance(loss_weights, Sequence):
        raise TypeError(f"`loss_weights` must be a list of floats, one per loss type, got {loss_weights!r}")
    if len(loss_weights) != len(types):
        raise ValueError(
            f"`loss_weights` has {len(loss_weights)} entries but `loss_type` names {len(types)} loss type(s) "
            f"{types}; give one weight per loss type (or none for all 1)"
        )
    weights = [check_finite_float(f"loss_weights[{i}]", w) for i, w in enumerate(loss_weights)]
    return list(zip(types, weights, strict=True))


def _one_loss(
    loss_type: str,
    lw: torch.Tensor,
    ll: torch.Tensor,
    rw: torch.Tensor,
    rl: torch.Tensor,
    beta: float,
    eps: float,
    discopop_tau: float,
    chosen_lengths: torch.Tensor | None,
    rejected_lengths: torch.Tensor | None,
) -> torch.Tensor:
    rho_w = lw - rw
    rho_l = ll - rl
    if loss_type in _LENGTH_NORMALISED:
        rho_w = rho_w / _lengths("chosen_lengths", chosen_lengths, rho_w, loss_type)
        rho_l = rho_l / _lengths("rejected_lengths", rejected_lengths, rho_l, loss_type)
    delta = rho_w - rho_l
    z = beta * delta
    if loss_type == "sigmoid":
        return _smoothed_sigmoid(z, eps)
    if loss_type == "hinge":
        return torch.relu(1.0 - z)
    if loss_type == "ipo":
        return (delta - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "robust":
        if eps >= 0.5:
            raise ValueError(f"loss_type='robust' needs label_smoothing in [0, 0.5), got {eps}")
        return (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    if loss_type == "exo_pair":
        if not 0.0 < eps < 1.0:
            raise ValueError(f"loss_type='exo_pair' needs label_smoothing in (0, 1) (recommended 1e-3), got {eps}")
        eps_t = torch.tensor(eps, dtype=z.dtype, device=z.device)
        return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps_t)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - torch.log(eps_t)
        )
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * rho_w) - 0.5 * F.logsigmoid(-beta * rho_w) - 0.5 * F.logsigmoid(-beta * rho_l)
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(z)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * rho_w) - F.logsigmoid(-beta * rho_l)
    if loss_type == "sppo_hard":
        half = 0.5 / beta
        return (rho_w - half) ** 2 + (rho_l + half) ** 2
    if loss_type == "aot":
        d = torch.sort(lw - ll, dim=0).values - torch.sort(rw - rl, dim=0).values
        return _smoothed_sigmoid(beta * d, eps)
    if loss_type == "aot_unpaired":
        d = torch.sort(rho_w, dim=0).values - torch.sort(rho_l, dim=0).values
        return _smoothed_sigmoid(beta * d, eps)
    if loss_type == "apo_zero":
        return 1.0 - torch.sigmoid(beta * rho_w) + torch.sigmoid(beta * rho_l)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * rho_w) + 1.0 - torch.sigmoid(z)
    if loss_type == "discopop":
        mix = torch.sigmoid(z / discopop_tau)
        return (1.0 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)
    # sft: token-mean NLL of the chosen completions over the whole batch, one value repeated per pair
    n_w = _lengths("chosen_lengths", chosen_lengths, lw, loss_type)
    return (-lw.sum() / n_w.sum().clamp_min(1.0)).expand(lw.shape)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: DPOLossType | Sequence[DPOLossType] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """DPO-family loss on summed sequence log-probs (see the module docstring for every formula).

    Args:
        policy_chosen_logps, policy_rejected_logps: ``(P,)`` policy sequence log-probs (with grad).
        ref_chosen_logps, ref_rejected_logps: ``(P,)`` reference sequence log-probs (detached).
        beta: β > 0 (TRL default 0.1).
        loss_type: one of :data:`DPO_LOSS_TYPES`, or a list of them (combined with ``loss_weights``).
        loss_weights: one finite weight per entry of ``loss_type`` (default all 1); only with a list.
        label_smoothing: ε; used by sigmoid (cDPO), robust, exo_pair, aot and aot_unpaired.
        discopop_tau: τ > 0 of discopop (TRL and the paper default 0.05).
        chosen_lengths, rejected_lengths: ``(P,)`` completion token counts, required by ipo and sigmoid_norm
            (both) and sft (chosen).
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
    plan = _types_and_weights(loss_type, loss_weights)
    eps = check_in_range("label_smoothing", label_smoothing, 0.0, 1.0)
    tau = check_finite_float("discopop_tau", discopop_tau)
    if tau <= 0:
        raise ValueError(f"`discopop_tau` must be > 0 (the paper's default is 0.05), got {discopop_tau}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be 'mean', 'sum' or 'none', got {reduction!r}")
    for name, value in (
        ("policy_chosen_logps", policy_chosen_logps),
        ("policy_rejected_logps", policy_rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
    ):
        if value.numel() and not bool(torch.isfinite(value.detach()).all()):
            raise ValueError(
                f"`{name}` contains NaN or inf; sequence log-probs must be finite (check for empty completions, "
                "masked-out scores or an overflowing forward pass)"
            )
    lw, ll = policy_chosen_logps, policy_rejected_logps
    rw, rl = ref_chosen_logps.detach(), ref_rejected_logps.detach()
    total: torch.Tensor | None = None
    for name, weight in plan:
        losses = _one_loss(name, lw, ll, rw, rl, beta, eps, tau, chosen_lengths, rejected_lengths)
        term = weight * reduce_pairs(losses, reduction)
        total = term if total is None else total + term
    assert total is not None
    return total
