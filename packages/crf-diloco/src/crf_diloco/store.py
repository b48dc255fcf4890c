"""A thin fsspec wrapper with create-only writes, ranged reads, retries and byte counters.

Create-only semantics per backend (fsspec 2026.9, read from its source):

* local files: ``AbstractFileSystem.pipe_file(mode="create")`` is an ``exists()`` check followed by a
  plain write, which races and lets readers see a half-written file. We instead write a temporary
  file in the same directory and ``os.link`` it into place; ``link`` fails with ``FileExistsError``
  if the name exists and readers only ever see complete objects.
* ``memory://``: ``pipe_file(mode="create")`` opens with ``"xb"``, which checks and then creates (two threads can
  both win); the check-and-create runs under a process-wide lock here, so exactly one writer wins.
* ``s3://`` (s3fs): ``pipe_file(mode="create")`` sends ``If-None-Match: *``; a 412 surfaces as
  ``FileExistsError`` or, depending on the error body, ``OSError(EINVAL, "...Precondition...")``;
  both mean "already exists". Other protocols that implement ``mode="create"`` work the same way.

`ObjectStore.preflight` proves it for the store at hand (it writes one key twice and requires the second write to
fail); `ObjectStoreAllReduce` runs that check before its first round and refuses a store that overwrites.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from crf_diloco.errors import AllReduceError, CorruptObjectError, StoreBackendMissingError

__all__ = ["ADAPTER_PACKAGES", "ObjectStore", "Traffic", "validate_uri"]

T = TypeVar("T")

#: fsspec protocol -> the package that provides its adapter.
ADAPTER_PACKAGES: dict[str, str] = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
}


class _ClaimedPaths:
    """Create-only for ``memory://``: one writer at a time per path (others wait for it, then see the object).

    ``MemoryFileSystem.pipe_file(mode="create")`` checks that the path is free and then creates it, so two threads
    can both win. A claim makes check-and-create exclusive per path without serialising writes of other paths.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[str, threading.Event] = {}

    @contextlib.contextmanager
    def claim(self, fs: MemoryFileSystem, path: str) -> Iterator[None]:
        """Hold ``path`` for one create; raise ``FileExistsError`` if it exists (after any writer in flight)."""
        while True:
            with self._lock:
                busy = self._busy.get(path)
                if busy is None:
                    if fs.exists(path):
                        raise FileExistsError(path)
                    done = self._busy[path] = threading.Event()
                    break
            busy.wait()
        try:
            yield
        finally:
            with self._lock:
                del self._busy[path]
            done.set()


_MEMORY_CREATES = _ClaimedPaths()
_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]*")
_SCHEME_LIKE_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")


def validate_uri(uri: str) -> str:
    """Return ``uri`` if it names a store location exactly, else raise ``ValueError`` naming the problem.

    Refused: empty or whitespace-padded strings and control characters (``"/data\\n"``), a URI without a bucket or
    folder (``"s3://"``, which would otherwise become a local folder named ``s3:``), a malformed scheme, and a
    scheme without ``//`` (``"s3:bucket"``, also a local folder otherwise).
    """
    if not isinstance(uri, str):
        raise TypeError(f"uri must be a str, got {type(uri).__name__}")
    if not uri.strip() or uri != uri.strip() or any(ord(c) < 32 or ord(c) == 127 for c in uri):
        raise ValueError(
            f"uri={uri!r} is empty, padded with whitespace or holds control characters; give the URI alone"
        )
    protocol, path = fsspec.core.split_protocol(uri)
    if protocol is not None:
        if not _SCHEME_RE.fullmatch(protocol):
            raise ValueError(f"uri={uri!r} has a malformed scheme {protocol!r}; write e.g. s3://bucket/prefix")
        if not path.strip("/"):
            raise ValueError(f"uri={uri!r} names no bucket or folder; write {protocol}://<bucket-or-folder>[/prefix]")
    elif _SCHEME_LIKE_RE.match(uri) and not uri.startswith(("./", "/")):
        scheme = uri.split(":", 1)[0]
        raise ValueError(
            f"uri={uri!r} looks like a {scheme}: URI without '//' and would become a local folder; write "
            f"{scheme}://<bucket-or-folder>[/prefix], or ./{uri} for a local folder"
        )
    return uri


_NOT_TRANSIENT = (FileNotFoundError, FileExistsError)


