"""GRPO channel: TRL's GRPO loss, fed per-token log-probs and entropies from the chunked LM head.

The loss math is TRL's own ``GRPOTrainer._compute_loss`` (every ``loss_type``: grpo, bnpo, dr_grpo, dapo, cispo,
sapo, luspo, vespo; its masking, clipping, KL to the reference, importance sampling, entropy masks and
normalisation, unchanged). What it reads from the model are the completion tokens' log-probs and entropies,
``(B, C)``, which TRL computes from materialised ``(B, T, V)`` logits (TRL 1.14) or from ``(B·T, 32768)``
vocabulary tiles of every position (TRL 1.16 on CPU). :func:`score_completions` produces the same two tensors
from one decoder pass and a chunked head over the real completion tokens only (``crf_core.channels.head``), so
no full-vocabulary tensor bigger than one chunk exists in the forward or the backward; the same pass can score
an extra per-row term (the SDPO divergence), so GRPO and the SDPO student share one policy forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from crf_core._checks import is_int
from crf_core.channels.head import HeadStates, LMHead
from crf_distill import RowTerm

__all__ = ["CompletionScores", "TermFactory", "score_completions"]

TermFactory = Callable[[torch.Tensor, torch.Tensor], RowTerm]
"""``factory(sample (M,), position (M,)) -> RowTerm`` for the ``M`` scored rows, given the sample and completion
position of each row (so the term can look up per-row extras such as the teacher's states)."""


@dataclass(frozen=True)
class CompletionScores:
    """Per completion token ``(B, C)``: log-probs, entropies (if asked) and an extra term's values (if given);
    0 on padding (``attention_mask == 0``), like TRL's fused LM head."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    extra: torch.Tensor | None


def score_completions(
    head: LMHead,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    entropy: bool = False,
    extra: TermFactory | None = None,
) -> CompletionScores:
    """Score the last ``logits_to_keep`` tokens of ``[prompt ; completion]`` ``(B, T)`` (TRL's layout).

    Position ``T − C − 1 + c`` of the decoder states predicts completion token ``c``; only tokens with
    ``attention_mask == 1`` are scored.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be (B, T), got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    length = input_ids.shape[1]
    if not is_int(logits_to_keep) or not 0 < logits_to_keep < length:
        raise ValueError(f"logits_to_keep must be an int in [1, T={length}), got {logits_to_keep!r}")
    start = length - logits_to_keep
    real = attention_mask[:, start:] > 0
    sample, position = torch.nonzero(real, as_tuple=True)

    def scored(states: HeadStates) -> CompletionScores:  # inside the model's forward when it is sharded
        rows = states.tensor[:, start - 1 : length - 1][real]
        terms = [] if extra is None else [extra(sample, position)]
        scores = head.score(rows, input_ids[:, start:][real], is_logits=states.is_logits, terms=terms, entropy=entropy)
        return CompletionScores(
            spread(scores.logprobs),
            None if scores.entropy is None else spread(scores.entropy),
            spread(scores.values[0]) if scores.values else None,
        )

    def spread(values: torch.Tensor) -> torch.Tensor:  # masked_scatter keeps an all-padding batch differentiable
        return values.new_zeros(real.shape).masked_scatter(real, values)

    return head.run(scored, input_ids, attention_mask)
