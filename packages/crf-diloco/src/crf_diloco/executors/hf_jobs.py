"""`HFJobsExecutor`: import-safe v0 skeleton. Constructing it raises `NotImplementedError` (failure mode 9).

Until it is implemented, start one Hugging Face Job per replica by hand; the ``CRF_DILOCO_*`` variables tell
each one its rank, and the training script builds its allreduce with `ObjectStoreAllReduce.from_env`::

    from huggingface_hub import inspect_job, run_job

    world_size, uri, run_id = 4, "s3://my-bucket/diloco", "run-1"
    jobs = [
        run_job(
            image="python:3.11",
            command=["bash", "-c", "pip install 'crf-diloco[s3]' && python train.py"],
            env={"CRF_DILOCO_RANK": str(rank), "CRF_DILOCO_WORLD_SIZE": str(world_size),
                 "CRF_DILOCO_URI": uri, "CRF_DILOCO_RUN_ID": run_id},
            secrets={"AWS_ACCESS_KEY_ID": "...", "AWS_SECRET_ACCESS_KEY": "..."},
            flavor="a10g-small",
        )
        for rank in range(world_size)
    ]
    # poll inspect_job(job_id=job.id).status.stage until COMPLETED, ERROR or CANCELED
    # (Jobs report no exit code: treat ERROR as failure and read .status.message and fetch_job_logs)

Store credentials go in the job's ``secrets``, not in the local shell.
"""

from __future__ import annotations

from typing import Any

from crf_diloco.executors._skeleton import SkeletonExecutor, skeleton_error


class HFJobsExecutor(SkeletonExecutor):
    """Replicas as Hugging Face Jobs — not implemented in v0; ``__init__`` raises `NotImplementedError`.

    Use `LocalProcessExecutor` (one host) or `RayExecutor` (a Ray cluster), or the by-hand pattern in this
    module's docstring.
    """

    def __init__(self, flavor: str = "cpu-basic", **options: Any) -> None:
        raise skeleton_error(type(self).__name__)