def _missing_adapter_error(uri: str, protocol: str, cause: BaseException) -> StoreBackendMissingError:
    package = ADAPTER_PACKAGES.get(protocol)
    hint = (
        f"install `{package}` (pip install {package}, or crf-diloco's extra for it)"
        if package
        else "install the fsspec adapter package for that protocol"
    )
    return StoreBackendMissingError(
        f"cannot open {uri!r}: no fsspec adapter for protocol {protocol!r}; {hint}. ({cause})"
    )


def _is_precondition_failed(exc: OSError) -> bool:
    return exc.errno == errno.EINVAL and "precondition" in str(exc).lower()


@dataclass(frozen=True)
class Traffic:
    """What a store carried: payload bytes, requests, and how many of them were sequential.

    ``round_trips`` counts request *waves*: a request that starts while none of this store's requests is in flight
    opens one, and requests that overlap it (concurrent reads, a background write) belong to it; over a network
    each wave costs at least one round trip, so this is the number of sequential round trips. ``idle_round_trips``
    are the waves in which every request found nothing (polls for an object that is not there yet). Subtract two
    snapshots for what happened in between."""

    bytes_read: int = 0
    bytes_written: int = 0
    requests: int = 0
    round_trips: int = 0
    idle_round_trips: int = 0

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def busy_round_trips(self) -> int:
        """Sequential request waves that found something (``round_trips - idle_round_trips``)."""
        return self.round_trips - self.idle_round_trips


