"""Loss math for Composer-style RL post-training: token log-probs, divergences, DPO family, SimPO, TAID, Entropy-OPD, chunked fused-linear losses.

One loss per module; every public function validates its inputs and documents paper, formula, symbols and
shapes. Masks are 1 on response tokens and 0 on prompt/padding throughout.
"""

from crf_distill._version import __version__
from crf_distill.aggregate import Aggregation, aggregate
from crf_distill.chunked import ChunkTerm, chunked_distillation_loss, chunked_fused_loss, chunked_token_logprobs
from crf_distill.dpo import DPO_LOSS_TYPES, dpo_loss
from crf_distill.entropy_opd import entropy_opd_loss, entropy_opd_per_token, teacher_entropy_gate, token_entropy
from crf_distill.head_scores import (
    HeadScores,
    RowFn,
    RowSource,
    RowSupport,
    RowTerm,
    chunked_weighted_sums,
    head_logits,
    head_logits_at,
    head_scores,
    logit_scores,
)
from crf_distill.jsd import (
    generalized_jsd,
    generalized_jsd_on_support,
    generalized_jsd_per_token,
    is_ratio_weight,
    top_k_ids,
)
from crf_distill.kl import forward_kl, forward_kl_per_token, reverse_kl, reverse_kl_per_token
from crf_distill.logprobs import avg_sequence_logprob, sequence_logprob, token_logprobs
from crf_distill.simpo import simpo_loss
from crf_distill.taid import TAIDSchedule, taid_linear_t, taid_loss, taid_per_token, taid_target_logprobs

__all__ = [
    "DPO_LOSS_TYPES",
    "Aggregation",
    "ChunkTerm",
    "HeadScores",
    "RowFn",
    "RowSource",
    "RowSupport",
    "RowTerm",
    "TAIDSchedule",
    "__version__",
    "aggregate",
    "avg_sequence_logprob",
    "chunked_distillation_loss",
    "chunked_fused_loss",
    "chunked_token_logprobs",
    "chunked_weighted_sums",
    "dpo_loss",
    "entropy_opd_loss",
    "entropy_opd_per_token",
    "forward_kl",
    "forward_kl_per_token",
    "generalized_jsd",
    "generalized_jsd_on_support",
    "generalized_jsd_per_token",
    "head_logits",
    "head_logits_at",
    "head_scores",
    "is_ratio_weight",
    "logit_scores",
    "reverse_kl",
    "reverse_kl_per_token",
    "sequence_logprob",
    "simpo_loss",
    "taid_linear_t",
    "taid_loss",
    "taid_per_token",
    "taid_target_logprobs",
    "teacher_entropy_gate",
    "token_entropy",
    "token_logprobs",
    "top_k_ids",
]
