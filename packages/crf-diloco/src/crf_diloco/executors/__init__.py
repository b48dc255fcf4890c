"""Executors: start N replicas of a training script that synchronise through an object store.

`LocalProcessExecutor` (child processes) and `RayExecutor` (Ray tasks) are implemented; `ModalExecutor` and
`HFJobsExecutor` are import-safe v0 skeletons whose constructors raise `NotImplementedError`.
"""

from crf_diloco.executors.base import (
    OutputCallback,
    ReplicaFailureError,
    ReplicaResult,
    ServerlessExecutor,
    new_run_id,
    raise_for_failures,
    run_replicas,
)
from crf_diloco.executors.hf_jobs import HFJobsExecutor
from crf_diloco.executors.local import LocalProcessExecutor, LocalReplicaHandle
from crf_diloco.executors.modal import ModalExecutor
from crf_diloco.executors.ray import RayExecutor, RayReplicaHandle
from crf_diloco.replica_env import ENV_RANK, ENV_RUN_ID, ENV_URI, ENV_WORLD_SIZE, replica_environment

__all__ = [
    "ENV_RANK",
    "ENV_RUN_ID",
    "ENV_URI",
    "ENV_WORLD_SIZE",
    "HFJobsExecutor",
    "LocalProcessExecutor",
    "LocalReplicaHandle",
    "ModalExecutor",
    "OutputCallback",
    "RayExecutor",
    "RayReplicaHandle",
    "ReplicaFailureError",
    "ReplicaResult",
    "ServerlessExecutor",
    "new_run_id",
    "raise_for_failures",
    "replica_environment",
    "run_replicas",
]
