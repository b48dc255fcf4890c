"""Trace-replay pairs in the trainer: tokenised once, cycled in a shared order, sharded across ranks.

Records are crf-replaysim's normalised DPO pairs (flat ``prompt``/``chosen``/``rejected`` strings, optional
``prompt_messages``/``chosen_messages``/``rejected_messages`` chat lists, ``tools`` schemas and
``ref_chosen_logps``/``ref_rejected_logps`` numbers). Three renderings (``render``; the trainer's
``trace_replay_render``):

* ``"chat"``: the conversation intact. ``prompt_messages + chosen_messages`` (and ``+ rejected_messages``) are
  rendered with the tokenizer's chat template and the record's ``tools``, as the policy sees a multi-turn rollout;
  only the response's assistant turns (their text, tool calls and end-of-turn marker) are scored, never tool
  results or headers (``crf_core.trainer.conversation``).
* ``"flat"``: the prompt rendered from ``prompt_messages`` with the chat template when the tokenizer has one (else
  the flat ``prompt``); responses are the flat strings followed by EOS (a tool call is the text ``name(args)``).
* ``"auto"`` (the trainer's default): ``"chat"`` for a record with the three message lists when the chat template renders tool
  calls and tool results (TRL's ``supports_tool_calling``), else ``"flat"``; a record the template cannot render as a
  conversation (not prefix-preserving, or cut to nothing by ``max_length``) falls back to ``"flat"`` with a warning,
  where ``"chat"`` raises.

Order: every rank draws the same sequence of permutations of all pairs (one seeded generator); each micro-batch
takes the next ``batch_size × world_size`` indices of that stream and rank ``r`` uses the ``r``-th slice, so the
ranks see different pairs (sharded, not duplicated) and their cursors stay identical. The cursor (position,
current permutation, generator state) is checkpointed with the Trainer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from crf_core.channels import SequenceBatch
from crf_core.trainer.conversation import check_messages, render_conversation

__all__ = ["PAIR_RENDERINGS", "PairCursor", "TokenizedPair", "check_pair_records", "collate_pairs", "tokenize_pairs"]

logger = logging.getLogger(__name__)

_REQUIRED = ("prompt", "chosen", "rejected")
_MESSAGE_KEYS = ("prompt_messages", "chosen_messages", "rejected_messages")
#: How ``tokenize_pairs`` renders a record (see the module docstring).
PAIR_RENDERINGS: tuple[str, ...] = ("auto", "chat", "flat")


def check_pair_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy records and check the keys the trainer reads (string prompt/chosen/rejected, finite references, and when
    present the chat lists and ``tools``)."""
    out = []
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"pair record {i} is {type(record).__name__}, expected a mapping (a JSON object)")
        for key in _REQUIRED:
            if not isinstance(record.get(key), str):
                raise ValueError(
                    f"pair record {i} needs a string {key!r} (crf-replaysim's flat text); got "
                    f"{type(record.get(key)).__name__}. Normalise the pairs with crf-replaysim first"
                )
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            value = record.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            ):
                raise ValueError(f"pair record {i}: {key!r} must be a finite number, got {value!r}")
        for key in _MESSAGE_KEYS:
            if record.get(key) is not None:
                check_messages(record[key], f"pair record {i}: {key}")
        tools = record.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
            raise ValueError(
                f"pair record {i}: 'tools' must be a list of tool schemas (dicts), got {type(tools).__name__}"
            )
        out.append(dict(record))
    if not out:
        raise ValueError("no trace-replay pairs were given; pass a non-empty pair file or list")
    return out


