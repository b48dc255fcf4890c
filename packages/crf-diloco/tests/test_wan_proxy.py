"""The WAN proxy of the benchmarks (``wan_proxy.py``): bytes intact, delays and caps at least as configured,
127.0.0.1 only, bounded, stops by itself; an S3 round through it. Every wait here is bounded; no assertion depends on
this machine being fast (only lower bounds the proxy guarantees)."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from wan_proxy import CHUNK, WanLink, WanProxy, _Pacer

from crf_diloco import Link, MockManager, ObjectStoreAllReduce

SECRET = "wan-proxy-test-secret-0123456789abcdef"


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A TCP server on 127.0.0.1 that sends back what it receives, until the client half-closes."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[:2]
    stop.set()
    server.close()


def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` through the proxy to the echo server and read it all back."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        sender = threading.Thread(target=lambda: (conn.sendall(data), conn.shutdown(socket.SHUT_WR)))
        sender.start()
        back = bytearray()
        while chunk := conn.recv(1 << 16):
            back += chunk
        sender.join(30)
    return bytes(back)


def test_bytes_pass_intact_and_are_counted_per_link(echo: tuple[str, int]) -> None:
    data = os.urandom(3 * CHUNK + 123)
    with WanProxy(echo, links=2, link=WanLink(rtt=0.002, per_link=200e6), lifetime=60) as proxy:
        assert _exchange(proxy.ports[1], data) == data
        deadline = time.monotonic() + 30
        while proxy.stats[1].down < len(data) and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = proxy.snapshot()
    assert (stats[1].up, stats[1].down, stats[1].connections) == (len(data), len(data), 1)
    assert (stats[0].up, stats[0].down, stats[0].connections) == (0, 0, 0), "the other link saw nothing"


def test_latency_and_bandwidth_are_at_least_as_configured(echo: tuple[str, int]) -> None:
    """Lower bounds only: an exchange costs at least one rtt plus a handshake rtt; n bytes each way (the echo starts
    sending back as the first bytes arrive) cost the handshake, 2n / rate on a link that carries both directions
    together, and the last byte's half round trip."""
    rtt, rate, n = 0.2, 2e6, 400_000
    with WanProxy(echo, link=WanLink(rtt=rtt, per_link=rate, connect_rtts=1), lifetime=60) as proxy:
        start = time.monotonic()
        assert _exchange(proxy.ports[0], b"x") == b"x"
        assert time.monotonic() - start >= 2 * rtt  # handshake + request/response
        start = time.monotonic()
        assert _exchange(proxy.ports[0], b"y" * n) == b"y" * n
        assert time.monotonic() - start >= rtt + 2 * n / rate + rtt / 2


def test_pacers_never_carry_more_than_their_rate() -> None:
    """The virtual clock: chunks booked back to back on a 1 MB/s pacer leave at n/rate intervals; no cap passes."""
    pacer = _Pacer(1e6)
    assert pacer.book(10.0, 500_000) == pytest.approx(10.5)
    assert pacer.book(max(10.0, pacer.free), 250_000) == pytest.approx(10.75)
    assert _Pacer(None).book(3.0, 10**9) == 3.0


def test_listens_on_loopback_only_and_refuses_other_upstreams() -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        WanProxy(("10.0.0.1", 80))
    with pytest.raises(ValueError, match="lifetime"):
        WanProxy(("127.0.0.1", 80), lifetime=0)
    with pytest.raises(ValueError, match="rtt"):
        WanLink(rtt=-1)
    with pytest.raises(ValueError, match="per_link"):
        WanLink(per_link=10)
    with WanProxy(("127.0.0.1", 9), links=3, lifetime=30) as proxy:
        assert [host for host, _ in proxy.addresses] == ["127.0.0.1"] * 3


def test_stops_by_itself_after_its_lifetime_and_closes_connections(echo: tuple[str, int]) -> None:
    proxy = WanProxy(echo, link=WanLink(rtt=0.0), lifetime=1).start()
    conn = socket.create_connection(("127.0.0.1", proxy.ports[0]), timeout=30)
    proxy._thread.join(30)  # type: ignore[union-attr]
    assert not proxy.running, "the proxy outlived its lifetime"
    conn.settimeout(30)
    assert conn.recv(1) == b"", "its connections were closed"
    conn.close()
    with pytest.raises(RuntimeError, match="started already"):
        proxy.start()


