"""OpenAI chat messages: validation, flat-text rendering and action comparison.

A message is a dict in OpenAI chat-completions format::

    {"role": "system" | "developer" | "user", "content": str | [parts]}
    {"role": "assistant", "content": str | None, "tool_calls": [
        {"id": str, "type": "function", "function": {"name": str, "arguments": str}}]}
    {"role": "tool", "tool_call_id": str, "content": str | [parts]}

``parts`` is a list of ``{"type": "text", "text": str}`` content parts (other part types are
kept but contribute no text). Extra keys on a message (``name``, ``refusal``, ``reasoning``...) are
allowed and preserved. The same rules are written as JSON Schema in
``schema/dpo_pair.schema.json``; ``tests/test_records.py`` checks that both agree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from crf_replaysim.jsonl import loads_bounded

__all__ = [
    "ROLES",
    "MessageError",
    "action_key",
    "content_text",
    "flatten_action",
    "flatten_prompt",
    "validate_messages",
    "validate_tool_arguments",
]

ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")

Message = Mapping[str, Any]
_JSON_TYPES = {
    type(None): "null",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
}


class MessageError(ValueError):
    """A chat message list does not follow the OpenAI chat format."""


def _fail(where: str, problem: str, fix: str) -> MessageError:
    return MessageError(f"{where}: {problem}. Fix: {fix}")


def _validate_content(content: Any, where: str, *, nullable: bool) -> None:
    if content is None:
        if not nullable:
            raise _fail(where, "'content' is null", "give this message a string content")
        return
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _fail(
                    f"{where}.content[{j}]",
                    f"content part is {type(part).__name__} without a string 'type'",
                    'use {"type": "text", "text": "..."} parts or a plain string',
                )
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise _fail(f"{where}.content[{j}]", "text part has no string 'text'", "add 'text': str")
        return
    raise _fail(where, f"'content' is {type(content).__name__}", "use a string, a list of content parts or null")


def _validate_tool_calls(tool_calls: Any, where: str) -> None:
    if not isinstance(tool_calls, list):
        raise _fail(where, f"'tool_calls' is {type(tool_calls).__name__}", "make 'tool_calls' a list")
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise _fail(at, f"tool call is {type(call).__name__}", "use a dict with 'id', 'type', 'function'")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise _fail(at, "missing a non-empty string 'id'", "give every tool call the id its tool result cites")
        if call.get("type", "function") != "function":
            raise _fail(at, f"'type' is {call.get('type')!r}", "only 'function' tool calls are supported")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _fail(at, "'function' is missing or not a dict", "add 'function': {'name': str, 'arguments': str}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _fail(f"{at}.function", "missing a non-empty string 'name'", "name the tool being called")
        if not isinstance(fn.get("arguments"), str):
            raise _fail(
                f"{at}.function",
                f"'arguments' is {type(fn.get('arguments')).__name__}",
                "OpenAI format carries arguments as a JSON-encoded string: json.dumps(args)",
            )


def validate_messages(messages: Any, where: str = "messages", *, min_items: int = 0) -> None:
    """Raise ``MessageError`` naming the first message that breaks the OpenAI chat format.

    ``where`` prefixes error locations (e.g. ``"chosen_messages"``); ``min_items`` is the
    least number of messages accepted.
    """
    if not isinstance(messages, list):
        raise _fail(where, f"expected a list of chat messages, got {type(messages).__name__}", "pass a list of dicts")
    if len(messages) < min_items:
        raise _fail(where, f"has {len(messages)} messages, needs at least {min_items}", "add the missing messages")
    for i, msg in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(msg, dict):
            raise _fail(at, f"message is {type(msg).__name__}", "each message is a dict with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise _fail(at, f"'role' is {role!r}", f"use one of {', '.join(ROLES)}")
        if role == "assistant":
            if "content" not in msg and "tool_calls" not in msg:
                raise _fail(at, "assistant message has neither 'content' nor 'tool_calls'", "add one of them")
            _validate_content(msg.get("content"), at, nullable=True)
            if msg.get("tool_calls") is not None:
                _validate_tool_calls(msg["tool_calls"], at)
            if not content_text(msg.get("content")) and not msg.get("tool_calls"):
                raise _fail(at, "assistant message is empty (no text, no tool calls)", "drop it or give it content")
        else:
            if "content" not in msg:
                raise _fail(at, f"{role} message has no 'content'", "add 'content'")
            _validate_content(msg["content"], at, nullable=False)
            if "tool_calls" in msg:
                raise _fail(at, f"{role} message carries 'tool_calls'", "only assistant messages call tools")
        if role == "tool" and (not isinstance(msg.get("tool_call_id"), str) or not msg["tool_call_id"]):
            raise _fail(at, "tool message without a string 'tool_call_id'", "cite the id of the tool call it answers")


def validate_tool_arguments(messages: Sequence[Message], where: str = "messages") -> None:
    """Raise ``MessageError`` unless every tool call's ``arguments`` decodes to a JSON object.

    What a preferred (chosen) action must satisfy: a call whose arguments are cut short (``'{"command": "ls"'``),
    ``null``, an array, empty, or nested past the depth limit is not an action to train towards. Parsing is
    bounded (:func:`crf_replaysim.jsonl.loads_bounded`), so hostile arguments fail here and nowhere else.
    """
    for i, msg in enumerate(messages):
        for j, call in enumerate(msg.get("tool_calls") or []):
            at = f"{where}[{i}].tool_calls[{j}].function.arguments"
            try:
                value = loads_bounded(call["function"]["arguments"])
            except ValueError as err:
                raise _fail(at, f"not usable JSON: {err}", "a chosen tool call carries a JSON object") from None
            if not isinstance(value, dict):
                kind = _JSON_TYPES.get(type(value), type(value).__name__)
                raise _fail(at, f"decodes to JSON {kind}, not an object", 'pass e.g. \'{"command": "ls"}\'')


def content_text(content: Any) -> str:
    """Text of a message ``content``: the string itself, the joined ``text`` parts, or ``""`` for null."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")


