"""The body of one Modal replica, run inside its container: start the command, relay its lines, report its end.

`ModalExecutor` registers `run_replica` as its Modal function (``serialized=True``, so the container imports it
from ``crf_diloco``, which the executor's image carries). It needs nothing but the standard library and
`crf_diloco.executors._process`; the log queue it is given is a ``modal.Queue`` (anything with ``put``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from crf_diloco.executors._process import ReplicaProcess, terminate_all
from crf_diloco.executors._remote import ReplicaSecrets

RELAY_INTERVAL_S = 0.5
_MAX_BATCH_CHARS = 256 * 1024
_PUT_TIMEOUT_S = 10.0


class LineRelay:
    """Forwards a replica's output lines, secrets masked: batched to ``queue`` every 0.5 s, or printed as
    ``[rank r] line`` to this container's own streams (Modal's logs) when there is no queue."""

    def __init__(self, rank: int, queue: Any, redact: Callable[[str], str]) -> None:
        self.rank = rank
        self._queue = queue
        self._redact = redact
        self._pending: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dropped = 0
        self._thread = threading.Thread(target=self._flush_loop, daemon=True) if queue is not None else None
        if self._thread is not None:
            self._thread.start()

    def __call__(self, rank: int, stream: str, line: str) -> None:
        line = self._redact(line)
        if self._queue is None:
            print(f"[rank {rank}] {line}", file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)
            return
        with self._lock:
            self._pending.append((stream, line))

    def _flush_loop(self) -> None:
        while not self._stop.wait(RELAY_INTERVAL_S):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        while pending:
            size, cut = 0, 0
            while cut < len(pending) and (cut == 0 or size + len(pending[cut][1]) <= _MAX_BATCH_CHARS):
                size += len(pending[cut][1])
                cut += 1
            batch, pending = pending[:cut], pending[cut:]
            try:
                self._queue.put((self.rank, batch), timeout=_PUT_TIMEOUT_S)
            except Exception:  # a full or unreachable queue must not stall the replica
                self.dropped += len(batch)

    def close(self) -> None:
        """Send what is left and stop."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(_PUT_TIMEOUT_S + RELAY_INTERVAL_S)
            if self.dropped:
                print(
                    f"crf-diloco: {self.dropped} output lines of rank {self.rank} could not be relayed", file=sys.stderr
                )


def restart_error(rank: int, first_task: str) -> str:
    """What a restarted replica reports instead of running its command again."""
    return (
        f"Modal restarted replica {rank} (its input was preempted or its container lost; the first attempt ran in "
        f"task {first_task or '?'}); it was not run again, as a DiLoCo replica never restarts silently: relaunch "
        "into the run (same --run-id) to resume from the store"
    )


def _first_attempt(rank: int, attempts: Any) -> str | None:
    """``None`` on the first attempt of this rank's input; else the task id the first attempt recorded.

    ``attempts`` is the launch's ``modal.Dict``: the first attempt records its task id under the rank, so a
    restart (Modal reschedules preempted inputs whatever ``retries`` says) finds it there.
    """
    if attempts is None:
        return None
    task = os.environ.get("MODAL_TASK_ID", "")
    try:
        if attempts.put(rank, task, skip_if_exists=True):
            return None
        return str(attempts.get(rank) or "")
    except Exception as exc:  # cannot tell: run, but say so
        print(f"crf-diloco: cannot check for a restart of rank {rank}: {type(exc).__name__}", file=sys.stderr)
        return None


def run_replica(
    rank: int,
    argv: Sequence[str],
    env: Mapping[str, str],
    secret_names: Sequence[str],
    log_queue: Any,
    tail_lines: int,
    terminate_grace_s: float,
    attempts: Any = None,
) -> dict[str, Any]:
    """Run ``argv`` with this container's environment plus ``env``; return the `ReplicaResult` fields as a dict.

    The secrets arrive as this container's environment (Modal injects them); ``secret_names`` says which variables
    they are, so that their values are masked in everything relayed or returned. A cancellation from the launcher
    (Modal raises ``InputCancellation``) stops the command (SIGTERM, then SIGKILL) before it propagates. When
    ``attempts`` (a ``modal.Dict``) shows that this rank already started once, the command is not run again: the
    result says the replica was restarted (`restart_error`).
    """
    secrets = ReplicaSecrets({name: os.environ[name] for name in secret_names if os.environ.get(name)})
    first_task = _first_attempt(rank, attempts)
    if first_task is not None:
        error = restart_error(rank, first_task)
        print(f"crf-diloco: {error}", file=sys.stderr, flush=True)
        return {"rank": rank, "returncode": None, "duration_s": 0.0, "stdout_tail": "", "stderr_tail": "",
                "timed_out": False, "error": error}  # fmt: skip
    relay = LineRelay(rank, log_queue, secrets.redact)
    try:
        try:
            process = ReplicaProcess(rank, argv, {**os.environ, **env}, on_output=relay, tail_lines=tail_lines)
        except OSError as exc:
            return {"rank": rank, "returncode": None, "duration_s": 0.0, "stdout_tail": "", "stderr_tail": "",
                    "timed_out": False, "error": secrets.redact(exc.strerror or str(exc))}  # fmt: skip
        try:
            while process.wait(0.2) is None:
                pass
        finally:
            terminate_all([process], terminate_grace_s)
        result = asdict(process.finish())
    finally:
        relay.close()
    for key in ("stdout_tail", "stderr_tail", "error"):
        if result[key] is not None:
            result[key] = secrets.redact(result[key])
    return result
