"""Shared fixtures: a scripted OpenAI-compatible teacher on 127.0.0.1 and a secret API key.

``ScriptedTeacher`` is a real HTTP server (``http.server`` in a thread). Each request takes the
next entry of ``script`` if any, else asks ``responder(body)`` for the assistant message. A
script entry is a dict with any of:

- ``sleep``: seconds to wait before answering (interrupted when the server stops);
- ``status`` (default 200), ``headers``;
- ``json``: a body to send as JSON, or ``raw``: bytes sent as is, or ``message``: an assistant
  message wrapped in a chat-completions body; ``echo_auth``: put the Authorization header in
  the body (a misbehaving server, for redaction tests);
- ``error_echo_auth`` / ``content_echo_auth``: a JSON error object / a completion quoting the
  Authorization header (the latter \\u-escaped);
- ``gzip``: send the body gzip-compressed (``Content-Encoding: gzip``);
- ``drip``: seconds between bytes: the body (Content-Length announced) is sent one byte at a time;
- ``endless``: stream chunks of ``endless`` bytes forever (chunked encoding), stopping by itself after
  ``ENDLESS_LIMIT_S`` or when the client hangs up.

The server records every request (path, headers, JSON body, arrival time) and the largest
number of requests it was handling at once.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``CRF_REQUIRE_DATA_JUICER=1`` (``nox -s dj``) a missing data-juicer is an error, not a skip: that session
    exists to run the tests that skip elsewhere, and must not pass with none of them run."""
    if os.environ.get("CRF_REQUIRE_DATA_JUICER") == "1" and importlib.util.find_spec("data_juicer") is None:
        raise pytest.UsageError(
            "CRF_REQUIRE_DATA_JUICER=1 but data_juicer is not importable: install it (nox -s dj provisions it) "
            "or unset CRF_REQUIRE_DATA_JUICER"
        )


KEY_ENV = "CRF_REPLAYSIM_TEST_KEY"
ENDLESS_LIMIT_S = 30.0  # a never-ending reply still ends, so a broken test cannot hang the run


def completion_body(message: dict[str, Any], model: str = "scripted-teacher") -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def default_responder(body: dict[str, Any]) -> dict[str, Any]:
    """A deterministic teacher: names how many messages it saw (never equal to a recorded action)."""
    return {"role": "assistant", "content": f"teacher action after {len(body['messages'])} messages"}


