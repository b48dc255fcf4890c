"""Shared fixtures for crf-diloco's tests: replica threads, a moto S3 server, fault-injecting stores."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import register_implementation

sys.path.insert(0, str(Path(__file__).parent))  # test support modules beside this file (s3_server, wan_proxy)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``CRF_REQUIRE_RAY=1`` (``nox -s ray``) a missing Ray is an error, not a skip: that session
    exists to run the tests that skip elsewhere, and must not pass with none of them run."""
    if os.environ.get("CRF_REQUIRE_RAY") == "1" and importlib.util.find_spec("ray") is None:
        raise pytest.UsageError(
            "CRF_REQUIRE_RAY=1 but ray is not importable: install it (nox -s ray provisions it) "
            "or unset CRF_REQUIRE_RAY"
        )


ReplicaFn = Callable[[int], Any]


def _run_replicas(fn: ReplicaFn, world_size: int, timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank)`` for every rank in its own thread; return results, re-raise the first error."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a replica thread did not finish within {timeout}s")
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@pytest.fixture
def run_replicas() -> Callable[..., list[Any]]:
    """``run_replicas(fn, world_size, timeout=60)``: one thread per rank, results in rank order."""
    return _run_replicas


def read_record(ar: Any, key: str) -> dict[str, Any]:
    """The body of the sealed JSON record at ``key`` (authenticated with ``ar``'s secret)."""
    body = ar.auth.open_record(key, ar.store.get(key))
    return dict(json.loads(body))


@pytest.fixture(name="read_record")
def read_record_fixture() -> Callable[[Any, str], dict[str, Any]]:
    """``read_record(ar, key)``: the body of a sealed record in ``ar``'s store."""
    return read_record


