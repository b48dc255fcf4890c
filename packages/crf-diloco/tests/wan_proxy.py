"""A WAN between replicas and a bucket, on 127.0.0.1: a TCP proxy that adds latency and caps bandwidth.

Test and benchmark support (not shipped). ``WanProxy(upstream, links=N, link=WanLink(...))`` listens on ``N`` ports of
127.0.0.1, one per replica (its *link*), and forwards every connection to ``upstream`` (e.g. moto's S3 server). Each
direction of each connection is a delay line with pacing:

* every chunk is delayed by ``rtt / 2`` (so one request/response exchange costs one ``rtt``), and the first bytes of
  a new connection by ``connect_rtts × rtt`` more (the TCP handshake a real connection pays);
* bandwidth is a virtual-clock pacer per connection (``per_connection``), per link (``per_link``: the replica's own
  line, both directions together) and over all links (``total``): a chunk of ``n`` bytes starts when every pacer it
  crosses is free and occupies each for ``n / rate`` seconds, so no pacer ever carries more than its rate. A chunk is
  booked at most ``AHEAD`` (10 ms) before that time, so connections that share a link take turns (one that read
  megabytes ahead from its upstream does not hold the link until they are sent, which would let a per-connection
  cap idle the link).

Deterministic: delays follow from arrival times and sizes only (no randomness). Bounded: at most ``buffer`` bytes
queue per direction (the sender waits beyond that) and ``lifetime`` seconds after `start` the proxy closes every
connection and stops by itself. Listens on 127.0.0.1 only and forwards only to a 127.0.0.1 upstream.

`LinkStats` counts bytes per link and direction and connections, so a benchmark can compute a round's floor:
``bytes on the wire / bandwidth + sequential round trips × rtt``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["LinkStats", "WanLink", "WanProxy"]

CHUNK = 64 * 1024
#: how far ahead of now a chunk may be booked on its pacers (connections sharing a link interleave at this grain)
AHEAD = 0.010


@dataclass(frozen=True)
class WanLink:
    """What the network between a replica and the bucket looks like.

    Args:
        rtt: round-trip time added to every exchange, seconds (half each way).
        per_connection: bytes/s one TCP connection carries (``None``: no cap of its own).
        per_link: bytes/s one replica's line carries, up and down together (``None``: no cap).
        total: bytes/s all links together carry (``None``: no cap), e.g. a shared bottleneck.
        connect_rtts: round trips a new connection pays before its first byte (TCP handshake: 1).
    """

    rtt: float = 0.040
    per_connection: float | None = None
    per_link: float | None = 50e6
    total: float | None = None
    connect_rtts: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.rtt, (int, float)) and 0 <= self.rtt <= 10):
            raise ValueError(f"rtt must be seconds in [0, 10], got {self.rtt!r}")
        for name in ("per_connection", "per_link", "total"):
            rate = getattr(self, name)
            if rate is not None and not (isinstance(rate, (int, float)) and 1e3 <= rate <= 1e12):
                raise ValueError(f"{name} must be bytes/s in [1e3, 1e12] or None (no cap), got {rate!r}")
        if not 0 <= self.connect_rtts <= 10:
            raise ValueError(f"connect_rtts must be in [0, 10], got {self.connect_rtts!r}")

    @property
    def bandwidth(self) -> float:
        """The tightest cap one replica's traffic meets (``inf`` with none)."""
        caps = [r for r in (self.per_link, self.total) if r is not None]
        return min(caps) if caps else math.inf


@dataclass
class LinkStats:
    """Traffic of one link: bytes up (replica to upstream) and down, and connections opened."""

    up: int = 0
    down: int = 0
    connections: int = 0

    @property
    def bytes(self) -> int:
        return self.up + self.down


