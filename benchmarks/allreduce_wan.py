"""ObjectStoreAllReduce over a simulated WAN: the S3 protocol behind a latency/bandwidth proxy, against its floor.

What is measured
    moto's S3 server on 127.0.0.1 (the tests' helper, ``packages/crf-diloco/tests/s3_server.py``) sits behind a TCP
    proxy of our own (``packages/crf-diloco/tests/wan_proxy.py``, run in its own process) with one listening port
    per replica: each replica reaches the bucket through its own *link*, which adds ``--rtt`` to every exchange
    (half each way; ``--connect-rtts`` more for each new connection's handshake, 0 by default because moto's server
    closes every connection after one response where S3 keeps it alive) and carries at most ``--link`` bytes/s
    (both directions together), each connection at most ``--per-connection`` and all links together at most
    ``--total`` (each optional). ``--replicas`` processes (2, 4 and 8 by default) run ``--rounds`` authenticated
    rounds per codec after one warm-up round, each round started together after a Gloo barrier; a round's time is
    the slowest replica's.

The floor, computed from the same run
    ``floor = bytes on the wire / bandwidth + sequential round trips × rtt``, where the bytes are what the proxy
    carried per link and round (HTTP included), the bandwidth term is the largest of ``max over links(bytes) /
    link`` and ``sum(bytes) / total``, and the sequential round trips are those of the slowest replica: request
    waves (a request that starts while none of that replica's is in flight opens one; concurrent reads and
    background writes share it), not counting waves in which every request found nothing (polls for an object
    not there yet). ``ratio = round time / floor``; the target (issue 24) is <= 1.3 at 2, 4 and 8 replicas.
    Beside it, the CPU seconds every process of the run (replicas, moto's server, the proxy) spent per round, and
    the cores they kept busy: where that nears the machine's cores, the simulation is CPU-bound and the ratio
    measures the machine.

Another server
    ``--endpoint http://127.0.0.1:PORT`` puts an S3 server you started in moto's place (e.g. MinIO: one that serves
    requests on several cores, where moto's take turns under one Python lock on the replicas' CPUs), with
    ``--bucket`` (created if absent) and the credentials in ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``. It
    must honour ``If-None-Match: *`` (the replicas' preflight refuses one that does not); its own CPU is not counted.

Run: ``python benchmarks/allreduce_wan.py`` (defaults: 40 ms, 50 MB/s per link, 1M elements, codecs fp32, int8,
int4, topk; ``--replicas 2 --codecs fp32 --rounds 2`` for a quick look). Medians over ``--rounds``; the load
average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crf_diloco.link import parse_rate, parse_seconds

ROOT = Path(__file__).resolve().parents[1]
TEST_SUPPORT = ROOT / "packages" / "crf-diloco" / "tests"  # s3_server.py and wan_proxy.py (test support)
SECRET = "crf-diloco-wan-benchmark-secret-" * 2


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def _cap(text: str) -> float | None:
    """``50MB/s`` -> 50e6 bytes/s; ``none`` or ``0`` -> no cap."""
    return None if text.strip().lower() in ("none", "0", "") else parse_rate(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_split(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(replicas' CPUs, simulated servers' CPUs). With ``pin``, moto's server and the proxy, which stand in for a
    remote bucket and network, get the last CPU of this process's set and the replicas the others, so the servers'
    work does not take CPU from the replicas as it would not on a real WAN; without it (None, None) all share all."""
    if not pin:
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"--pin needs at least 2 CPUs; this process may use {len(cores)}")
    return set(cores[:-1]), {cores[-1]}


