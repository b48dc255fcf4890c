"""The replica environment contract: the variables an executor sets and `ObjectStoreAllReduce.from_env` reads.

It lives below both layers: the protocol (`crf_diloco.allreduce`) reads these names and the launch layer
(`crf_diloco.executors`) writes them, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping

ENV_RANK = "CRF_DILOCO_RANK"
ENV_WORLD_SIZE = "CRF_DILOCO_WORLD_SIZE"
ENV_URI = "CRF_DILOCO_URI"
ENV_RUN_ID = "CRF_DILOCO_RUN_ID"
REPLICA_ENV_VARS = (ENV_RANK, ENV_WORLD_SIZE, ENV_URI, ENV_RUN_ID)
ENV_SECRET = "CRF_DILOCO_SECRET"
"""The per-run key that authenticates store objects. A secret: executors pass it the way their backend passes
secrets (never as plain job environment, never in logs)."""
SECRET_ENV_VARS = (ENV_SECRET,)

__all__ = [
    "ENV_RANK",
    "ENV_RUN_ID",
    "ENV_SECRET",
    "ENV_URI",
    "ENV_WORLD_SIZE",
    "REPLICA_ENV_VARS",
    "SECRET_ENV_VARS",
    "replica_environment",
]


def replica_environment(
    rank: int, world_size: int, uri: str, run_id: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables a replica needs (``CRF_DILOCO_RANK``/``_WORLD_SIZE``/``_URI``/``_RUN_ID``) plus ``extra``.

    ``extra`` may not set the ``CRF_DILOCO_*`` variables itself: the executor owns them.
    """
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(REPLICA_ENV_VARS))
    if clash:
        raise ValueError(f"env must not set {clash}: the executor sets them per replica (pass uri/run_id instead)")
    bad = [k for k, v in extra.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"env keys and values must be strings; offending keys: {bad!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must satisfy 0 <= rank < world_size={world_size}, got {rank}")
    extra.update({ENV_RANK: str(rank), ENV_WORLD_SIZE: str(world_size), ENV_URI: uri, ENV_RUN_ID: run_id})
    return extra
