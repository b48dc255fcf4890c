"""Streaming DiLoCo over a simulated WAN: inner steps/s while a fragment syncs, against inner steps/s with no sync.

What is measured
    ``--replicas`` processes (default 2) each train the same MLP (``--layers`` square Linear layers of ``--width``,
    one fragment each) with real ``torchft.local_sgd.DiLoCo`` (``sync_every = fragments x --period``,
    ``fragment_sync_delay = --delay``) through `MockManager` (``overlap=True``: a fragment's rounds run on a
    background thread) on ``s3://`` against moto's S3 server behind the WAN proxy of ``benchmarks/allreduce_wan.py``
    (``--rtt``, ``--link``). Every inner step is timed and classed by whether a sync was open when it started or
    ended (from the sync's ``start_quorum`` at ``prepare_sync`` until its ``should_commit`` returned at
    ``perform_sync``); the step that waits for its fragment's round and for ``should_commit`` (with
    ``--vote-scope run``, a store-wide vote: a barrier) counts as during a sync, so a round that outlasts its window
    or a vote shows up as a slower rate. The first ``--period`` steps are left out: the first sync also joins the
    run (layout check, frontier).

    * ``during sync``: inner steps/s over the steps during which a sync was in flight;
    * ``no sync``: inner steps/s of the same loop without DiLoCo, run by the same processes before and after (the
      mean of the two), and, for reference, over the DiLoCo run's steps with no sync in flight.

    ``ratio = during sync / no sync``; the target (issue 24) is >= 0.9. ``--no-overlap`` runs the rounds inside
    ``wait()`` instead (``MockManager(overlap=False)``), the comparison point. ``--vote-scope replica`` gives
    ``should_commit`` torchft's own scope (``MockManager(vote_scope="replica")``: no store-wide vote, no barrier).
    Beside it, ``waited s/sync``: the seconds per sync the training thread spent blocked in the manager
    (``start_quorum``, a work's ``wait``, ``should_commit``), a figure that does not depend on how the replicas share
    the CPUs. With ``--pin`` (the default) every replica shares one CPU, so a sync's client CPU (s3fs, the MAC, the
    codec) is taken from the inner steps of both: the ratio is then bounded by that CPU, not by waiting.

Run: ``python benchmarks/diloco_overlap.py`` (``--codec int8`` for smaller rounds). The load average is printed at the
start and the end; the machine's other work moves every figure, so compare ratios of one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from typing import Any

from allreduce_wan import (
    SECRET,
    TEST_SUPPORT,
    _free_port,
    _proxy_process,
    cpu_split,
    pin_to,
    placement,
)

from crf_diloco.link import parse_rate, parse_seconds
from crf_diloco.manager import VOTE_SCOPES


class _SyncClock:
    """Wraps a manager's sync calls: the seconds the training thread spends inside each one that may block it
    (``start_quorum``, a work's ``wait``, ``should_commit``; ``waited``, per kind of call as DiLoCo makes them), and
    whether a sync is open (from its ``start_quorum`` until its ``should_commit`` returned: ``open``; ``ended``: a
    ``should_commit`` ran since the flag was last cleared), so that the step which waits for the vote counts as a
    step during a sync even when the rounds were done before it started."""

    def __init__(self, manager: Any) -> None:
        self.waited: dict[str, list[float]] = {"start_quorum": [], "wait": [], "should_commit": []}
        self.open = self.ended = False
        allreduce = manager.allreduce

        def allreduce_timed(*args: Any, **kwargs: Any) -> Any:
            work = allreduce(*args, **kwargs)
            work.wait = self._timed("wait", work.wait)
            return work

        manager.start_quorum = self._timed("start_quorum", manager.start_quorum)
        manager.should_commit = self._timed("should_commit", manager.should_commit)
        manager.allreduce = allreduce_timed

    def _timed(self, name: str, call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.open = self.open or name == "start_quorum"
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.waited[name].append(time.perf_counter() - start)
                if name == "should_commit":
                    self.open, self.ended = False, True

        return run


def _replica(
    rank: int, world: int, port: int, args: dict[str, Any], options: dict[str, Any], uri: str, out: Any
) -> None:
    pin_to(args["cores"])
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchft.local_sgd import DiLoCo

    from crf_diloco import MockManager, ObjectStoreAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = [nn.Linear(args["width"], args["width"]) for _ in range(args["layers"])]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x, y = (
        torch.randn(args["batch"], args["width"], generator=g),
        torch.randn(args["batch"], args["width"], generator=g),
    )

    def step() -> None:
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()

    def plain(n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            step()
        return n / (time.perf_counter() - start)

    plain(args["plain_steps"] // 2)  # warm-up (allocator, caches): the first steps run slower
    before = plain(args["plain_steps"])
    # every replica enters DiLoCo with the same weights (DiLoCo's global state starts from them), not its plain steps'
    model.load_state_dict(initial)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ar = ObjectStoreAllReduce(uri, rank, world, run_id=args["run_id"], secret=SECRET, timeout=300,
                              compression=args["codec"], storage_options=options)  # fmt: skip
    manager = MockManager(ar, overlap=args["overlap"], vote_scope=args["vote_scope"],
                          checkpoint_every=args["checkpoint_every"])  # fmt: skip
    clock = _SyncClock(manager)
    outer = [torch.optim.SGD(layer.parameters(), lr=0.7, momentum=0.9, nesterov=True) for layer in layers]
    steps: list[tuple[float, bool]] = []
    dist.barrier()
    with DiLoCo(manager, layers, inner, outer, sync_every=args["period"] * len(layers),
                fragment_sync_delay=args["delay"]):  # fmt: skip
        for _ in range(args["steps"]):
            busy, clock.ended = clock.open, False
            start = time.perf_counter()
            step()
            steps.append((time.perf_counter() - start, busy or clock.open or clock.ended))
        manager.shutdown()
    committed = manager.current_step()
    after = plain(args["plain_steps"])
    traffic = ar.store.traffic()
    ar.close()
    moved = (traffic.bytes_read + traffic.bytes_written, sum(manager.checkpoint_bytes))
    out.put((rank, before, after, steps, committed, moved, clock.waited))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--layers", type=int, default=3, help="square Linear layers, one DiLoCo fragment each")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--period", type=int, default=24, help="inner steps between two syncs of one fragment")
    parser.add_argument("--delay", type=int, default=20, help="fragment_sync_delay (< --period)")
    parser.add_argument("--syncs", type=int, default=3, help="syncs per fragment")
    parser.add_argument("--plain-steps", type=int, default=40, help="inner steps without DiLoCo, before and after")
    parser.add_argument("--codec", default="fp32", help="wire codec of the outer gradients (fp32: none)")
    parser.add_argument(
        "--no-overlap", action="store_true", help="run rounds inside wait() (MockManager(overlap=False))"
    )
    parser.add_argument("--vote-scope", choices=VOTE_SCOPES, default="run",
                        help="MockManager(vote_scope=...): run, a store-wide vote at should_commit (a barrier); "
                             "replica, torchft's scope (no request at should_commit)")  # fmt: skip
    parser.add_argument("--checkpoint-every", type=int, default=1,
                        help="MockManager(checkpoint_every=N): the global state (all fragments, several times a "
                             "sync's bytes) after every Nth committed sync instead of every one")  # fmt: skip
    parser.add_argument("--slowest", type=int, default=0, help="print the N slowest inner steps of each replica")
    parser.add_argument("--rtt", type=parse_seconds, default=0.040)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="moto's server and the proxy (a remote bucket and network on a real WAN) on the last "
                             "CPU, the replicas on the others, so that the servers' work is not charged to the "
                             "replicas' inner steps; --no-pin: all share every CPU")  # fmt: skip
    parser.add_argument("--link", type=parse_rate, default=50e6)
    args = parser.parse_args(argv)
    if not 0 < args.delay < args.period or args.replicas < 2 or args.checkpoint_every < 1:
        parser.error("need 0 < --delay < --period, --replicas >= 2 and --checkpoint-every >= 1")
    sys.path.insert(0, str(TEST_SUPPORT))
    from s3_server import moto_s3_server

    load_start = os.getloadavg()
    ctx = mp.get_context("spawn")
    replica_cores, server_cores = cpu_split(args.pin)
    pin_to(server_cores)  # moto's server thread and the proxy process start from here: they inherit it
    config = {"width": args.width, "layers": args.layers, "batch": args.batch, "period": args.period,
              "delay": args.delay, "steps": args.period * args.layers * args.syncs, "plain_steps": args.plain_steps,
              "codec": None if args.codec == "fp32" else args.codec, "overlap": not args.no_overlap,
              "vote_scope": args.vote_scope, "checkpoint_every": args.checkpoint_every,
              "run_id": f"overlap-{uuid.uuid4().hex[:8]}", "cores": replica_cores}  # fmt: skip
    link = {"rtt": args.rtt, "per_link": args.link, "connect_rtts": 0.0}
    with moto_s3_server("crf-diloco-overlap") as s3:
        parent, child = ctx.Pipe()
        proxy = ctx.Process(target=_proxy_process, args=(s3.port, args.replicas, link, 3600.0, child))
        proxy.start()
        try:
            ports = parent.recv()
            out = ctx.Queue()
            port = _free_port()
            procs = [
                ctx.Process(
                    target=_replica,
                    args=(
                        r,
                        args.replicas,
                        port,
                        config,
                        s3.storage_options(f"http://127.0.0.1:{ports[r]}"),
                        f"s3://{s3.bucket}/overlap",
                        out,
                    ),
                )
                for r in range(args.replicas)
            ]
            for p in procs:
                p.start()
            results = [out.get(timeout=3600) for _ in procs]
            for p in procs:
                p.join()
        finally:
            parent.send("stop")
            proxy.join(30)
            if proxy.is_alive():
                proxy.kill()
    print(f"Streaming DiLoCo over a simulated WAN (moto S3 behind the proxy: rtt {args.rtt * 1000:.0f} ms, link "
          f"{args.link:.3g} B/s): {args.replicas} replicas, {args.layers} fragments of {args.width}x{args.width}, "
          f"codec {args.codec}, period {args.period}, fragment_sync_delay {args.delay}, overlap "
          f"{not args.no_overlap}, vote scope {args.vote_scope}, checkpoint every {args.checkpoint_every}; "
          f"{os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{v:.2f}' for v in load_start)} at the start, {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
          f"at the end; {placement(replica_cores, server_cores)}")  # fmt: skip
    print(f"{'rank':>4} {'no sync':>8} {'during sync':>11} {'ratio':>6} {'DiLoCo, no sync':>15} {'steps in sync':>13} "
          f"{'longest step':>12} {'commits':>7} {'MB moved':>8} {'checkpoints':>11}  "
          "waited s/sync (start_quorum + wait + should_commit)")  # fmt: skip
    ratios = []
    for rank, before, after, steps, committed, moved, waited in sorted(results):
        # from the second sync on, as for the steps: the first one also joins the run
        per_sync = {k: sum(v[len(v) // max(committed, 1) :]) / max(committed - 1, 1) for k, v in waited.items()}
        plain_rate = (before + after) / 2
        measured = steps[args.period :]  # from the second sync on: the first one also joins the run (layout, frontier)
        busy = [d for d, syncing in measured if syncing]
        idle = [d for d, syncing in measured if not syncing]
        during = len(busy) / sum(busy) if busy else float("nan")
        quiet = len(idle) / sum(idle) if idle else float("nan")
        ratios.append(during / plain_rate)
        print(f"{rank:>4} {plain_rate:>8.2f} {during:>11.2f} {during / plain_rate:>6.2f} {quiet:>15.2f} "
              f"{len(busy):>6}/{len(measured):<6} {max(d for d, _ in measured):>11.3f}s {committed:>7} "
              f"{moved[0] / 1e6:>8.1f} {moved[1] / 1e6:>11.1f}  {sum(per_sync.values()):.3f} "
              f"({' + '.join(f'{v:.3f}' for v in per_sync.values())})")  # fmt: skip
    print(f"median ratio (inner steps/s during syncs / with no sync): {statistics.median(ratios):.3f}; steps/s")
    if args.slowest:
        for rank, _, _, steps, *_ in sorted(results):
            worst = sorted(range(len(steps)), key=lambda i: -steps[i][0])[: args.slowest]
            print(f"rank {rank} slowest steps (index: seconds, sync in flight):",
                  ", ".join(f"{i}: {steps[i][0]:.2f}{' s' if steps[i][1] else ''}" for i in sorted(worst)))  # fmt: skip


if __name__ == "__main__":
    main()
