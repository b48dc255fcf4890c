"""Checkpoints and heals over a simulated WAN: how long a replica takes to write the run's global state and to read
it back, against their floors.

What is measured
    A state like Streaming DiLoCo's (``--fragments`` entries, each an outer momentum and the global parameters of
    ``--numel`` fp32 elements, so one part of ``8 × numel`` bytes per fragment, and the manager's small entry) is
    written to moto's S3 server through the WAN proxy of ``benchmarks/allreduce_wan.py`` (``--rtt``, ``--link``,
    ``--per-connection``) by a replica process, and read back, ``--repeats`` times each way, in alternation:

    * ``write``: what `MockManager` checkpoints with (``ObjectStoreAllReduce.snapshots()``), a first checkpoint
      (every part new, under a fresh run prefix each time): the stored parts listed while the parts are named, the
      parts uploaded at once, then the manifest, then the collection of older states (one listing, no header);
    * ``write 1 by 1``: the same class with ``run=None``: the parts uploaded one after the other, as every
      checkpoint was before;
    * ``read``: what `MockManager` heals with: the manifest, then every part's header with its first MiB at once,
      then the rest in ranged reads of 8 MiB, 16 at a time;
    * ``read 1 by 1``: the same class with ``run=None`` and one read per part (``read_chunk`` of 1 TiB): the parts
      one after the other, each in one request, as every heal read before;
    * ``one behind``: ``read`` by a replica that holds every part but fragment 0's (it missed that fragment's
      sync): it hashes its own state (`StateSnapshots.local_parts`, as `MockManager` does for a replica that was in
      step before) and fetches the manifest and that one part.

    ``floor = bytes moved / link + 2 × rtt`` (a manifest is written after its parts, read before them); ``ratio =
    time / floor``; ``speedup = 1 by 1 / at once``, medians of the same run. ``round trips`` counts the store's
    requests that waited on one another (the listings and the collection included).

Run: ``python benchmarks/diloco_snapshots.py`` (``--per-connection 10MB/s``: a link that one connection cannot fill,
as S3 from another cloud often is). The load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from allreduce_wan import SECRET, TEST_SUPPORT, _cap, _proxy_process

from crf_diloco.link import parse_rate, parse_seconds


def _fragment(g: Any, numel: int) -> dict[str, Any]:
    """One Streaming DiLoCo fragment's state: outer SGD momentum and the global parameters."""
    import torch

    group = {"lr": 0.7, "momentum": 0.9, "nesterov": True, "params": [0]}
    return {
        "outer_optimizer": {
            "state": {0: {"momentum_buffer": torch.randn(numel, generator=g)}},
            "param_groups": [group],
        },
        "original_parameters": {"weight": torch.randn(numel, generator=g)},
    }