class ScriptedTeacher:
    def __init__(self) -> None:
        self.script: deque[dict[str, Any]] = deque()
        self.responder: Callable[[dict[str, Any]], dict[str, Any] | dict[str, Any]] = default_responder
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def start(self) -> ScriptedTeacher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _next_entry(self, body: Any) -> dict[str, Any]:
        with self._lock:
            if self.script:
                return self.script.popleft()
        answer = self.responder(body)
        if "status" in answer or "raw" in answer or "json" in answer or "sleep" in answer:
            return answer  # the responder returned a script entry
        return {"message": answer}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        teacher = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                with teacher._lock:
                    teacher.in_flight += 1
                    teacher.max_in_flight = max(teacher.max_in_flight, teacher.in_flight)
                try:
                    self._answer()
                finally:
                    with teacher._lock:
                        teacher.in_flight -= 1

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                with teacher._lock:
                    teacher.requests.append(
                        {"path": self.path, "headers": dict(self.headers.items()), "body": body, "t": time.monotonic()}
                    )
                if self.path != "/v1/chat/completions":
                    self._send(404, b'{"error": {"message": "no such route"}}', {})
                    return
                entry = teacher._next_entry(body)
                if entry.get("sleep"):
                    teacher.stopping.wait(entry["sleep"])
                status = entry.get("status", 200)
                if "raw" in entry:
                    payload = entry["raw"]
                elif "json" in entry:
                    payload = json.dumps(entry["json"]).encode()
                elif "message" in entry:
                    payload = json.dumps(completion_body(entry["message"])).encode()
                else:
                    payload = json.dumps({"error": {"message": f"scripted status {status}", "code": status}}).encode()
                auth = self.headers.get("Authorization", "")
                if entry.get("echo_auth"):
                    payload += b" auth was: " + auth.encode()
                if entry.get("error_echo_auth"):  # HTTP 200 carrying an error that quotes the key
                    payload = json.dumps({"error": {"message": f"invalid key {auth}"}}).encode()
                if entry.get("content_echo_auth"):  # a completion whose text holds the key, \u-escaped
                    escaped = "".join(f"\\u{ord(c):04x}" for c in auth)
                    payload = json.dumps(completion_body({"role": "assistant", "content": "KEY"})).encode()
                    payload = payload.replace(b"KEY", f"my key is {escaped}".encode())
                headers = dict(entry.get("headers", {}))
                if entry.get("gzip"):
                    payload = gzip.compress(payload)
                    headers["Content-Encoding"] = "gzip"
                if entry.get("endless"):
                    self._send_endless(status, int(entry["endless"]), headers)
                else:
                    self._send(status, payload, headers, drip=entry.get("drip"))

            def _send(self, status: int, payload: bytes, headers: dict[str, str], drip: float | None = None) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    if "Content-Length" not in headers:
                        self.send_header("Content-Length", str(len(payload)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    if drip is None:
                        self.wfile.write(payload)
                        return
                    for i in range(len(payload)):
                        if teacher.stopping.wait(drip):
                            return
                        self.wfile.write(payload[i : i + 1])
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def _send_endless(self, status: int, size: int, headers: dict[str, str]) -> None:
                chunk = b"%x\r\n" % size + b" " * size + b"\r\n"
                deadline = time.monotonic() + ENDLESS_LIMIT_S
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(b"1\r\n[\r\n")
                    while time.monotonic() < deadline and not teacher.stopping.is_set():
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        time.sleep(0.001)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        return Handler


@pytest.fixture
def teacher_server() -> Iterator[ScriptedTeacher]:
    server = ScriptedTeacher().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_teacher_server() -> Iterator[Callable[[], ScriptedTeacher]]:
    """Start more scripted servers (a second host for redirect tests); all stop at teardown."""
    started: list[ScriptedTeacher] = []

    def make() -> ScriptedTeacher:
        started.append(ScriptedTeacher().start())
        return started[-1]

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A random secret in ``$CRF_REPLAYSIM_TEST_KEY``."""
    key = "sk-or-test-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_ENV, key)
    return key


@pytest.fixture
def make_client(teacher_server: ScriptedTeacher, api_key: str) -> Callable[..., Any]:
    """Build a ``TeacherClient`` pointed at the scripted server with fast retries."""
    from crf_replaysim.teacher import TeacherClient

    def make(**kwargs: Any) -> TeacherClient:
        options: dict[str, Any] = {
            "base_url": teacher_server.base_url,
            "api_key_env": KEY_ENV,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "timeout_s": 5.0,
            "seed": 0,
        }
        options.update(kwargs)
        return TeacherClient(options.pop("model", "scripted-teacher"), **options)

    return make


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write rows (dicts are JSON-encoded, strings written verbatim) one per line."""
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


@pytest.fixture
def jsonl_writer() -> Callable[[Path, list[Any]], Path]:
    return write_jsonl


def minimal_trace(trace_id: str = "t-1") -> dict[str, Any]:
    """A two-decision trace: a tool call, its result, then a final answer."""
    return {
        "trace_id": trace_id,
        "messages": [
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "run_command", "arguments": '{"command": "ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
            {"role": "assistant", "content": "There are two files: a.py and b.py."},
        ],
        "meta": {"agent_model": "student"},
    }


@pytest.fixture
def trace_factory() -> Callable[[str], dict[str, Any]]:
    return minimal_trace


# --------------------------------------------------------------------------- adversarial tally

_TALLY = {"tried": 0, "contained": 0}


@pytest.fixture
def contained() -> Iterator[Callable[[], None]]:
    """For adversarial cases: counts the case as tried; the test calls ``contained()`` once its assertions
    (attack contained, good data kept) have passed. The totals are printed at the end of the run."""
    _TALLY["tried"] += 1
    done: list[bool] = []
    yield lambda: done.append(True)
    _TALLY["contained"] += bool(done)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _TALLY["tried"]:
        terminalreporter.write_line(
            f"crf-replaysim adversarial suite: {_TALLY['tried']} attacks or bad inputs tried, "
            f"{_TALLY['contained']} contained with the good data kept"
        )