def _two_replicas_through_a_proxy(
    moto_s3: dict[str, Any],
    run_replicas: Callable[..., list[Any]],
    link: WanLink,
    replica: Callable[[ObjectStoreAllReduce], Any],
) -> tuple[list[Any], Any]:
    """``replica(allreduce)`` for ranks 0 and 1 (conftest's ``run_replicas``), each on moto's S3 server through its own
    link of one `WanProxy`, under a fresh prefix; each rank's result and the proxy's per-link counts."""
    host, port = moto_s3["endpoint"].removeprefix("http://").split(":")
    uri = f"s3://{moto_s3['bucket']}/wan-{uuid.uuid4().hex[:8]}"
    with WanProxy((host, int(port)), links=2, link=link, lifetime=300) as proxy:
        options = [{**moto_s3["storage_options"], "endpoint_url": f"http://127.0.0.1:{p}"} for p in proxy.ports]

        def run(rank: int) -> Any:
            ar = ObjectStoreAllReduce(uri, rank, 2, secret=SECRET, timeout=120, storage_options=options[rank])
            try:
                return replica(ar)
            finally:
                ar.close()

        out = run_replicas(run, 2, timeout=240)
        stats = proxy.snapshot()
    return out, stats


def test_an_s3_round_through_the_proxy_commits_and_is_counted(
    moto_s3: dict[str, Any], run_replicas: Callable[..., list[Any]]
) -> None:
    """Two replicas on moto's S3 server, each through its own link: the round commits with the exact mean, every
    byte the stores counted crossed the proxy, and concurrent requests share round trips."""

    def replica(ar: ObjectStoreAllReduce) -> Any:
        t = torch.full((4096,), float(ar.rank))
        ar.allreduce(t)
        return t, ar.store.traffic()

    out, stats = _two_replicas_through_a_proxy(moto_s3, run_replicas, WanLink(rtt=0.005, per_link=100e6), replica)
    for rank, (t, traffic) in enumerate(out):
        assert torch.equal(t, torch.full((4096,), 0.5))
        assert stats[rank].bytes >= traffic.bytes_read + traffic.bytes_written > 4 * 4096
        assert 0 < traffic.round_trips < traffic.requests, "overlapping requests share a round trip"


def test_a_sync_over_the_wan_takes_at_least_its_floor(
    moto_s3: dict[str, Any], run_replicas: Callable[..., list[Any]]
) -> None:
    """`MockManager.syncs` against a real delay line: each sync's recorded time is at least the floor its own counts
    give on that link (``bytes / bandwidth + busy round trips x rtt``), so neither the round trips nor the bytes are
    over-counted, and the sync's bytes all crossed the proxy."""
    rtt, rate, syncs = 0.030, 20e6, 3
    link = Link(rtt, rate)

    def replica(ar: ObjectStoreAllReduce) -> Any:
        manager = MockManager(ar, checkpoint=False)
        for _ in range(syncs):
            manager.start_quorum()
            work = manager.allreduce(torch.full((65536,), float(ar.rank)))
            manager.current_step()  # the round starts in the background
            assert work.wait()
            assert manager.should_commit()
        manager.shutdown()
        return manager.syncs, ar.store.traffic()

    out, stats = _two_replicas_through_a_proxy(moto_s3, run_replicas, WanLink(rtt=rtt, per_link=rate), replica)
    for rank, (records, total) in enumerate(out):
        assert [r.committed for r in records] == [True] * syncs
        for r in records:
            moved = r.traffic.bytes_read + r.traffic.bytes_written
            assert moved > 65536 * 4  # the payload up, the reduced shard and the other's shard down
            assert r.traffic.busy_round_trips >= 3  # announce, payload, decision: a round cannot take fewer
            floor = link.floor_s(moved, r.traffic.busy_round_trips)
            print(rank, r.round_id, round(r.seconds, 3), round(floor, 3), r.traffic)
            assert r.seconds >= floor, (rank, r, floor)
        assert stats[rank].bytes >= sum(r.traffic.bytes_read + r.traffic.bytes_written for r in records)
        assert total.bytes_read + total.bytes_written >= sum(
            r.traffic.bytes_read + r.traffic.bytes_written for r in records
        )
