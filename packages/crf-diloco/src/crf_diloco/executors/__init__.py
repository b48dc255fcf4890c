"""Executors: start N replicas of a training script that synchronise through an object store.

`LocalProcessExecutor` (child processes), `RayExecutor` (Ray tasks), `HFJobsExecutor` (Hugging Face Jobs) and
`ModalExecutor` (Modal function calls) implement the `ServerlessExecutor` protocol on `ExecutorBase`, which owns
the launch template (validate, start each rank, stop the started ones when one fails). Each module's ``LAUNCHER``
(`crf_diloco.executors.registry`) makes it a ``crf-diloco launch --executor`` choice. The cloud SDKs (``ray``,
``huggingface_hub``, ``modal``) are imported only when an executor that needs one is constructed.
"""

from crf_diloco.executors.base import (
    ExecutorBase,
    LaunchPlan,
    OutputCallback,
    ReplicaFailureError,
    ReplicaResult,
    ServerlessExecutor,
    new_run_id,
    plan_launch,
    raise_for_failures,
    run_replicas,
)
from crf_diloco.executors.hf_jobs import HFJobHandle, HFJobsExecutor
from crf_diloco.executors.local import LocalProcessExecutor, LocalReplicaHandle
from crf_diloco.executors.modal import ModalExecutor, ModalReplicaHandle
from crf_diloco.executors.ray import RayExecutor, RayReplicaHandle
from crf_diloco.executors.script import script_command
from crf_diloco.replica_env import ENV_RANK, ENV_RUN_ID, ENV_URI, ENV_WORLD_SIZE, replica_environment

__all__ = [
    "ENV_RANK",
    "ENV_RUN_ID",
    "ENV_URI",
    "ENV_WORLD_SIZE",
    "ExecutorBase",
    "HFJobHandle",
    "HFJobsExecutor",
    "LaunchPlan",
    "LocalProcessExecutor",
    "LocalReplicaHandle",
    "ModalExecutor",
    "ModalReplicaHandle",
    "OutputCallback",
    "RayExecutor",
    "RayReplicaHandle",
    "ReplicaFailureError",
    "ReplicaResult",
    "ServerlessExecutor",
    "new_run_id",
    "plan_launch",
    "raise_for_failures",
    "replica_environment",
    "run_replicas",
    "script_command",
]
