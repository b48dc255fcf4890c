"""Trace-replay DPO channel: a preference loss on (teacher action, recorded student action) pairs.

Pairs come from crf-replaysim: the teacher's action at a decision point of a recorded agent trace is
``chosen``, the student's recorded action ``rejected``. With ``ρ = log π_θ(y|x) − log π_ref(y|x)`` summed over the
response tokens, the loss is TRL's DPO ``loss_type`` (``crf_distill.dpo_loss``: every TRL 1.16 type, sigmoid,
hinge, ipo, robust, exo_pair, nca_pair, sigmoid_norm, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down,
discopop and sft, or a weighted list of them), mean over pairs; or SimPO (``crf_distill.simpo_loss``, Meng et al. 2024):
``−log σ(β_s·(avg_w − avg_l) − γ)`` on length-averaged log-probs, reference-free. ``label_smoothing`` ε applies
to every variant that has one (sigmoid/cDPO, robust, exo_pair and SimPO).

Sequence log-probs are scored through ``crf_core.channels.head`` on the response tokens only, chunked at large
vocabularies. Used unchanged by ``compose_loss`` and by ``ComposerReplicationTrainer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeGuard, get_args

import torch

from crf_core.channels._validate import check_number
from crf_core.channels.head import HeadStates, LMHead
from crf_distill import DPO_LOSS_TYPES, dpo_loss, simpo_loss
from crf_distill.dpo import DPOLossType

__all__ = [
    "DPO_VARIANTS",
    "DPOVariant",
    "PreferenceConfig",
    "PreferenceResult",
    "SequenceBatch",
    "SequenceLogps",
    "TraceReplayDPOChannel",
    "parse_variant",
]

DPOVariant = Literal[DPOLossType, "simpo"]
"""A preference loss: every ``crf_distill`` DPO loss type (TRL's ``loss_type`` names), plus SimPO."""
DPO_VARIANTS: tuple[DPOVariant, ...] = get_args(DPOVariant)


def _is_loss_type(name: object) -> TypeGuard[DPOLossType]:
    return name in DPO_LOSS_TYPES


def _is_variant(name: object) -> TypeGuard[DPOVariant]:
    return name in DPO_VARIANTS


def parse_variant(value: object) -> DPOVariant | tuple[DPOLossType, ...]:
    """``dpo_variant`` as given: one name, a list/tuple of DPO loss types, or a comma-separated string of them."""
    if isinstance(value, str) and "," in value:
        value = tuple(part.strip() for part in value.split(","))
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"dpo_variant must name at least one of {DPO_LOSS_TYPES}, got an empty list")
        names: list[DPOLossType] = []
        for name in value:
            if name == "simpo":
                raise ValueError(
                    "dpo_variant='simpo' is reference-free and cannot be combined in a list with DPO loss types; "
                    "use it alone"
                )
            if not _is_loss_type(name):
                raise ValueError(f"dpo_variant must be one of {DPO_LOSS_TYPES}, got {name!r}")
            names.append(name)
        return names[0] if len(names) == 1 else tuple(names)
    if not _is_variant(value):
        raise ValueError(f"dpo_variant must be one of {DPO_VARIANTS}, got {value!r}")
    return value


@dataclass(frozen=True)
class PreferenceConfig:
    """The preference loss (validated on construction).

    Attributes:
        variant: a TRL DPO ``loss_type`` name or ``"simpo"``; or several DPO loss types (tuple, list or
            comma-separated string) combined with ``loss_weights`` as TRL does.
        beta: DPO β > 0. label_smoothing: ε in [0, 0.5).
        loss_weights: one finite weight per loss type of a list variant (default all 1); None for a single type.
        discopop_tau: τ > 0 of the discopop loss (default 0.05).
        simpo_beta: SimPO β > 0. simpo_gamma: SimPO absolute target margin γ >= 0.
    """

    variant: DPOVariant | tuple[DPOLossType, ...] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_beta: float = 2.0
    simpo_gamma: float = 1.0
    loss_weights: tuple[float, ...] | None = None
    discopop_tau: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", parse_variant(self.variant))
        check_number("dpo_beta", self.beta, low=0.0, low_inclusive=False)
        check_number("dpo_label_smoothing", self.label_smoothing, low=0.0, high=0.4999999)
        check_number("simpo_beta", self.simpo_beta, low=0.0, low_inclusive=False)
        check_number("simpo_gamma", self.simpo_gamma, low=0.0)
        check_number("dpo_discopop_tau", self.discopop_tau, low=0.0, low_inclusive=False)
        if self.loss_weights is not None:
            names = self.variant if isinstance(self.variant, tuple) else (self.variant,)
            if self.variant == "simpo":
                raise ValueError("dpo_loss_weights applies to DPO loss types, not to dpo_variant='simpo'; unset it")
            weights = tuple(check_number(f"dpo_loss_weights[{i}]", w) for i, w in enumerate(self.loss_weights))
            if len(weights) != len(names):
                raise ValueError(
                    f"dpo_loss_weights has {len(weights)} entries but dpo_variant names {len(names)} loss type(s) "
                    f"{names}; give one weight per loss type (or leave dpo_loss_weights unset for all 1)"
                )
            object.__setattr__(self, "loss_weights", weights)

    @property
    def reference_free(self) -> bool:
        """SimPO needs no reference log-probs (given ones are ignored)."""
        return self.variant == "simpo"

    @property
    def loss_type(self) -> DPOLossType | tuple[DPOLossType, ...]:
        """The DPO loss type(s) of ``variant`` (``crf_distill.dpo_loss``'s ``loss_type``); not for SimPO."""
        variant = self.variant
        if variant == "simpo":
            raise ValueError("dpo_variant='simpo' is not a DPO loss type (it is reference-free); use simpo_loss")
        return variant


