"""Trace-replay DPO channel: load crf-replaysim pair records, tokenise them, score them, take the loss.

Records are the normalised DPO pairs crf-replaysim writes (one JSON object per line with flat
``prompt``/``chosen``/``rejected`` strings and ``prompt_messages``/``chosen_messages``/
``rejected_messages`` chat lists). The prompt is rendered with the tokenizer's chat template from
``prompt_messages`` when the tokenizer has one (so it matches how the policy sees chat prompts),
else the flat ``prompt`` string is used; responses are the flat ``chosen``/``rejected`` strings
followed by EOS. Optional ``ref_chosen_logps``/``ref_rejected_logps`` numbers are precomputed
reference sequence log-probs.

Loss (crf-distill): TRL ``loss_type`` names via ``crf_distill.dpo_loss`` on summed response
log-probs, or SimPO (``crf_distill.simpo_loss``) on length-averaged log-probs, reference-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crf_core.loss import DPO_VARIANTS  # TRL loss_type names plus "simpo", shared with compose_loss
from crf_distill import avg_sequence_logprob, dpo_loss, sequence_logprob, simpo_loss, token_logprobs

__all__ = [
    "DPO_VARIANTS",
    "PairBatch",
    "TokenizedPair",
    "collate_pairs",
    "load_pair_records",
    "pair_logps",
    "preference_loss",
    "tokenize_pairs",
]


_REQUIRED = ("prompt", "chosen", "rejected")


def load_pair_records(source: str | Path | Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Read pair records from a JSONL file (or take an iterable of dicts) and check their keys.

    Every record needs string ``prompt``, ``chosen`` and ``rejected``; ``prompt_messages`` (a list of
    chat messages) and numeric ``ref_chosen_logps``/``ref_rejected_logps`` are optional.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"trace-replay pair file {str(path)!r} does not exist; write it with crf-replaysim")
        records = []
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no} is not valid JSON ({exc.msg})") from exc
    else:
        records = [dict(r) for r in source]
    if not records:
        raise ValueError("no trace-replay pairs were given; pass a non-empty pair file or list")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise TypeError(f"pair record {i} is {type(record).__name__}, expected a JSON object")
        for key in _REQUIRED:
            if not isinstance(record.get(key), str):
                raise ValueError(
                    f"pair record {i} needs a string {key!r} (crf-replaysim's flat text); got "
                    f"{type(record.get(key)).__name__}. Normalise the pairs with crf-replaysim first"
                )
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            value = record.get(key)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"pair record {i}: {key!r} must be a finite number, got {value!r}")
    return records


@dataclass(frozen=True)
class TokenizedPair:
    """Token ids of one pair: the shared prompt and the two responses (EOS included)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    ref_chosen_logps: float | None = None
    ref_rejected_logps: float | None = None


def _render_prompt(record: Mapping[str, Any], tokenizer: Any) -> str:
    messages = record.get("prompt_messages")
    if messages and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise TypeError("the tokenizer's chat template did not render a string")
        return text
    return str(record["prompt"])


def tokenize_pairs(records: Sequence[Mapping[str, Any]], tokenizer: Any, max_length: int) -> list[TokenizedPair]:
    """Tokenise records; prompt + response is cut to ``max_length`` (prompt from the left, response from the right)."""
    if not (isinstance(max_length, int) and max_length >= 2):
        raise ValueError(f"max_length must be an int ≥ 2, got {max_length!r}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; set one so responses end like the policy's")
    out = []
    for record in records:
        prompt = list(tokenizer(_render_prompt(record, tokenizer))["input_ids"])
        sides = [
            [*list(tokenizer(record[k], add_special_tokens=False)["input_ids"]), eos] for k in ("chosen", "rejected")
        ]
        longest = max(len(s) for s in sides)
        keep_prompt = max(1, min(len(prompt), max_length - longest))
        prompt = prompt[-keep_prompt:]
        sides = [s[: max_length - len(prompt)] for s in sides]
        out.append(
            TokenizedPair(prompt, sides[0], sides[1], record.get("ref_chosen_logps"), record.get("ref_rejected_logps"))
        )
    return out


@dataclass(frozen=True)
class PairBatch:
    """``2P`` right-padded rows, chosen first then rejected.

    ``input_ids``/``attention_mask``/``response_mask`` are ``(2P, L)``; ``response_mask`` is 1 on the
    response tokens (what the sequence log-prob sums over).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def collate_pairs(pairs: Sequence[TokenizedPair], pad_token_id: int, device: torch.device | str = "cpu") -> PairBatch:
    """Pack pairs into a :class:`PairBatch` (chosen rows ``[:P]``, rejected rows ``[P:]``)."""
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    length = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    resp = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        n_p, n = len(prompt), len(prompt) + len(response)
        ids[i, :n] = torch.tensor(prompt + response, dtype=torch.long)
        attn[i, :n] = 1
        resp[i, n_p:n] = 1
    return PairBatch(ids.to(device), attn.to(device), resp.to(device))


def pair_logps(model: nn.Module, batch: PairBatch, *, average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected sequence log-probs ``(P,)`` each: sums (DPO) or per-token averages (SimPO)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    labels = batch.input_ids[:, 1:]
    mask = batch.response_mask[:, 1:]
    lp = token_logprobs(logits, labels, ignore_index=None)
    seq = avg_sequence_logprob(lp, mask) if average else sequence_logprob(lp, mask)
    return seq[: batch.num_pairs], seq[batch.num_pairs :]


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    *,
    variant: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_beta: float = 2.0,
    simpo_gamma: float = 1.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The trace-replay DPO loss (mean over pairs) for ``variant`` (a TRL loss_type or ``"simpo"``).

    For ``"simpo"`` the policy inputs must be length-averaged log-probs and the references are ignored
    (SimPO is reference-free); for the DPO family they are summed log-probs and references are required.
    """
    if variant == "simpo":
        return simpo_loss(
            policy_chosen, policy_rejected, beta=simpo_beta, gamma=simpo_gamma, label_smoothing=label_smoothing
        )
    if variant not in DPO_VARIANTS:
        raise ValueError(f"dpo_variant must be one of {DPO_VARIANTS}, got {variant!r}")
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"dpo_variant={variant!r} needs reference log-probs; use 'simpo' for a reference-free loss")
    return dpo_loss(
        policy_chosen,
        policy_rejected,
        ref_chosen,
        ref_rejected,
        beta=beta,
        loss_type=variant,  # type: ignore[arg-type]
        label_smoothing=label_smoothing,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
    )
