"""A complete serverless DiLoCo replica: real ``torchft.local_sgd.DiLoCo`` over `MockManager`.

Launch it with ``crf-diloco launch --replicas N --uri URI diloco_replica.py --out DIR``: every replica reads its
rank and the store from the ``CRF_DILOCO_*`` environment, trains a tiny regression model on its own data shard
(AdamW inner steps, Nesterov-SGD outer steps every ``--sync-every`` steps, the DiLoCo paper's optimizers) and
writes its final parameters to ``DIR/rank{r}.safetensors`` and a summary to ``DIR/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file
from torch import nn
from torchft.local_sgd import DiLoCo

from crf_diloco.allreduce import ObjectStoreAllReduce
from crf_diloco.manager import MockManager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sync-every", type=int, default=4)
    args = parser.parse_args()

    manager = MockManager(ObjectStoreAllReduce.from_env(timeout=120))
    rank = manager.rank
    torch.manual_seed(0)  # every replica starts from the same weights
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    inner = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    data = torch.Generator().manual_seed(7919 * (rank + 1))  # each replica has its own data shard
    losses = []
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
        for _ in range(args.steps):
            x = torch.randn(16, 6, generator=data)
            y = torch.sin(x[:, :3]) + 0.1 * torch.randn(16, 3, generator=data)
            loss = nn.functional.mse_loss(model(x), y)
            inner.zero_grad()
            loss.backward()
            inner.step()
            losses.append(loss.item())
    print(f"rank {rank}: {manager.current_step()} outer steps, last loss {losses[-1]:.4f}", flush=True)
    final = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    save_file(
        {**final, **{f"initial.{k}": v for k, v in initial.items()}}, os.path.join(args.out, f"rank{rank}.safetensors")
    )
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"outer_steps": manager.current_step(), "losses": losses}, f)


if __name__ == "__main__":
    main()