class _Pacer:
    """A virtual clock: the earliest time the resource it models is free again."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.free = 0.0

    def book(self, start: float, n: int) -> float:
        """Occupy the resource for ``n`` bytes from ``start``; the time the last byte leaves."""
        if self.rate is None:
            return start
        self.free = start + n / self.rate
        return self.free


@dataclass
class _Direction:
    """One direction of one connection: chunks waiting for their delivery time, and the bytes they hold."""

    queue: deque[tuple[float, bytes]] = field(default_factory=deque)
    queued: int = 0
    closed: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class WanProxy:
    """A latency/bandwidth-shaping TCP proxy on 127.0.0.1 in front of ``upstream`` (a 127.0.0.1 ``(host, port)``).

    Args:
        upstream: where connections go, e.g. moto's S3 server; must be on 127.0.0.1.
        links: how many listening ports (one per replica); `ports` lists them after `start`.
        link: the network's shape (`WanLink`).
        lifetime: seconds after `start` at which the proxy stops by itself (1 s to 24 h).
        buffer: bytes that may queue per direction before the sender waits (at least one chunk).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        links: int = 1,
        link: WanLink | None = None,
        lifetime: float = 600.0,
        buffer: int = 8 << 20,
    ) -> None:
        host, port = upstream
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"upstream must be on 127.0.0.1 (this proxy never leaves the machine), got {host!r}")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"upstream port must be an int in (0, 65536), got {port!r}")
        if not isinstance(links, int) or not 1 <= links <= 256:
            raise ValueError(f"links must be an int in [1, 256] (one per replica), got {links!r}")
        if not 1 <= lifetime <= 86400:
            raise ValueError(f"lifetime must be seconds in [1, 86400] (the proxy stops by itself), got {lifetime!r}")
        if buffer < CHUNK:
            raise ValueError(f"buffer must be at least {CHUNK} bytes, got {buffer!r}")
        self.upstream = ("127.0.0.1", port)
        self.link = link or WanLink()
        self.lifetime = lifetime
        self.buffer = buffer
        self.stats = [LinkStats() for _ in range(links)]
        self.ports: list[int] = []
        #: where each link listens, as the operating system reports it
        self.addresses: list[tuple[str, int]] = []
        self._links = links
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._total = _Pacer(self.link.total)
        self._link_pacers = [_Pacer(self.link.per_link) for _ in range(links)]
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle (any thread) ---------------------------------------------------------------------------
    def start(self) -> WanProxy:
        """Start listening (in a daemon thread running its own event loop); returns once `ports` is filled."""
        if self._thread is not None:
            raise RuntimeError("this WanProxy was started already; make a new one")
        self._thread = threading.Thread(target=self._run, name="wan-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the WAN proxy did not start within 10 s")
        if self._error is not None:
            raise RuntimeError(f"the WAN proxy could not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection and stop; returns once the proxy's thread ended (or ``timeout`` passed)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> WanProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> list[LinkStats]:
        """A copy of every link's counters."""
        return [LinkStats(s.up, s.down, s.connections) for s in self.stats]

    # -- the event loop --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() if it happens before ready
            self._error = exc
        finally:
            self._stopped.set()
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        servers = []
        try:
            for index in range(self._links):
                server = await asyncio.start_server(
                    lambda r, w, i=index: self._serve(i, r, w), "127.0.0.1", 0, reuse_address=True
                )
                servers.append(server)
                host, port = server.sockets[0].getsockname()[:2]
                self.addresses.append((host, port))
                self.ports.append(port)
            self._ready.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.lifetime)
        finally:
            for server in servers:
                server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for server in servers:
                await server.wait_closed()

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _serve(self, index: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        stats = self.stats[index]
        stats.connections += 1
        opened = time.monotonic() + self.link.connect_rtts * self.link.rtt  # the handshake's cost
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        conn = _Pacer(self.link.per_connection)
        up, down = _Direction(), _Direction()
        pumps = [
            self._spawn(self._read(client_r, up, conn, index, "up", opened)),
            self._spawn(self._write(up, up_w)),
            self._spawn(self._read(up_r, down, conn, index, "down", opened)),
            self._spawn(self._write(down, client_w)),
        ]
        try:
            await asyncio.gather(*pumps)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            for writer in (up_w, client_w):
                writer.close()

    async def _read(
        self, reader: asyncio.StreamReader, out: _Direction, conn: _Pacer, index: int, way: str, opened: float
    ) -> None:
        """Read chunks as they come and schedule each one's delivery: after its transmission through every pacer it
        crosses, plus half a round trip."""
        link, stats = self._link_pacers[index], self.stats[index]
        try:
            while True:
                while out.queued >= self.buffer:
                    out.changed.clear()
                    await out.changed.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                n = len(data)
                while (start := max(time.monotonic(), opened, conn.free, link.free, self._total.free)) > (
                    ahead := time.monotonic() + AHEAD
                ):
                    await asyncio.sleep(start - ahead)  # no connection books a pacer more than AHEAD in advance
                done = max(conn.book(start, n), link.book(start, n), self._total.book(start, n))
                out.queue.append((done + self.link.rtt / 2, data))
                out.queued += n
                if way == "up":
                    stats.up += n
                else:
                    stats.down += n
                out.changed.set()
        finally:
            out.closed = True
            out.changed.set()

    async def _write(self, inp: _Direction, writer: asyncio.StreamWriter) -> None:
        """Deliver chunks at their time, in order; half-close the other side once the reader ended."""
        while True:
            if not inp.queue:
                if inp.closed:
                    with contextlib.suppress(OSError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                inp.changed.clear()
                await inp.changed.wait()
                continue
            due, data = inp.queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            inp.queue.popleft()
            inp.queued -= len(data)
            inp.changed.set()
            writer.write(data)
            await writer.drain()
