"""ObjectStoreAllReduce vs torch.distributed Gloo allreduce, side by side.

What is measured
    ``--replicas`` processes (default 4) each hold one fp32 tensor of ``--sizes`` elements (default
    16M and 64M) and average it across replicas with:

    * ``gloo``: ``torch.distributed.all_reduce`` on a Gloo process group (TCP on 127.0.0.1);
    * ``objstore-local``: :class:`crf_diloco.ObjectStoreAllReduce` on a local folder;
    * ``floor-local``: the protocol's file traffic and arithmetic alone on the same folder (write the
      payload, reduce one shard from ranged reads, write it, read the others, copy back; no records,
      MACs, checks or decision): what the protocol costs on top of its I/O is objstore − floor;
    * ``floor-concurrent``: the same traffic with the protocol's concurrency (background writes, the other replicas'
      slices and reduced shards read at once by a thread pool); the I/O floor is the faster of the two floors;
    * ``floor-auth``: ``floor-local`` plus the protocol's content tag (Poly1305 keyed per object,
      `crf_diloco.auth`) over every buffer written and read: the least an authenticated protocol does;
    * ``naive-local``: a naive file all-gather on the same folder (each replica writes its tensor,
      reads all the others' and sums them), the scheme the protocol replaces;
    * ``objstore-s3``: :class:`crf_diloco.ObjectStoreAllReduce` on ``s3://`` against moto's S3 server
      (a ``moto_server`` subprocess on 127.0.0.1) through s3fs (skip with ``--skip-s3``).

    Every replica enters each collective after a Gloo barrier; a collective's time is the slowest
    replica's time from the barrier to the end of its call; the figure is the median over ``--reps``, after
    ``--warmup`` untimed rounds of every variant (the protocol keeps ``keep_rounds`` rounds of objects, so its first
    rounds write into memory the machine hands out for the first time, several times slower on a VM).
    The same processes run every variant, so all of them see the same machine.

Bytes
    Bytes read and written per replica as a multiple of the tensor size, for world sizes 2, 4 and 8
    (threads on ``memory://``, ``--bytes-numel`` elements), and bytes per round of every codec (bf16, int8,
    int4, topk) against fp32 at world sizes 4 and 8: the mean and the largest replica's bytes read + written,
    divided by fp32's, next to the codec's payload ratio without headers. Every ObjectStoreAllReduce runs
    with a run secret (authenticated objects), as replicas started by ``crf-diloco launch`` do. Targets
    (issue 12): at most 2.9x the tensor size at every world size (the protocol moves 1 + 1/m + 2(m-1)/m,
    2.875x at m = 8; a naive all-gather moves N x), 4 x 64M at most 1.0x Gloo's time on a local folder,
    int8 at most 0.3x of uncompressed; the sparse codec (``topk``, default k = 41 of 4096) at most 0.02x.

Run: ``python benchmarks/allreduce.py`` (``--sizes 1M --reps 2 --skip-s3`` for a quick look; ``--bytes-only``
for the bytes tables alone).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


_OWN_FILES: list[str] = []


def _drop_own_files() -> None:
    """Delete this replica's files of earlier file-based collectives (every replica is past them: the Gloo
    barrier before each collective), so the folder in memory does not fill up."""
    while _OWN_FILES:
        os.unlink(_OWN_FILES.pop())


def _naive_allgather(t: Any, folder: str, rank: int, world_size: int, tag: str) -> None:
    """Each replica writes its whole tensor; each reads every other one and averages (N x download)."""
    import numpy as np
    import torch

    _drop_own_files()
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{tag}-{rank}.tmp")
    t.numpy().tofile(tmp)
    os.replace(tmp, os.path.join(folder, f"{tag}-{rank}.bin"))
    _OWN_FILES.append(os.path.join(folder, f"{tag}-{rank}.bin"))
    acc = t.clone()
    for r in range(world_size):
        if r == rank:
            continue
        path = os.path.join(folder, f"{tag}-{r}.bin")
        while not os.path.exists(path):
            time.sleep(0.001)
        acc += torch.from_numpy(np.fromfile(path, dtype=np.float32))
    t.copy_(acc / world_size)


BENCH_SECRET = "crf-diloco-benchmark-secret-" * 2
_FLOOR_BUFFERS: dict[int, Any] = {}


def _write_file(path: str, data: memoryview) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb", buffering=0) as f:
        f.write(data)
    os.link(tmp, path)
    os.unlink(tmp)


def _pread_when_there(path: str, offset: int, buf: memoryview) -> None:
    while not os.path.exists(path):
        time.sleep(0.001)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        f.readinto(buf)


def _floor_local(
    t: Any, folder: str, rank: int, world_size: int, tag: str, mac: Callable[[memoryview], object] | None = None
) -> None:
    """The protocol's file traffic and arithmetic and nothing else (no records, MACs, checks, decision, backoff):
    write the payload, reduce one shard from ranged reads, write it, read the other reduced shards, copy back.
    ``mac``: called on every buffer before it is written and after it is read (``floor-auth``)."""
    import torch

    mac = mac or (lambda view: None)

    n = t.numel()
    bounds = [k * n // world_size for k in range(world_size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    if n not in _FLOOR_BUFFERS:
        _FLOOR_BUFFERS[n] = (torch.empty(n), torch.empty(hi - lo))
    result, scratch = _FLOOR_BUFFERS[n]
    _drop_own_files()
    os.makedirs(folder, exist_ok=True)
    payload = memoryview(t.numpy()).cast("B")
    mac(payload)
    _write_file(os.path.join(folder, f"{tag}-data-{rank}"), payload)
    _OWN_FILES.extend(os.path.join(folder, f"{tag}-{kind}-{rank}") for kind in ("data", "reduced"))
    acc = result[lo:hi]
    for r in range(world_size):
        if r == rank:
            src = t[lo:hi]
        else:
            view = memoryview(scratch.numpy()).cast("B")
            _pread_when_there(os.path.join(folder, f"{tag}-data-{r}"), 4 * lo, view)
            mac(view)
            src = scratch
        acc.copy_(src) if r == 0 else acc.add_(src)
    acc /= world_size
    reduced = memoryview(acc.numpy()).cast("B")
    mac(reduced)
    _write_file(os.path.join(folder, f"{tag}-reduced-{rank}"), reduced)
    for k in range(world_size):
        if k != rank:
            view = memoryview(result[bounds[k] : bounds[k + 1]].numpy()).cast("B")
            _pread_when_there(os.path.join(folder, f"{tag}-reduced-{k}"), 0, view)
            mac(view)
    t.copy_(result)


def _content_tag() -> Callable[[memoryview], object]:
    """The protocol's content tag (`crf_diloco.auth.Authenticator.tag`, keyed with the benchmark's secret) as a
    function of one buffer: what authenticating every byte written and read costs, and nothing else."""
    from crf_diloco.auth import Authenticator

    auth, nonce = Authenticator(BENCH_SECRET, "floor-auth"), "00" * 16
    return lambda view: auth.tag("floor", nonce, 0, [view])


_POOL: list[Any] = []


def _floor_local_concurrent(t: Any, folder: str, rank: int, world_size: int, tag: str) -> None:
    """`_floor_local`'s traffic with the concurrency the protocol uses: the payload and the reduced shard are
    written on a background thread, the other replicas' slices and reduced shards are read by a pool at once."""
    import concurrent.futures

    import torch

    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(16))
    pool = _POOL[0]
    n = t.numel()
    bounds = [k * n // world_size for k in range(world_size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    key = ("concurrent", n)
    if key not in _FLOOR_BUFFERS:
        _FLOOR_BUFFERS[key] = (torch.empty(n), [torch.empty(hi - lo) for _ in range(world_size)])
    result, scratch = _FLOOR_BUFFERS[key]
    _drop_own_files()
    os.makedirs(folder, exist_ok=True)
    writes = [pool.submit(_write_file, os.path.join(folder, f"{tag}-data-{rank}"), memoryview(t.numpy()).cast("B"))]
    _OWN_FILES.extend(os.path.join(folder, f"{tag}-{kind}-{rank}") for kind in ("data", "reduced"))
    reads = {
        r: pool.submit(
            _pread_when_there, os.path.join(folder, f"{tag}-data-{r}"), 4 * lo, memoryview(scratch[r].numpy()).cast("B")
        )
        for r in range(world_size)
        if r != rank
    }
    acc = result[lo:hi]
    for r in range(world_size):
        if r != rank:
            reads[r].result()
        src = t[lo:hi] if r == rank else scratch[r]
        acc.copy_(src) if r == 0 else acc.add_(src)
    acc /= world_size
    writes.append(pool.submit(_write_file, os.path.join(folder, f"{tag}-reduced-{rank}"),
                              memoryview(acc.numpy()).cast("B")))  # fmt: skip
    gathers = [
        pool.submit(
            _pread_when_there,
            os.path.join(folder, f"{tag}-reduced-{k}"),
            0,
            memoryview(result[bounds[k] : bounds[k + 1]].numpy()).cast("B"),
        )
        for k in range(world_size)
        if k != rank
    ]
    for future in [*gathers, *writes]:
        future.result()
    t.copy_(result)


def _worker(rank: int, world_size: int, port: int, jobs: list[dict[str, Any]], out: Any) -> None:
    import torch
    import torch.distributed as dist

    from crf_diloco import ObjectStoreAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    reducers: dict[tuple[str, str], ObjectStoreAllReduce] = {}
    content_tag = _content_tag()
    for job in jobs:
        g = torch.Generator().manual_seed(rank)
        t = torch.randn(job["numel"], generator=g)
        dist.barrier()
        start = time.perf_counter()
        if job["kind"] == "gloo":
            dist.all_reduce(t)
            t /= world_size
        elif job["kind"] == "naive-local":
            _naive_allgather(t, job["uri"], rank, world_size, job["tag"])
        elif job["kind"] == "floor-local":
            _floor_local(t, job["uri"], rank, world_size, job["tag"])
        elif job["kind"] == "floor-auth":
            _floor_local(t, job["uri"], rank, world_size, job["tag"], mac=content_tag)
        elif job["kind"] == "floor-local-concurrent":
            _floor_local_concurrent(t, job["uri"], rank, world_size, job["tag"])
        else:
            key = (job["uri"], job["run_id"])
            if key not in reducers:
                reducers[key] = ObjectStoreAllReduce(
                    job["uri"],
                    rank,
                    world_size,
                    run_id=job["run_id"],
                    timeout=600,
                    storage_options=job.get("options"),
                    secret=BENCH_SECRET,
                )
            reducers[key].allreduce(t)
        elapsed = time.perf_counter() - start
        out.put((job["label"], rank, elapsed, float(t[:4].sum())))
    dist.barrier()
    dist.destroy_process_group()


def _run_jobs(world_size: int, jobs: list[dict[str, Any]]) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, jobs, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    per_job: dict[tuple[str, int], dict[int, float]] = {}
    checks: dict[tuple[str, int], set[float]] = {}
    seen: dict[str, int] = {}
    for _ in range(world_size * len(jobs)):
        label, rank, elapsed, check = queue.get(timeout=3600)
        idx = seen.get(f"{label}/{rank}", 0)
        seen[f"{label}/{rank}"] = idx + 1
        per_job.setdefault((label, idx), {})[rank] = elapsed
        checks.setdefault((label, idx), set()).add(round(check, 4))
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a benchmark replica exited with code {p.exitcode}")
    for key, values in checks.items():
        if len(values) != 1:
            raise RuntimeError(f"{key}: replicas disagree on the result ({values})")
    times: dict[str, list[float]] = {}
    for (label, _), ranks in sorted(per_job.items()):
        if not label.startswith("warmup:"):
            times.setdefault(label, []).append(max(ranks.values()))
    return times


def _start_moto() -> tuple[subprocess.Popen[bytes], dict[str, Any], str]:
    import boto3

    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(exe):
        exe = shutil.which("moto_server") or exe
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    bucket = "crf-diloco-bench"
    creds = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds).create_bucket(Bucket=bucket)
    options = {
        "key": "bench",
        "secret": "bench",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return proc, options, f"s3://{bucket}"


def _bytes_table(numel: int) -> None:
    import torch

    from crf_diloco import ObjectStoreAllReduce

    def run(world_size: int, compression: str | None) -> list[tuple[int, int]]:
        uri = f"memory://crf-bench-{uuid.uuid4().hex}"
        out: list[tuple[int, int]] = [(0, 0)] * world_size

        def replica(rank: int) -> None:
            ar = ObjectStoreAllReduce(uri, rank, world_size, timeout=600, compression=compression, secret=BENCH_SECRET)
            ar.allreduce(torch.randn(numel))
            out[rank] = (ar.bytes_read, ar.bytes_written)

        threads = [threading.Thread(target=replica, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    size = 4 * numel
    print(f"\nBytes per replica / tensor size ({numel:,} fp32 elements; naive all-gather moves N x)")
    print(f"{'world':>5} {'written':>8} {'read':>8} {'total':>8} {'max total':>10}  (target <= 2.9)")
    for world_size in (2, 4, 8):
        counts = run(world_size, None)
        totals = [(r + w) / size for r, w in counts]
        mean_w = statistics.mean(w for _, w in counts) / size
        mean_r = statistics.mean(r for r, _ in counts) / size
        print(f"{world_size:>5} {mean_w:>8.3f} {mean_r:>8.3f} {statistics.mean(totals):>8.3f} {max(totals):>10.3f}")
    from crf_diloco.payload import codec_of
    from crf_diloco.wire import parse_codec

    targets = {"int8": "<= 0.3", "topk": "<= 0.02"}
    print(f"\nBytes per round per replica, codec / fp32 ({numel:,} elements; payload = data only, no headers)")
    print(f"{'world':>5} {'codec':<14} {'payload':>8} {'mean':>8} {'max':>8}  target")
    for world_size in (4, 8):
        plain = [r + w for r, w in run(world_size, None)]
        for compression in ("bf16", "int8", "int4", "topk"):
            got = [r + w for r, w in run(world_size, compression)]
            ratios = [a / b for a, b in zip(got, plain, strict=True)]
            name = codec_of(compression)
            print(
                f"{world_size:>5} {name:<14} {parse_codec(name).ratio():>8.4f} {statistics.mean(ratios):>8.4f} "
                f"{max(ratios):>8.4f}  {targets.get(compression, '')}"
            )


#: the file-based variants beside the protocol: (job kind, folder under the benchmark's, label)
FILE_VARIANTS = (
    ("floor-local", "floor", "floor-local"),
    ("floor-auth", "floor-auth", "floor-auth"),
    ("floor-local-concurrent", "floor-concurrent", "floor-concurrent"),
    ("naive-local", "naive", "naive-local"),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sizes", default="16M,64M", help="comma-separated element counts, e.g. 16M,64M")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed rounds of every variant first (default 3: the protocol keeps keep_rounds=2 rounds of objects, "
        "so its first rounds write into memory the machine has not handed out before)",
    )
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--s3-sizes", default=None, help="sizes for the moto S3 runs (default: --sizes)")
    parser.add_argument("--bytes-numel", default="4M")
    parser.add_argument("--bytes-only", action="store_true", help="print the bytes tables only (no timings)")
    parser.add_argument(
        "--folder",
        default=None,
        help="local folder for the file-based variants (default: a new dir in /dev/shm if present, else the temp dir)",
    )
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    if args.bytes_only:
        _bytes_table(_parse_size(args.bytes_numel))
        return

    load_start = os.getloadavg()[0]
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    s3_sizes = [_parse_size(s) for s in args.s3_sizes.split(",")] if args.s3_sizes else sizes
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    folder = args.folder or tempfile.mkdtemp(prefix="crf-allreduce-bench-", dir=shm)
    moto = None
    jobs: list[dict[str, Any]] = []
    try:
        if not args.skip_s3:
            moto, options, s3_uri = _start_moto()
        for numel in sizes:
            for rep in range(args.warmup + args.reps):
                untimed = "warmup:" if rep < args.warmup else ""  # warm-up rounds run, their times are dropped
                jobs.append({"kind": "gloo", "numel": numel, "label": f"{untimed}gloo/{numel}"})
                jobs.append(
                    {
                        "kind": "objstore",
                        "numel": numel,
                        "uri": folder,
                        "run_id": f"local{numel}",
                        "label": f"{untimed}objstore-local/{numel}",
                    }
                )
                for kind, subdir, name in FILE_VARIANTS:
                    jobs.append(
                        {
                            "kind": kind,
                            "numel": numel,
                            "uri": os.path.join(folder, subdir),
                            "tag": f"{numel}-{rep}",
                            "label": f"{untimed}{name}/{numel}",
                        }
                    )
                if moto is not None and numel in s3_sizes:
                    jobs.append(
                        {
                            "kind": "objstore",
                            "numel": numel,
                            "uri": s3_uri,
                            "run_id": f"s3{numel}",
                            "options": options,
                            "label": f"{untimed}objstore-s3/{numel}",
                        }
                    )
        times = _run_jobs(args.replicas, jobs)
    finally:
        if moto is not None:
            moto.kill()
            moto.wait()
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)

    print(
        f"ObjectStoreAllReduce vs Gloo: {args.replicas} replicas, fp32, median of {args.reps} (seconds; ratio = / gloo)"
    )
    print(
        f"local folder: {folder}; {os.cpu_count()} CPUs, load average {load_start:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end"
    )
    print(f"{'elements':>10} {'variant':<18} {'time':>8} {'ratio':>7} {'/ floor':>8} {'/ auth floor':>13}")
    variants = ("gloo", "objstore-local", "floor-local", "floor-concurrent", "floor-auth", "naive-local", "objstore-s3")
    for numel in sizes:
        gloo = statistics.median(times[f"gloo/{numel}"])
        floor = min(statistics.median(times[f"{v}/{numel}"]) for v in ("floor-local", "floor-concurrent"))
        auth_floor = statistics.median(times[f"floor-auth/{numel}"])
        for variant in variants:
            key = f"{variant}/{numel}"
            if key in times:
                t = statistics.median(times[key])
                print(
                    f"{numel:>10,} {variant:<18} {t:>8.3f} {t / gloo:>7.2f} {t / floor:>8.2f} {t / auth_floor:>13.2f}"
                )
    print(
        "ratio: / Gloo; / floor: / the faster of floor-local and floor-concurrent (the protocol's own I/O floor); "
        "/ auth floor: / floor-auth (that I/O plus the protocol's content tag over every byte written and read)"
    )
    _bytes_table(_parse_size(args.bytes_numel))


if __name__ == "__main__":
    main()