@dataclass(frozen=True)
class TokenizedPair:
    """Token ids of one pair: the shared prompt and the two responses (EOS included). ``chosen_mask`` /
    ``rejected_mask`` (0/1 per response token) mark the tokens scored; ``None`` scores every response token."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    ref_chosen_logps: float | None = None
    ref_rejected_logps: float | None = None
    chosen_mask: list[int] | None = None
    rejected_mask: list[int] | None = None


def _render_prompt(record: Mapping[str, Any], tokenizer: Any) -> str:
    messages = record.get("prompt_messages")
    if messages and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise TypeError("the tokenizer's chat template did not render a string")
        return text
    return str(record["prompt"])


def tokenize_pairs(
    records: Sequence[Mapping[str, Any]], tokenizer: Any, max_length: int, render: str = "flat"
) -> list[TokenizedPair]:
    """Tokenise records (``render``: ``"chat"``, ``"flat"`` or ``"auto"``, see the module docstring); prompt + response
    is cut to ``max_length`` (prompt from the left, response from the right)."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
    if render not in PAIR_RENDERINGS:
        raise ValueError(f"render must be one of {PAIR_RENDERINGS}, got {render!r}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; set one so responses end like the policy's")
    chat_capable = render == "chat" or (render == "auto" and _renders_tool_calls(tokenizer))
    out = []
    chat = 0
    unrendered: list[str] = []
    for i, record in enumerate(records):
        has_messages = all(isinstance(record.get(k), list) and record.get(k) for k in _MESSAGE_KEYS)
        if render == "chat" and not has_messages:
            raise ValueError(
                f"pair record {i} lacks prompt_messages/chosen_messages/rejected_messages, which "
                "trace_replay_render='chat' needs; use crf-replaysim's records or trace_replay_render='flat'"
            )
        if chat_capable and has_messages:
            try:
                out.append(_chat_pair(i, record, tokenizer, max_length))
                chat += 1
                continue
            except ValueError as exc:
                if render == "chat":
                    raise
                unrendered.append(str(exc))  # "auto": this record trains as flat text (warned below)
        prompt = list(tokenizer(_render_prompt(record, tokenizer))["input_ids"])
        sides = [[*tokenizer(record[k], add_special_tokens=False)["input_ids"], eos] for k in ("chosen", "rejected")]
        keep_prompt = max(1, min(len(prompt), max_length - max(len(s) for s in sides)))
        prompt = prompt[-keep_prompt:]
        sides = [s[: max_length - len(prompt)] for s in sides]
        out.append(
            TokenizedPair(prompt, sides[0], sides[1], record.get("ref_chosen_logps"), record.get("ref_rejected_logps"))
        )
    if unrendered:
        logger.warning(
            "trace-replay pairs: %d record(s) could not be rendered as conversations and train as flat text (first: "
            "%s); set trace_replay_render='chat' to make this an error, or 'flat' to silence it",
            len(unrendered),
            unrendered[0],
        )
    if render == "auto" and records:
        logger.info("trace-replay pairs: %d rendered as conversations, %d as flat text", chat, len(out) - chat)
    return out


def _renders_tool_calls(tokenizer: Any) -> bool:
    """Whether the chat template renders tool calls and tool results (TRL's check), so a conversation survives."""
    if not getattr(tokenizer, "chat_template", None) or not getattr(tokenizer, "is_fast", False):
        return False
    from trl.chat_template_utils import supports_tool_calling

    return bool(supports_tool_calling(tokenizer))


def _chat_pair(index: int, record: Mapping[str, Any], tokenizer: Any, max_length: int) -> TokenizedPair:
    """One record rendered as two conversations sharing the context's tokens; the responses' assistant turns scored."""
    tools = record.get("tools")
    try:
        chosen = render_conversation(tokenizer, record["prompt_messages"], record["chosen_messages"], tools=tools)
        rejected = render_conversation(tokenizer, record["prompt_messages"], record["rejected_messages"], tools=tools)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"pair record {index}: {exc}") from exc
    shared = 0  # the context's tokens, identical on both sides
    limit = min(chosen.context_tokens, rejected.context_tokens)
    while shared < limit and chosen.input_ids[shared] == rejected.input_ids[shared]:
        shared += 1
    prompt = list(chosen.input_ids[:shared])
    sides = [list(chosen.input_ids[shared:]), list(rejected.input_ids[shared:])]
    masks = [list(chosen.trained[shared:]), list(rejected.trained[shared:])]
    keep_prompt = max(1, min(len(prompt), max_length - max(len(s) for s in sides)))
    prompt = prompt[-keep_prompt:] if prompt else prompt
    room = max_length - len(prompt)
    sides, masks = [s[:room] for s in sides], [m[:room] for m in masks]
    for name, mask in zip(("chosen", "rejected"), masks, strict=True):
        if not any(mask):
            raise ValueError(
                f"pair record {index}: no {name} assistant token fits in trace_replay_max_length={max_length}; "
                "raise the limit or shorten the record"
            )
    return TokenizedPair(
        prompt,
        sides[0],
        sides[1],
        record.get("ref_chosen_logps"),
        record.get("ref_rejected_logps"),
        chosen_mask=masks[0],
        rejected_mask=masks[1],
    )