def _state(fragments: int, numel: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {f"StreamingDiLoCoFragment_{i}": _fragment(g, numel) for i in range(fragments)}
    state["torchft"] = {"round": 0, "step": 1, "batches_committed": 2}
    return state


def _weights(state: dict[str, Any] | None) -> list[Any]:
    if state is None:
        raise RuntimeError("the state was not found")
    return [v["original_parameters"]["weight"] for k, v in state.items() if k != "torchft"]


def _replica(job: dict[str, Any], out: Any) -> None:
    import torch

    from crf_diloco import ObjectStoreAllReduce
    from crf_diloco.snapshots import StateSnapshots

    torch.set_num_threads(1)
    state = _state(job["fragments"], job["numel"])
    ar = ObjectStoreAllReduce(job["uri"], 0, 1, run_id=job["run_id"], secret=SECRET, storage_options=job["proxied"])
    snapshots, one_by_one = ar.snapshots(), StateSnapshots(ar.store, ar.auth, read_chunk=1 << 40)
    assert snapshots.write(0, state)
    own = {k: v for k, v in _state(job["fragments"], job["numel"]).items() if k != "torchft"}
    own["StreamingDiLoCoFragment_0"]["original_parameters"]["weight"].add_(1.0)  # synced without this replica
    writers: list[Any] = []

    def write(at_once: bool) -> tuple[float, Any]:
        fresh = ObjectStoreAllReduce(job["uri"], 0, 1, run_id=f"{job['run_id']}-w{len(writers)}", secret=SECRET,
                                     storage_options=job["proxied"])  # fmt: skip
        writers.append(fresh)
        writer = fresh.snapshots() if at_once else StateSnapshots(fresh.store, fresh.auth)
        before = fresh.store.traffic()
        start = time.perf_counter()
        if not writer.write(0, state):
            raise RuntimeError("a first checkpoint under a fresh run prefix was not created")
        return time.perf_counter() - start, fresh.store.traffic() - before

    def read(snapshots: StateSnapshots, have: Callable[[], Any] | None = None) -> tuple[float, Any]:
        before = ar.store.traffic()
        start = time.perf_counter()
        got = snapshots.read(0, have)
        elapsed, done = time.perf_counter() - start, ar.store.traffic() - before
        if not all(map(torch.equal, _weights(got), _weights(state))):
            raise RuntimeError("the state read back differs from the one written")
        return elapsed, done

    ways: dict[str, Callable[[], tuple[float, Any]]] = {
        "write": lambda: write(True),
        "write 1 by 1": lambda: write(False),
        "read": lambda: read(snapshots),
        "read 1 by 1": lambda: read(one_by_one),
        "one behind": lambda: read(snapshots, lambda: snapshots.local_parts(own)),
    }
    for _ in range(job["repeats"]):
        for name, way in ways.items():
            elapsed, done = way()
            out.put((name, elapsed, done.bytes_read + done.bytes_written, done.requests, done.busy_round_trips))
    for writer in (ar, *writers):
        writer.close()
    out.put(None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--fragments", type=int, default=4, help="fragments (parts) of the state")
    parser.add_argument("--numel", type=int, default=2_000_000, help="fp32 elements of each fragment's parameters")
    parser.add_argument("--repeats", type=int, default=5, help="writes and reads each way (in alternation)")
    parser.add_argument("--rtt", type=parse_seconds, default=0.040)
    parser.add_argument("--link", type=parse_rate, default=50e6, help="bytes/s of the replica's link")
    parser.add_argument("--per-connection", type=_cap, default=None, help="bytes/s one connection carries")
    args = parser.parse_args(argv)
    if args.fragments < 1 or args.numel < 1 or args.repeats < 1:
        parser.error("--fragments, --numel and --repeats must be >= 1")
    sys.path.insert(0, str(TEST_SUPPORT))
    from s3_server import moto_s3_server

    load_start = os.getloadavg()
    ctx = mp.get_context("spawn")
    link = {"rtt": args.rtt, "per_link": args.link, "per_connection": args.per_connection, "connect_rtts": 0.0}
    results: dict[str, list[tuple[float, int, int, int]]] = {}
    with moto_s3_server("crf-diloco-snapshots") as s3:
        parent, child = ctx.Pipe()
        proxy = ctx.Process(target=_proxy_process, args=(s3.port, 1, link, 3600.0, child))
        proxy.start()
        try:
            (port,) = parent.recv()
            job = {"uri": f"s3://{s3.bucket}/snapshots", "run_id": "snapshots", "fragments": args.fragments,
                   "numel": args.numel, "repeats": args.repeats,
                   "proxied": s3.storage_options(f"http://127.0.0.1:{port}")}  # fmt: skip
            out = ctx.Queue()
            replica = ctx.Process(target=_replica, args=(job, out))
            replica.start()
            while (item := out.get(timeout=1800)) is not None:
                name, *figures = item
                results.setdefault(name, []).append(tuple(figures))
            replica.join(60)
            if replica.exitcode != 0:
                raise RuntimeError(f"the replica exited with {replica.exitcode}")
        finally:
            parent.send("stop")
            proxy.join(30)
            if proxy.is_alive():
                proxy.kill()
    print(f"Checkpoints and heals over a simulated WAN: moto S3 behind a proxy, rtt {args.rtt * 1000:.0f} ms, link "
          f"{args.link:.3g} B/s, per connection {args.per_connection or 0:.3g} B/s (0: no cap); {args.fragments} "
          f"parts of {8 * args.numel / 1e6:.1f} MB; median of {args.repeats} each way; {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{v:.2f}' for v in load_start)} at the start, "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end")  # fmt: skip
    print(f"{'way':<12} {'MB':>7} {'requests':>8} {'round trips':>11} {'time s':>7} {'floor s':>7} {'ratio':>6}")
    medians = {}
    for name, rows in results.items():
        elapsed = statistics.median(r[0] for r in rows)
        nbytes, requests, trips = rows[-1][1:]
        floor = nbytes / args.link + 2 * args.rtt
        medians[name] = elapsed
        print(f"{name:<12} {nbytes / 1e6:>7.1f} {requests:>8} {trips:>11} {elapsed:>7.3f} {floor:>7.3f} "
              f"{elapsed / floor:>6.2f}")  # fmt: skip
    print(f"speedup (1 by 1 / at once): write {medians['write 1 by 1'] / medians['write']:.2f}x, read "
          f"{medians['read 1 by 1'] / medians['read']:.2f}x; one behind / read 1 by 1: "
          f"{medians['one behind'] / medians['read 1 by 1']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