def _render_tool_call(call: Mapping[str, Any]) -> str:
    fn = call["function"]
    return f"{fn['name']}({fn['arguments']})"


def _action_text(msg: Message) -> str:
    pieces = [content_text(msg.get("content"))] if content_text(msg.get("content")) else []
    pieces.extend(_render_tool_call(c) for c in msg.get("tool_calls") or [])
    return "\n".join(pieces)


def flatten_action(messages: Sequence[Message]) -> str:
    """Flat text of an action (the ``chosen``/``rejected`` side) for text ops.

    Each message contributes its text, then one ``name(arguments)`` line per tool call;
    messages are joined by a blank line. No role tags, so length and character-ratio
    filters measure what the model said and did.
    """
    return "\n\n".join(_action_text(m) for m in messages)


def flatten_prompt(messages: Sequence[Message]) -> str:
    """Flat text of a context (the ``prompt`` side): ``"<role>: <text>"`` blocks joined by a blank line."""
    return "\n\n".join(f"{m['role']}: {_action_text(m)}" for m in messages)


def _canonical_arguments(arguments: str) -> Any:
    try:
        return loads_bounded(arguments)
    except ValueError:  # not JSON, or too deep: compared as text
        return arguments.strip()


def action_key(msg: Message) -> str:
    """Canonical form of an assistant action, for "did the teacher do the same thing?".

    Two actions match when their stripped text is equal and they call the same tools, in the
    same order, with equal parsed JSON arguments. Tool-call ids and key order do not matter.
    """
    calls = [
        [c["function"]["name"], _canonical_arguments(c["function"]["arguments"])] for c in msg.get("tool_calls") or []
    ]
    return json.dumps([content_text(msg.get("content")).strip(), calls], sort_keys=True, ensure_ascii=False)
