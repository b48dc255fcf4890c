"""A small Hugging Face Jobs endpoint on 127.0.0.1 that runs every job as a local process (HFJobsExecutor tests).

The routes, payloads and stages are the ones ``huggingface_hub``'s jobs client uses (``HfApi.run_job``,
``run_uv_job``, ``inspect_job``, ``fetch_job_logs``, ``cancel_job``, ``list_jobs``, ``whoami``)::

    GET  /api/whoami-v2                          {"type": "user", "name": ..., "orgs": [...]}
    POST /api/jobs/{namespace}                   job spec (camelCase) → JobInfo
    GET  /api/jobs/{namespace}                   [JobInfo, ...] (``?label=k=v``: only jobs with every such label)
    GET  /api/jobs/{namespace}/{job_id}          JobInfo
    GET  /api/jobs/{namespace}/{job_id}/logs     server-sent events ``data: {"timestamp", "data"}``, replayed
                                                 from the start (``?tail=N``: the last N), followed until the job ends
    POST /api/jobs/{namespace}/{job_id}/cancel

Every ``/api`` route wants ``Authorization: Bearer <token>`` (401 otherwise); the namespace must be the user or
one of its orgs (403); a bad spec is a 400 ``{"error": ...}``: what the Hub refuses is refused here too (an unknown
flavour, labels whose keys or values are not ``[A-Za-z0-9_-]``, a ``timeoutSeconds`` that is not a positive
integer). With a rate limit set (``--rate-limit N/S`` or the ``rate_limit`` behaviour), a token that made N
``/api`` requests within S seconds gets ``429`` with a ``Retry-After`` header (whole seconds), as the Hub does. A job is ``SCHEDULING`` for ``--scheduling-s``,
then ``RUNNING`` while its command runs in a fresh working folder with the job's ``environment`` and ``secrets``
on top of a few of the server's variables (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, ``UV_CACHE_DIR``) that stand
in for the image, plus ``UV_NO_PROJECT=1`` (a container holds no project, but the job folders may lie inside
this repository, and ``uv run`` must not find it); stdout and stderr go to one log, as on the Hub. It ends ``COMPLETED`` (exit 0), ``ERROR``
(non-zero exit, killed, or past ``timeoutSeconds``; the message texts are this server's own) or ``CANCELED``.
Secrets are never returned (the Hub keeps them encrypted).

Not covered: the image itself (the command runs on this machine), hardware (a flavour is only checked against a
list), volumes and bucket uploads (so no local uv scripts), ports, SSH, network groups, retries (``attempts``),
scheduled jobs, metrics, ``duplicate``, billing; the Hub's real quotas (its limits are per account and per 5
minutes; here they are whatever the test sets), the Hub's maximum label and timeout lengths (unknown here), and the
``RateLimit`` headers the Hub may send beside ``Retry-After``.

Test-only routes, under ``/_fake``: ``GET /_fake/jobs`` (every job as submitted, secrets included, with its
process id and raw log), ``GET /_fake/stats`` (requests served per kind, how many got a 429 and how many ``flaky_inspect`` 500s were served), ``POST /_fake/jobs/{id}/kill`` (SIGKILL the job's process group: an OOM kill or a lost node) and
``POST /_fake/behaviour`` (switch the server into lying or broken modes; see `Behaviour`).

Run: ``python hf_jobs_server.py --token T --user U --workdir DIR``; prints ``http://127.0.0.1:PORT`` once listening.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

FLAVORS = {
    "cpu-basic",
    "cpu-upgrade",
    "cpu-performance",
    "cpu-xl",
    "t4-small",
    "t4-medium",
    "l4x1",
    "l4x4",
    "l40sx1",
    "l40sx4",
    "l40sx8",
    "a10g-small",
    "a10g-large",
    "a10g-largex2",
    "a10g-largex4",
    "a100-large",
    "a100x4",
    "a100x8",
    "h200",
    "h200x2",
    "h200x4",
    "h200x8",
    "rtx-pro-6000",
    "rtx-pro-6000x2",
    "rtx-pro-6000x4",
    "rtx-pro-6000x8",
}  # fmt: skip  (huggingface_hub 2.4's JobHardware)
LABEL_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
LABEL_VALUE = re.compile(r"^[A-Za-z0-9_-]*$")
IMAGE_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "UV_CACHE_DIR", "XDG_CACHE_HOME")
TERMINAL = ("COMPLETED", "ERROR", "CANCELED", "DELETED")
ROUTE = re.compile(r"^/api/jobs/(?P<ns>[^/]+)(?:/(?P<id>[^/]+)(?:/(?P<action>logs|cancel))?)?$")


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class Behaviour:
    """Ways the server can misbehave, set with ``POST /_fake/behaviour`` (keys as below; jobs by submission index).

    lie_stage: ``{index: stage}``; status reads of that job report this stage whatever really happened.
    garbage_inspect: job indices whose status reads (its own, or a listing that holds it) return ``200`` with a
        body that is not JSON.
    flaky_inspect: how many of the next status reads (inspections and listings) fail with ``500``.
    rate_limit: ``[N, S]``: at most N ``/api`` requests per token in any S seconds, then ``429`` + ``Retry-After``.
    reject_from: submissions from this index on get ``429`` with an error that echoes the token and the spec (secrets too).
    bad_job_id: JobInfo of new jobs carries this id (``"../whoami-v2"``) instead of the real one.
    echo_secrets: JobInfo carries the secret values.
    garbage_logs: the log stream interleaves events that are not JSON.
    """

    lie_stage: dict[int, str] = field(default_factory=dict)
    garbage_inspect: list[int] = field(default_factory=list)
    flaky_inspect: int = 0
    rate_limit: list[float] | None = None
    reject_from: int | None = None
    bad_job_id: str | None = None
    echo_secrets: bool = False
    garbage_logs: bool = False


class Job:
    """A submitted job: its spec, its process, its log and its stage."""

    def __init__(self, index: int, namespace: str, spec: dict[str, Any], workdir: str, scheduling_s: float) -> None:
        self.index = index
        self.id = secrets.token_hex(12)  # 24 hex digits, like the Hub's ids
        self.namespace = namespace
        self.spec = spec
        self.created_at = now_iso()
        self.stage = "SCHEDULING"
        self.message: str | None = None
        self.lines: list[tuple[str, str]] = []  # (timestamp, line)
        self.changed = threading.Condition()
        self.proc: subprocess.Popen[bytes] | None = None
        self.cancelled = False
        self.timed_out = False
        self.workdir = os.path.join(workdir, self.id)
        os.makedirs(self.workdir)
        threading.Thread(target=self._run, args=(scheduling_s,), daemon=True).start()

    def _log(self, line: str) -> None:
        with self.changed:
            self.lines.append((now_iso(), line))
            self.changed.notify_all()

    def _end(self, stage: str, message: str | None) -> None:
        with self.changed:
            if self.stage not in TERMINAL:
                self.stage, self.message = stage, message
            self.changed.notify_all()

    def _run(self, scheduling_s: float) -> None:
        time.sleep(scheduling_s)
        with self.changed:
            if self.cancelled:
                self.stage = "CANCELED"
                self.changed.notify_all()
                return
            env = {k: os.environ[k] for k in IMAGE_ENV if k in os.environ}
            env["UV_NO_PROJECT"] = "1"  # a container holds no project; the job folder may lie inside one here
            env.update(self.spec.get("environment") or {})
            env.update(self.spec.get("secrets") or {})
            command = [*self.spec["command"], *(self.spec.get("arguments") or [])]
            try:
                self.proc = subprocess.Popen(
                    command, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                self.stage, self.message = "ERROR", f"Failed to start the command: {exc.strerror}"
                self.changed.notify_all()
                return
            self.stage = "RUNNING"
            self.lines.append((now_iso(), f"===== Job started at {now_iso()} ====="))
            self.changed.notify_all()
        timeout = self.spec.get("timeoutSeconds")
        timer = threading.Timer(timeout, self._time_out) if timeout else None
        if timer:
            timer.daemon = True
            timer.start()
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._log(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        code = self.proc.wait()
        if timer:
            timer.cancel()
        if self.cancelled:
            self._end("CANCELED", None)
        elif self.timed_out:
            self._end("ERROR", f"Job timed out after {timeout}s")
        elif code == 0:
            self._end("COMPLETED", None)
        else:
            self._end("ERROR", f"Job failed with exit code: {code if code > 0 else 128 - code}")

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def _time_out(self) -> None:
        self.timed_out = True
        self._signal(signal.SIGKILL)

    def cancel(self) -> None:
        with self.changed:
            if self.stage in TERMINAL:
                return
            self.cancelled = True
        self._signal(signal.SIGTERM)
        threading.Timer(5.0, self._signal, args=(signal.SIGKILL,)).start()

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def abandon(self) -> None:
        """The server stops: a job still being scheduled never starts (checked under the same lock as its start) and
        a running one is killed, so no job process outlives the server."""
        with self.changed:
            self.cancelled = True
        self.kill()

    def info(self, owner: dict[str, str], behaviour: Behaviour) -> dict[str, Any]:
        spec = self.spec
        stage = behaviour.lie_stage.get(self.index, self.stage)
        body: dict[str, Any] = {
            "id": behaviour.bad_job_id or self.id,
            "createdAt": self.created_at,
            "dockerImage": spec.get("dockerImage"),
            "spaceId": spec.get("spaceId"),
            "command": spec["command"],
            "arguments": spec.get("arguments") or [],
            "environment": spec.get("environment") or {},
            "secrets": dict(spec.get("secrets") or {}) if behaviour.echo_secrets else {},
            "flavor": spec.get("flavor"),
            "labels": spec.get("labels"),
            "status": {"stage": stage, "message": self.message if stage == self.stage else None},
            "owner": owner,
        }
        return body


class State:
    def __init__(self, token: str, user: str, orgs: list[str], workdir: str, scheduling_s: float) -> None:
        self.token = token
        self.user = user
        self.orgs = orgs
        self.workdir = workdir
        self.scheduling_s = scheduling_s
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()
        self.behaviour = Behaviour()
        self.requests: list[float] = []  # when each /api request within the rate-limit window arrived
        self.stats: dict[str, int] = {}

    def count(self, kind: str) -> None:
        with self.lock:
            self.stats[kind] = self.stats.get(kind, 0) + 1

    def retry_after(self) -> int | None:
        """Seconds until the next request is allowed, if this one is over the rate limit (else it is recorded)."""
        limit = self.behaviour.rate_limit
        if not limit:
            return None
        most, window = int(limit[0]), float(limit[1])
        with self.lock:
            now = time.monotonic()
            self.requests = [t for t in self.requests if now - t < window]
            if len(self.requests) >= most:
                return max(1, math.ceil(self.requests[0] + window - now))
            self.requests.append(now)
            return None

    @property
    def owner(self) -> dict[str, str]:
        return {"id": "5e9ecfc04957053f60648a3e", "name": self.user, "type": "user"}


def validate_spec(spec: Any) -> str | None:
    """The reason the Hub would refuse this spec, or None."""
    if not isinstance(spec, dict):
        return "Body must be a JSON object"
    if not (isinstance(spec.get("dockerImage"), str) or isinstance(spec.get("spaceId"), str)):
        return "dockerImage or spaceId is required"
    command = spec.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
        return "command must be a non-empty array of strings"
    for key in ("environment", "secrets", "labels"):
        value = spec.get(key)
        if value is not None and (
            not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        ):
            return f"{key} must be an object of strings"
    for key, value in (spec.get("labels") or {}).items():
        if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
            return f"Invalid label {key}={value}: keys and values must match ^[a-zA-Z0-9_-]*$"
    if spec.get("flavor") not in FLAVORS:
        return f"Invalid flavor {spec.get('flavor')!r}"
    timeout = spec.get("timeoutSeconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0):
        return "timeoutSeconds must be a positive integer"
    return None


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, format: str, *args: Any) -> None:  # keep the test output clean
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return ...

    def _authorised(self) -> bool:
        """The token is right and within the rate limit (else the 401 or 429 has been sent)."""
        state = self.server.state
        if self.headers.get("Authorization") != f"Bearer {state.token}":
            self._error(401, "Invalid credentials in Authorization header")
            return False
        wait = state.retry_after()
        if wait is not None:
            state.count("429")
            data = json.dumps({"error": "You have exceeded the rate limit for the Jobs API"}).encode()
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Retry-After", str(wait))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return False
        return True

    def _status_read_fails(self, jobs: list[Job]) -> bool:
        """Apply ``flaky_inspect`` and ``garbage_inspect`` to a read of these jobs' status (True: answered)."""
        behaviour = self.server.state.behaviour
        with self.server.state.lock:
            flaky = behaviour.flaky_inspect > 0
            if flaky:
                behaviour.flaky_inspect -= 1
        if flaky:
            self.server.state.count("flaky_500")
            self._error(500, "Internal Error")
            return True
        if any(job.index in behaviour.garbage_inspect for job in jobs):
            data = b"<html>502 Bad Gateway</html>"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return True
        return False

    def _job(self, namespace: str, job_id: str) -> Job | None:
        state = self.server.state
        job = state.jobs.get(job_id)
        if job is None or job.namespace != namespace:
            self._error(404, f"Job {job_id} not found")
            return None
        return job

    def do_GET(self) -> None:
        url = urlparse(self.path)
        state = self.server.state
        if url.path == "/_fake/jobs":
            jobs = [{"id": j.id, "namespace": j.namespace, "spec": j.spec, "stage": j.stage, "message": j.message,
                     "pid": j.proc.pid if j.proc else None, "index": j.index, "log": [line for _, line in j.lines]}
                    for j in state.jobs.values()]  # fmt: skip
            return self._json(200, jobs)
        if url.path == "/_fake/stats":
            with state.lock:
                return self._json(200, dict(state.stats))
        if not self._authorised():
            return None
        if url.path == "/api/whoami-v2":
            return self._json(200, {"type": "user", "id": state.owner["id"], "name": state.user,
                                    "orgs": [{"name": o, "type": "org"} for o in state.orgs]})  # fmt: skip
        match = ROUTE.match(url.path)
        if not match:
            return self._error(404, "Not found")
        namespace, job_id, action = match.group("ns", "id", "action")
        if job_id is None:
            state.count("list")
            wanted = dict(p.partition("=")[::2] for p in parse_qs(url.query).get("label", []))
            jobs = [j for j in state.jobs.values() if j.namespace == namespace
                    and all((j.spec.get("labels") or {}).get(k) == v for k, v in wanted.items())]  # fmt: skip
            if self._status_read_fails(jobs):
                return None
            return self._json(200, [j.info(state.owner, state.behaviour) for j in jobs])
        job = self._job(namespace, job_id)
        if job is None:
            return None
        if action == "logs":
            state.count("logs")
            return self._stream_logs(job, parse_qs(url.query))
        if action is not None:
            return self._error(405, "Method not allowed")
        state.count("inspect")
        if self._status_read_fails([job]):
            return None
        return self._json(200, job.info(state.owner, state.behaviour))

    def _stream_logs(self, job: Job, query: dict[str, list[str]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        tail = int(query["tail"][0]) if "tail" in query else None
        with job.changed:
            sent = max(0, len(job.lines) - tail) if tail is not None else 0
        garbage = self.server.state.behaviour.garbage_logs
        try:
            while True:
                with job.changed:
                    if sent >= len(job.lines) and job.stage not in TERMINAL:
                        job.changed.wait(1.0)
                    batch = job.lines[sent:]
                    ended = job.stage in TERMINAL
                if not batch and not ended:
                    self.wfile.write(b": keep-alive\n\n")
                for stamp, line in batch:
                    if garbage:
                        self.wfile.write(b"data: {this is not json\n\n")
                    event = json.dumps({"timestamp": stamp, "data": line})
                    self.wfile.write(f"data: {event}\n\n".encode())
                sent += len(batch)
                self.wfile.flush()
                if ended and sent >= len(job.lines):
                    return
        except (BrokenPipeError, ConnectionResetError):
            return

    def do_POST(self) -> None:
        url = urlparse(self.path)
        state = self.server.state
        if url.path == "/_fake/behaviour":
            body = self._body()
            state.behaviour = Behaviour(**{k: v for k, v in body.items() if k != "lie_stage"},
                                        lie_stage={int(k): v for k, v in body.get("lie_stage", {}).items()})  # fmt: skip
            return self._json(200, {})
        kill = re.match(r"^/_fake/jobs/([^/]+)/kill$", url.path)
        if kill:
            job = state.jobs.get(kill.group(1))
            if job is None:
                return self._error(404, "no such job")
            job.kill()
            return self._json(200, {})
        if not self._authorised():
            return None
        match = ROUTE.match(url.path)
        if not match:
            return self._error(404, "Not found")
        namespace, job_id, action = match.group("ns", "id", "action")
        if namespace not in (state.user, *state.orgs):
            return self._error(403, f"You are not allowed to run jobs in namespace {namespace}")
        if job_id is None:
            state.count("submit")
            return self._submit(namespace)
        job = self._job(namespace, job_id)
        if job is None:
            return None
        if action != "cancel":
            return self._error(405, "Method not allowed")
        state.count("cancel")
        job.cancel()
        return self._json(200, {})

    def _submit(self, namespace: str) -> None:
        state = self.server.state
        spec = self._body()
        problem = validate_spec(spec)
        if problem:
            return self._error(400, problem)
        with state.lock:
            index = len(state.jobs)
            if state.behaviour.reject_from is not None and index >= state.behaviour.reject_from:
                auth = self.headers.get("Authorization")
                return self._error(429, f"Quota exceeded for {auth}, cannot run {json.dumps(spec)}")
            job = Job(index, namespace, spec, state.workdir, state.scheduling_s)
            state.jobs[job.id] = job
        return self._json(200, job.info(state.owner, state.behaviour))


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: State) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.state = state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token", required=True)
    parser.add_argument("--user", required=True)
    parser.add_argument("--org", action="append", default=[])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--scheduling-s", type=float, default=0.2)
    parser.add_argument("--rate-limit", default=None, metavar="N/S", help="at most N /api requests per S seconds")
    args = parser.parse_args()
    server = Server(State(args.token, args.user, args.org, args.workdir, args.scheduling_s))
    if args.rate_limit:
        most, window = args.rate_limit.split("/")
        server.state.behaviour.rate_limit = [int(most), float(window)]

    def stop(signum: int, frame: Any) -> None:
        for job in list(server.state.jobs.values()):
            job.abandon()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
