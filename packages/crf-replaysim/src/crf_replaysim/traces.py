"""Agent traces: the JSONL input of replay.

One trace per line, a JSON object::

    {"trace_id": "fix-flaky-test-001",            # required, unique in the file
     "messages": [...],                           # required, OpenAI chat format (see messages.py)
     "tools": [{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}],
     "meta": {"model": "...", ...}}               # optional, copied into each pair's meta

Rules beyond the chat format: every ``tool`` message answers a tool call made by an earlier
assistant message, and at least one assistant message has context before it (a *decision
point*). Blank lines are skipped; every other line either parses into a :class:`Trace` or is
reported as a :class:`MalformedLine` with its 1-based line number, never dropped silently
(lines are read by :func:`crf_replaysim.jsonl.iter_json_lines`: bad UTF-8, lone surrogates, too
deep or too long lines are reported like bad JSON).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from crf_replaysim.jsonl import DEFAULT_MAX_DEPTH, DEFAULT_MAX_LINE_BYTES, MalformedLine, iter_json_lines
from crf_replaysim.messages import MessageError, validate_messages

__all__ = [
    "MalformedLine",
    "Trace",
    "TraceError",
    "example_traces_path",
    "iter_traces",
    "load_traces",
    "parse_trace",
]

_TRACE_KEYS = frozenset({"trace_id", "messages", "tools", "meta"})


class TraceError(ValueError):
    """A trace does not follow the trace format."""


@dataclass(frozen=True)
class Trace:
    """One recorded agent conversation. ``line`` is its 1-based line in the source file (0 if none)."""

    trace_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    line: int = 0

    def decision_points(self) -> list[int]:
        """Indices of the assistant messages that have context before them (index >= 1)."""
        return [i for i, m in enumerate(self.messages) if i >= 1 and m["role"] == "assistant"]


def _validate_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise TraceError(f"'tools' is {type(tools).__name__}. Fix: make it a list of function tool specs")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise TraceError(
                f"tools[{i}] is not a function tool spec. "
                'Fix: use {"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )


def _validate_tool_results(messages: list[dict[str, Any]]) -> None:
    called: set[str] = set()
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            called.update(c["id"] for c in msg.get("tool_calls") or [])
        elif msg["role"] == "tool" and msg["tool_call_id"] not in called:
            raise TraceError(
                f"messages[{i}] answers tool call {msg['tool_call_id']!r}, which no earlier assistant message made. "
                "Fix: keep tool results after the assistant message whose tool_calls carry that id"
            )


def parse_trace(obj: Any, line: int = 0) -> Trace:
    """Validate a decoded JSON object and return it as a :class:`Trace` (raises ``TraceError``)."""
    if not isinstance(obj, dict):
        raise TraceError(f"a trace is a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _TRACE_KEYS)
    if unknown:
        raise TraceError(
            f"unknown keys {unknown}. Fix: a trace has trace_id, messages, tools, meta; put extras in meta"
        )
    trace_id = obj.get("trace_id")
    if not isinstance(trace_id, str) or not trace_id:
        raise TraceError(f"trace_id is {trace_id!r}. Fix: give every trace a non-empty string id")
    try:
        validate_messages(obj.get("messages"), "messages", min_items=2)
    except MessageError as err:
        raise TraceError(str(err)) from None
    messages: list[dict[str, Any]] = obj["messages"]
    _validate_tool_results(messages)
    tools = obj.get("tools")
    if tools is not None:
        _validate_tools(tools)
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise TraceError(f"meta is {type(meta).__name__}. Fix: use a JSON object")
    trace = Trace(trace_id=trace_id, messages=messages, tools=tools, meta=meta, line=line)
    if not trace.decision_points():
        raise TraceError("no assistant message follows any context, so there is nothing to replay")
    return trace


def iter_traces(
    path: str | Path, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, max_depth: int = DEFAULT_MAX_DEPTH
) -> Iterator[Trace | MalformedLine]:
    """Stream a trace JSONL file: a :class:`Trace` per good line, a :class:`MalformedLine` per bad one.

    Reads one line at a time (constant memory besides the set of seen ids; ``max_line_bytes`` caps a
    line). A repeated ``trace_id`` is malformed: provenance must name one trace.
    """
    seen: set[str] = set()
    for item in iter_json_lines(path, max_line_bytes=max_line_bytes, max_depth=max_depth):
        if isinstance(item, MalformedLine):
            yield item
            continue
        lineno, obj = item
        try:
            trace = parse_trace(obj, line=lineno)
        except TraceError as err:
            yield MalformedLine(lineno, str(err))
            continue
        if trace.trace_id in seen:
            yield MalformedLine(lineno, f"trace_id {trace.trace_id!r} repeats an earlier line. Fix: make ids unique")
            continue
        seen.add(trace.trace_id)
        yield trace


def load_traces(path: str | Path) -> tuple[list[Trace], list[MalformedLine]]:
    """All traces of a file and all malformed lines (loads everything; use :func:`iter_traces` to stream)."""
    traces: list[Trace] = []
    malformed: list[MalformedLine] = []
    for item in iter_traces(path):
        (traces if isinstance(item, Trace) else malformed).append(item)  # type: ignore[arg-type]
    return traces, malformed


def example_traces_path() -> Path:
    """Path of the shipped example traces (``crf_replaysim/data/example_traces.jsonl``)."""
    return Path(str(resources.files("crf_replaysim").joinpath("data").joinpath("example_traces.jsonl")))
