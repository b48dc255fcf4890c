"""`ModalExecutor`: import-safe v0 skeleton. Constructing it raises `NotImplementedError` (failure mode 9).

Until it is implemented, run the replicas on Modal by hand; each one builds its own allreduce and manager::

    import modal

    app = modal.App("crf-diloco")
    image = modal.Image.debian_slim().pip_install("crf-diloco[s3]")

    @app.function(image=image, gpu="H100", timeout=3600, secrets=[modal.Secret.from_name("aws")])
    def replica(rank: int, world_size: int, uri: str, run_id: str) -> None:
        from crf_diloco import MockManager, ObjectStoreAllReduce

        manager = MockManager(ObjectStoreAllReduce(uri, rank, world_size, run_id=run_id))
        ...  # build the model and optimizers, train inside torchft.local_sgd.DiLoCo(manager, ...)

    @app.local_entrypoint()
    def main(world_size: int = 4, uri: str = "s3://my-bucket/diloco", run_id: str = "run-1") -> None:
        calls = [replica.spawn(rank, world_size, uri, run_id) for rank in range(world_size)]
        for call in calls:
            call.get()  # re-raises the replica's exception

Credentials for the store go in Modal secrets (``secrets=[...]``), not in the local shell.
"""

from __future__ import annotations

from typing import Any

from crf_diloco.executors._skeleton import SkeletonExecutor, skeleton_error


class ModalExecutor(SkeletonExecutor):
    """Replicas as Modal function calls — not implemented in v0; ``__init__`` raises `NotImplementedError`.

    Use `LocalProcessExecutor` (one host) or `RayExecutor` (a Ray cluster), or the by-hand pattern in this
    module's docstring.
    """

    def __init__(self, app_name: str = "crf-diloco", **options: Any) -> None:
        raise skeleton_error(type(self).__name__)