class ObjectStore:
    """Keys under one prefix of an fsspec filesystem.

    Args:
        uri: any fsspec URI or a bare local path. Local paths and ``file://`` URIs have their
            directory created immediately; other backends are resolved lazily (first use or
            :meth:`preflight`), so a missing adapter fails there with :class:`StoreBackendMissingError`.
        storage_options: passed to the fsspec filesystem (e.g. ``{"endpoint_url": ...}`` for S3).
        retries: extra attempts on transient errors (``OSError`` other than not-found/exists/permission).
        retry_backoff: first back-off in seconds; doubles on each attempt.
    """

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int = 3,
        retry_backoff: float = 0.05,
    ) -> None:
        validate_uri(uri)
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if retry_backoff < 0:
            raise ValueError(f"retry_backoff must be >= 0, got {retry_backoff}")
        self.uri = uri
        protocol, _ = fsspec.core.split_protocol(uri)
        self.protocol = protocol or "file"
        # object stores are polled for objects other replicas create: never trust a cached listing
        self.storage_options = {"use_listings_cache": False, **(storage_options or {})}
        self.retries = retries
        self.retry_backoff = retry_backoff
        self._fs: fsspec.AbstractFileSystem | None = None
        self._root = ""
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self._requests = 0
        self._in_flight = 0
        self._waves = 0
        self._idle_waves = 0
        self._wave_found = False
        if self.protocol in ("file", "local"):
            self._resolve()
            os.makedirs(self._root, exist_ok=True)

    # -- resolution ---------------------------------------------------------------------------
    def _resolve(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            try:
                fs, root = fsspec.core.url_to_fs(self.uri, **_without_sdk_checks(self.protocol, self.storage_options))
            except ImportError as exc:
                raise _missing_adapter_error(self.uri, self.protocol, exc) from exc
            except ValueError as exc:
                if "protocol" in str(exc).lower():
                    raise _missing_adapter_error(self.uri, self.protocol, exc) from exc
                raise
            _skip_continue(fs)
            self._fs, self._root = fs, str(root).rstrip("/")
        return self._fs

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._resolve()

    @property
    def remote(self) -> bool:
        """True unless the store is a local folder or ``memory://``: requests cost a network round trip, so fewer,
        larger and concurrent ones pay."""
        return not isinstance(self.fs, (LocalFileSystem, MemoryFileSystem))

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, key: str) -> str:
        """Full filesystem path of ``key`` (relative to the prefix)."""
        self._resolve()
        return f"{self._root}/{key}" if self._root else key

    def _local_path(self, key: str) -> str:
        """``key`` on the local disk. `CorruptObjectError` if a directory between the prefix and the object is a
        symbolic link or resolves outside the prefix: nothing planted in the store redirects a read or a write."""
        path = self.path(key)
        folder = os.path.dirname(key)
        root = os.path.realpath(self._root)
        if os.path.realpath(os.path.dirname(path)) != (os.path.join(root, folder) if folder else root):
            raise CorruptObjectError(
                f"{key}: a directory on its path under {self.uri!r} is a symbolic link or leaves the store prefix; "
                "refused (the store holds something crf-diloco never writes)"
            )
        return path

    # -- accounting ---------------------------------------------------------------------------
    def traffic(self) -> Traffic:
        """Bytes, requests and sequential round trips so far (`Traffic`)."""
        with self._lock:
            return Traffic(self.bytes_read, self.bytes_written, self._requests, self._waves, self._idle_waves)

    def _begin(self) -> None:
        with self._lock:
            self._requests += 1
            if self._in_flight == 0:
                self._waves += 1
                self._wave_found = False
            self._in_flight += 1

    def _end(self, found: bool) -> None:
        with self._lock:
            self._wave_found = self._wave_found or found
            self._in_flight -= 1
            if self._in_flight == 0 and not self._wave_found:
                self._idle_waves += 1

    # -- retries ------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        self._begin()
        found = False
        try:
            result = self._attempts(what, fn)
            found = True
            return result
        except FileNotFoundError:
            raise
        except BaseException:
            found = True  # an answer, if not the one hoped for
            raise
        finally:
            self._end(found)

    def _attempts(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.retry_backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (IsADirectoryError, NotADirectoryError) as exc:
                raise CorruptObjectError(
                    f"{what} under {self.uri!r}: the store holds something other than an object there ({exc})"
                ) from exc
            except PermissionError as exc:
                raise AllReduceError(f"permission denied on {what} under {self.uri!r}: {exc}") from exc
            except _NOT_TRANSIENT:
                raise
            except OSError as exc:
                if isinstance(exc, OSError) and _is_precondition_failed(exc):
                    raise FileExistsError(str(exc)) from exc
                if attempt == self.retries:
                    raise AllReduceError(
                        f"store error on {what} under {self.uri!r} after {self.retries + 1} attempts: {exc!r}"
                    ) from exc
            except Exception as exc:
                if "credential" in type(exc).__name__.lower() or "credential" in str(exc).lower():
                    raise AllReduceError(
                        f"no usable credentials for {self.uri!r} ({exc}); configure them for the "
                        f"{self.protocol!r} backend (for s3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                        "~/.aws/credentials or an IAM role) or pass storage_options"
                    ) from exc
                raise
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    # -- operations ---------------------------------------------------------------------------
    def put_create(self, key: str, data: bytes | Sequence[memoryview]) -> bool:
        """Write ``data`` (bytes, or buffers to concatenate) at ``key`` only if nothing is there.

        Returns False if an object already existed there.
        """
        fs = self.fs
        parts = [memoryview(data)] if isinstance(data, bytes) else list(data)
        try:
            if isinstance(fs, LocalFileSystem):
                root = self._root
                self._call(f"create {key}", lambda: _local_create(root, key, self._local_path(key), parts))
            else:
                path = self.path(key)
                joined = parts[0].tobytes() if len(parts) == 1 else b"".join(parts)
                if isinstance(fs, MemoryFileSystem):  # its "xb" open checks, then creates: not atomic on its own
                    with _MEMORY_CREATES.claim(fs, path):
                        self._call(f"create {key}", lambda: fs.pipe_file(path, joined, mode="create"))
                else:
                    self._call(f"create {key}", lambda: fs.pipe_file(path, joined, mode="create"))
        except FileExistsError:
            return False
        with self._lock:
            self.bytes_written += sum(p.nbytes for p in parts)
        return True

    def get(self, key: str, limit: int | None = None) -> bytes:
        """Whole object; ``FileNotFoundError`` if absent; `CorruptObjectError` if longer than ``limit`` bytes."""
        if limit is not None:
            data = self.get_range(key, 0, limit + 1)
            if len(data) > limit:
                raise CorruptObjectError(f"{key}: object is larger than the {limit} bytes such a record may have")
            return data
        if self.is_local:
            data = self._call(f"read {key}", lambda: _local_read(self._local_path(key), key, 0, None))
        else:
            data = self._call(f"read {key}", lambda: self.fs.cat_file(self.path(key)))
        self._count_read(len(data))
        return bytes(data)

    def try_get(self, key: str, limit: int | None = None) -> bytes | None:
        """Whole object (see :meth:`get`), or ``None`` if absent."""
        try:
            return self.get(key, limit)
        except FileNotFoundError:
            return None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object (one ranged read; fewer if the object ends first)."""
        if not 0 <= start <= end:
            raise ValueError(f"bad byte range [{start}, {end}) for {key}")
        if self.is_local:
            data = self._call(f"ranged read {key}", lambda: _local_read(self._local_path(key), key, start, end))
        else:
            data = self._call(f"ranged read {key}", lambda: self.fs.cat_file(self.path(key), start=start, end=end))
        self._count_read(len(data))
        return bytes(data)

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        """Read bytes ``[start, start + len(buf))`` of an object into ``buf``; the number of bytes read (fewer if
        the object ends first). Local files are read straight into ``buf`` (a private copy: what was read cannot
        change under the reader, unlike a memory map); elsewhere this is one ranged read."""
        path = self.path(key)
        if self.is_local:
            got = self._call(f"ranged read {key}", lambda: _local_read_into(self._local_path(key), key, start, buf))
        else:
            data = self._call(f"ranged read {key}", lambda: self.fs.cat_file(path, start=start, end=start + buf.nbytes))
            got = min(len(data), buf.nbytes)
            buf[:got] = data[:got]
        self._count_read(got)
        return got

    def _count_read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def exists(self, key: str) -> bool:
        if self.is_local:
            return os.path.lexists(self._local_path(key))  # a planted link or FIFO is "something there"
        path = self.path(key)
        return bool(self._call(f"exists {key}", lambda: self.fs.exists(path)))

    def list_names(self, key: str) -> list[str]:
        """Base names of the entries directly under ``key`` (empty if it does not exist)."""
        path = self.path(key)
        try:
            if self.is_local:
                local = self._local_path(key) if key else path
                return sorted(self._call(f"list {key}", lambda: _local_list(local)))
            entries = self._call(f"list {key}", lambda: self.fs.ls(path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def list_tree(self, key: str) -> list[str]:
        """Every object under ``key`` of a remote store, relative to it, from one recursive listing (``[]`` if
        none)."""
        if not self.remote:
            raise ValueError("list_tree is for remote stores; walk a local one with list_names")
        root = self.path(key).rstrip("/")
        try:
            found = self._call(f"list {key}/**", lambda: self.fs.find(root))
        except FileNotFoundError:
            return []
        return sorted(str(p)[len(root) + 1 :] for p in found if str(p).startswith(root + "/"))

    def remove_keys(self, keys: Sequence[str]) -> None:
        """Best-effort delete of ``keys`` of a remote store: one bulk request per 1000 (garbage collection never fails
        a round)."""
        if not self.remote:
            raise ValueError("remove_keys is for remote stores; use remove_tree on a local one")
        if keys:
            paths = [self.path(k) for k in keys]
            with contextlib.suppress(OSError, AllReduceError):
                self._call(f"delete {len(paths)} objects", lambda: self.fs.rm(paths))

    def remove(self, key: str) -> None:
        """Best-effort delete of the one object ``key`` (a symbolic link on a local disk: the link, never its
        target)."""
        with contextlib.suppress(OSError, AllReduceError):
            path = self._local_path(key) if self.is_local else self.path(key)
            self._call(f"delete {key}", lambda: self.fs.rm_file(path))

    def remove_tree(self, key: str) -> None:
        """Best-effort recursive delete (garbage collection never fails a round). On a local disk nothing behind a
        symbolic link is deleted."""
        with contextlib.suppress(OSError, AllReduceError):
            path = self._local_path(key) if self.is_local else self.path(key)
            if self.is_local and os.path.islink(path):
                return
            self.fs.rm(path, recursive=True)

    def preflight(self) -> None:
        """Prove the store usable and create-only: write a probe key twice, read it back, delete it.

        The second write must fail (the key exists) and the object must still hold the first bytes; a store that
        overwrites would let two replicas both "win" a quorum or a decision, so it is refused.

        Raises:
            StoreBackendMissingError: the adapter package is not installed.
            AllReduceError: the store is unreachable, the credentials are missing or wrong, or writes overwrite.
        """
        key = f".preflight/{uuid.uuid4().hex}"
        first, second = b"crf-diloco preflight 1", b"crf-diloco preflight 2"
        try:
            if not self.put_create(key, first):
                raise AllReduceError(f"preflight of {self.uri!r}: a fresh probe key already existed")
            overwrote = self.put_create(key, second)
            back = self.get(key)
            if overwrote or back != first:
                raise AllReduceError(
                    f"{self.uri!r} does not enforce create-only writes (a second write of {key} "
                    f"{'succeeded' if overwrote else 'changed the object'}): replicas could overwrite each other's "
                    "quorum and decision objects. Use a local folder, memory://, or S3 (or a store that honours "
                    "If-None-Match: *)"
                )
        except StoreBackendMissingError:
            raise
        except AllReduceError:
            raise
        except Exception as exc:
            raise AllReduceError(
                f"preflight of {self.uri!r} failed: {exc!r}; check the URI, network access and credentials "
                "(and that the fsspec adapter supports pipe_file(mode='create'))"
            ) from exc
        finally:
            if self._fs is not None:
                self.remove_tree(key)


def _without_sdk_checks(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for s3fs with botocore's own body checks off where they are not set: the CRC32 it computes over
    every upload and checks on every download (botocore >= 1.36) and the SHA-256 of every body it signs over plain
    HTTP. Every object here carries the run's MAC over its bytes, checked end to end by the reader, so these only
    repeat that check at the cost of client CPU (about a fifth of s3fs's time per request, measured with py-spy on
    `benchmarks/diloco_overlap.py`). A value given in ``config_kwargs`` (or its ``s3`` dict) is kept as given."""
    if protocol not in ("s3", "s3a"):
        return options
    from botocore.config import Config

    config = dict(options.get("config_kwargs") or {})
    for name in ("request_checksum_calculation", "response_checksum_validation"):
        if name in Config.OPTION_DEFAULTS:  # older botocore computes no checksums and takes no such option
            config.setdefault(name, "when_required")
    config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
    return {**options, "config_kwargs": config}


