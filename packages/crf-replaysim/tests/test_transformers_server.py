"""Replay through a real OpenAI-compatible server nobody here wrote: `transformers serve`, offline, on CPU.

The server is Hugging Face's own (``transformers serve``, FastAPI + uvicorn, from ``transformers[serving]``); the
model is a tiny Qwen2 the test writes to disk (no hub download): a byte-level tokenizer, a Qwen-style chat
template, and weights set by hand so that greedy decoding always answers with one tool call,
``<tool_call>{"name": "run_command", "arguments": {"command": "ls"}}</tool_call>``, which the server's own Qwen
response parser turns into an OpenAI ``tool_calls`` entry. Every request therefore exercises the server's real
request validation, chat templating, generation, tool-call parsing, usage accounting and error bodies.

Run with ``nox -s transformers_server`` (tagged ci), which installs the ``serve`` dependency group and sets
``CRF_REQUIRE_TRANSFORMERS_SERVE=1`` so that a missing package fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
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

pytestmark = pytest.mark.openai_server

_REQUIRED = os.environ.get("CRF_REQUIRE_TRANSFORMERS_SERVE") == "1"
_MISSING = [m for m in ("torch", "transformers", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
_SERVE_FROM = (5, 24)  # the `serve` group's floor: its server, tool-call parser and error bodies are what is tested
if not _MISSING and tuple(int(p) for p in importlib.metadata.version("transformers").split(".")[:2]) < _SERVE_FROM:
    _MISSING.append("transformers>=5.24")
if _MISSING and not _REQUIRED:
    pytest.skip(f"needs {', '.join(_MISSING)}: run `nox -s transformers_server`", allow_module_level=True)

CALL = {"name": "run_command", "arguments": {"command": "ls"}}
TOOLS = [{"type": "function", "function": {"name": "run_command", "description": "Run a shell command.",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]  # fmt: skip
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{% elif message.content %}{% for part in message.content %}"
    "{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    '{%- for call in message.tool_calls or [] %}\n<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}"
    "{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tool_call_model(out: Path) -> None:
    """Write the tiny Qwen2 "tool-call machine" to ``out`` (with numpy and tokenizers: no torch import here).

    Attention and MLP weights are zero, so the residual stream at each position is the token's embedding and
    the next token depends on the current one only. Four tokens get their own direction: the newline that
    ends the generation prompt, then three added tokens (``<tool_call>\\n``, the call's JSON, ``\\n</tool_call>``)
    each point at the next, and the last at ``<|im_end|>`` (end of turn), as does every other token.
    """
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    pieces = ["<tool_call>\n", json.dumps(CALL), "\n</tool_call>"]
    tokenizer.add_tokens(pieces)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    pad, eos = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}))
    chain = [tokenizer.token_to_id("Ċ"), *(tokenizer.token_to_id(p) for p in pieces)]  # Ċ: the byte "\n"
    vocab, hidden = tokenizer.get_vocab_size(), 8
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": hidden, "num_hidden_layers": 1, "num_attention_heads": 1,
              "num_key_value_heads": 1, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None, "dtype": "float32"}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "eos_token_id": eos, "pad_token_id": pad})
    )
    embed, head = np.zeros((vocab, hidden), np.float32), np.zeros((vocab, hidden), np.float32)
    embed[:, 0] = 1.0  # direction 0: "end the turn"
    head[eos, 0] = 10.0
    for k, token in enumerate(chain, start=1):
        embed[token] = 0.0
        embed[token, k] = 1.0
        head[chain[k] if k < len(chain) else eos, k] = 10.0
    square, ones = np.zeros((hidden, hidden), np.float32), np.ones(hidden, np.float32)
    layer = {f"self_attn.{p}_proj.weight": square for p in "qkvo"}
    layer |= {f"self_attn.{p}_proj.bias": np.zeros(hidden, np.float32) for p in "qkv"}
    layer |= {f"mlp.{p}_proj.weight": square for p in ("gate", "up", "down")}
    layer |= {"input_layernorm.weight": ones, "post_attention_layernorm.weight": ones}
    weights = {f"model.layers.0.{name}": value for name, value in layer.items()}
    weights |= {"model.embed_tokens.weight": embed, "model.norm.weight": ones, "lm_head.weight": head}
    save_file({name: value.copy() for name, value in weights.items()}, str(out / "model.safetensors"), {"format": "pt"})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``transformers serve`` pinned to the tiny model, on 127.0.0.1, offline; stopped at the end of the module."""
    model_dir = tmp_path_factory.mktemp("tiny-qwen2-tool-caller")
    build_tool_call_model(model_dir)
    port = _free_port()
    cli = Path(sys.executable).with_name("transformers")
    command = [str(cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"transformers serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("transformers serve did not answer within 120 s")
            time.sleep(0.5)
        yield {"base_url": base_url, "model": str(model_dir)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def trace(trace_id: str, task: str) -> dict[str, Any]:
    """Two decision points: a tool call (the model's own answer, so identical) and a final text answer."""
    return {
        "trace_id": trace_id,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": task},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "run_command", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
            {"role": "assistant", "content": "There are two files: a.py and b.py."},
        ],
    }  # fmt: skip


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    path = tmp_path / "traces.jsonl"
    rows = [trace("list-1", "List the files."), trace("list-2", "What is in this directory?")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def replay_args(server: dict[str, str], traces: Path, out: Path, *extra: str) -> list[str]:
    return ["replay", str(traces), str(out), "--model", server["model"], "--base-url", server["base_url"],
            "--no-api-key", "--max-tokens", "16", "--timeout", "60", "--backoff-base", "0.05", "--backoff-max", "0.2",
            "--quiet", *extra]  # fmt: skip


def test_replay_gets_real_tool_calls_and_usage_and_a_rerun_is_cached(server, traces, tmp_path, capsys):
    out, cache = tmp_path / "pairs.jsonl", tmp_path / "cache"
    args = replay_args(server, traces, out, "--cache-dir", str(cache), "--strict")
    assert main(args) == 0
    err = capsys.readouterr().err
    # Turn 1: the server's tool call equals the recorded one (identical, skipped); turn 3: it differs.
    assert "identical (teacher == recorded, skipped unless --keep-identical): 2" in err
    assert "pairs written:    2" in err
    assert "teacher tokens:   prompt 0," not in err  # the server's usage was counted
    pairs = [p for p in read_pairs(out, strict=True) if not isinstance(p, RecordError)]
    assert [(p.pair.trace_id, p.pair.turn) for p in pairs] == [("list-1", 3), ("list-2", 3)]
    for loaded in pairs:
        (teacher,) = loaded.pair.chosen_messages
        (call,) = teacher["tool_calls"]
        assert call["function"]["name"] == "run_command"
        assert json.loads(call["function"]["arguments"]) == CALL["arguments"]
        meta = loaded.pair.meta
        assert meta["teacher_finish_reason"] == "tool_calls"
        assert meta["teacher_usage"]["prompt_tokens"] > 0
        assert meta["teacher_usage"]["completion_tokens"] == 4  # the call's three tokens and the end of turn
        assert meta["teacher_reply_model"] == server["model"]
    assert main(args) == 0  # answered from the cache: the server is not asked again
    err = capsys.readouterr().err
    assert "teacher requests: 0 (cache hits 4" in err
    assert "teacher tokens:   prompt 0, completion 0" in err


def test_the_servers_own_error_body_fails_each_point_and_the_run_completes(server, traces, tmp_path, capsys):
    out = tmp_path / "pairs.jsonl"
    args = replay_args(server, traces, out, "--max-retries", "0")
    args[args.index("--model") + 1] = "someone/else"
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "failed points:    4" in err
    assert "HTTP 400" in err
    assert "Server is pinned to" in err  # the server's own words, from its JSON error body
    assert out.read_text() == ""


def test_the_python_api_against_the_server(server):
    client = TeacherClient(server["model"], base_url=server["base_url"], api_key_env=None, max_tokens=16)

    async def go() -> Any:
        try:
            return await client.complete(trace("x", "List the files.")["messages"][:1], TOOLS)
        finally:
            await client.aclose()

    reply = asyncio.run(go())
    assert reply.finish_reason == "tool_calls"
    assert reply.message["tool_calls"][0]["function"]["name"] == "run_command"
    assert reply.usage is not None
    assert reply.usage["total_tokens"] == reply.usage["prompt_tokens"] + reply.usage["completion_tokens"]
    assert client.stats.prompt_tokens == reply.usage["prompt_tokens"]
