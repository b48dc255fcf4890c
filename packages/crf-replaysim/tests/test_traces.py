"""Trace JSONL format: parsing rules, malformed lines with line numbers, the shipped example traces."""

from __future__ import annotations

import copy
import json

import pytest

from crf_replaysim.messages import validate_messages
from crf_replaysim.traces import (
    MalformedLine,
    Trace,
    TraceError,
    example_traces_path,
    iter_traces,
    load_traces,
    parse_trace,
)


def test_decision_points_are_assistant_messages_after_context(trace_factory):
    trace = parse_trace(trace_factory("t"), line=7)
    assert trace.decision_points() == [1, 3]
    assert trace.line == 7
    assert trace.meta == {"agent_model": "student"}


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t.pop("trace_id"), "trace_id is None"),
        (lambda t: t.update(extra=1), r"unknown keys \['extra'\].*put extras in meta"),
        (lambda t: t.update(messages=t["messages"][:1]), "needs at least 2"),
        (lambda t: t["messages"].pop(1), "answers tool call 'c1', which no earlier assistant message made"),
        (lambda t: t.update(messages=[t["messages"][0], t["messages"][0]]), "nothing to replay"),
        (
            lambda t: t["messages"][1]["tool_calls"][0]["function"].update(arguments={"command": "ls"}),
            "JSON-encoded string",
        ),
        (lambda t: t.update(tools=[{"type": "function"}]), r"tools\[0\] is not a function tool spec"),
        (lambda t: t.update(meta="student"), "meta is str"),
    ],
)
def test_parse_trace_rejects_with_the_fix(trace_factory, mutate, match):
    trace = copy.deepcopy(trace_factory("t"))
    mutate(trace)
    with pytest.raises(TraceError, match=match):
        parse_trace(trace)


def test_malformed_lines_are_reported_with_line_numbers(tmp_path, trace_factory, jsonl_writer):
    bad_tool = trace_factory("orphan")
    bad_tool["messages"].pop(1)
    path = jsonl_writer(
        tmp_path / "traces.jsonl",
        [trace_factory("a"), "{not json", "", bad_tool, trace_factory("a"), "[1, 2]", trace_factory("b")],
    )
    with open(path, "ab") as fh:
        fh.write(b'{"trace_id": "\xff\xfe"}\n')
    items = list(iter_traces(path))
    traces = [i for i in items if isinstance(i, Trace)]
    malformed = [i for i in items if isinstance(i, MalformedLine)]
    assert [(t.trace_id, t.line) for t in traces] == [("a", 1), ("b", 7)]
    assert [m.line for m in malformed] == [2, 4, 5, 6, 8]
    reasons = dict((m.line, m.reason) for m in malformed)
    assert reasons[2].startswith("invalid JSON")
    assert "no earlier assistant message" in reasons[4]
    assert "repeats an earlier line" in reasons[5]
    assert "got list" in reasons[6]
    assert reasons[8].startswith("not UTF-8")
    assert load_traces(path) == (traces, malformed)


def test_example_traces_are_realistic_coding_agent_traces():
    traces, malformed = load_traces(example_traces_path())
    assert malformed == []
    assert 6 <= len(traces) <= 10
    for trace in traces:
        validate_messages(trace.messages)
        names = {t["function"]["name"] for t in trace.tools or []}
        assert {"read_file", "run_command", "edit_file"} <= names
        calls = [c for m in trace.messages for c in m.get("tool_calls") or []]
        assert calls, f"{trace.trace_id} makes no tool call"
        assert {c["function"]["name"] for c in calls} <= names
        for c in calls:
            json.loads(c["function"]["arguments"])
        assert trace.messages[-1]["role"] == "assistant"
        assert trace.messages[-1]["content"]
        assert len(trace.decision_points()) >= 3
    assert len({t.trace_id for t in traces}) == len(traces)
