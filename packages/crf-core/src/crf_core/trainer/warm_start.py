"""Supervised warm start on multi-turn episodes: the policy learns a tool-call format before RL.

A policy that never emits a well-formed tool call gets no tool result, so multi-turn RL (TRL's
``environment_factory``) has nothing to reinforce. The usual remedy is a short supervised step on demonstrations of
whole episodes (draft, ``run_tests``, read the result, fix, ``submit``). :func:`warm_start_on_episodes` renders each
``(context, response)`` episode with the tokenizer's chat template (``crf_core.trainer.conversation``: the same
rendering as the rollouts and as trace-replay DPO) and minimises the cross-entropy of the response's assistant
turns only, tool calls included; tool results, headers and the context are never trained, as in every RL channel.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from crf_core.trainer.conversation import RenderedConversation, render_conversation

__all__ = ["WarmStartReport", "warm_start_on_episodes"]

Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class WarmStartReport:
    """``steps`` taken and the mean assistant-token cross-entropy of the first and the last step."""

    steps: int
    first_loss: float
    last_loss: float


def warm_start_on_episodes(
    model: Any,
    tokenizer: Any,
    episodes: Sequence[tuple[Messages, Messages]],
    *,
    tools: Sequence[Any] | None = None,
    steps: int = 200,
    learning_rate: float = 3e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> WarmStartReport:
    """Train ``model`` in place on the assistant turns of ``episodes`` (AdamW, ``steps`` steps of ``batch_size``
    episodes drawn without replacement, reshuffled each pass; seeded).

    Args:
        model: a causal LM (returns ``.logits``).
        tokenizer: fast tokenizer with a chat template (the one the rollouts use).
        episodes: ``(context, response)`` message lists; the response holds at least one assistant turn.
        tools: tool schemas or functions rendered in the prompt (as the trainer passes them to the template).
        steps, learning_rate, batch_size, seed: the optimisation.

    Raises:
        ValueError: no episodes, bad numbers, or an episode the template cannot render (named by index).
    """
    if isinstance(episodes, (str, bytes)) or not isinstance(episodes, Sequence) or not episodes:
        raise ValueError("episodes must be a non-empty sequence of (context, response) message lists")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, (int, float))
        or not 0 < learning_rate < math.inf
    ):
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}")
    schemas = _schemas(tools)
    rows = []
    for index, episode in enumerate(episodes):
        if not isinstance(episode, tuple) or len(episode) != 2:
            raise ValueError(f"episode {index} must be a (context, response) tuple of message lists")
        try:
            rows.append(render_conversation(tokenizer, episode[0], episode[1], tools=schemas))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"episode {index}: {exc}") from exc
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=float(learning_rate))
    order: list[int] = []
    rng = random.Random(seed)
    was_training = model.training
    model.train()
    losses: list[float] = []
    try:
        for _ in range(steps):
            batch: list[RenderedConversation] = []
            while len(batch) < min(batch_size, len(rows)):
                if not order:
                    order = list(range(len(rows)))
                    rng.shuffle(order)
                batch.append(rows[order.pop()])
            width = max(len(r.input_ids) for r in batch)
            ids = torch.full((len(batch), width), int(pad), dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for i, row in enumerate(batch):
                n = len(row.input_ids)
                ids[i, :n] = torch.tensor(row.input_ids)
                attention[i, :n] = 1
                trained = torch.tensor(row.trained, dtype=torch.bool)
                labels[i, :n] = torch.where(trained, ids[i, :n], torch.full_like(ids[i, :n], -100))
            ids, attention, labels = ids.to(device), attention.to(device), labels.to(device)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            losses.append(float(loss.detach()))
    finally:
        model.train(was_training)
    return WarmStartReport(steps, losses[0], losses[-1])


def _schemas(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Tool schemas for the template: dicts as given, functions through transformers' ``get_json_schema``."""
    if not tools:
        return None
    from transformers.utils import get_json_schema

    out = []
    for tool in tools:
        if isinstance(tool, Mapping):
            out.append(dict(tool))
        elif callable(tool):
            out.append(get_json_schema(tool))
        else:
            raise TypeError(f"a tool must be a schema dict or a function, got {type(tool).__name__}")
    return out
