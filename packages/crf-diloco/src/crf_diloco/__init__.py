"""Serverless DiLoCo: torchft's DiLoCo synchronised through nothing but an object store."""

from crf_diloco._version import __version__
from crf_diloco.allreduce import ObjectStoreAllReduce, RoundInfo
from crf_diloco.errors import (
    AllReduceError,
    CorruptObjectError,
    HealError,
    RoundAbortedError,
    RoundDesyncError,
    RoundTimeoutError,
    StoreBackendMissingError,
)
from crf_diloco.executors import (
    HFJobsExecutor,
    LocalProcessExecutor,
    ModalExecutor,
    RayExecutor,
    ReplicaFailureError,
    ReplicaResult,
    ServerlessExecutor,
    raise_for_failures,
    run_replicas,
)
from crf_diloco.manager import DILOCO_MANAGER_SURFACE, MockManager, ObjectStoreWork

__all__ = [
    "DILOCO_MANAGER_SURFACE",
    "AllReduceError",
    "CorruptObjectError",
    "HFJobsExecutor",
    "HealError",
    "LocalProcessExecutor",
    "MockManager",
    "ModalExecutor",
    "ObjectStoreAllReduce",
    "ObjectStoreWork",
    "RayExecutor",
    "ReplicaFailureError",
    "ReplicaResult",
    "RoundAbortedError",
    "RoundDesyncError",
    "RoundInfo",
    "RoundTimeoutError",
    "ServerlessExecutor",
    "StoreBackendMissingError",
    "__version__",
    "raise_for_failures",
    "run_replicas",
]
