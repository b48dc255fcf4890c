"""TeacherClient against a real HTTP server on 127.0.0.1 (see conftest.ScriptedTeacher)."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import logging
import time

import pytest

from crf_replaysim.teacher import (
    OPENROUTER_BASE_URL,
    TeacherActionError,
    TeacherClient,
    TeacherConfigError,
    TeacherHTTPError,
    TeacherResponseError,
    TeacherRetriesExhausted,
)
from crf_replaysim.teacher.retry import parse_retry_after

CONTEXT = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Run the tests."}]
TOOLS = [{"type": "function", "function": {"name": "run_command", "parameters": {"type": "object"}}}]


def complete(client: TeacherClient, messages=CONTEXT, tools=None):
    async def go():
        try:
            return await client.complete(messages, tools)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_complete_sends_openai_request_and_returns_action(teacher_server, make_client, api_key):
    teacher_server.script.append(
        {
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "x1",
                        "type": "function",
                        "function": {"name": "run_command", "arguments": '{"command": "pytest"}'},
                    }
                ],
            }
        }
    )
    client = make_client(model="org/teacher-1", temperature=0.3, max_tokens=256, extra_body={"top_p": 0.9})
    reply = complete(client, tools=TOOLS)
    assert reply.message["tool_calls"][0]["function"] == {"name": "run_command", "arguments": '{"command": "pytest"}'}
    assert reply.finish_reason == "tool_calls"
    assert reply.cached is False
    (req,) = teacher_server.requests
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["Authorization"] == f"Bearer {api_key}"
    assert req["body"] == {
        "model": "org/teacher-1",
        "messages": CONTEXT,
        "temperature": 0.3,
        "max_tokens": 256,
        "tools": TOOLS,
        "top_p": 0.9,
    }


def test_default_endpoint_is_openrouter_and_key_env_is_configurable(monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-default")
    client = TeacherClient("m")
    assert client.base_url == OPENROUTER_BASE_URL
    assert client.chat_url == "https://openrouter.ai/api/v1/chat/completions"
    monkeypatch.setenv("MY_TEACHER_KEY", "sk-custom")
    assert TeacherClient("m", api_key_env="MY_TEACHER_KEY")._headers()["Authorization"] == "Bearer sk-custom"


def test_missing_key_names_the_variable_and_the_fix(monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(TeacherConfigError, match=r"OPENROUTER_API_KEY is not set.*--api-key-env.*--no-api-key"):
        TeacherClient("m")


def test_no_api_key_sends_no_authorization(teacher_server, make_client):
    client = make_client(api_key_env=None)
    complete(client)
    assert "Authorization" not in teacher_server.requests[0]["headers"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": ""}, "model must be"),
        ({"base_url": "openrouter.ai/api/v1"}, "base_url must start with"),
        ({"max_concurrency": 0}, "max_concurrency must be"),
        ({"max_retries": -1}, "max_retries must be"),
        ({"timeout_s": 0}, "timeout_s must be"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"extra_body": {"messages": []}}, "extra_body may not set"),
    ],
)
def test_bad_configuration_is_refused(make_client, kwargs, match):
    with pytest.raises(TeacherConfigError, match=match):
        make_client(**kwargs)


def test_malformed_context_is_refused_before_any_request(teacher_server, make_client):
    with pytest.raises(TeacherConfigError, match=r"messages\[0\].*role"):
        complete(make_client(), messages=[{"role": "robot", "content": "hi"}])
    assert teacher_server.requests == []


def test_429_retry_after_is_honoured(teacher_server, make_client):
    teacher_server.script.append({"status": 429, "headers": {"Retry-After": "1"}})
    client = make_client()
    reply = complete(client)
    assert reply.message["content"] == "teacher action after 2 messages"
    first, second = teacher_server.requests
    # backoff alone would wait <= 0.01 s; the server asked for 1 s
    assert second["t"] - first["t"] >= 0.95
    assert client.stats.retries == 1


def test_retry_after_parsing():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.25") == 0.25
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= parse_retry_after(future) <= 31  # type: ignore[operator]


def test_retry_after_above_limit_fails_without_waiting(teacher_server, make_client):
    teacher_server.script.append({"status": 503, "headers": {"Retry-After": "3600"}})
    start = time.monotonic()
    with pytest.raises(TeacherHTTPError, match="asks to wait 3600 s, above max_retry_after_s=300"):
        complete(make_client())
    assert time.monotonic() - start < 60  # far below the 3600 s asked for: it did not wait (margin for a loaded CI)
    assert len(teacher_server.requests) == 1  # the 503 was served, and not asked again
    assert not teacher_server.script


def test_5xx_are_retried_with_backoff(teacher_server, make_client):
    teacher_server.script.extend([{"status": 500}, {"status": 502}, {"status": 503}])
    client = make_client(backoff_base_s=0.05, backoff_max_s=1.0)
    reply = complete(client)
    assert reply.message["role"] == "assistant"
    times = [r["t"] for r in teacher_server.requests]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 4
    # equal jitter: retry k waits in [d/2, d] with d = 0.05 * 2**k
    for k, gap in enumerate(gaps):
        assert gap >= 0.05 * 2**k / 2 - 0.005


def test_retries_exhausted_reports_attempts_and_last_error(teacher_server, make_client):
    teacher_server.script.extend([{"status": 500}] * 5)
    with pytest.raises(TeacherRetriesExhausted, match="failed 3 times; last error: HTTP 500") as info:
        complete(make_client(max_retries=2))
    assert info.value.attempts == 3
    assert isinstance(info.value.last_error, TeacherHTTPError)
    assert len(teacher_server.requests) == 3


def test_4xx_is_not_retried_and_names_the_fix(teacher_server, make_client):
    teacher_server.script.append({"status": 401})
    with pytest.raises(TeacherHTTPError, match=r"HTTP 401.*Fix: check the key in \$CRF_REPLAYSIM_TEST_KEY") as info:
        complete(make_client())
    assert info.value.status == 401
    assert len(teacher_server.requests) == 1


def test_slow_reply_past_timeout_is_retried(teacher_server, make_client):
    # the slow reply would come after 60 s (the server's wait ends when it stops, so a pass costs nothing)
    teacher_server.script.append({"sleep": 60.0, "message": {"role": "assistant", "content": "too late"}})
    start = time.monotonic()
    reply = complete(make_client(timeout_s=0.3))
    assert reply.message["content"] == "teacher action after 2 messages"
    assert len(teacher_server.requests) == 2
    assert time.monotonic() - start < 30  # it gave up on the slow one at timeout_s, not after its 60 s


def test_timeouts_exhaust_retries(teacher_server, make_client):
    teacher_server.script.extend([{"sleep": 3.0, "message": {"role": "assistant", "content": "x"}}] * 2)
    with pytest.raises(TeacherRetriesExhausted, match=r"no reply within timeout_s=0\.2"):
        complete(make_client(timeout_s=0.2, max_retries=1))
    assert len(teacher_server.requests) == 2  # both slow replies were asked for
    assert not teacher_server.script


def test_malformed_json_is_retried_then_succeeds(teacher_server, make_client):
    teacher_server.script.append({"raw": b'{"choices": [{"message": '})
    reply = complete(make_client())
    assert reply.message["content"] == "teacher action after 2 messages"
    assert len(teacher_server.requests) == 2


def test_malformed_json_every_time_is_reported(teacher_server, make_client):
    teacher_server.script.extend([{"raw": b"<html>bad gateway</html>"}] * 3)
    with pytest.raises(TeacherRetriesExhausted, match="body is not JSON") as info:
        complete(make_client(max_retries=2))
    assert isinstance(info.value.last_error, TeacherResponseError)
    assert info.value.attempts == 3
    assert len(teacher_server.requests) == 3  # the three bad bodies were served
    assert not teacher_server.script


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"object": "list", "data": []}, "no 'choices' list"),
        ({"error": {"message": "provider hiccup"}}, "endpoint reported an error: provider hiccup"),
    ],
)
def test_unusable_200_replies_are_reported(teacher_server, make_client, body, match):
    teacher_server.script.extend([{"json": body}] * 2)
    with pytest.raises(TeacherRetriesExhausted, match=match):
        complete(make_client(max_retries=1))
    assert len(teacher_server.requests) == 2  # both scripted replies were served
    assert not teacher_server.script


def test_an_unusable_action_is_paid_once_and_not_retried(teacher_server, make_client):
    """A completion was billed even when its message is unusable: asking again would pay for the same answer."""
    body = {"choices": [{"message": {"role": "assistant", "content": ""}}], "usage": {"prompt_tokens": 7}}
    teacher_server.script.extend([{"json": body}] * 2)
    client = make_client(max_retries=3)
    with pytest.raises(TeacherActionError, match="unusable action") as info:
        complete(client)
    assert len(teacher_server.requests) == 1
    assert info.value.usage == {"prompt_tokens": 7}
    assert client.stats.prompt_tokens == 7


def test_error_object_with_4xx_code_fails_at_once(teacher_server, make_client):
    teacher_server.script.append({"json": {"error": {"message": "model not found", "code": 404}}})
    with pytest.raises(TeacherHTTPError, match="endpoint reported error 404: model not found") as info:
        complete(make_client())
    assert not info.value.retryable
    assert len(teacher_server.requests) == 1


def test_error_object_with_5xx_code_is_retried(teacher_server, make_client):
    teacher_server.script.append({"json": {"error": {"message": "upstream overloaded", "code": 502}}})
    reply = complete(make_client())
    assert reply.message["content"].startswith("teacher action")
    assert len(teacher_server.requests) == 2  # the scripted error was served, then the retry answered
    assert not teacher_server.script


def test_tool_call_arguments_sent_as_objects_are_encoded(teacher_server, make_client):
    teacher_server.script.append(
        {
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "a", "function": {"name": "read_file", "arguments": {"path": "x.py"}}}],
            }
        }
    )
    call = complete(make_client()).message["tool_calls"][0]
    assert call == {"id": "a", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "x.py"}'}}


def test_concurrency_is_bounded(teacher_server, make_client):
    teacher_server.responder = lambda body: {"sleep": 0.2, "message": {"role": "assistant", "content": "ok"}}
    client = make_client(max_concurrency=3)

    async def go():
        try:
            return await asyncio.gather(*(client.complete([{"role": "user", "content": f"q{i}"}]) for i in range(9)))
        finally:
            await client.aclose()

    replies = asyncio.run(go())
    assert len(replies) == 9
    assert teacher_server.max_in_flight == 3


def test_cache_answers_identical_requests_from_disk(teacher_server, make_client, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = complete(make_client(cache_dir=cache))
    assert len(teacher_server.requests) == 1
    # a new client (new process, rotated key) with the same cache directory
    monkeypatch.setenv("CRF_REPLAYSIM_TEST_KEY", "sk-or-rotated")
    client = make_client(cache_dir=cache)
    again = complete(client)
    assert len(teacher_server.requests) == 1
    assert again.cached
    assert again.message == first.message
    assert client.stats.cache_hits == 1
    # a different request, or different sampling, is a miss
    complete(client, messages=[*CONTEXT, {"role": "user", "content": "and lint"}])
    complete(make_client(cache_dir=cache, temperature=0.7))
    assert len(teacher_server.requests) == 3
    assert len(list(cache.rglob("*.json"))) == 3


def test_corrupt_cache_entry_is_refetched(teacher_server, make_client, tmp_path, caplog):
    cache = tmp_path / "cache"
    client = make_client(cache_dir=cache)
    complete(client)
    (entry,) = cache.rglob("*.json")
    entry.write_text("{truncated", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="crf_replaysim.teacher"):
        reply = complete(client)
    assert not reply.cached
    assert len(teacher_server.requests) == 2
    assert "unreadable cache entry" in caplog.text
    assert json.loads(entry.read_text(encoding="utf-8"))["key"] == client.cache_key(client.request_body(CONTEXT))


def test_key_never_appears_in_repr_logs_or_errors(teacher_server, make_client, api_key, caplog):
    teacher_server.script.extend(
        [
            {"status": 429, "headers": {"Retry-After": "0.01"}, "echo_auth": True},
            {"status": 500, "echo_auth": True},
            {"raw": b"not json", "echo_auth": True},
        ]
    )
    client = make_client()
    with caplog.at_level(logging.DEBUG):
        complete(client)
        teacher_server.script.append({"status": 403, "echo_auth": True})
        with pytest.raises(TeacherHTTPError) as info:
            complete(client)
    assert "auth was: Bearer <secret>" in str(info.value)  # the server echoed it; we redacted it
    assert caplog.records, "retries should have been logged"
    texts = [caplog.text, repr(client), str(client), str(vars(client)), str(info.value), repr(info.value)]
    for text in texts:
        assert api_key not in text
    assert "CRF_REPLAYSIM_TEST_KEY" in repr(client)


def test_key_cut_by_the_error_snippet_is_still_redacted(teacher_server, make_client, api_key):
    # 260 padding bytes + " auth was: Bearer " puts the key across the 300-character snippet limit
    teacher_server.script.append({"status": 400, "raw": b"x" * 260, "echo_auth": True})
    with pytest.raises(TeacherHTTPError) as info:
        complete(make_client())
    assert api_key[:14] not in str(info.value)


def test_identical_requests_in_flight_share_one_call(teacher_server, make_client):
    teacher_server.responder = lambda body: {"sleep": 0.2, "message": {"role": "assistant", "content": "shared"}}
    client = make_client()

    async def go():
        try:
            return await asyncio.gather(*(client.complete(CONTEXT) for _ in range(5)), client.complete(CONTEXT[:1]))
        finally:
            await client.aclose()

    replies = asyncio.run(go())
    assert len(teacher_server.requests) == 2
    assert client.stats.deduplicated == 4
    assert all(r.message == {"role": "assistant", "content": "shared"} for r in replies)
    assert len({id(r.message) for r in replies}) == 6  # no shared mutable state between callers


def test_shared_call_failure_reaches_every_caller(teacher_server, make_client):
    teacher_server.script.append({"sleep": 0.2, "status": 401})
    client = make_client()

    async def go():
        try:
            return await asyncio.gather(*(client.complete(CONTEXT) for _ in range(3)), return_exceptions=True)
        finally:
            await client.aclose()

    results = asyncio.run(go())
    assert len(teacher_server.requests) == 1
    assert all(isinstance(r, TeacherHTTPError) and r.status == 401 for r in results)


def test_cancelling_the_only_caller_cancels_the_request(teacher_server, make_client):
    teacher_server.script.append({"sleep": 2.0, "message": {"role": "assistant", "content": "late"}})
    client = make_client()

    async def go():
        call = asyncio.ensure_future(client.complete(CONTEXT))
        await asyncio.sleep(0.2)
        (task,) = client._inflight.tasks.values()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait({task}, timeout=1.0)  # the HTTP call unwinds well before the server's 2 s answer
        cancelled = task.cancelled()
        await client.aclose()
        return cancelled

    assert asyncio.run(go())
    assert client._inflight.tasks == {}
