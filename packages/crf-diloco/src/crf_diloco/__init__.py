"""Serverless DiLoCo: torchft's DiLoCo synchronised through nothing but an object store.

Names load on first use, so `crf-diloco launch` and the executors start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from crf_diloco._version import __version__

_EXPORTS = {
    "crf_diloco.allreduce": ("ObjectStoreAllReduce", "RoundInfo"),
    "crf_diloco.errors": (
        "AllReduceError",
        "CorruptObjectError",
        "HealError",
        "PayloadMismatchError",
        "RoundAbortedError",
        "RoundDesyncError",
        "RoundTimeoutError",
        "StoreBackendMissingError",
    ),
    "crf_diloco.executors": (
        "HFJobsExecutor",
        "LocalProcessExecutor",
        "ModalExecutor",
        "RayExecutor",
        "ReplicaFailureError",
        "ReplicaResult",
        "ServerlessExecutor",
        "raise_for_failures",
        "run_replicas",
    ),
    "crf_diloco.link": ("Link",),
    "crf_diloco.manager": ("DILOCO_MANAGER_SURFACE", "MockManager", "ObjectStoreWork", "SyncRecord"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DILOCO_MANAGER_SURFACE",
    "AllReduceError",
    "CorruptObjectError",
    "HFJobsExecutor",
    "HealError",
    "Link",
    "LocalProcessExecutor",
    "MockManager",
    "ModalExecutor",
    "ObjectStoreAllReduce",
    "ObjectStoreWork",
    "PayloadMismatchError",
    "RayExecutor",
    "ReplicaFailureError",
    "ReplicaResult",
    "RoundAbortedError",
    "RoundDesyncError",
    "RoundInfo",
    "RoundTimeoutError",
    "ServerlessExecutor",
    "StoreBackendMissingError",
    "SyncRecord",
    "__version__",
    "raise_for_failures",
    "run_replicas",
]

if TYPE_CHECKING:
    from crf_diloco.allreduce import ObjectStoreAllReduce, RoundInfo
    from crf_diloco.errors import (
        AllReduceError,
        CorruptObjectError,
        HealError,
        PayloadMismatchError,
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
    from crf_diloco.link import Link
    from crf_diloco.manager import DILOCO_MANAGER_SURFACE, MockManager, ObjectStoreWork, SyncRecord


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'crf_diloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
