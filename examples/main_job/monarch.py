"""Replicas as Monarch actors (``--executor monarch``): one process per replica spawned by Meta's Monarch.

Monarch (PyPI ``torchmonarch``) runs a program from one controller that spawns processes and *actors*
on them and calls their endpoints. Each replica is one actor whose ``train`` endpoint sets the replica
environment (``crf_diloco.replica_env.replica_environment``: rank, world size, store URI, run id, and
the run's secret) and runs the same `run_replica` the executors start, so training is identical to
``--executor local``. The replicas talk to each other only through the object store; Monarch only
starts them, waits and returns each one's report.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from monarch.actor import Actor, current_rank, endpoint, this_host

from main_job.records import ReplicaReport

__all__ = ["ComposerReplica", "run_monarch_replicas"]


class ComposerReplica(Actor):
    """One DiLoCo replica: trains as ``job.json`` says, with its rank from Monarch."""

    @endpoint
    def train(self, job: str, world_size: int, uri: str, run_id: str, extra: Mapping[str, str]) -> ReplicaReport:
        from crf_diloco.replica_env import replica_environment
        from main_job.replica import run_replica

        os.environ.update(replica_environment(current_rank().rank, world_size, uri, run_id, extra))
        return run_replica(Path(job))


def run_monarch_replicas(
    job: Path, world_size: int, uri: str, run_id: str, extra: Mapping[str, str]
) -> list[ReplicaReport]:
    """Spawn ``world_size`` processes on this host, one `ComposerReplica` each, train, return reports by rank."""
    # The actors' processes unpickle `ComposerReplica` by importing main_job: they inherit this environment, so the
    # folder that holds main_job goes on their PYTHONPATH (this process imported it already).
    examples = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (examples, os.environ.get("PYTHONPATH")) if p)
    procs = this_host().spawn_procs(per_host={"procs": world_size})
    try:
        replicas = procs.spawn("replicas", ComposerReplica)
        reports = replicas.train.call(str(job), world_size, uri, run_id, dict(extra)).get()
        return sorted((report for _, report in reports.items()), key=lambda r: r.rank)
    finally:
        procs.stop().get()
