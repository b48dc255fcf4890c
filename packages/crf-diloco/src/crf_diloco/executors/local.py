"""`LocalProcessExecutor`: N replicas as N child processes on this machine (development, CI, one big host)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from crf_diloco.executors._process import ReplicaProcess, terminate_all
from crf_diloco.executors.base import (
    ExecutorBase,
    LaunchPlan,
    OutputCallback,
    ReplicaResult,
    plan_launch,
    validate_tail_lines,
    validate_timeout,
)
from crf_diloco.executors.registry import BuildContext, Launcher


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


@dataclass(frozen=True)
class _LocalLaunch:
    """What the replicas of one local launch share: this process's environment and the output callback."""

    base_env: dict[str, str]
    on_output: OutputCallback | None


class LocalProcessExecutor(ExecutorBase[LaunchPlan, _LocalLaunch, LocalReplicaHandle]):
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

    def prepare_launch(
        self, command: Sequence[str], world_size: int, uri: str, run_id: str | None, env: Mapping[str, str] | None
    ) -> LaunchPlan:
        return plan_launch(command, world_size, uri, run_id, env)

    def begin_launch(self, plan: LaunchPlan, on_output: OutputCallback | None) -> _LocalLaunch:
        return _LocalLaunch(dict(os.environ), on_output)

    def start_replica(self, launch: _LocalLaunch, plan: LaunchPlan, rank: int) -> LocalReplicaHandle:
        """Start rank ``rank`` as a child process (this process's environment plus the plan's)."""
        process = ReplicaProcess(
            rank,
            plan.argv,
            {**launch.base_env, **plan.envs[rank]},
            cwd=self.cwd,
            on_output=launch.on_output,
            tail_lines=self.tail_lines,
        )
        return LocalReplicaHandle(rank=rank, run_id=plan.run_id, process=process)

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


def _from_cli(args: argparse.Namespace, context: BuildContext) -> LocalProcessExecutor:
    del args, context
    return LocalProcessExecutor()


LAUNCHER = Launcher(
    "local", "--executor local (child processes of the launcher)", _from_cli, same_machine=True, order=0
)
