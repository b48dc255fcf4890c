"""A thin fsspec wrapper with create-only writes, ranged reads, retries and byte counters.

Create-only semantics per backend (fsspec 2026.9, read from its source):

* local files: ``AbstractFileSystem.pipe_file(mode="create")`` is an ``exists()`` check followed by a
  plain write, which races and lets readers see a half-written file. We instead write a temporary
  file in the same directory and ``os.link`` it into place; ``link`` fails with ``FileExistsError``
  if the name exists and readers only ever see complete objects.
* ``memory://``: ``pipe_file(mode="create")`` opens with ``"xb"`` → ``FileExistsError``.
* ``s3://`` (s3fs): ``pipe_file(mode="create")`` sends ``If-None-Match: *``; a 412 surfaces as
  ``FileExistsError`` or, depending on the error body, ``OSError(EINVAL, "...Precondition...")``;
  both mean "already exists". Other protocols that implement ``mode="create"`` work the same way.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from crf_diloco.errors import AllReduceError, StoreBackendMissingError

__all__ = ["ADAPTER_PACKAGES", "ObjectStore"]

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
_NOT_TRANSIENT = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


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


def _map_file(path: str) -> memoryview:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


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
        if not isinstance(uri, str) or not uri.strip():
            raise ValueError(f"uri must be a non-empty string, got {uri!r}")
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
        if self.protocol in ("file", "local"):
            self._resolve()
            os.makedirs(self._root, exist_ok=True)

    # -- resolution ---------------------------------------------------------------------------
    def _resolve(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            try:
                fs, root = fsspec.core.url_to_fs(self.uri, **self.storage_options)
            except ImportError as exc:
                raise _missing_adapter_error(self.uri, self.protocol, exc) from exc
            except ValueError as exc:
                if "protocol" in str(exc).lower():
                    raise _missing_adapter_error(self.uri, self.protocol, exc) from exc
                raise
            self._fs, self._root = fs, str(root).rstrip("/")
        return self._fs

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._resolve()

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, key: str) -> str:
        """Full filesystem path of ``key`` (relative to the prefix)."""
        self._resolve()
        return f"{self._root}/{key}" if self._root else key

    # -- retries ------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.retry_backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
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
        path = self.path(key)
        fs = self.fs
        parts = [memoryview(data)] if isinstance(data, bytes) else list(data)
        try:
            if isinstance(fs, LocalFileSystem):
                self._call(f"create {key}", lambda: self._local_create(path, parts))
            else:
                joined = parts[0].tobytes() if len(parts) == 1 else b"".join(parts)
                self._call(f"create {key}", lambda: fs.pipe_file(path, joined, mode="create"))
        except FileExistsError:
            return False
        with self._lock:
            self.bytes_written += sum(p.nbytes for p in parts)
        return True

    @staticmethod
    def _local_create(path: str, parts: list[memoryview]) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        try:
            os.link(tmp, path)
        finally:
            os.unlink(tmp)

    def get(self, key: str) -> bytes:
        """Whole object; ``FileNotFoundError`` if absent."""
        path = self.path(key)
        data = self._call(f"read {key}", lambda: self.fs.cat_file(path))
        with self._lock:
            self.bytes_read += len(data)
        return bytes(data)

    def try_get(self, key: str) -> bytes | None:
        """Whole object, or ``None`` if absent."""
        try:
            return self.get(key)
        except FileNotFoundError:
            return None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object (one ranged read)."""
        if not 0 <= start <= end:
            raise ValueError(f"bad byte range [{start}, {end}) for {key}")
        if start == end:
            return b""
        path = self.path(key)
        data = self._call(f"ranged read {key}", lambda: self.fs.cat_file(path, start=start, end=end))
        with self._lock:
            self.bytes_read += len(data)
        return bytes(data)

    def view(self, key: str, start: int | None = None, end: int | None = None) -> memoryview:
        """Bytes ``[start, end)`` (default: all) of an object as a read-only buffer.

        On a local disk the file is memory-mapped (objects are immutable, so the mapping stays
        valid even after garbage collection unlinks the file): no copy into Python memory.
        Elsewhere it is one (ranged) read.
        """
        if start is not None and end is not None and not 0 <= start <= end:
            raise ValueError(f"bad byte range [{start}, {end}) for {key}")
        path = self.path(key)
        if isinstance(self.fs, LocalFileSystem):
            data = self._call(f"map {key}", lambda: _map_file(path))[start:end]
        elif start is None and end is None:
            data = memoryview(self._call(f"read {key}", lambda: self.fs.cat_file(path)))
        else:
            data = memoryview(self._call(f"ranged read {key}", lambda: self.fs.cat_file(path, start=start, end=end)))
        with self._lock:
            self.bytes_read += data.nbytes
        return data

    def try_view(self, key: str) -> memoryview | None:
        """Whole object as a buffer (see :meth:`view`), or ``None`` if absent."""
        try:
            return self.view(key)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        path = self.path(key)
        return bool(self._call(f"exists {key}", lambda: self.fs.exists(path)))

    def list_names(self, key: str) -> list[str]:
        """Base names of the entries directly under ``key`` (empty if it does not exist)."""
        path = self.path(key)
        try:
            entries = self._call(f"list {key}", lambda: self.fs.ls(path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def remove_tree(self, key: str) -> None:
        """Best-effort recursive delete (garbage collection never fails a round)."""
        path = self.path(key)
        with contextlib.suppress(OSError, AllReduceError):
            self.fs.rm(path, recursive=True)

    def preflight(self) -> None:
        """Resolve the adapter and write, read and delete a probe object.

        Raises:
            StoreBackendMissingError: the adapter package is not installed.
            AllReduceError: the store is unreachable or the credentials are missing or wrong.
        """
        key = f".preflight/{uuid.uuid4().hex}"
        payload = b"crf-diloco preflight"
        try:
            self.put_create(key, payload)
            if self.get(key) != payload:
                raise AllReduceError(f"preflight of {self.uri!r}: read back different bytes than written")
        except StoreBackendMissingError:
            raise
        except AllReduceError:
            raise
        except Exception as exc:
            raise AllReduceError(
                f"preflight of {self.uri!r} failed: {exc!r}; check the URI, network access and credentials"
            ) from exc
        finally:
            if self._fs is not None:
                self.remove_tree(key)
