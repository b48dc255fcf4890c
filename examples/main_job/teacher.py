"""Trace replay for the trace-replay DPO channel: the shipped weak-student traces against a teacher.

By default the teacher is a local OpenAI-compatible endpoint on 127.0.0.1 that answers each *train*
task's prompt with its reference solution (it is built from the train tasks only, so it cannot leak a
held-out answer); ``--teacher-url`` replays against a real one. crf-replaysim turns each decision
point into a pair (teacher's answer chosen, recorded answer rejected) and ``DJNormalizer`` normalises
them with ``data/coding_recipe.yaml``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

from main_job.tasks import DATA, CodingTask

__all__ = ["build_trace_pairs", "oracle_teacher"]


class _OracleHandler(BaseHTTPRequestHandler):
    solutions: ClassVar[dict[str, str]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        prompt = next((m.get("content") for m in reversed(body.get("messages", [])) if m.get("role") == "user"), "")
        answer = self.solutions.get(prompt)
        if answer is None:
            self._reply(404, {"error": {"code": 404, "message": "unknown task"}})
            return
        message = {"role": "assistant", "content": answer}
        self._reply(
            200,
            {
                "id": "oracle",
                "object": "chat.completion",
                "model": "reference-solutions",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            },
        )

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # keep the job's output readable
        pass


@contextmanager
def oracle_teacher(tasks: Sequence[CodingTask]) -> Iterator[str]:
    """A local OpenAI-compatible teacher on 127.0.0.1 answering each of ``tasks`` with its reference solution."""
    handler = type("Oracle", (_OracleHandler,), {"solutions": {t.prompt: t.solution for t in tasks}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def build_trace_pairs(
    workdir: Path,
    train: Sequence[CodingTask],
    teacher_url: str | None,
    teacher_model: str,
    traces: Path = DATA / "traces.jsonl",
) -> Path:
    """Replay ``traces`` against the teacher and normalise the pairs; returns the normalised pair file."""
    from crf_replaysim import TeacherClient, normalize_jsonl, replay_jsonl

    raw, normalised = workdir / "trace_pairs.raw.jsonl", workdir / "trace_pairs.jsonl"

    def replay(url: str, api_key_env: str | None) -> None:
        client = TeacherClient(teacher_model, base_url=url, api_key_env=api_key_env, max_retries=2, timeout_s=60)
        summary = replay_jsonl(traces, raw, client=client)
        print(f"trace replay: {summary.pairs_written} pairs from {summary.traces_read} traces", flush=True)

    if teacher_url is None:
        with oracle_teacher(train) as url:
            replay(url, None)
    else:
        replay(teacher_url, "OPENROUTER_API_KEY" if "openrouter" in teacher_url else "OPENAI_API_KEY")
    summary = normalize_jsonl(raw, normalised, recipe=str(DATA / "coding_recipe.yaml"))
    print(f"normalised with crf-replaysim: kept {summary.kept} of {summary.read} pairs", flush=True)
    if summary.kept == 0:
        raise RuntimeError("normalisation dropped every trace-replay pair; check examples/data/coding_recipe.yaml")
    return normalised
