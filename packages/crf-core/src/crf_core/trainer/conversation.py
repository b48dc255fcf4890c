"""A multi-turn conversation rendered with the tokenizer's chat template, its assistant turns marked for training.

Trace-replay DPO pairs from agent traces (crf-replaysim's ``prompt_messages`` / ``chosen_messages`` /
``rejected_messages``) are conversations: the context, then an action that may span several messages (an assistant
turn with tool calls, the tool's result, the next assistant turn). :func:`render_conversation` renders context +
response as the policy sees it (the chat template, with the record's tool schemas) and marks the tokens of the
response's assistant turns (text and tool calls, the template's end-of-turn marker included) as trained; tool results,
role headers and the context are not. OpenAI-format tool calls (``arguments`` a JSON string) are given to the
template as dicts, the shape Hugging Face chat templates render.

How turns are found, for any template: assistant turn ``i`` spans from the end of the rendering of messages ``[:i]``
with the generation prompt to the end of the rendering of messages ``[:i + 1]`` (trailing whitespace the template
adds after the turn excluded). Both renderings must be prefixes of the whole conversation's (the template is
prefix-preserving, as TRL's multi-turn rollouts require too); a template that is not is refused with the fix.
Characters map to tokens through a fast tokenizer's offsets, so no BPE merge across a boundary is split.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ROLES", "RenderedConversation", "check_messages", "normalise_messages", "render_conversation"]

ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
_MAX_ARGUMENT_CHARS = 1_000_000


@dataclass(frozen=True)
class RenderedConversation:
    """Token ids of context + response, ``trained`` (1 on the response's assistant-turn tokens, else 0, same length)
    and ``context_tokens`` (how many leading tokens render the context alone)."""

    input_ids: tuple[int, ...]
    trained: tuple[int, ...]
    context_tokens: int


def check_messages(messages: Any, where: str, *, min_items: int = 1) -> None:
    """Raise ``ValueError`` naming the first message of ``messages`` that is not a chat message TRL and chat templates
    read: a list of mappings with a known ``role``; content a string, a list of parts or (assistant) ``None``;
    ``tool_calls`` (assistant only) a list of ``{"function": {"name": str, "arguments": dict or JSON str}}``."""
    if not isinstance(messages, list) or len(messages) < min_items:
        raise ValueError(f"{where} must be a list of at least {min_items} chat message(s), got {_kind(messages)}")
    for i, message in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at} is {type(message).__name__}; a chat message is a dict with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{at} has role {role!r}; use one of {ROLES}")
        content = message.get("content")
        if not (isinstance(content, (str, list)) or (content is None and role == "assistant")):
            raise ValueError(f"{at} content is {type(content).__name__}; use a string or a list of content parts")
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if role != "assistant" or not isinstance(calls, list):
            raise ValueError(f"{at} has tool_calls; only an assistant message carries them, as a list")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ValueError(f"{at}.tool_calls[{j}] needs 'function': {{'name': str, 'arguments': ...}}")
            arguments = function.get("arguments")
            if arguments is not None and not isinstance(arguments, (str, Mapping)):
                raise ValueError(f"{at}.tool_calls[{j}] arguments must be a dict or a JSON string")


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Deep copies, with each tool call's ``arguments`` that is a JSON string of an object decoded to a dict (what
    Hugging Face chat templates render) and ``type`` defaulting to ``"function"``; other arguments are kept as given."""
    out = []
    for message in messages:
        item = copy.deepcopy(dict(message))
        if item.get("tool_calls"):
            calls = []
            for call in item["tool_calls"]:
                call = {"type": "function", **call, "function": dict(call["function"])}
                arguments = call["function"].get("arguments")
                if isinstance(arguments, str) and len(arguments) <= _MAX_ARGUMENT_CHARS:
                    try:
                        decoded = json.loads(arguments)
                    except (ValueError, RecursionError):
                        decoded = None
                    if isinstance(decoded, dict):
                        call["function"]["arguments"] = decoded
                calls.append(call)
            item["tool_calls"] = calls
        out.append(item)
    return out


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation, tokenize=False
    )
    if not isinstance(text, str):
        raise TypeError("the tokenizer's chat template did not render a string")
    return text


def render_conversation(
    tokenizer: Any,
    context: Sequence[Mapping[str, Any]],
    response: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> RenderedConversation:
    """Render ``context + response`` with ``tokenizer``'s chat template and mark the response's assistant turns.

    Args:
        tokenizer: a fast tokenizer (offsets) with a chat template.
        context: the messages before the action (at least one).
        response: the action: at least one assistant message, possibly followed by tool results and more turns.
        tools: tool schemas to render (OpenAI's ``{"type": "function", "function": {...}}``), or None.

    Raises:
        ValueError: malformed messages, a response without an assistant turn, or a template that is not
            prefix-preserving. TypeError: a tokenizer without a chat template or offsets.
    """
    check_messages(list(context) if isinstance(context, Sequence) else context, "context")
    check_messages(list(response) if isinstance(response, Sequence) else response, "response")
    if not any(m.get("role") == "assistant" for m in response):
        raise ValueError("the response has no assistant message, so nothing would be trained; add the action")
    if tools is not None and (not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be a list of tool schemas (dicts) or None")
    if not getattr(tokenizer, "chat_template", None):
        raise TypeError("the tokenizer has no chat template; set one, or train on the flat text")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("rendering a conversation needs a fast tokenizer (token offsets); load it with use_fast=True")
    messages = normalise_messages([*context, *response])
    schemas = [dict(t) for t in tools] if tools else None
    full = _render(tokenizer, messages, schemas, False)
    context_text = _render(tokenizer, messages[: len(context)], schemas, False)
    _check_prefix(context_text, full, "the context")
    spans: list[tuple[int, int]] = []
    for index in range(len(context), len(messages)):
        if messages[index].get("role") != "assistant":
            continue
        start_text = _render(tokenizer, messages[:index], schemas, True)
        end_text = _render(tokenizer, messages[: index + 1], schemas, False)
        _check_prefix(start_text, full, f"the generation prompt before message {index}")
        _check_prefix(end_text, full, f"assistant message {index}")
        end = len(end_text.rstrip())
        if end > len(start_text):
            spans.append((len(start_text), end))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(t) for t in encoded["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
    trained = [0] * len(ids)
    span = 0
    for k, (a, b) in enumerate(offsets):
        while span < len(spans) and spans[span][1] < b:
            span += 1
        if span < len(spans) and b > a and a >= spans[span][0] and b <= spans[span][1]:
            trained[k] = 1
    if not any(trained):
        raise ValueError("no token of the response's assistant turns survived tokenization; check the chat template")
    context_tokens = 0
    while context_tokens < len(offsets) and offsets[context_tokens][1] <= len(context_text):
        context_tokens += 1
    return RenderedConversation(tuple(ids), tuple(trained), context_tokens)


def _check_prefix(part: str, full: str, what: str) -> None:
    if not full.startswith(part):
        raise ValueError(
            f"the chat template renders {what} differently once later messages follow (it is not prefix-preserving), "
            "so the assistant turns cannot be located; use a prefix-preserving template (TRL's "
            "get_training_chat_template gives one for common models) or trace_replay_render='flat'"
        )


def _kind(value: Any) -> str:
    return f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
