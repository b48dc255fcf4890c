"""A replica for executor tests: ``--rounds`` allreduces of random tensors through `ObjectStoreAllReduce`.

Reads its rank, world size, URI and run id from the ``CRF_DILOCO_*`` environment (`ObjectStoreAllReduce.from_env`).
Each round reduces two tensors (a flat one and a 2-D one, drawn from a rank- and round-dependent seed); the
replica saves what it sent and what it got back, so the test can recompute the mean independently::

    OUT/rank{r}.safetensors   in{k}_flat, in{k}_mat, out{k}_flat, out{k}_mat   for every round k
    OUT/rank{r}.json          {"round_ids": [round_id before each call...], "final_round_id": ..., bytes counters,
                               "authenticated": whether CRF_DILOCO_SECRET keyed its objects}
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from crf_diloco.allreduce import ObjectStoreAllReduce


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--numel", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()

    allreduce = ObjectStoreAllReduce.from_env(timeout=args.timeout)
    rank = allreduce.rank
    tensors: dict[str, torch.Tensor] = {}
    round_ids = []
    for k in range(args.rounds):
        generator = torch.Generator().manual_seed(1_000 * rank + k + 17)
        flat = torch.randn(args.numel, generator=generator) * (rank + 1)
        mat = torch.rand(3, 5, generator=generator) - 0.5
        tensors[f"in{k}_flat"], tensors[f"in{k}_mat"] = flat.clone(), mat.clone()
        round_ids.append(allreduce.round_id)
        returned = allreduce.allreduce([flat, mat], op="avg")
        if returned[0] is not flat or returned[1] is not mat:
            raise AssertionError("allreduce must reduce in place and return its input")
        tensors[f"out{k}_flat"], tensors[f"out{k}_mat"] = flat, mat
        print(f"round {round_ids[-1]} committed on rank {rank}", flush=True)
    save_file(tensors, os.path.join(args.out, f"rank{rank}.safetensors"))
    report = {
        "round_ids": round_ids,
        "final_round_id": allreduce.round_id,
        "bytes_read": allreduce.bytes_read,
        "bytes_written": allreduce.bytes_written,
        "authenticated": allreduce.auth.authenticated,
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    allreduce.close()


if __name__ == "__main__":
    main()
