"""One replica as a child process: start it in its own process group, pump its output, end it cleanly.

Shared by `LocalProcessExecutor` (children of the launcher) and `RayExecutor` (children of a Ray worker).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from crf_diloco.executors.base import OutputCallback, ReplicaResult, describe_returncode

logger = logging.getLogger(__name__)

_MAX_LINE_CHARS = 4000
_READER_JOIN_S = 2.0


class _Tail:
    """The last ``max_lines`` lines of a stream (each cut to ``_MAX_LINE_CHARS``), thread-safe."""

    def __init__(self, max_lines: int) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._lock = threading.Lock()

    def append(self, line: str) -> None:
        with self._lock:
            self._lines.append(line[:_MAX_LINE_CHARS])

    def text(self) -> str:
        with self._lock:
            return "\n".join(self._lines)


class ReplicaProcess:
    """A started replica process with reader threads on its stdout and stderr.

    The child runs in a new session (its own process group), so `terminate` reaches whatever it spawned
    (data-loader workers, shells) and a Ctrl-C in the launcher's terminal is handled by the launcher, which then
    stops the replicas on purpose.
    """

    def __init__(
        self,
        rank: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str | None = None,
        on_output: OutputCallback | None = None,
        tail_lines: int = 40,
    ) -> None:
        self.rank = rank
        self.started_at = time.monotonic()
        self._on_output = on_output
        self._tails = {"stdout": _Tail(tail_lines), "stderr": _Tail(tail_lines)}
        self._timeout_s: float | None = None
        self._ended_at: float | None = None
        self._exited = threading.Event()
        try:
            self.popen = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot start replica {rank}: {exc.strerror} (command {list(argv)!r}, cwd {cwd!r})"
            ) from exc
        assert self.popen.stdout is not None
        assert self.popen.stderr is not None
        self._readers = [
            threading.Thread(target=self._pump, args=(self.popen.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._pump, args=(self.popen.stderr, "stderr"), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        threading.Thread(target=self._watch_exit, daemon=True).start()

    def _watch_exit(self) -> None:
        self.popen.wait()
        self._ended_at = time.monotonic()
        self._exited.set()

    def _pump(self, pipe: IO[bytes], stream: str) -> None:
        callback_failed = False
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self._tails[stream].append(line)
                if self._on_output is not None and not callback_failed:
                    try:
                        self._on_output(self.rank, stream, line)
                    except Exception:  # keep draining the pipe, or the child blocks on a full one
                        callback_failed = True
                        logger.exception("on_output callback failed for rank %d; no more lines are relayed", self.rank)

    def wait(self, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` s (``None``: forever); the exit status, or ``None`` if still running."""
        if self._exited.wait(timeout):
            return self.popen.returncode
        return None

    def mark_timed_out(self, timeout_s: float) -> None:
        """Record that the replica is being stopped because it ran past a ``timeout_s`` deadline."""
        if self._timeout_s is None and self.wait(0) is None:
            self._timeout_s = timeout_s

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the replica's process group (no-op once the group is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
            os.killpg(self.popen.pid, sig)

    def finish(self) -> ReplicaResult:
        """Reap the exited child, drain its output, and report. Leftover grandchildren holding the pipes are killed."""
        self._exited.wait()
        returncode = self.popen.returncode
        assert returncode is not None
        assert self._ended_at is not None
        for reader in self._readers:
            reader.join(_READER_JOIN_S)
        if any(reader.is_alive() for reader in self._readers):
            self.signal_group(signal.SIGKILL)  # the child exited, but something it spawned keeps its pipes open
            for reader in self._readers:
                reader.join(_READER_JOIN_S)
        error = None
        if self._timeout_s is not None:
            error = f"timed out after {self._timeout_s:g} s; terminated ({describe_returncode(returncode)})"
        elif returncode < 0:
            error = describe_returncode(returncode)
        return ReplicaResult(
            rank=self.rank,
            returncode=returncode,
            duration_s=self._ended_at - self.started_at,
            stdout_tail=self._tails["stdout"].text(),
            stderr_tail=self._tails["stderr"].text(),
            timed_out=self._timeout_s is not None,
            error=error,
        )


def terminate_all(processes: Sequence[ReplicaProcess], grace_s: float, *, timeout_s: float | None = None) -> None:
    """Stop every running process: SIGTERM all groups, wait up to ``grace_s`` s in total, SIGKILL the rest.

    ``timeout_s``: set when stopping them for running past that deadline (their results then say timed out).
    """
    running = [p for p in processes if p.wait(0) is None]
    for process in running:
        if timeout_s is not None:
            process.mark_timed_out(timeout_s)
        process.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        if process.wait(max(0.0, deadline - time.monotonic())) is None:
            process.signal_group(signal.SIGKILL)
    for process in running:
        process.wait(None)