def _skip_continue(fs: fsspec.AbstractFileSystem) -> None:
    """S3 (s3fs/botocore): send each PUT's body with its headers instead of asking the server to confirm first.

    botocore adds ``Expect: 100-continue`` to every S3 request with a body, so each write waits one round trip for
    ``100 Continue`` before sending: over a WAN that is a round trip per object written (member, quorum, payload,
    reduced shard, vote, decision). The objects here are written once and are small or expected to succeed, so the
    header is dropped for this filesystem's client (other clients are untouched). A client without the hook (no
    botocore, or another store) is left as it is."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "s3" not in protocols:
        return
    try:
        from botocore.handlers import add_expect_header

        fs.s3.meta.events.unregister("before-call.s3", add_expect_header)
    except Exception:
        return


def _local_create(root: str, key: str, path: str, parts: list[memoryview]) -> None:
    """Write a temporary file next to ``path`` and link it into place: ``FileExistsError`` if ``path`` exists,
    and readers never see a partial object. Directories are created one by one under ``root``; one that exists but
    is not a plain directory (a symbolic link, a file) is refused."""
    directory = root
    for part in key.split("/")[:-1]:
        directory = os.path.join(directory, part)
        try:
            mode = os.lstat(directory).st_mode
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory)
            mode = os.lstat(directory).st_mode
        if not stat.S_ISDIR(mode):
            raise CorruptObjectError(f"{key}: {part!r} on its path is not a plain directory; refused")
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            for part_view in parts:
                view = part_view.cast("B") if part_view.format != "B" else part_view
                while view.nbytes:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def _local_list(path: str) -> list[str]:
    if os.path.islink(path):
        return []  # a planted link is no directory of ours
    try:
        return os.listdir(path)
    except NotADirectoryError:
        return []


def _open_regular(path: str, key: str) -> int:
    """A read-only descriptor of the regular file at ``path``; `CorruptObjectError` for anything else (a FIFO, a
    device, a socket or a symbolic link), without blocking: a FIFO is opened non-blocking and closed again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptObjectError(f"{key}: a symbolic link, not an object; refused") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise CorruptObjectError(f"{key}: {kind}, not an object; refused")
    return fd


def _local_read(path: str, key: str, start: int, end: int | None) -> bytes:
    fd = _open_regular(path, key)
    with open(fd, "rb", buffering=0) as f:
        if end is None:
            return f.read()
        f.seek(start)
        return f.read(end - start)


def _local_read_into(path: str, key: str, start: int, buf: memoryview) -> int:
    fd = _open_regular(path, key)
    try:
        got = 0
        while got < buf.nbytes:
            n = _preadv(fd, buf[got:], start + got)
            if n == 0:
                break
            got += n
        return got
    finally:
        os.close(fd)


def _preadv(fd: int, buf: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf], offset)
    data = os.pread(fd, buf.nbytes, offset)  # pragma: no cover (platforms without preadv)
    buf[: len(data)] = data
    return len(data)
