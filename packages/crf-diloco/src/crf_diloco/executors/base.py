"""What every executor shares: the `ServerlessExecutor` protocol, `ReplicaResult`, the replica environment.

An executor starts ``world_size`` copies of one command (a training script), each told its rank, the world size,
the object-store URI and the run id through environment variables (``CRF_DILOCO_*``, read back by
`ObjectStoreAllReduce.from_env`). The replicas share nothing but that store; the executor only starts them,
relays their output, enforces a deadline and reports how each one ended.

Lifecycle: ``handles = executor.launch_replicas(cmd, world_size=N, uri=URI)`` starts them;
``executor.collect(handles, timeout=T)`` waits (terminating whatever is still running at the deadline) and returns
one `ReplicaResult` per rank; ``executor.terminate(handles)`` stops them early. `run_replicas` does all three.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar, runtime_checkable

from crf_diloco.auth import launch_secret
from crf_diloco.layout import validate_name
from crf_diloco.replica_env import ENV_SECRET

OutputCallback = Callable[[int, str, str], None]
"""``on_output(rank, stream, line)``: called once per output line of a replica; ``stream`` is ``"stdout"`` or
``"stderr"``, ``line`` has no trailing newline. Called from reader threads, so it must be thread-safe."""

_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class ReplicaResult:
    """How one replica ended.

    Attributes:
        rank: the replica's rank, ``0 <= rank < world_size``.
        returncode: the process exit status (negative: killed by that signal), or ``None`` when the backend
            could not say (the host running it died, it never started).
        duration_s: wall time from launch to the end, in seconds.
        stdout_tail, stderr_tail: the last lines of each stream (bounded), for error reports.
        timed_out: the replica was still running at the ``collect`` deadline and was terminated.
        error: what the executor saw go wrong besides the exit code (timeout, signal, crash of the host
            worker), or ``None``.
    """

    rank: int
    returncode: int | None
    duration_s: float
    stdout_tail: str = ""
    stderr_tail: str = ""
    timed_out: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the replica exited with status 0 on its own."""
        return self.returncode == 0 and not self.timed_out and self.error is None

    def describe(self) -> str:
        """One line: ``"rank 1: FAILED (exit code 3) after 0.4 s"``."""
        if self.ok:
            return f"rank {self.rank}: ok after {self.duration_s:.1f} s"
        return f"rank {self.rank}: FAILED ({self.error or describe_returncode(self.returncode)}) after {self.duration_s:.1f} s"


class ReplicaFailureError(RuntimeError):
    """Raised by `raise_for_failures` when one or more replicas did not succeed; ``.results`` holds them all."""

    def __init__(self, results: Sequence[ReplicaResult]) -> None:
        self.results = list(results)
        failed = [r for r in self.results if not r.ok]
        lines = [f"{len(failed)} of {len(self.results)} replicas failed:"]
        for result in failed:
            lines.append("  " + result.describe())
            tail = result.stderr_tail.strip().splitlines()[-10:]
            lines.extend("    | " + line for line in tail)
        super().__init__("\n".join(lines))


H = TypeVar("H")


@runtime_checkable
class ServerlessExecutor(Protocol[H]):
    """Starts N replicas of a command against one object store and reports how each ended.

    ``H`` is the executor's handle type (one handle per replica, ordered by rank).
    """

    def launch_replicas(
        self,
        command: Sequence[str],
        *,
        world_size: int,
        uri: str,
        run_id: str | None = None,
        env: Mapping[str, str] | None = None,
        on_output: OutputCallback | None = None,
    ) -> list[H]:
        """Start ``world_size`` replicas of ``command`` (an argv list); return their handles, ordered by rank."""
        ...

    def collect(self, handles: Sequence[H], *, timeout: float | None = None) -> list[ReplicaResult]:
        """Wait for every replica (terminating those still running after ``timeout`` s); results ordered by rank."""
        ...

    def terminate(self, handles: Sequence[H]) -> None:
        """Stop every replica that is still running (politely first, then by force). Idempotent."""
        ...