@pytest.fixture
def memory_uri() -> Iterator[str]:
    """A fresh ``memory://`` prefix, removed afterwards."""
    name = f"crf-test-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = MemoryFileSystem()
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def make_tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@pytest.fixture
def tiny_model() -> Callable[[dict[str, torch.Tensor] | None], torch.nn.Module]:
    """``tiny_model(state)``: a small MLP, loaded from ``state`` when given (identical replicas)."""

    def build(state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        model = make_tiny_model()
        if state is not None:
            model.load_state_dict(state)
        return model

    return build


# -- fault-injecting filesystems (registered fsspec protocols, each with its own store) ---------
class FaultyMemoryFileSystem(MemoryFileSystem):
    """A memory filesystem whose reads/writes can fail or be corrupted by registered rules.

    ``rules`` is a list of ``(op, predicate(path) -> bool, action)``; ``op`` in ``{"read", "write"}``;
    ``action`` is ``"oserror"`` (raise a transient ``OSError``), ``"flip"`` (flip a byte of the
    bytes read), ``"truncate"`` (return the first half of the bytes read) or a callable run before the
    operation. Each rule fires ``count`` times.
    """

    protocol = "crffaulty"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    rules: ClassVar[list[dict[str, Any]]] = []
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return str(super()._strip_protocol(str(path).removeprefix("crffaulty://")))

    def _fire(self, op: str, path: str) -> str | None:
        action: Any = None
        with self.lock:
            for rule in self.rules:
                if rule["op"] == op and rule["count"] > 0 and rule["match"](path):
                    rule["count"] -= 1
                    rule["fired"] += 1
                    action = rule["action"]
                    break
        if callable(action):
            action(path)  # outside the lock: it may wait for other replicas
            return None
        return None if action is None else str(action)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        action = self._fire("read", path)
        if action == "oserror":
            raise OSError(5, "injected transient read error", path)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        if action == "truncate":
            return bytes(data[: len(data) // 2])
        if action == "flip" and data:
            data = bytearray(data)
            data[len(data) // 2] ^= 0xFF
            return bytes(data)
        return data

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        if self._fire("write", path) == "oserror":
            raise OSError(5, "injected transient write error", path)
        super().pipe_file(path, value, mode=mode, **kwargs)


@pytest.fixture
def faulty_store() -> Iterator[type[FaultyMemoryFileSystem]]:
    """The ``crffaulty://`` filesystem class; add rules with ``add_rule``; cleared afterwards."""
    register_implementation("crffaulty", FaultyMemoryFileSystem, clobber=True)
    FaultyMemoryFileSystem.store.clear()
    FaultyMemoryFileSystem.rules.clear()
    yield FaultyMemoryFileSystem
    FaultyMemoryFileSystem.store.clear()
    FaultyMemoryFileSystem.rules.clear()


def add_rule(op: str, match: Callable[[str], bool], action: Any, count: int = 1) -> dict[str, Any]:
    rule = {"op": op, "match": match, "action": action, "count": count, "fired": 0}
    FaultyMemoryFileSystem.rules.append(rule)
    return rule


@pytest.fixture
def fault_rule() -> Callable[..., dict[str, Any]]:
    """``fault_rule(op, match, action, count=1)``: register a fault on the ``crffaulty://`` store."""
    return add_rule


class DictFileSystem(AbstractFileSystem):
    """Objects in a dict of the subclass (``objects``), behind a protocol of its own. ``create_only``: whether
    ``pipe_file(mode="create")`` refuses a key that exists; ``hooks`` may replace what a ranged read returns:
    ``hook(start, end, key, answer) -> bytes | None``. Neither a local nor a memory filesystem, so the protocol treats
    it as a remote store."""

    objects: ClassVar[dict[str, bytes]]
    hooks: ClassVar[list[Callable[[int | None, int | None, str, bytes], bytes | None]]]
    create_only: ClassVar[bool] = True
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return str(path).removeprefix(f"{cls.protocol}://").strip("/")

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        key = self._strip_protocol(path)
        with self.lock:
            if mode == "create" and self.create_only and key in self.objects:
                raise FileExistsError(path)
            self.objects[key] = bytes(value)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        key = self._strip_protocol(path)
        with self.lock:
            if key not in self.objects:
                raise FileNotFoundError(path)
            answer = self.objects[key][start:end]
        for hook in list(self.hooks):
            changed = hook(start, end, key, answer)
            if changed is not None:
                answer = changed
        return answer

    def exists(self, path: str, **kwargs: Any) -> bool:
        key = self._strip_protocol(path)
        with self.lock:
            return key in self.objects or any(k.startswith(key + "/") for k in self.objects)

    def ls(self, path: str, detail: bool = False, **kwargs: Any) -> list[Any]:
        prefix = self._strip_protocol(path) + "/"
        with self.lock:
            return sorted({prefix + k[len(prefix) :].split("/")[0] for k in self.objects if k.startswith(prefix)})

    def find(self, path: str, *args: Any, **kwargs: Any) -> list[str]:
        """Every object under ``path`` (one recursive listing, as S3's)."""
        prefix = self._strip_protocol(path) + "/"
        with self.lock:
            return sorted(k for k in self.objects if k.startswith(prefix))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """Delete each path (one or a list, as fsspec's ``rm`` takes them) and everything under it."""
        keys = [self._strip_protocol(p) for p in (path if isinstance(path, list) else [path])]
        with self.lock:
            for k in [k for k in self.objects if any(k == key or k.startswith(key + "/") for key in keys)]:
                del self.objects[k]


class OverwritingFileSystem(DictFileSystem):
    """A store that ignores create-only: ``pipe_file(mode="create")`` overwrites (backed by a dict)."""

    protocol = "crfoverwrite"
    objects: ClassVar[dict[str, bytes]] = {}
    hooks: ClassVar[list[Any]] = []
    create_only = False


class RemoteFileSystem(DictFileSystem):
    """A create-only store the protocol treats as remote (early reads, one-request reduced shards)."""

    protocol = "crfremote"
    objects: ClassVar[dict[str, bytes]] = {}
    hooks: ClassVar[list[Any]] = []


@pytest.fixture
def remote() -> Iterator[type[RemoteFileSystem]]:
    """The ``crfremote://`` filesystem class (create-only, remote to the protocol; add read ``hooks``); cleared
    afterwards."""
    register_implementation("crfremote", RemoteFileSystem, clobber=True)
    RemoteFileSystem.objects.clear()
    RemoteFileSystem.hooks.clear()
    yield RemoteFileSystem
    RemoteFileSystem.objects.clear()
    RemoteFileSystem.hooks.clear()


@pytest.fixture
def overwriting_store() -> Iterator[type[OverwritingFileSystem]]:
    """The ``crfoverwrite://`` filesystem class (a store whose "create-only" writes overwrite); cleared afterwards."""
    register_implementation("crfoverwrite", OverwritingFileSystem, clobber=True)
    OverwritingFileSystem.objects.clear()
    yield OverwritingFileSystem
    OverwritingFileSystem.objects.clear()


# -- moto S3 server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moto_s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 (free port) with one bucket; yields ``bucket`` and ``storage_options``."""
    pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3_server import moto_s3_server

    with moto_s3_server() as s3:
        yield {"bucket": s3.bucket, "storage_options": s3.storage_options(), "endpoint": s3.endpoint}


# -- outputs of replica_scripts/diloco_replica.py ------------------------------------------------------------------
def _diloco_replicas_agree(out: Path, world_size: int, outer_steps: int) -> None:
    """Every replica wrote ``outer_steps`` outer steps and the same final weights, which moved from the initial ones."""
    from safetensors.torch import load_file

    for rank in range(world_size):
        assert json.loads((out / f"rank{rank}.json").read_text())["outer_steps"] == outer_steps
    saved = [load_file(str(out / f"rank{rank}.safetensors")) for rank in range(world_size)]
    names = [k for k in saved[0] if not k.startswith("initial.")]
    assert names
    for name in names:
        for rank in range(1, world_size):
            assert torch.equal(saved[0][name], saved[rank][name]), (
                f"{name} differs between replicas after the last sync"
            )
        assert not torch.equal(saved[0][name], saved[0][f"initial.{name}"]), f"{name} never moved"


@pytest.fixture
def diloco_replicas_agree() -> Callable[[Path, int, int], None]:
    """``diloco_replicas_agree(out_dir, world_size=, outer_steps=)``: check what diloco_replica.py wrote."""
    return _diloco_replicas_agree
