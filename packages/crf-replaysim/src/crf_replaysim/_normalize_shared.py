"""What the normaliser front end (``normalize.py``) and the data-juicer backend (``_dj_executor.py``) share.

The run summary, the derived ``pair`` field and the mapping of a text op over a chat list's text, in
one place below both, so neither imports the other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from crf_replaysim.records import RecordError

__all__ = ["NormalizeSummary", "map_message_text", "message_texts", "pair_text"]


@dataclass
class NormalizeSummary:
    """Counts of one normalisation run.

    ``read``: records (or JSONL lines) read; ``kept``: records written; ``dropped_per_op``: records each
    recipe step removed, keyed ``op_name(text_key)`` (data-juicer backend: per executor pass, see its
    docs); ``malformed``: ``(line number, reason)`` of input lines that were not valid records (never written);
    ``input_format``: the format the input was read as (``records``, ``trl-standard``, ``trl-conversational``).
    """

    read: int = 0
    kept: int = 0
    dropped_per_op: dict[str, int] = field(default_factory=dict)
    malformed: list[tuple[int, str]] = field(default_factory=list)
    input_format: str | None = None

    def format(self) -> str:
        """Multi-line human-readable summary, as the CLI prints it at the end."""
        lines = [f"read {self.read}, kept {self.kept}, dropped {sum(self.dropped_per_op.values())}"]
        if self.input_format:
            lines.append(f"  input format: {self.input_format}")
        lines += [f"  dropped by {label}: {count}" for label, count in self.dropped_per_op.items()]
        if self.malformed:
            lines.append(f"  malformed lines (not written): {len(self.malformed)}")
            lines += [f"    line {number}: {reason}" for number, reason in self.malformed]
        return "\n".join(lines)


def pair_text(record: Mapping[str, Any]) -> str:
    """The derived ``pair`` field: ``[prompt, chosen, rejected]`` as compact JSON (unambiguous, so exact dedup)."""
    return json.dumps([record["prompt"], record["chosen"], record["rejected"]], ensure_ascii=False)


def message_texts(messages: list[Any]) -> list[str]:
    """The strings :func:`map_message_text` would rewrite, in the same order."""
    texts: list[str] = []

    def collect(text: str) -> str:
        texts.append(text)
        return text

    map_message_text(messages, collect)
    return texts


def map_message_text(messages: list[Any], apply: Callable[[str], str]) -> list[Any]:
    """A copy of ``messages`` with ``apply`` run on each string ``content`` and each ``{"type": "text"}`` part.

    Tool-call arguments (JSON) are left untouched.
    """
    out: list[Any] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise RecordError(f"chat messages must be dicts, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": apply(content)}
        elif isinstance(content, list):
            parts = [
                {**part, "text": apply(part["text"])}
                if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                else part
                for part in content
            ]
            message = {**message, "content": parts}
        out.append(message)
    return out
