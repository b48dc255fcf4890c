"""The training channels, one home each, shared by ``compose_loss`` and ``ComposerReplicationTrainer``.

* :mod:`~crf_core.channels.head` — the policy's decoder + linear LM head, scored per token, chunked at large
  vocabularies (no ``(B, T, V)`` logits).
* :mod:`~crf_core.channels.grpo` — GRPO: TRL's loss math on chunked per-token log-probs and entropies.
* :mod:`~crf_core.channels.sdpo` — SDPO self-distillation (generalised JSD; TAID and Entropy-OPD wrappers).
* :mod:`~crf_core.channels.trace_replay_dpo` — trace-replay DPO (TRL's DPO loss types, SimPO).
* :mod:`~crf_core.channels.lm_ce` — ``compose_loss``'s next-token cross-entropy (the verification stand-in).
"""

from crf_core.channels.grpo import CompletionScores, score_completions
from crf_core.channels.head import (
    ChunkPlan,
    HeadPrecision,
    HeadStates,
    LMHead,
    RowSource,
    hidden_source,
    logits_source,
    mean_weights,
    token_mean,
)
from crf_core.channels.lm_ce import lm_ce_term
from crf_core.channels.sdpo import SDPO_WRAPPERS, SDPOChannel, SDPOConfig, SDPOTargets, first_error_mask
from crf_core.channels.trace_replay_dpo import (
    DPO_VARIANTS,
    PreferenceConfig,
    PreferenceResult,
    SequenceBatch,
    SequenceLogps,
    TraceReplayDPOChannel,
)

__all__ = [
    "DPO_VARIANTS",
    "SDPO_WRAPPERS",
    "ChunkPlan",
    "CompletionScores",
    "HeadPrecision",
    "HeadStates",
    "LMHead",
    "PreferenceConfig",
    "PreferenceResult",
    "RowSource",
    "SDPOChannel",
    "SDPOConfig",
    "SDPOTargets",
    "SequenceBatch",
    "SequenceLogps",
    "TraceReplayDPOChannel",
    "first_error_mask",
    "hidden_source",
    "lm_ce_term",
    "logits_source",
    "mean_weights",
    "score_completions",
    "token_mean",
]
