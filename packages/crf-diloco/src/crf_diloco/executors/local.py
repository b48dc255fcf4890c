"""`LocalProcessExecutor`: N replicas as N child processes on this machine (development, CI, one big host)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from crf_diloco.executors._process import ReplicaProcess, terminate_all
from crf_diloco.executors.base import (
    OutputCallback,
    ReplicaResult,
    validate_launch,
    validate_tail_lines,
    validate_timeout,
)
from crf_diloco.replica_env import replica_environment


@dataclass(frozen=True)
class LocalReplicaHandle:
    """One running local replica: its rank, run id, and process."""

    rank: int
    run_id: str
    process: ReplicaProcess

    @property
    def pid(self) -> int:
        """The replica's process id (also its process-group id)."""
        return self.process.popen.pid


class LocalProcessExecutor:
    """Runs each replica as a child process of this one, with ``CRF_DILOCO_*`` set in its environment.

    Children inherit this process's environment (plus ``env``, the replica variables and ``PYTHONUNBUFFERED=1``
    so their logs arrive line by line), run in their own process group, and have their output relayed line by
    line to ``on_output`` while the last ``tail_lines`` lines of each stream are kept for the `ReplicaResult`.

    Args:
        cwd: working directory of the replicas (default: this process's).
        terminate_grace_s: seconds between SIGTERM and SIGKILL when stopping a replica.
        tail_lines: how many trailing lines of stdout and stderr each `ReplicaResult` keeps.
    """

    def __init__(self, *, cwd: str | None = None, terminate_grace_s: float = 5.0, tail_lines: int = 40) -> None:
        if cwd is not None and not os.path.isdir(cwd):
            raise ValueError(f"cwd must be an existing directory, got {cwd!r}")
        validate_timeout(terminate_grace_s, "terminate_grace_s")
        validate_tail_lines(tail_lines)
        self.cwd = cwd
        self.terminate_grace_s = float(terminate_grace_s)
        self.tail_lines = tail_lines

    def launch_replicas(
        self,
        command: Sequence[str],
        *,
        world_size: int,
        uri: str,
        run_id: str | None = None,
        env: Mapping[str, str] | None = None,
        on_output: OutputCallback | None = None,
    ) -> list[LocalReplicaHandle]:
        """Start ``world_size`` processes running ``command``; if one cannot start, stop the others and raise."""
        argv, uri, run_id = validate_launch(command, world_size, uri, run_id)
        base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        handles: list[LocalReplicaHandle] = []
        try:
            for rank in range(world_size):
                child_env = {**base_env, **replica_environment(rank, world_size, uri, run_id, env)}
                process = ReplicaProcess(
                    rank, argv, child_env, cwd=self.cwd, on_output=on_output, tail_lines=self.tail_lines
                )
                handles.append(LocalReplicaHandle(rank=rank, run_id=run_id, process=process))
        except BaseException:
            self.terminate(handles)
            raise
        return handles

    def collect(self, handles: Sequence[LocalReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        """Wait until every replica exits or ``timeout`` s pass; terminate the late ones; results by rank."""
        timeout = validate_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in handles:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if handle.process.wait(remaining) is None:
                break
        if timeout is not None:
            terminate_all([h.process for h in handles], self.terminate_grace_s, timeout_s=timeout)
        return [handle.process.finish() for handle in sorted(handles, key=lambda h: h.rank)]

    def terminate(self, handles: Sequence[LocalReplicaHandle]) -> None:
        """SIGTERM every running replica's process group, then SIGKILL those alive after the grace period."""
        terminate_all([h.process for h in handles], self.terminate_grace_s)
