"""replay_jsonl end to end against the scripted teacher on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from crf_replaysim.records import NormalizedDPOPair, load_schema
from crf_replaysim.replay import replay_jsonl, replay_jsonl_async
from crf_replaysim.teacher import TeacherHTTPError
from crf_replaysim.traces import example_traces_path, load_traces

VALIDATOR = jsonschema.Draft202012Validator(load_schema())
TRACES, _ = load_traces(example_traces_path())
N_POINTS = sum(len(t.decision_points()) for t in TRACES)


def read_pairs(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def recorded_action(body):
    """Look up the recorded action that follows the request's context in the example traces."""
    for trace in TRACES:
        turn = len(body["messages"])
        if turn < len(trace.messages) and trace.messages[:turn] == body["messages"]:
            return trace, turn, trace.messages[turn]
    raise AssertionError("request context is not a prefix of any example trace")


def test_one_pair_per_decision_point_with_provenance(teacher_server, make_client, tmp_path):
    out = tmp_path / "pairs.jsonl"
    summary = replay_jsonl(example_traces_path(), out, client=make_client(model="org/teacher"))
    pairs = read_pairs(out)
    assert summary.traces_read == len(TRACES)
    assert summary.decision_points == summary.pairs_written == len(pairs) == N_POINTS
    assert summary.malformed == summary.failed == []
    assert summary.identical == 0
    expected_order = [(t.trace_id, turn) for t in TRACES for turn in t.decision_points()]
    assert [(p["trace_id"], p["turn"]) for p in pairs] == expected_order
    by_id = {t.trace_id: t for t in TRACES}
    for pair in pairs:
        VALIDATOR.validate(pair)
        trace = by_id[pair["trace_id"]]
        turn = pair["turn"]
        assert pair["prompt_messages"] == trace.messages[:turn]
        assert pair["rejected_messages"] == [trace.messages[turn]]
        assert pair["chosen_messages"] == [{"role": "assistant", "content": f"teacher action after {turn} messages"}]
        assert pair["chosen"] == f"teacher action after {turn} messages"
        assert pair["meta"]["teacher_model"] == "org/teacher"
        assert pair["meta"]["chosen_source"] == "teacher"
        assert pair["meta"]["trace_line"] == TRACES.index(trace) + 1
        assert pair["meta"]["trace_meta"] == trace.meta
        NormalizedDPOPair.from_dj_record(pair)


def test_teacher_sees_the_context_up_to_the_decision_and_the_tools(teacher_server, make_client, tmp_path):
    replay_jsonl(example_traces_path(), tmp_path / "p.jsonl", client=make_client(max_concurrency=4))
    bodies = [r["body"] for r in teacher_server.requests]
    assert len(bodies) == N_POINTS
    seen = set()
    for body in bodies:
        trace, turn, _ = recorded_action(body)
        assert body["tools"] == trace.tools
        assert trace.messages[turn]["role"] == "assistant"
        seen.add((trace.trace_id, turn))
    assert len(seen) == N_POINTS


def test_chosen_recorded_swaps_the_sides(teacher_server, make_client, tmp_path):
    out = tmp_path / "pairs.jsonl"
    replay_jsonl(example_traces_path(), out, client=make_client(), chosen="recorded")
    for pair in read_pairs(out):
        assert pair["chosen_messages"][0]["content"] != f"teacher action after {pair['turn']} messages"
        assert pair["rejected_messages"] == [
            {"role": "assistant", "content": f"teacher action after {pair['turn']} messages"}
        ]
        assert (pair["meta"]["chosen_source"], pair["meta"]["rejected_source"]) == ("recorded", "teacher")


def same_as_recorded_on_even_turns(body):
    """Teacher that repeats the recorded action (new ids, reordered JSON) at even turns."""
    _, turn, recorded = recorded_action(body)
    if turn % 2:
        return {"role": "assistant", "content": "a different idea"}
    message = {"role": "assistant", "content": recorded.get("content")}
    if recorded.get("tool_calls"):
        message["tool_calls"] = [
            {
                "id": f"teacher-{i}",
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(dict(reversed(list(json.loads(c["function"]["arguments"]).items())))),
                },
            }
            for i, c in enumerate(recorded["tool_calls"])
        ]
    return message


def test_identical_actions_are_skipped_and_counted(teacher_server, make_client, tmp_path):
    teacher_server.responder = same_as_recorded_on_even_turns
    even = sum(1 for t in TRACES for turn in t.decision_points() if turn % 2 == 0)
    assert 0 < even < N_POINTS
    out = tmp_path / "pairs.jsonl"
    summary = replay_jsonl(example_traces_path(), out, client=make_client())
    pairs = read_pairs(out)
    assert summary.identical == even
    assert summary.pairs_written == len(pairs) == N_POINTS - even
    assert all(p["turn"] % 2 == 1 for p in pairs)

    kept = tmp_path / "all.jsonl"
    summary = replay_jsonl(example_traces_path(), kept, client=make_client(), keep_identical=True)
    pairs = read_pairs(kept)
    assert summary.pairs_written == len(pairs) == N_POINTS
    assert [p["meta"]["identical"] for p in pairs] == [p["turn"] % 2 == 0 for p in pairs]


