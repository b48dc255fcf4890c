"""Text of TRL prompts and completions: a string, or a list of chat messages (one home for both users).

Used by SDPO reprompting (``crf_core.trainer.reprompt``) and by the rewards (``crf_core.rewards``).
A message is a mapping with a ``content`` key whose value is a string, ``None`` or a list of parts,
of which the ``{"type": "text", "text": ...}`` ones count. An assistant message may carry ``tool_calls``
(``{"function": {"name": ..., "arguments": dict or JSON string}}``, TRL's and OpenAI's shapes); a ``tool``
message carries a tool's result.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

__all__ = ["Messages", "PromptLike", "action_text", "content_text", "message_text", "tool_call_text"]

Messages = Sequence[Mapping[str, Any]]
PromptLike = Union[str, Messages]  # noqa: UP007 (a runtime alias; `|` needs 3.10 typing on both sides)


def message_text(value: PromptLike) -> str:
    """Text of a completion/prompt: the string itself, or the joined text of a message list's contents."""
    if isinstance(value, str):
        return value
    if not isinstance(value, Sequence):
        raise TypeError(f"expected a str or a list of chat messages, got {type(value).__name__}")
    parts: list[str] = []
    for message in value:
        if not isinstance(message, Mapping) or "content" not in message:
            raise TypeError("chat messages must be dicts with a 'content' key")
        parts.append(content_text(message["content"]))
    return "".join(parts)


def content_text(content: Any) -> str:
    """Text of one message's ``content``: a string, ``None`` (empty) or the text parts of a list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    raise TypeError(f"message content must be str, a list of parts or None, got {type(content).__name__}")


def tool_call_text(call: Mapping[str, Any]) -> str:
    """One tool call as ``name({"arg": ...})`` (arguments as compact JSON; a JSON string is kept as written)."""
    if not isinstance(call, Mapping):
        raise TypeError(f"a tool call must be a mapping, got {type(call).__name__}")
    function = call.get("function", call)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise TypeError("a tool call needs a 'function' mapping with a string 'name' (TRL's and OpenAI's shape)")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{function['name']}({text})"


def action_text(value: PromptLike) -> str:
    """What the assistant did in a completion.

    A string, or a message list without tool calls and tool messages, gives :func:`message_text` (unchanged). A
    multi-turn completion (TRL's tool-calling rollouts) gives each assistant turn's text followed by one
    :func:`tool_call_text` line per tool call, turns joined by a newline; tool results and other roles are left out.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, Sequence):
        raise TypeError(f"expected a str or a list of chat messages, got {type(value).__name__}")
    if not any(isinstance(m, Mapping) and (m.get("tool_calls") or m.get("role") == "tool") for m in value):
        return message_text(value)
    turns: list[str] = []
    for message in value:
        if not isinstance(message, Mapping):
            raise TypeError("chat messages must be dicts with a 'content' key")
        if message.get("role", "assistant") != "assistant":
            continue
        lines = [content_text(message.get("content"))] if content_text(message.get("content")) else []
        lines.extend(tool_call_text(call) for call in message.get("tool_calls") or [])
        if lines:
            turns.append("\n".join(lines))
    return "\n".join(turns)
