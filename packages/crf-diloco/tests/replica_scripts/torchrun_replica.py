"""One worker of a replica that is itself a ``torchrun`` world: all-reduce over gloo, print what each worker sees.

Prints one JSON line per worker: the replica's rank and world size (``CRF_DILOCO_*``), torchrun's ``RANK`` /
``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, and the sum of ``CRF_DILOCO_RANK * 10 + RANK + 1`` over the
workers of this replica (so a world that leaked across replicas would show in the sum).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    replica = int(os.environ["CRF_DILOCO_RANK"])
    value = torch.tensor([float(replica * 10 + dist.get_rank() + 1)])
    dist.all_reduce(value)
    names = ("CRF_DILOCO_RANK", "CRF_DILOCO_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    record = {name: os.environ.get(name) for name in names}
    record.update(sum=value.item(), dist_rank=dist.get_rank(), dist_world_size=dist.get_world_size())
    os.write(1, (json.dumps(record) + "\n").encode())  # one write: both workers share torchrun's stdout
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
