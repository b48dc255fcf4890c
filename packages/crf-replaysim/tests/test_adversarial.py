"""Adversarial inputs for the CLIs, the loaders and the teacher client: each is contained and the good data kept.

Every test takes the ``contained`` fixture and calls it once its assertions pass; the run ends with the tally
("N attacks or bad inputs tried, N contained with the good data kept"). Servers are real HTTP servers on
127.0.0.1 (``conftest.ScriptedTeacher``); child processes are interrupted with a real SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest

from crf_replaysim._synthetic import synthetic_dj_records
from crf_replaysim.cli import main
from crf_replaysim.jsonl import UnsafeOutputError
from crf_replaysim.normalize import normalize_jsonl
from crf_replaysim.pairs import read_pairs
from crf_replaysim.records import RecordError
from crf_replaysim.replay import ReplayBusyError, ReplayStateError, replay_jsonl, replay_state_paths
from crf_replaysim.teacher import (
    TeacherClient,
    TeacherConfigError,
    TeacherHTTPError,
    TeacherResponseTooLarge,
    TeacherRetriesExhausted,
)

KEY_ENV = "CRF_REPLAYSIM_TEST_KEY"
GOOD = [json.dumps(r, ensure_ascii=False) for r in synthetic_dj_records(6, seed=5)]


def complete(client: TeacherClient, messages: list[dict[str, Any]] | None = None) -> Any:
    async def go() -> Any:
        try:
            return await client.complete(messages or [{"role": "user", "content": "Run the tests."}])
        finally:
            await client.aclose()

    return asyncio.run(go())


def distinct_traces(trace_factory: Any, n: int) -> list[dict[str, Any]]:
    """``n`` two-point traces whose contexts all differ (identical contexts would share teacher calls)."""
    traces = [trace_factory(f"t{i}") for i in range(n)]
    for trace in traces:
        trace["messages"][0]["content"] = f"List the files of {trace['trace_id']}."
    return traces


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def replay_cli(server: Any, traces: Path, out: Path, *extra: str) -> list[str]:
    return ["replay", str(traces), "-o", str(out), "--model", "org/teacher", "--base-url", server.base_url,
            "--api-key-env", KEY_ENV, "--backoff-base", "0.01", "--backoff-max", "0.02", "--quiet", *extra]  # fmt: skip


# --------------------------------------------------------------------------- output is an input


def _alias(kind: str, target: Path) -> Path:
    if kind == "same path":
        return target
    if kind == "dotted path":
        (target.parent / "sub").mkdir(exist_ok=True)
        return target.parent / "sub" / ".." / target.name
    alias = target.parent / f"alias-{kind.replace(' ', '-')}.jsonl"
    if kind == "symlink":
        alias.symlink_to(target)
    else:
        os.link(target, alias)
    return alias


ALIASES = ["same path", "dotted path", "symlink", "hard link"]


@pytest.mark.parametrize("kind", ALIASES)
def test_normalize_into_its_own_input_is_refused_before_opening(tmp_path, capsys, contained, kind):
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(GOOD[:5]) + "\n", encoding="utf-8")
    before = src.read_bytes()
    assert main(["normalize", str(src), "-o", str(_alias(kind, src)), "--skip-dj", "--quiet"]) == 1
    assert "same file as the input" in capsys.readouterr().err
    assert src.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    contained()


@pytest.mark.parametrize("kind", ALIASES)
def test_replay_into_its_own_traces_is_refused_before_opening(
    teacher_server, api_key, tmp_path, capsys, contained, kind, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", [trace_factory("a"), trace_factory("b")])
    before = traces.read_bytes()
    assert main(replay_cli(teacher_server, traces, _alias(kind, traces))) == 1
    assert "same file as the input" in capsys.readouterr().err
    assert traces.read_bytes() == before
    assert teacher_server.requests == []
    contained()


def test_normalize_into_a_directory_is_refused(tmp_path, contained):
    src = tmp_path / "p.jsonl"
    src.write_text(GOOD[0] + "\n", encoding="utf-8")
    with pytest.raises(UnsafeOutputError, match="is a directory"):
        normalize_jsonl(src, tmp_path)
    contained()


# --------------------------------------------------------------------------- bad lines among good ones

DEEP = "[" * 30_000 + "]" * 30_000
BAD_LINES: dict[str, tuple[bytes, str]] = {
    "invalid JSON": (b'{"prompt": "x", ', "invalid JSON"),
    "non-UTF-8 byte": (GOOD[0].encode()[:40] + b"\xff\xfe" + GOOD[0].encode()[40:], "not UTF-8"),
    "lone high surrogate": (GOOD[0].replace('"trace_id": "', '"trace_id": "\\ud83d', 1).encode(), "lone surrogate"),
    "lone low surrogate in a key": (b'{"\\udc00": 1}', "lone surrogate"),
    "nested 30,000 deep": (DEEP.encode(), "nested too deeply"),
    "nested past max_depth": (json.dumps({"meta": json.loads("[" * 150 + "]" * 150)}).encode(), "nested deeper"),
    "NaN": (GOOD[0].replace('"turn": ', '"turn": NaN, "x": ', 1).encode(), "NaN is not valid JSON"),
    "Infinity": (b'{"chosen": Infinity}', "Infinity is not valid JSON"),
    "huge line": (b'{"prompt": "' + b"x" * 300_000 + b'"}', "longer than max_line_bytes"),
    "missing keys": (b'{"chosen": "only one side"}', "lacks"),
    "newer major schema": (GOOD[0].replace('"schema_version": "1.0"', '"schema_version": "2.0"').encode(), "newer"),
    "garbage schema version": (GOOD[0].replace('"schema_version": "1.0"', '"schema_version": "one"').encode(), "MAJOR"),
    "not an object": (b"[1, 2, 3]", "JSON object"),
    "TRL row with a number as chosen": (b'{"prompt": "p", "chosen": 3, "rejected": "r"}', "chosen is int"),
    "TRL row among records": (b'{"prompt": "p", "chosen": "good answer", "rejected": "bad answer"}', "one format"),
    "blank line": (b"   ", "blank line"),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_normalize_skips_a_bad_line_and_keeps_every_good_one(tmp_path, capsys, contained, kind):
    bad, reason = BAD_LINES[kind]
    src = tmp_path / "p.jsonl"
    src.write_bytes(b"\n".join([g.encode() for g in GOOD[:3]] + [bad] + [g.encode() for g in GOOD[3:]]) + b"\n")
    out = tmp_path / "out.jsonl"
    out.write_text("previous output\n", encoding="utf-8")
    args = ["normalize", str(src), "-o", str(out), "--skip-dj", "--quiet", "--max-line-bytes", "65536"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "line 4: " in err, err
    assert reason in err, err
    assert lines(out) == GOOD  # every good line, in order, byte for byte
    assert main([*args, "--strict"]) == 3
    items = list(read_pairs(src, max_line_bytes=65536))
    errors = [i for i in items if isinstance(i, RecordError)]
    if kind == "blank line":  # the pair reader skips blank lines
        assert errors == []
        assert len(items) == len(GOOD)
    else:
        assert [e.line for e in errors] == [4]
        assert reason in errors[0].reason
        with pytest.raises(RecordError, match="line 4: "):
            list(read_pairs(src, strict=True, max_line_bytes=65536))
    contained()


def test_normalize_without_a_trailing_newline_and_with_a_bom(tmp_path, contained):
    src = tmp_path / "p.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\n".join(GOOD).encode())
    summary = normalize_jsonl(src, tmp_path / "o.jsonl", skip_dj=True)
    assert summary.malformed == []
    assert lines(tmp_path / "o.jsonl") == GOOD
    contained()


TRACE_ATTACKS = {
    "lone surrogate": lambda t: json.dumps(t).replace("List the files", "List \\ud83d the files"),
    "nested 30,000 deep": lambda t: DEEP,
    "non-UTF-8": lambda t: json.dumps(t).replace("List", "L\udcffist"),
    "huge line": lambda t: json.dumps({**t, "meta": {"blob": "y" * 200_000}}),
    "NaN in meta": lambda t: json.dumps(t).replace('"agent_model": "student"', '"agent_model": NaN'),
}


@pytest.mark.parametrize("kind", list(TRACE_ATTACKS))
def test_replay_skips_a_bad_trace_and_replays_the_other_49(
    teacher_server, api_key, tmp_path, capsys, contained, kind, trace_factory
):
    rows: list[Any] = distinct_traces(trace_factory, 50)
    rows[17] = TRACE_ATTACKS[kind](rows[17])
    traces = tmp_path / "t.jsonl"
    traces.write_bytes(
        b"".join((r if isinstance(r, str) else json.dumps(r)).encode("utf-8", "surrogateescape") + b"\n" for r in rows)
    )
    out = tmp_path / "pairs.jsonl"
    assert main(replay_cli(teacher_server, traces, out, "--max-line-bytes", "65536", "--concurrency", "4")) == 0
    err = capsys.readouterr().err
    assert "malformed lines:  1" in err
    assert "line 18: " in err
    pairs = [json.loads(line) for line in lines(out)]
    assert len(pairs) == 49 * 2
    assert "t17" not in {p["trace_id"] for p in pairs}
    contained()


# --------------------------------------------------------------------------- the key never appears


def test_http_200_error_quoting_the_key_never_shows_it(
    teacher_server, api_key, tmp_path, capsys, caplog, contained, trace_factory, jsonl_writer
):
    teacher_server.responder = lambda body: {"error_echo_auth": True, "status": 200}
    traces = jsonl_writer(tmp_path / "t.jsonl", [trace_factory("a")])
    out = tmp_path / "p.jsonl"
    with caplog.at_level(logging.DEBUG):
        assert main(replay_cli(teacher_server, traces, out, "--max-retries", "1")) == 0
    err = capsys.readouterr().err
    assert "invalid key Bearer <secret>" in err  # the failure is reported, redacted
    with pytest.raises(TeacherRetriesExhausted) as info:
        complete(TeacherClient("m", base_url=teacher_server.base_url, api_key_env=KEY_ENV, max_retries=0))
    for text in (err, caplog.text, str(info.value), repr(info.value.last_error), out.read_text()):
        assert api_key not in text
    contained()


def test_escaped_key_inside_a_completion_is_redacted_before_pairs_and_cache(
    teacher_server, api_key, tmp_path, contained, trace_factory, jsonl_writer
):
    teacher_server.responder = lambda body: {"content_echo_auth": True, "status": 200}
    cache = tmp_path / "cache"
    out = tmp_path / "p.jsonl"
    client = TeacherClient("m", base_url=teacher_server.base_url, api_key_env=KEY_ENV, cache_dir=cache)
    replay_jsonl(jsonl_writer(tmp_path / "t.jsonl", [trace_factory("a")]), out, client=client)
    text = out.read_text() + "".join(p.read_text() for p in cache.rglob("*.json"))
    assert "my key is Bearer <secret>" in text
    assert api_key not in text
    contained()


@pytest.mark.parametrize(
    "url", ["http://api.example.com/v1", "http://10.0.0.5:8000/v1", "http://localhost.evil.com/v1"]
)
def test_a_key_over_plain_http_to_another_host_is_refused(api_key, contained, url):
    with pytest.raises(TeacherConfigError, match="plain http://"):
        TeacherClient("m", base_url=url, api_key_env=KEY_ENV)
    for loopback in ("http://127.0.0.1:9/v1", "http://[::1]:9/v1", "http://localhost:9/v1"):
        TeacherClient("m", base_url=loopback, api_key_env=KEY_ENV)
    TeacherClient("m", base_url=url, api_key_env=None)  # no key: nothing to leak
    contained()


def test_url_userinfo_is_sent_as_basic_auth_and_never_shown(teacher_server, tmp_path, caplog, contained):
    teacher_server.script.extend([{"status": 500, "echo_auth": True}] * 2)
    host = teacher_server.base_url.removeprefix("http://")
    client = TeacherClient("m", base_url=f"http://alice:s3cr3t-pw@{host}", api_key_env=None, max_retries=1)
    with caplog.at_level(logging.DEBUG), pytest.raises(TeacherRetriesExhausted) as info:
        complete(client)
    assert teacher_server.requests[0]["headers"]["Authorization"].startswith("Basic ")
    for text in (repr(client), str(info.value), caplog.text, client.chat_url):
        assert "s3cr3t-pw" not in text
        assert "alice:" not in text
    assert "auth was: Basic <secret>" in str(info.value)
    contained()


def test_redirect_to_another_host_is_not_followed(
    teacher_server, api_key, tmp_path, contained, trace_factory, jsonl_writer, make_teacher_server
):
    other = make_teacher_server()
    target = f"{other.base_url}/chat/completions"
    teacher_server.responder = lambda body: {"status": 307, "headers": {"Location": target}, "raw": b""}
    out = tmp_path / "p.jsonl"
    client = TeacherClient("m", base_url=teacher_server.base_url, api_key_env=KEY_ENV)
    with pytest.raises(TeacherHTTPError, match="does not follow redirects") as info:
        replay_jsonl(jsonl_writer(tmp_path / "t.jsonl", [trace_factory("a")]), out, client=client)
    assert other.requests == []  # the key never travelled to the other host
    assert api_key not in str(info.value)
    assert not out.exists()
    contained()


# --------------------------------------------------------------------------- bounded responses


def test_a_dripping_server_is_cut_at_the_deadline(teacher_server, make_client, contained):
    teacher_server.script.append({"message": {"role": "assistant", "content": "slow " * 40}, "drip": 0.05})
    start = time.monotonic()
    with pytest.raises(TeacherRetriesExhausted, match=r"no reply within timeout_s=0\.6"):
        complete(make_client(timeout_s=0.6, max_retries=0))
    assert time.monotonic() - start < 8.0  # cut at 0.6 s; reading it all would take 250 bytes x 0.05 s = 12.5 s
    assert len(teacher_server.requests) == 1  # the dripping reply was the one served
    assert not teacher_server.script
    contained()


@pytest.mark.parametrize(("cap", "error"), [(256 * 1024, TeacherResponseTooLarge), (2**40, TeacherRetriesExhausted)])
def test_a_never_ending_reply_stops_at_the_cap_or_the_deadline(teacher_server, make_client, contained, cap, error):
    teacher_server.script.append({"endless": 4096})
    start = time.monotonic()
    with pytest.raises(error):
        complete(make_client(timeout_s=1.0, max_retries=0, max_response_bytes=cap))
    assert time.monotonic() - start < 30.0  # the reply never ends: any bound proves the stop (margin for load)
    assert len(teacher_server.requests) == 1  # too large is not retried
    contained()


def test_declared_oversize_body_fails_without_reading_or_retrying(teacher_server, make_client, contained):
    teacher_server.script.append({"raw": b"{}", "headers": {"Content-Length": str(10**9)}})
    with pytest.raises(TeacherResponseTooLarge, match="max_response_bytes=1024"):
        complete(make_client(max_response_bytes=1024))
    assert len(teacher_server.requests) == 1
    contained()


def test_a_gzip_bomb_is_stopped_at_the_cap_in_bounded_memory(teacher_server, make_client, contained):
    squeezer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = b"\0" * 2**20
    bomb = b"".join(squeezer.compress(zeros) for _ in range(256)) + squeezer.flush()  # 256 MiB inflated
    assert len(bomb) < 300_000
    teacher_server.script.append({"raw": bomb, "headers": {"Content-Encoding": "gzip"}})
    tracemalloc.start()
    try:
        with pytest.raises(TeacherResponseTooLarge):
            complete(make_client(max_response_bytes=2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak
    assert len(teacher_server.requests) == 1  # the bomb was served once, and too large is not retried
    assert not teacher_server.script
    contained()


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (
            {"raw": b"\x1f\x8b\x08\x00garbage", "headers": {"Content-Encoding": "gzip"}},
            "broken compressed body|ended early",
        ),
        ({"raw": zlib.compress(b'{"choices": []}')[:-6], "headers": {"Content-Encoding": "deflate"}}, "ended early"),
        ({"raw": b"{}", "headers": {"Content-Encoding": "br"}}, "unsupported Content-Encoding"),
        ({"json": {"choices": [{"message": {"role": "assistant", "content": "\ud83d"}}]}}, "lone surrogate"),
        ({"raw": b'{"choices": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"}, "not JSON|nested"),
        ({"raw": b'{"choices": [{"message": {"role": "assistant", "content": "x"}}], "usage": {"n": NaN}}'}, "NaN"),
    ],
    ids=["broken gzip", "truncated deflate", "unknown encoding", "lone surrogate reply", "deep reply", "NaN reply"],
)
def test_unusable_bodies_fail_the_request_not_the_client(teacher_server, make_client, contained, entry, match):
    if "lone surrogate" in match:  # json.dumps writes it as an escape, as a hostile server would
        entry = {"raw": json.dumps(entry["json"]).encode()}
    teacher_server.script.extend([entry, entry])
    with pytest.raises(TeacherRetriesExhausted, match=match):
        complete(make_client(max_retries=1))
    assert len(teacher_server.requests) == 2  # both scripted bodies were served
    assert not teacher_server.script
    assert complete(make_client()).message["content"].startswith("teacher action")  # the next request is fine
    assert len(teacher_server.requests) == 3
    contained()


def test_a_429_storm_fails_each_point_boundedly_and_the_run_finishes(
    teacher_server, api_key, tmp_path, capsys, contained, trace_factory, jsonl_writer
):
    teacher_server.responder = lambda body: {"status": 429, "headers": {"Retry-After": "0"}}
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 4))
    out = tmp_path / "p.jsonl"
    start = time.monotonic()
    assert main(replay_cli(teacher_server, traces, out, "--max-retries", "2", "--strict")) == 3
    assert time.monotonic() - start < 60  # the storm never stops: any bound proves each point gave up
    err = capsys.readouterr().err
    assert "failed points:    8" in err
    assert "HTTP 429" in err
    assert len(teacher_server.requests) == 8 * 3
    assert lines(out) == []
    contained()


# --------------------------------------------------------------------------- cache, interrupts, concurrency


def test_an_unwritable_cache_warns_once_and_keeps_the_paid_replies(
    teacher_server, make_client, tmp_path, caplog, contained, trace_factory, jsonl_writer
):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 3))
    with caplog.at_level(logging.WARNING, logger="crf_replaysim.teacher"):
        summary = replay_jsonl(traces, tmp_path / "p.jsonl", client=make_client(cache_dir=blocker))
    assert summary.pairs_written == 6
    assert summary.failed == []
    assert caplog.text.count("cannot write the response cache") == 1
    contained()


def test_ctrl_c_in_normalize_leaves_the_previous_output_and_no_temp_file(tmp_path, contained):
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(GOOD) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    out.write_text("previous output\n", encoding="utf-8")

    def interrupt(_: int) -> None:
        if len(ticks) == 3:
            raise KeyboardInterrupt
        ticks.append(1)

    ticks: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        normalize_jsonl(src, out, skip_dj=True, progress=interrupt)
    assert out.read_text() == "previous output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "p.jsonl"]
    contained()


def _default_sigint() -> None:
    # A shell's background job (a CI script run with `&`) ignores SIGINT and exec hands that down; the replay
    # under test must see what a terminal's foreground process gets from Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_replay(server: Any, traces: Path, out: Path, cache: Path, key: str) -> subprocess.Popen[str]:
    args = replay_cli(server, traces, out, "--cache-dir", str(cache), "--concurrency", "2")
    return subprocess.Popen(
        [sys.executable, "-m", "crf_replaysim", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, KEY_ENV: key},
        preexec_fn=_default_sigint,  # only a signal disposition: safe after fork beside the server threads
    )


def _wait_for_lines(path: Path, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never reached {n} lines")


def test_ctrl_c_in_replay_keeps_the_old_output_and_resumes_without_paying_twice(
    teacher_server, api_key, tmp_path, contained, trace_factory, jsonl_writer
):
    teacher_server.responder = lambda body: {"sleep": 0.2, "message": {"role": "assistant", "content": "teacher"}}
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 20))
    out, cache = tmp_path / "p.jsonl", tmp_path / "cache"
    out.write_text("previous output\n", encoding="utf-8")
    partial, journal = replay_state_paths(out)
    child = _start_replay(teacher_server, traces, out, cache, api_key)
    _wait_for_lines(journal, 8)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 130, err
    assert "run the same command again to resume" in err
    assert api_key not in err
    assert out.read_text() == "previous output\n"
    paid = len(list(cache.rglob("*.json")))  # replies received (and paid for) before the interrupt
    asked_before = len(teacher_server.requests)
    assert 0 < paid < 40
    rerun = _start_replay(teacher_server, traces, out, cache, api_key)
    _, err = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, err
    assert len(teacher_server.requests) - asked_before == 40 - paid  # nothing answered is asked again
    reference = tmp_path / "reference.jsonl"
    replay_jsonl(traces, reference, client=TeacherClient("org/teacher", base_url=teacher_server.base_url,
                                                         api_key_env=KEY_ENV, cache_dir=cache))  # fmt: skip
    assert out.read_bytes() == reference.read_bytes()
    assert not partial.exists()
    assert not journal.exists()
    contained()


def test_an_interrupted_replay_refuses_other_traces_and_restarts_on_request(
    teacher_server, make_client, tmp_path, contained, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 3))
    out = tmp_path / "p.jsonl"
    seen: list[int] = []

    def interrupt(done: int) -> None:
        seen.append(done)
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replay_jsonl(traces, out, client=make_client(), progress=interrupt)
    assert not out.exists()
    assert replay_state_paths(out)[1].exists()
    other = jsonl_writer(tmp_path / "other.jsonl", [trace_factory("x")])
    with pytest.raises(ReplayStateError, match=r"traces_sha256.*--restart"):
        replay_jsonl(other, out, client=make_client())
    with pytest.raises(ReplayStateError, match="settings"):
        replay_jsonl(traces, out, client=make_client(temperature=0.5))
    resumed = replay_jsonl(traces, out, client=make_client())
    assert (resumed.resumed, resumed.pairs_written) == (3, 6)
    summary = replay_jsonl(other, out, client=make_client(), resume=False)
    assert summary.pairs_written == 2
    assert summary.resumed == 0
    contained()


def test_a_kill_mid_write_is_repaired_on_resume(
    teacher_server, make_client, tmp_path, contained, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 3))
    out = tmp_path / "p.jsonl"

    def interrupt(done: int) -> None:
        if done == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replay_jsonl(traces, out, client=make_client(), progress=interrupt)
    partial, journal = replay_state_paths(out)
    with open(partial, "ab") as fh:  # a pair written, its journal line cut short: the kill came in between
        fh.write(b'{"half": "a line"}\n{"cut')
    with open(journal, "ab") as fh:
        fh.write(b'{"line": 3, "tu')
    summary = replay_jsonl(traces, out, client=make_client())
    assert summary.pairs_written == 6
    assert summary.resumed == 4
    assert [(p["trace_id"], p["turn"]) for p in map(json.loads, lines(out))] == [
        (f"t{i}", t) for i in range(3) for t in (1, 3)
    ]
    contained()


def test_failed_points_are_retried_on_resume_and_land_in_input_order(
    teacher_server, make_client, tmp_path, contained, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 3))
    out = tmp_path / "p.jsonl"
    teacher_server.script.append({"status": 400})  # the first point fails (not retried) ...

    def interrupt(done: int) -> None:
        if done == 4:
            raise KeyboardInterrupt  # ... and the run is interrupted later

    with pytest.raises(KeyboardInterrupt):
        replay_jsonl(traces, out, client=make_client(max_concurrency=1), max_pending=1, progress=interrupt)
    assert not teacher_server.script  # the 400 was served ...
    first = teacher_server.requests[0]["body"]["messages"]
    asked_before_resume = len(teacher_server.requests)
    summary = replay_jsonl(traces, out, client=make_client())
    assert summary.failed == []
    assert summary.pairs_written == 6
    # ... to the first point, asked once before the interruption and once more on resume
    assert [r["body"]["messages"] for r in teacher_server.requests[:asked_before_resume]].count(first) == 1
    assert [r["body"]["messages"] for r in teacher_server.requests[asked_before_resume:]].count(first) == 1
    assert [(p["trace_id"], p["turn"]) for p in map(json.loads, lines(out))][:2] == [("t0", 1), ("t0", 3)]
    contained()


def test_a_second_replay_into_the_same_output_is_refused(
    teacher_server, api_key, tmp_path, contained, trace_factory, jsonl_writer
):
    teacher_server.responder = lambda body: {"sleep": 0.1, "message": {"role": "assistant", "content": "teacher"}}
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 10))
    out, cache = tmp_path / "p.jsonl", tmp_path / "cache"
    first = _start_replay(teacher_server, traces, out, cache, api_key)
    try:
        _wait_for_lines(replay_state_paths(out)[1], 2)
        client = TeacherClient("org/teacher", base_url=teacher_server.base_url, api_key_env=KEY_ENV)
        with pytest.raises(ReplayBusyError, match="another crf-replaysim replay is writing"):
            replay_jsonl(traces, out, client=client)
    finally:
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert len(lines(out)) == 20
    contained()


def test_concurrent_replays_sharing_a_cache_do_not_collide(
    teacher_server, api_key, tmp_path, contained, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 15))
    cache = tmp_path / "cache"
    runs = [_start_replay(teacher_server, traces, tmp_path / f"p{i}.jsonl", cache, api_key) for i in range(3)]
    for run in runs:
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
    outputs = {(tmp_path / f"p{i}.jsonl").read_bytes() for i in range(3)}
    assert len(outputs) == 1
    assert len(outputs.pop().splitlines()) == 30
    entries = list(cache.rglob("*"))
    assert not [p for p in entries if p.name.startswith(".")]  # no temporary file left behind
    assert all(json.loads(p.read_text())["response"] for p in entries if p.is_file())
    contained()


# --------------------------------------------------------------------------- round two: hostile JSON inside values

DEEP_ARGS = "[" * 5_000 + "]" * 5_000  # valid JSON, nested past every recursion limit


def tool_reply(arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "k1", "type": "function", "function": {"name": "run_command", "arguments": arguments}}]}  # fmt: skip


def test_deep_tool_arguments_from_the_teacher_fail_one_point_and_are_paid_once(
    teacher_server, make_client, tmp_path, contained, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 2))
    hostile = "List the files of t1."
    teacher_server.responder = lambda body: (
        tool_reply(DEEP_ARGS) if body["messages"][0]["content"] == hostile and len(body["messages"]) == 1
        else {"role": "assistant", "content": f"teacher action after {len(body['messages'])} messages"}
    )  # fmt: skip
    out, cache = tmp_path / "p.jsonl", tmp_path / "cache"
    summary = replay_jsonl(traces, out, client=make_client(cache_dir=cache))
    assert [(tid, turn) for _, tid, turn, _ in summary.failed] == [("t1", 1)]
    assert "nested too deeply" in summary.failed[0][3]
    assert summary.pairs_written == 3
    assert len(teacher_server.requests) == 4
    assert summary.prompt_tokens == 40  # the hostile reply was paid for, and is counted
    rerun = replay_jsonl(traces, tmp_path / "again.jsonl", client=make_client(cache_dir=cache))
    assert len(teacher_server.requests) == 4  # nothing paid twice: the same failure, from the cache
    assert (rerun.cache_hits, len(rerun.failed), rerun.pairs_written) == (4, 1, 3)
    contained()


@pytest.mark.parametrize("chosen", ["teacher", "recorded"])
def test_deep_tool_arguments_in_a_recorded_trace_cost_at_most_their_point(
    teacher_server, make_client, tmp_path, contained, trace_factory, jsonl_writer, chosen
):
    rows = distinct_traces(trace_factory, 3)
    rows[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] = DEEP_ARGS
    traces = jsonl_writer(tmp_path / "t.jsonl", rows)
    out = tmp_path / "p.jsonl"
    summary = replay_jsonl(traces, out, client=make_client(), chosen=chosen)
    assert summary.malformed == []
    if chosen == "teacher":  # the broken call is a fine negative example
        assert (summary.pairs_written, summary.failed) == (6, [])
        assert len(teacher_server.requests) == 6
    else:  # it cannot be preferred: refused before anything is paid for it
        assert [(tid, turn) for _, tid, turn, _ in summary.failed] == [("t1", 1)]
        assert "checked before asking" in summary.failed[0][3]
        assert len(teacher_server.requests) == 5
    assert [e for e in read_pairs(out) if isinstance(e, RecordError)] == []
    contained()


def _trl_row(i: int, tools: Any) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"Fix bug number {i} in the parser module."}],
            "chosen": [{"role": "assistant", "content": f"I will read parser.py first and fix bug {i}."}],
            "rejected": [{"role": "assistant", "content": f"Bug {i} is not worth fixing at all today."}],
            "tools": tools}  # fmt: skip


@pytest.mark.parametrize("command", ["normalize", "validate"])
def test_a_trl_row_whose_tools_string_is_5000_deep_is_reported_and_the_rest_written(
    tmp_path, capsys, contained, command
):
    good_tools = json.dumps([{"type": "function", "function": {"name": "read_file", "parameters": {}}}])
    rows = [_trl_row(i, good_tools) for i in range(5)]
    rows[2]["tools"] = DEEP_ARGS
    src = tmp_path / "trl.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["normalize", str(src), str(out), "--skip-dj"] if command == "normalize" else ["validate", str(src)]
    assert main([*args, "--quiet"]) == (0 if command == "normalize" else 3)
    err = capsys.readouterr().err
    assert "line 3: " in err, err
    assert "nested too deeply" in err, err
    if command == "normalize":
        assert len(lines(out)) == 4
    contained()


NOT_AN_OBJECT = {"cut short": '{"command": "ls"', "null": "null", "array": "[1,2]", "empty": ""}


@pytest.mark.parametrize("kind", list(NOT_AN_OBJECT))
def test_tool_arguments_that_are_not_an_object_are_never_chosen(
    teacher_server, make_client, tmp_path, capsys, contained, trace_factory, jsonl_writer, kind
):
    arguments = NOT_AN_OBJECT[kind]
    teacher_server.responder = lambda body: tool_reply(arguments)
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 2))
    out = tmp_path / "p.jsonl"
    summary = replay_jsonl(traces, out, client=make_client())
    assert summary.pairs_written == 0
    assert len(summary.failed) == 4
    assert all("chosen_messages[0].tool_calls[0].function.arguments" in why for *_, why in summary.failed)
    assert len(teacher_server.requests) == 4  # accepted by the client, refused as a pair: never retried
    # Chosen the other way round, the same calls are fine negatives.
    kept = replay_jsonl(traces, tmp_path / "r.jsonl", client=make_client(), chosen="recorded")
    assert (kept.pairs_written, kept.failed) == (4, [])
    # A pair file written by something else that prefers such a call is invalid.
    record = json.loads(lines(tmp_path / "r.jsonl")[0])
    record["chosen_messages"], record["rejected_messages"] = record["rejected_messages"], record["chosen_messages"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD[0] + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    assert main(["validate", str(bad), "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "valid records:   1" in err
    assert "line 2: chosen_messages[0].tool_calls[0].function.arguments" in err
    contained()


# --------------------------------------------------------------------------- round two: runs that are interrupted


def test_a_torn_journal_then_a_second_interruption_still_resumes_without_paying_again(
    teacher_server, make_client, tmp_path, contained, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 4))
    out, cache = tmp_path / "p.jsonl", tmp_path / "cache"
    partial, journal = replay_state_paths(out)

    def stop_at(n: int) -> Any:
        def progress(done: int) -> None:
            if done == n:
                raise KeyboardInterrupt

        return progress

    def run(progress: Any = None) -> Any:
        client = make_client(cache_dir=cache, max_concurrency=1)
        return replay_jsonl(traces, out, client=client, max_pending=1, progress=progress)

    with pytest.raises(KeyboardInterrupt):
        run(stop_at(3))
    with open(journal, "ab") as fh:  # the kill came mid-line
        fh.write(b'{"line": 2, "tu')
    with open(partial, "ab") as fh:
        fh.write(b'{"cut')
    with pytest.raises(KeyboardInterrupt):
        run(stop_at(6))  # resumed, then interrupted again: it appends after the torn fragment
    assert all(line.endswith(b"}") for line in journal.read_bytes().splitlines())
    summary = run()
    assert (summary.resumed, summary.pairs_written, summary.failed) == (6, 8, [])
    assert len(teacher_server.requests) == 8  # each of the 8 points paid for once
    assert [(p["trace_id"], p["turn"]) for p in map(json.loads, lines(out))] == [
        (f"t{i}", t) for i in range(4) for t in (1, 3)
    ]
    contained()


def test_a_billed_reply_that_fails_validation_is_paid_once_and_counted(
    teacher_server, api_key, tmp_path, capsys, contained, trace_factory, jsonl_writer
):
    teacher_server.responder = lambda body: {"role": "assistant", "content": ""}  # 200, billed, unusable
    traces = jsonl_writer(tmp_path / "t.jsonl", distinct_traces(trace_factory, 2))
    out, cache = tmp_path / "p.jsonl", tmp_path / "cache"
    assert main(replay_cli(teacher_server, traces, out, "--cache-dir", str(cache))) == 0
    err = capsys.readouterr().err
    assert len(teacher_server.requests) == 4  # not 4 x 6
    assert "failed points:    4" in err
    assert "teacher tokens:   prompt 40, completion 20 (paid this run)" in err
    assert "retries 0" in err
    assert main(replay_cli(teacher_server, traces, tmp_path / "again.jsonl", "--cache-dir", str(cache))) == 0
    assert len(teacher_server.requests) == 4
    assert "teacher tokens:   prompt 0, completion 0" in capsys.readouterr().err
    contained()


# --------------------------------------------------------------------------- round two: credentials and options


def test_a_token_given_as_the_url_username_alone_is_redacted(teacher_server, tmp_path, caplog, contained):
    token = "tok-" + os.urandom(12).hex()
    teacher_server.script.extend([{"status": 500, "raw": f"unknown user {token}".encode()}] * 2)
    host = teacher_server.base_url.removeprefix("http://")
    client = TeacherClient("m", base_url=f"http://{token}@{host}", api_key_env=None, max_retries=1,
                           backoff_base_s=0.01, backoff_max_s=0.02)  # fmt: skip
    with caplog.at_level(logging.DEBUG), pytest.raises(TeacherRetriesExhausted) as info:
        complete(client)
    assert "unknown user <secret>" in str(info.value)
    assert "retrying" in caplog.text
    for text in (repr(client), str(info.value), repr(info.value.last_error), caplog.text, client.chat_url):
        assert token not in text
    assert teacher_server.requests[0]["headers"]["Authorization"].startswith("Basic ")
    contained()


@pytest.mark.parametrize(
    "url", ["http://evil.localhost:9/v1", "http://a.b.localhost:9/v1", "http://localhost.:9/v1.evil.com"]
)
def test_a_localhost_lookalike_is_not_loopback(api_key, contained, url):
    if url.endswith(".evil.com"):  # a path, not a host: this one is localhost itself
        TeacherClient("m", base_url=url, api_key_env=KEY_ENV)
    else:
        with pytest.raises(TeacherConfigError, match="plain http://"):
            TeacherClient("m", base_url=url, api_key_env=KEY_ENV)
    contained()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "option", ["timeout_s", "connect_timeout_s", "backoff_base_s", "backoff_max_s", "max_retry_after_s", "temperature"]
)
def test_non_finite_numeric_options_are_refused(api_key, contained, option, value):
    with pytest.raises(TeacherConfigError, match=f"{option} must be a finite number"):
        TeacherClient("m", base_url="http://127.0.0.1:9/v1", api_key_env=KEY_ENV, **{option: value})
    contained()


@pytest.mark.parametrize("flag", ["--timeout", "--backoff-base", "--backoff-max", "--temperature"])
def test_non_finite_numbers_on_the_command_line_are_refused(teacher_server, api_key, tmp_path, capsys, contained, flag):
    traces = tmp_path / "t.jsonl"
    traces.write_text("{}\n", encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        main([*replay_cli(teacher_server, traces, tmp_path / "p.jsonl"), flag, "nan"])
    assert info.value.code == 2
    assert "'nan' is not a finite number" in capsys.readouterr().err
    assert teacher_server.requests == []
    contained()


@pytest.mark.parametrize(
    "bad", ["\u200b", "\x01", "\n", "\x7f", " ", "\u00e9"], ids=["zero-width", "SOH", "LF", "DEL", "space", "e-acute"]
)
def test_a_key_that_cannot_be_a_header_fails_before_any_request(
    teacher_server, tmp_path, capsys, monkeypatch, contained, trace_factory, jsonl_writer, bad
):
    key = "sk-or-" + os.urandom(8).hex()
    monkeypatch.setenv(KEY_ENV, key[:10] + bad + key[10:])
    traces = jsonl_writer(tmp_path / "t.jsonl", [trace_factory("a")])
    assert main(replay_cli(teacher_server, traces, tmp_path / "p.jsonl")) == 1
    err = capsys.readouterr().err
    assert f"character 11 is U+{ord(bad):04X}, not printable ASCII" in err
    assert key[:10] not in err
    assert key[10:] not in err
    assert teacher_server.requests == []
    contained()


def _nest(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"x": value}
    return value


@pytest.mark.parametrize("where", ["meta", "tools"])
def test_trace_meta_or_tools_nested_to_the_limit_are_refused_before_paying(
    teacher_server, make_client, tmp_path, contained, trace_factory, jsonl_writer, where
):
    rows = distinct_traces(trace_factory, 3)
    if where == "meta":
        rows[1]["meta"] = _nest(98)  # the trace line is 100 deep: readable, but one level deeper in a pair's meta
    else:
        rows[1]["tools"] = [{"type": "function", "function": {"name": "f", "parameters": _nest(95)}}]
    traces = jsonl_writer(tmp_path / "t.jsonl", rows)
    out = tmp_path / "p.jsonl"
    summary = replay_jsonl(traces, out, client=make_client())
    assert summary.malformed == []  # the trace itself is within the limit
    assert sorted((tid, turn) for _, tid, turn, _ in summary.failed) == [("t1", 1), ("t1", 3)]
    assert all("nested deeper than 100" in why for *_, why in summary.failed)
    assert len(teacher_server.requests) == 4  # nothing paid for the points that could not be written
    assert summary.pairs_written == 4
    assert [e for e in read_pairs(out) if isinstance(e, RecordError)] == []
    contained()


# --------------------------------------------------------------------------- round two: the default recipe keeps code

STDLIB_MODULES = ["argparse", "ast", "bisect", "calendar", "configparser", "csv", "dataclasses", "difflib", "enum",
                  "fractions", "functools", "gettext", "glob", "gzip", "heapq", "inspect", "ipaddress", "json.decoder",
                  "json.encoder", "locale", "logging", "mimetypes", "netrc", "numbers", "operator", "optparse",
                  "pathlib", "pprint", "queue", "quopri", "random", "sched", "secrets", "selectors", "shlex", "shutil",
                  "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback",
                  "types", "typing", "uuid", "warnings", "weakref", "zipfile"]  # fmt: skip
MUTATIONS = [("==", "!="), (" < ", " <= "), ("+ 1", "- 1"), ("return ", "return not "), (" and ", " or "),
             ("True", "False"), ("None", "0")]  # fmt: skip


def stdlib_functions(n: int) -> list[tuple[str, str]]:
    """``n`` distinct functions and methods of Python's own standard library (its source files at test time),
    as ``(qualified name, dedented source)``, chosen by a seeded draw."""
    import ast
    import importlib.util
    import random
    import textwrap

    found: dict[str, str] = {}
    for module in STDLIB_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            continue  # frozen or built in
        source = Path(spec.origin).read_text(encoding="utf-8")
        source_lines = source.splitlines(keepends=True)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                code = textwrap.dedent("".join(source_lines[node.lineno - 1 : node.end_lineno]))
                if len(code) <= 4000:
                    found.setdefault(code, f"{module}.{node.name}")
    assert len(found) >= n, len(found)
    picked = random.Random(0).sample(sorted(found.items()), n)
    return [(name, code) for code, name in picked]


def mutated(code: str, seed: int) -> str:
    """A plausible wrong version of ``code``: one operator or constant flipped, else its last line replaced."""
    import random

    for old, new in random.Random(seed).sample(MUTATIONS, len(MUTATIONS)):
        if old in code:
            return code.replace(old, new, 1)
    return "\n".join([*code.splitlines()[:-1], "    pass"])


JUNK = {
    "punctuation run": "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    "emoji flood": "🎉🎉🎉🎉🎉🎉🎉 wow 🎉🎉🎉🎉🎉🎉🎉 so 🎉🎉🎉🎉🎉🎉 cool 🎉🎉🎉🎉🎉",
    "digit run": "1234 5678 9012 3456 7890 1234 5678 9012",
    "symbol soup": "$$$ ### @@@ %%% ^^^ &&& *** ((( ))) ~~~ ||| <<< >>>",
    "binary": "".join(map(chr, range(0x80, 0x100))) * 2,
    "looping": "I will now run the tests. " * 30,
    "too short": "ok.",
}


def test_the_default_recipe_keeps_98_percent_of_real_code_and_still_drops_junk(tmp_path, capsys, contained):
    functions = stdlib_functions(500)
    rows = [{"prompt": f"Write {name} as in CPython's standard library (#{i}).", "chosen": code,
             "rejected": mutated(code, i)} for i, (name, code) in enumerate(functions)]  # fmt: skip
    rows += [{"prompt": f"Junk: {kind}", "chosen": text, "rejected": "def f(x):\n    return x + 1\n"}
             for kind, text in JUNK.items()]  # fmt: skip
    src = tmp_path / "stdlib.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "kept.jsonl"
    assert main(["normalize", str(src), str(out), "--output-format", "trl"]) == 0
    err = capsys.readouterr().err
    assert f"normalize: {len(rows)} records" in err  # the progress line counts records
    kept = {row["prompt"] for row in map(json.loads, lines(out))}
    kept_code = sum(row["prompt"] in kept for row in rows[: len(functions)])
    assert kept_code >= 490, f"kept {kept_code} of 500 functions\n{err}"  # >= 98 %
    assert [kind for kind in JUNK if f"Junk: {kind}" in kept] == []
    contained()