def collate_pairs(
    pairs: Sequence[TokenizedPair], pad_token_id: int, device: torch.device | str = "cpu"
) -> SequenceBatch:
    """``2P`` right-padded rows, chosen ``[:P]`` then rejected ``[P:]``; ``response_mask`` marks the scored response
    tokens (all of them, or a pair's ``chosen_mask``/``rejected_mask``)."""
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    rows = [(p.prompt_ids, p.chosen_ids, p.chosen_mask) for p in pairs]
    rows += [(p.prompt_ids, p.rejected_ids, p.rejected_mask) for p in pairs]
    length = max(len(a) + len(b) for a, b, _ in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    resp = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (prompt, response, scored) in enumerate(rows):
        n_p, n = len(prompt), len(prompt) + len(response)
        if scored is not None and len(scored) != len(response):
            raise ValueError(f"pair row {i}: the response mask has {len(scored)} entries for {len(response)} tokens")
        ids[i, :n] = torch.tensor(prompt + response, dtype=torch.long)
        attn[i, :n] = 1
        resp[i, n_p:n] = 1 if scored is None else torch.tensor(scored, dtype=torch.long)
    return SequenceBatch(ids.to(device), attn.to(device), resp.to(device))


class PairCursor:
    """The shared, sharded order of ``num_pairs`` pairs (see the module docstring).

    Args:
        num_pairs: pairs available (> 0). batch_size: pairs per rank per micro-batch.
        world_size, rank: the data-parallel layout. seed: the same on every rank.
    """

    def __init__(self, num_pairs: int, batch_size: int, *, world_size: int = 1, rank: int = 0, seed: int = 0) -> None:
        if num_pairs <= 0 or batch_size <= 0:
            raise ValueError(f"num_pairs and batch_size must be > 0, got {num_pairs} and {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must satisfy 0 <= rank < world_size={world_size}, got {rank}")
        self.num_pairs, self.batch_size, self.world_size, self.rank = num_pairs, batch_size, world_size, rank
        self._generator = torch.Generator().manual_seed(seed)
        self._order: list[int] = []
        self._position = 0

    def next(self) -> list[int]:
        """This rank's pair indices for the next micro-batch (all ranks advance together)."""
        drawn = []
        for _ in range(self.batch_size * self.world_size):
            if self._position >= len(self._order):
                self._order = torch.randperm(self.num_pairs, generator=self._generator).tolist()
                self._position = 0
            drawn.append(self._order[self._position])
            self._position += 1
        return drawn[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (JSON-serialisable)."""
        return {
            "num_pairs": self.num_pairs,
            "position": self._position,
            "order": list(self._order),
            "generator": self._generator.get_state().tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (for the same pairs)."""
        if state.get("num_pairs") != self.num_pairs:
            raise ValueError(
                f"the checkpoint's pair cursor is for {state.get('num_pairs')} pairs, this run has {self.num_pairs}; "
                "resume with the same trace-replay pairs"
            )
        order = [int(i) for i in state["order"]]
        position = int(state["position"])
        if sorted(order) != (list(range(self.num_pairs)) if order else []) or not 0 <= position <= len(order):
            raise ValueError("the checkpoint's pair cursor is corrupt (order is not a permutation of the pairs)")
        self._order, self._position = order, position
        self._generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