def run_replicas(
    executor: ServerlessExecutor[H],
    command: Sequence[str],
    *,
    world_size: int,
    uri: str,
    run_id: str | None = None,
    env: Mapping[str, str] | None = None,
    on_output: OutputCallback | None = None,
    timeout: float | None = None,
) -> list[ReplicaResult]:
    """Launch, collect, and terminate the replicas if anything (Ctrl-C included) interrupts the wait.

    The replicas get the run's secret as ``CRF_DILOCO_SECRET`` (`launch_secret`: from ``env``, else this process's
    environment, else a fresh one), so every object they write is authenticated.
    """
    env = {**(env or {}), ENV_SECRET: launch_secret(env)}
    handles = executor.launch_replicas(
        command, world_size=world_size, uri=uri, run_id=run_id, env=env, on_output=on_output
    )
    try:
        return executor.collect(handles, timeout=timeout)
    except BaseException:
        executor.terminate(handles)
        raise


def raise_for_failures(results: Sequence[ReplicaResult]) -> None:
    """Raise `ReplicaFailureError` (listing exit codes and stderr tails) unless every replica succeeded."""
    if not all(r.ok for r in results):
        raise ReplicaFailureError(results)


def new_run_id() -> str:
    """A fresh run id, ``run-<UTC timestamp>-<6 hex>``, so a new launch never meets an old run's rounds."""
    return f"run-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def validate_world_size(world_size: int) -> int:
    """Return ``world_size`` if it is an int >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of replicas), got {world_size!r}")
    return world_size


def validate_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    """Return ``timeout`` if it is ``None`` or a finite number of seconds > 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{name} must be None (no limit) or a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


def validate_command(command: Sequence[str]) -> list[str]:
    """Return ``command`` as a list if it is a non-empty argv of strings (not one shell string)."""
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
        raise TypeError(
            f"command must be an argv list such as [sys.executable, 'train.py', '--lr', '1e-3'], "
            f"not {type(command).__name__} {command!r}"
        )
    argv = list(command)
    if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
        raise ValueError(f"command must be a non-empty list of strings with a program first, got {argv!r}")
    return argv


def normalize_uri(uri: str) -> str:
    """Validate the store URI; make a bare relative path absolute so replicas with another cwd share it."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(
            f"uri must be a non-empty fsspec URI or local path (e.g. 's3://bucket/runs', '/tmp/store'), got {uri!r}"
        )
    if _URI_SCHEME.match(uri):
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def validate_tail_lines(tail_lines: int) -> int:
    """Return ``tail_lines`` (how many trailing output lines a `ReplicaResult` keeps) if it is an int >= 1."""
    if isinstance(tail_lines, bool) or not isinstance(tail_lines, int) or tail_lines < 1:
        raise ValueError(f"tail_lines must be an int >= 1, got {tail_lines!r}")
    return tail_lines


class LaunchSpec(NamedTuple):
    """The validated arguments of ``launch_replicas``: argv list, store URI (absolute if a path) and run id."""

    argv: list[str]
    uri: str
    run_id: str


def validate_launch(command: Sequence[str], world_size: int, uri: str, run_id: str | None) -> LaunchSpec:
    """Check what every ``launch_replicas`` receives; a ``None`` run id becomes a fresh `new_run_id`."""
    argv = validate_command(command)
    validate_world_size(world_size)
    run_id = validate_name(run_id, "run_id") if run_id is not None else new_run_id()
    return LaunchSpec(argv, normalize_uri(uri), run_id)


def describe_returncode(returncode: int | None) -> str:
    """``0`` → ``"exit code 0"``; ``-9`` → ``"killed by signal SIGKILL"``; ``None`` → ``"no exit code"``."""
    if returncode is None:
        return "no exit code"
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
