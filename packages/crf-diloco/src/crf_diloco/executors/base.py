"""What every executor shares: the `ServerlessExecutor` protocol, `ReplicaResult`, the replica environment.

An executor starts ``world_size`` copies of one command (a training script), each told its rank, the world size,
the object-store URI and the run id through environment variables (``CRF_DILOCO_*``, read back by
`ObjectStoreAllReduce.from_env`). The replicas share nothing but that store; the executor only starts them,
relays their output, enforces a deadline and reports how each one ended.

Lifecycle: ``handles = executor.launch_replicas(cmd, world_size=N, uri=URI)`` starts them;
``executor.collect(handles, timeout=T)`` waits (terminating whatever is still running at the deadline) and returns
one `ReplicaResult` per rank; ``executor.terminate(handles)`` stops them early. `run_replicas` does all three.

`ExecutorBase` owns ``launch_replicas`` for every executor: it validates the launch (`prepare_launch`, by default
`plan_launch`), sets up what the replicas of one launch share (`begin_launch`), starts each rank (`start_replica`)
and, when any of that fails, stops the replicas already started and releases the launch (`abort_launch`) before
the error (`launch_error` may word it) propagates. An executor implements those hooks plus ``collect`` and
``terminate``; `crf_diloco.executors.registry` makes it a ``crf-diloco launch --executor`` choice.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from crf_diloco._checks import is_int, is_number
from crf_diloco.auth import launch_secret
from crf_diloco.executors._interrupts import interrupts_held
from crf_diloco.layout import validate_name
from crf_diloco.replica_env import ENV_SECRET, replica_environment

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
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of replicas), got {world_size!r}")
    return world_size


def validate_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    """Return ``timeout`` if it is ``None`` or a finite number of seconds > 0."""
    if timeout is None:
        return None
    if not is_number(timeout) or not math.isfinite(timeout) or timeout <= 0:
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
    if not is_int(tail_lines) or tail_lines < 1:
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


@dataclass(frozen=True)
class LaunchPlan:
    """One ``launch_replicas`` checked before anything starts: the argv list, the store URI (absolute if a path),
    the run id and each rank's environment (``PYTHONUNBUFFERED=1``, the caller's ``env`` and the replica
    variables; an executor adds what its replicas inherit)."""

    argv: list[str]
    uri: str
    run_id: str
    envs: list[dict[str, str]]

    @property
    def world_size(self) -> int:
        return len(self.envs)


def plan_launch(
    command: Sequence[str], world_size: int, uri: str, run_id: str | None, env: Mapping[str, str] | None
) -> LaunchPlan:
    """The `LaunchPlan` of a launch (`validate_launch`, then each rank's environment)."""
    argv, uri, run_id = validate_launch(command, world_size, uri, run_id)
    envs = [
        {"PYTHONUNBUFFERED": "1", **replica_environment(rank, world_size, uri, run_id, env)}
        for rank in range(world_size)
    ]
    return LaunchPlan(argv, uri, run_id, envs)


P = TypeVar("P", bound=LaunchPlan)
L = TypeVar("L")


class ExecutorBase(ABC, Generic[P, L, H]):
    """The launch template every executor shares (see the module docstring).

    Type parameters: ``P`` the executor's `LaunchPlan`, ``L`` what one launch's replicas share (an output relay,
    a running app, a placement group), ``H`` its replica handle.
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
        """Start ``world_size`` replicas of ``command``; return their handles, ordered by rank. If one cannot be
        started, the ones already started are stopped (``terminate``) and the launch released before the error
        propagates."""
        plan = self.prepare_launch(command, world_size, uri, run_id, env)
        launch = self.begin_launch(plan, on_output)
        handles: list[H] = []
        try:
            for rank in range(plan.world_size):
                with interrupts_held():  # a Ctrl-C/SIGTERM raises once the started replica's handle is recorded
                    handles.append(self.start_replica(launch, plan, rank))
        except BaseException as exc:
            self.terminate(handles)
            self.abort_launch(launch)
            error = self.launch_error(exc, launch, len(handles)) if isinstance(exc, Exception) else None
            if error is None:
                raise
            raise error from None
        return handles

    @abstractmethod
    def prepare_launch(
        self, command: Sequence[str], world_size: int, uri: str, run_id: str | None, env: Mapping[str, str] | None
    ) -> P:
        """Validate everything the launch gets before anything starts (usually `plan_launch`)."""

    @abstractmethod
    def begin_launch(self, plan: P, on_output: OutputCallback | None) -> L:
        """Set up what the replicas of this launch share; the last step before the first replica starts."""

    @abstractmethod
    def start_replica(self, launch: L, plan: P, rank: int) -> H:
        """Start rank ``rank``'s replica and return its handle."""

    def abort_launch(self, launch: L) -> None:
        """Release what `begin_launch` set up, after a failed start (the started replicas are already stopped)."""

    def launch_error(self, exc: Exception, launch: L, started: int) -> Exception | None:
        """The error to raise when starting rank ``started`` failed with ``exc`` (None: ``exc`` itself)."""
        del exc, launch, started
        return None

    @abstractmethod
    def collect(self, handles: Sequence[H], *, timeout: float | None = None) -> list[ReplicaResult]:
        """Wait for every replica (terminating those still running after ``timeout`` s); results ordered by rank."""

    @abstractmethod
    def terminate(self, handles: Sequence[H]) -> None:
        """Stop every replica that is still running (politely first, then by force). Idempotent."""