def test_malformed_lines_are_reported_and_good_lines_replayed(
    teacher_server, make_client, tmp_path, trace_factory, jsonl_writer
):
    orphan = trace_factory("orphan")
    orphan["messages"].pop(1)
    traces = jsonl_writer(
        tmp_path / "t.jsonl", [trace_factory("a"), "{oops", orphan, trace_factory("a"), trace_factory("b")]
    )
    out = tmp_path / "pairs.jsonl"
    summary = replay_jsonl(traces, out, client=make_client())
    assert [ln for ln, _ in summary.malformed] == [2, 3, 4]
    assert [(p["trace_id"], p["turn"]) for p in read_pairs(out)] == [("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    text = summary.format()
    assert "malformed lines:  3" in text
    assert "line 2: invalid JSON" in text
    assert "line 4: trace_id 'a' repeats" in text


def test_failed_points_are_listed_and_the_run_continues(
    teacher_server, make_client, tmp_path, trace_factory, jsonl_writer
):
    b = trace_factory("b")
    b["messages"][0]["content"] = "List the files, please."

    def fail_second_turn_of_b(body):
        if body["messages"][0]["content"] == "List the files, please." and len(body["messages"]) == 3:
            return {"status": 500}
        return {"role": "assistant", "content": "teacher"}

    teacher_server.responder = fail_second_turn_of_b
    traces = jsonl_writer(tmp_path / "t.jsonl", [trace_factory("a"), b])
    out = tmp_path / "pairs.jsonl"
    summary = replay_jsonl(traces, out, client=make_client(max_retries=1))
    assert [(ln, tid, turn) for ln, tid, turn, _ in summary.failed] == [(2, "b", 3)]
    assert "failed 2 times; last error: HTTP 500" in summary.failed[0][3]
    assert [(p["trace_id"], p["turn"]) for p in read_pairs(out)] == [("a", 1), ("a", 3), ("b", 1)]
    assert "failed points:    1" in summary.format()


def test_auth_failure_aborts_and_leaves_no_output(teacher_server, make_client, tmp_path):
    teacher_server.responder = lambda body: {"status": 401}
    out = tmp_path / "pairs.jsonl"
    with pytest.raises(TeacherHTTPError, match="HTTP 401"):
        replay_jsonl(example_traces_path(), out, client=make_client())
    assert list(tmp_path.iterdir()) == []


def test_pending_requests_are_bounded(teacher_server, make_client, tmp_path):
    teacher_server.responder = lambda body: {"sleep": 0.05, "message": {"role": "assistant", "content": "slow teacher"}}
    out = tmp_path / "pairs.jsonl"
    summary = replay_jsonl(example_traces_path(), out, client=make_client(max_concurrency=8), max_pending=2)
    assert summary.pairs_written == N_POINTS
    assert teacher_server.max_in_flight == 2
    assert [(p["trace_id"], p["turn"]) for p in read_pairs(out)] == [
        (t.trace_id, n) for t in TRACES for n in t.decision_points()
    ]


def test_second_run_is_served_from_the_cache(teacher_server, make_client, tmp_path):
    cache = tmp_path / "cache"
    first = replay_jsonl(example_traces_path(), tmp_path / "1.jsonl", client=make_client(cache_dir=cache))
    second = replay_jsonl(example_traces_path(), tmp_path / "2.jsonl", client=make_client(cache_dir=cache))
    assert (first.teacher_requests, first.cache_hits) == (N_POINTS, 0)
    assert (second.teacher_requests, second.cache_hits) == (0, N_POINTS)
    assert (tmp_path / "1.jsonl").read_bytes() == (tmp_path / "2.jsonl").read_bytes()


def test_progress_counts_handled_decision_points(teacher_server, make_client, tmp_path):
    ticks = []
    replay_jsonl(example_traces_path(), tmp_path / "p.jsonl", client=make_client(), progress=ticks.append)
    assert ticks == list(range(1, N_POINTS + 1))


def test_sync_replay_refuses_a_running_loop_and_async_replay_works(teacher_server, make_client, tmp_path):
    client = make_client()

    async def inside():
        with pytest.raises(RuntimeError, match="await replay_jsonl_async"):
            replay_jsonl(example_traces_path(), tmp_path / "x.jsonl", client=client)
        try:
            return await replay_jsonl_async(example_traces_path(), tmp_path / "y.jsonl", client=client)
        finally:
            await client.aclose()

    assert asyncio.run(inside()).pairs_written == N_POINTS


def test_bad_options_are_refused(make_client, tmp_path):
    with pytest.raises(ValueError, match="chosen must be 'teacher' or 'recorded'"):
        replay_jsonl(example_traces_path(), tmp_path / "p.jsonl", client=make_client(), chosen="student")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pending must be"):
        replay_jsonl(example_traces_path(), tmp_path / "p.jsonl", client=make_client(), max_pending=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        replay_jsonl(tmp_path / "missing.jsonl", tmp_path / "p.jsonl", client=make_client())


def test_rollouts_of_the_same_task_share_teacher_calls(
    teacher_server, make_client, tmp_path, trace_factory, jsonl_writer
):
    """Two rollouts with identical contexts: each context is sent once, and each rollout still gets its pairs."""
    teacher_server.responder = lambda body: {"sleep": 0.1, "message": {"role": "assistant", "content": "teacher"}}
    traces = jsonl_writer(tmp_path / "t.jsonl", [trace_factory("rollout-0"), trace_factory("rollout-1")])
    out = tmp_path / "pairs.jsonl"
    summary = replay_jsonl(traces, out, client=make_client())
    assert (summary.teacher_requests, summary.deduplicated) == (2, 2)
    assert [(p["trace_id"], p["turn"]) for p in read_pairs(out)] == [
        ("rollout-0", 1),
        ("rollout-0", 3),
        ("rollout-1", 1),
        ("rollout-1", 3),
    ]
    assert "shared in flight 2" in summary.format()