def pin_to(cores: set[int] | None) -> None:
    """Run this thread, and the threads and processes it starts from now on, on ``cores`` (None: leave as is)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)


def placement(replica_cores: set[int] | None, server_cores: set[int] | None, server: str = "moto") -> str:
    """Where the processes ran, for the header (``server``: what serves the bucket here, if it is ours to place)."""
    ours = f"{server} and the proxy" if server else "the proxy"
    if replica_cores is None or server_cores is None:
        return f"replicas, {ours} share every CPU"
    return f"{ours} pinned to CPU {sorted(server_cores)}, the replicas to CPUs {sorted(replica_cores)}"


# -- the proxy, in its own process ------------------------------------------------------------------------------
def _proxy_process(upstream_port: int, links: int, link: dict[str, Any], lifetime: float, conn: Any) -> None:
    sys.path.insert(0, str(TEST_SUPPORT))
    from wan_proxy import WanLink, WanProxy

    with WanProxy(("127.0.0.1", upstream_port), links=links, link=WanLink(**link), lifetime=lifetime) as proxy:
        conn.send(proxy.ports)
        while proxy.running:
            if conn.poll(0.5):
                message = conn.recv()
                if message == "stop":
                    break
                conn.send(([(s.up, s.down, s.connections) for s in proxy.snapshot()], time.process_time()))
    conn.close()


# -- replicas ----------------------------------------------------------------------------------------------------
def _replica(
    rank: int, world: int, port: int, jobs: list[dict[str, Any]], out: Any, control: Any, ack: Any, cores: Any
) -> None:
    pin_to(cores)
    import torch
    import torch.distributed as dist

    from crf_diloco import ObjectStoreAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for job in jobs:
        ar = ObjectStoreAllReduce(job["uri"], rank, world, run_id=job["run_id"], secret=SECRET, timeout=300,
                                  compression=job["codec"], storage_options=job["options"][rank])  # fmt: skip
        x = torch.randn(job["numel"], generator=torch.Generator().manual_seed(rank))
        for step in range(job["rounds"] + 1):
            dist.barrier()
            if step == 1 and rank == 0:  # after the warm-up round: the proxy's counters now
                control.put(("snap", job["label"], "start"))
                ack.get(timeout=60)
            if step == 1:
                dist.barrier()  # nobody starts the measured rounds before the snapshot
                time.sleep(0.2)  # background writes of the warm-up round (collection) settle
                dist.barrier()
            before = ar.store.traffic()
            cpu = time.process_time()
            start = time.perf_counter()
            ar.allreduce(x.clone())
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu
            done = ar.store.traffic() - before
            if step:
                out.put(
                    (job["label"], rank, step, elapsed, done.round_trips, done.idle_round_trips, done.requests, cpu)
                )
        dist.barrier()
        time.sleep(0.2)
        dist.barrier()
        if rank == 0:
            control.put(("snap", job["label"], "end"))
            ack.get(timeout=60)
        dist.barrier()
        ar.close()
    dist.destroy_process_group()


@dataclass(frozen=True)
class Row:
    replicas: int
    codec: str
    numel: int
    wire_bytes: float  # per replica (mean over links) per round
    time: float
    floor: float
    round_trips: int
    idle_round_trips: int
    requests: float
    cpu: float  # CPU seconds per round of every process of the run: replicas, moto's server, the proxy
    server_cpu: float  # of which moto's server and the proxy (what a real bucket and network would not charge here)

    @property
    def ratio(self) -> float:
        """Round time / floor; NaN without a network to floor against (``--rtt 0 --link none``: then the round time
        is the protocol's and the simulation's own processing)."""
        return self.time / self.floor if self.floor > 0 else float("nan")


def _run(
    world: int, args: argparse.Namespace, s3: Any, proxy_ctl: Any, ports: list[int], cores: set[int] | None
) -> list[Row]:
    ctx = mp.get_context("spawn")
    out, control, ack = ctx.Queue(), ctx.Queue(), ctx.Queue()
    jobs = []
    for codec in args.codecs.split(","):
        label = f"{world}/{codec}"
        options = [s3.storage_options(f"http://127.0.0.1:{ports[r]}") for r in range(world)]
        jobs.append({"label": label, "codec": None if codec == "fp32" else codec, "numel": args.numel,
                     "rounds": args.rounds, "uri": f"s3://{s3.bucket}/wan", "run_id": f"w{world}-{codec.replace(':', '-').replace('/', '-')}-{uuid.uuid4().hex[:6]}",
                     "options": options})  # fmt: skip
    port = _free_port()
    procs = [ctx.Process(target=_replica, args=(r, world, port, jobs, out, control, ack, cores)) for r in range(world)]
    for p in procs:
        p.start()
    snaps: dict[tuple[str, str], tuple[list[tuple[int, int, int]], float, float]] = {}
    results: dict[str, list[tuple[int, int, float, int, int, int, float]]] = {}
    expected = world * args.rounds * len(jobs)
    got = 0
    while got < expected or len(snaps) < 2 * len(jobs):
        while not control.empty():
            _, label, tag = control.get()
            proxy_ctl.send("snap")
            links, proxy_cpu = proxy_ctl.recv()
            snaps[(label, tag)] = (links, proxy_cpu, time.process_time())  # this process runs moto's server
            ack.put(tag)
        try:
            label, rank, step, elapsed, trips, idle, requests, cpu = out.get(timeout=0.05)
        except Exception:
            if not any(p.is_alive() for p in procs) and got < expected:
                raise RuntimeError("a benchmark replica died") from None
            continue
        results.setdefault(label, []).append((rank, step, elapsed, trips, idle, requests, cpu))
        got += 1
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a replica exited with {p.exitcode}")
    rows = []
    link_rate = args.link or float("inf")
    total_rate = args.total or float("inf")
    for job in jobs:
        label = job["label"]
        (start, proxy0, main0), (end, proxy1, main1) = snaps[(label, "start")], snaps[(label, "end")]
        servers_cpu = (proxy1 - proxy0 + main1 - main0) / args.rounds
        replicas_cpu = sum(e[6] for e in results[label]) / args.rounds
        per_link = [
            ((e[0] - s[0]) + (e[1] - s[1])) / args.rounds for s, e in zip(start[:world], end[:world], strict=True)
        ]
        bandwidth_time = max(max(per_link) / link_rate, sum(per_link) / total_rate)
        times, trips, idles, requests, floors = [], [], [], [], []
        for step in range(1, args.rounds + 1):
            entries = [e for e in results[label] if e[1] == step]
            times.append(max(e[2] for e in entries))
            worst = max(entries, key=lambda e: e[3] - e[4])
            trips.append(worst[3] - worst[4])
            idles.append(worst[4])
            requests.append(statistics.mean(e[5] for e in entries))
            floors.append(bandwidth_time + (worst[3] - worst[4]) * args.rtt)
        rows.append(Row(world, job["codec"] or "fp32", args.numel, statistics.mean(per_link), statistics.median(times),
                        statistics.median(floors), int(statistics.median(trips)), int(statistics.median(idles)),
                        statistics.mean(requests), replicas_cpu + servers_cpu, servers_cpu))  # fmt: skip
    return rows


@contextlib.contextmanager
def _started_server(endpoint: str, bucket: str) -> Iterator[Any]:
    """The S3 server at ``endpoint`` (on 127.0.0.1: the proxy forwards nowhere else) with ``bucket`` there."""
    import s3fs
    from s3_server import S3Endpoint

    url = urllib.parse.urlsplit(endpoint)
    try:
        port = url.port
    except ValueError:  # a port that is not a number in range
        port = None
    if url.scheme != "http" or url.hostname != "127.0.0.1" or port is None:
        raise SystemExit(
            f"--endpoint must be http://127.0.0.1:PORT (the WAN proxy forwards to 127.0.0.1 only), got {endpoint!r}"
        )
    found = S3Endpoint("127.0.0.1", port, bucket, os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
                       os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"))  # fmt: skip
    fs = s3fs.S3FileSystem(**found.storage_options())
    if not fs.exists(bucket):
        fs.call_s3("create_bucket", Bucket=bucket)  # no LocationConstraint: us-east-1 refuses one naming itself
    yield found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", default="2,4,8", help="comma-separated world sizes")
    parser.add_argument("--codecs", default="fp32,int8,int4,topk", help="comma-separated codecs (fp32: none)")
    parser.add_argument("--numel", type=_parse_size, default=_parse_size("1M"), help="fp32 elements per replica")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per codec (after one warm-up)")
    parser.add_argument("--rtt", type=parse_seconds, default=0.040, help="added round-trip time, e.g. 40ms")
    parser.add_argument("--link", type=_cap, default=50e6, help="bytes/s per replica link, e.g. 50MB/s")
    parser.add_argument("--per-connection", type=_cap, default=None, help="bytes/s per connection")
    parser.add_argument("--total", type=_cap, default=None, help="bytes/s over all links together")
    parser.add_argument("--connect-rtts", type=float, default=0.0,
                        help="round trips a new connection pays (default 0: moto's server closes every connection "
                             "after one response, which S3 does not, so a handshake per request would be charged "
                             "that a keep-alive client never pays)")  # fmt: skip
    parser.add_argument("--endpoint", default=None,
                        help="an S3 server on 127.0.0.1 you started, in place of moto's, e.g. http://127.0.0.1:9000")  # fmt: skip
    parser.add_argument("--bucket", default="crf-diloco-wan", help="the bucket on --endpoint (created if absent)")
    parser.add_argument("--pin", action="store_true",
                        help="moto's server and the proxy on the last CPU, the replicas on the others (cpu_split)")  # fmt: skip
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.replicas.split(",")]
    if args.rounds < 1 or min(worlds) < 2:
        parser.error("--rounds must be >= 1 and every --replicas >= 2")
    sys.path.insert(0, str(TEST_SUPPORT))
    from s3_server import moto_s3_server

    load_start = os.getloadavg()
    link = {"rtt": args.rtt, "per_connection": args.per_connection, "per_link": args.link, "total": args.total,
            "connect_rtts": args.connect_rtts}  # fmt: skip
    rows: list[Row] = []
    ctx = mp.get_context("spawn")
    replica_cores, server_cores = cpu_split(args.pin)
    pin_to(server_cores)  # moto's server thread and the proxy process start from here: they inherit it
    ours = args.endpoint is None  # moto runs here (its CPU counted, pinned with the proxy) or a server you started
    with moto_s3_server(args.bucket) if ours else _started_server(args.endpoint, args.bucket) as s3:
        parent, child = ctx.Pipe()
        proxy = ctx.Process(target=_proxy_process, args=(s3.port, max(worlds), link, 3600.0, child))
        proxy.start()
        try:
            ports = parent.recv()
            for world in worlds:
                rows.extend(_run(world, args, s3, parent, ports, replica_cores))
        finally:
            parent.send("stop")
            proxy.join(30)
            if proxy.is_alive():
                proxy.kill()
    served = "moto S3" if ours else f"{args.endpoint} (its CPU not counted)"
    print(f"ObjectStoreAllReduce over a simulated WAN: {served} behind a proxy, rtt {args.rtt * 1000:.0f} ms, "
          f"link {args.link or 0:.3g} B/s, per connection {args.per_connection or 0:.3g} B/s, total "
          f"{args.total or 0:.3g} B/s (0: no cap); {args.numel:,} fp32 elements per replica; median of "
          f"{args.rounds} rounds; {os.cpu_count()} CPUs, load average {' '.join(f'{v:.2f}' for v in load_start)} "
          f"at the start, {' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end; {placement(replica_cores, server_cores, 'moto' if ours else '')}")  # fmt: skip
    print(f"{'replicas':>8} {'codec':<13} {'MB/round':>9} {'round s':>8} {'floor s':>8} {'ratio':>6} "
          f"{'round trips':>11} {'idle polls':>10} {'requests':>9} {'CPU s':>6} {'servers':>7} {'CPU/round':>9}")  # fmt: skip
    for r in rows:
        print(f"{r.replicas:>8} {r.codec:<13} {r.wire_bytes / 1e6:>9.3f} {r.time:>8.3f} {r.floor:>8.3f} "
              f"{r.ratio:>6.2f} {r.round_trips:>11} {r.idle_round_trips:>10} {r.requests:>9.1f} {r.cpu:>6.2f} {r.server_cpu:>7.2f} "
              f"{r.cpu / r.time:>9.2f}")  # fmt: skip
    print(
        "MB/round: wire bytes per replica link and round (up + down, HTTP included); round trips: sequential "
        "request waves that found something (slowest replica); floor = bytes / bandwidth + round trips x rtt"
    )


if __name__ == "__main__":
    main()