@dataclass(frozen=True)
class SequenceBatch:
    """``R`` token sequences to score: ``input_ids``, ``attention_mask`` and ``response_mask`` ``(R, L)``.

    ``response_mask`` is 1 on the response tokens, whose log-probs are summed (the first token is never scored:
    nothing predicts it).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor


@dataclass(frozen=True)
class SequenceLogps:
    """Per-sequence ``total`` (sum of response-token log-probs) and ``length`` (response tokens), ``(R,)``."""

    total: torch.Tensor
    length: torch.Tensor

    @property
    def average(self) -> torch.Tensor:
        """Length-normalised log-prob (SimPO's reward without β); 0 for an empty response."""
        return self.total / self.length.clamp_min(1.0)

    def rows(self, index: slice) -> SequenceLogps:
        return SequenceLogps(self.total[index], self.length[index])


@dataclass(frozen=True)
class PreferenceResult:
    """The loss (0-d) and per-pair implicit rewards ``(P,)`` (detached), for logging."""

    loss: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor

    @property
    def margin(self) -> torch.Tensor:
        return self.chosen_reward - self.rejected_reward


class TraceReplayDPOChannel:
    """The trace-replay DPO channel (see the module docstring)."""

    def __init__(self, config: PreferenceConfig) -> None:
        if not isinstance(config, PreferenceConfig):
            raise TypeError(f"config must be a PreferenceConfig, got {type(config).__name__}")
        self.config = config

    @staticmethod
    def sequence_logps(head: LMHead, batch: SequenceBatch) -> SequenceLogps:
        """Summed response-token log-probs of each sequence under ``head`` (grad if enabled)."""
        ids = batch.input_ids
        scored = batch.response_mask[:, 1:] > 0
        labels = ids[:, 1:][scored]
        seq = torch.nonzero(scored)[:, 0]

        def summed(states: HeadStates) -> SequenceLogps:  # inside the model's forward when it is sharded
            lp = head.score(states.tensor[:, :-1][scored], labels, is_logits=states.is_logits).logprobs
            total = torch.zeros(ids.shape[0], dtype=lp.dtype, device=lp.device).index_add(0, seq, lp)
            return SequenceLogps(total, scored.sum(-1).to(lp.dtype))

        return head.run(summed, ids, batch.attention_mask)

    def loss(
        self,
        chosen: SequenceLogps,
        rejected: SequenceLogps,
        ref_chosen: torch.Tensor | None = None,
        ref_rejected: torch.Tensor | None = None,
    ) -> PreferenceResult:
        """The preference loss of ``P`` pairs; references (summed log-probs ``(P,)``) for the DPO variants only."""
        cfg = self.config
        if cfg.reference_free:
            loss = simpo_loss(
                chosen.average,
                rejected.average,
                beta=cfg.simpo_beta,
                gamma=cfg.simpo_gamma,
                label_smoothing=cfg.label_smoothing,
            )
            with torch.no_grad():
                return PreferenceResult(loss, cfg.simpo_beta * chosen.average, cfg.simpo_beta * rejected.average)
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(
                f"dpo_variant={cfg.variant!r} needs reference log-probs of both sides (summed over the response); "
                "SimPO needs none"
            )
        ref_c = ref_chosen.to(chosen.total.dtype)
        ref_r = ref_rejected.to(rejected.total.dtype)
        loss = dpo_loss(
            chosen.total,
            rejected.total,
            ref_c,
            ref_r,
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            loss_weights=cfg.loss_weights,
            label_smoothing=cfg.label_smoothing,
            discopop_tau=cfg.discopop_tau,
            chosen_lengths=chosen.length.clamp_min(1.0),
            rejected_lengths=rejected.length.clamp_min(1.0),
        )
        with torch.no_grad():
            return PreferenceResult(loss, cfg.beta * (chosen.total - ref_c), cfg.beta * (rejected.total - ref_r))
