"""Text of TRL prompts and completions: a string, or a list of chat messages (one home for both users).

Used by SDPO reprompting (``crf_core.trainer.reprompt``) and by the rewards (``crf_core.rewards``).
A message is a mapping with a ``content`` key whose value is a string, ``None`` or a list of parts,
of which the ``{"type": "text", "text": ...}`` ones count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

__all__ = ["Messages", "PromptLike", "content_text", "message_text"]

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
