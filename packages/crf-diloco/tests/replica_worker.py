"""A replica process for the fault tests: runs allreduce rounds and logs every outcome as JSON lines.

Usage: ``python replica_worker.py URI RANK WORLD_SIZE LAST_ROUND LOG STOP_FILE [--die-before-data ROUND]``.
Runs rounds until LAST_ROUND or until STOP_FILE exists, sleeping 0.1 s between rounds (compute).
Inputs are deterministic per (rank, round), so the test can recompute the expected mean.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from crf_diloco import AllReduceError, ObjectStoreAllReduce

N = 257


def inputs(rank: int, round_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_003 * rank + round_id)
    return torch.randn(N, generator=g)


def main(argv: list[str]) -> None:
    uri, rank, world_size, last_round, log, stop = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4], argv[5]
    die_round = int(argv[7]) if len(argv) > 7 and argv[6] == "--die-before-data" else None
    ar = ObjectStoreAllReduce(uri, rank, world_size, timeout=4.0, quorum_timeout=1.0, poll_interval=0.02)
    if die_round is not None:
        original = ar.store.put_create

        def put_create(key: str, data: bytes) -> bool:
            if key == f"r{die_round:08d}/data/{rank}.safetensors":
                os._exit(17)  # killed mid-round: announced and in the quorum, no data
            return original(key, data)

        ar.store.put_create = put_create  # type: ignore[method-assign]
    ar.join()  # a restarted replica joins the round the others are in
    with open(log, "a") as out:
        while True:
            round_id = ar.round_id
            if round_id > last_round or os.path.exists(stop):
                break
            time.sleep(0.1)
            t = inputs(rank, round_id)
            record: dict[str, object] = {"rank": rank, "round": round_id}
            try:
                ar.allreduce(t)
                record.update(outcome="commit", values=t.tolist())
            except AllReduceError as exc:
                record.update(outcome="abort", reason=str(exc))
            info = ar.last_round
            record["participants"] = info.participants if info else []
            record["participated"] = bool(info and info.participated)
            out.write(json.dumps(record) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
