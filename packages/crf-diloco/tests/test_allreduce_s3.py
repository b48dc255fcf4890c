"""``s3://`` end to end against moto's S3 server on 127.0.0.1, through s3fs (create-only = If-None-Match)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from crf_diloco import AllReduceError, MockManager, ObjectStoreAllReduce
from crf_diloco.auth import Authenticator
from crf_diloco.layout import RoundKeys
from crf_diloco.store import ObjectStore

pytestmark = pytest.mark.integration
RunReplicas = Callable[..., list[Any]]
SECRET = "s3-run-secret-" * 4


def _uri(moto_s3: dict[str, Any]) -> str:
    return f"s3://{moto_s3['bucket']}/{uuid.uuid4().hex}"


def test_s3_create_only_write_is_enforced(moto_s3: dict[str, Any]) -> None:
    store = ObjectStore(_uri(moto_s3), moto_s3["storage_options"])
    assert store.put_create("k/obj", b"first") is True
    assert store.put_create("k/obj", b"second") is False  # 412 Precondition Failed from the server
    assert store.get("k/obj") == b"first"
    assert store.get_range("k/obj", 1, 3) == b"ir"  # ranged GET


def test_the_s3_test_server_computes_an_etag_under_the_objects_lock(moto_s3: dict[str, Any]) -> None:
    """moto reads a GET's body under ``FakeKey.lock`` but computed the ETag from the same file position without
    it, so a GET racing the PUT's response read an object over 16 MB from its middle (a payload header of
    1.35e19 bytes: the round aborted). The test server (`s3_server.lock_moto_etag`) takes the lock for the ETag."""
    import hashlib
    import threading

    from moto.s3.models import FakeKey

    body = torch.randn(4096).numpy().tobytes()
    key = FakeKey("k", body, account_id="123456789012", region_name="us-east-1")
    got: list[str] = []
    with key.lock:  # a GET is reading the body
        reader = threading.Thread(target=lambda: got.append(key.etag))
        reader.start()
        reader.join(0.3)
        assert not got, "the ETag was read from the buffer while a GET held it"
        assert reader.is_alive()
    reader.join(10)
    assert got == [f'"{hashlib.md5(body).hexdigest()}"']


@pytest.mark.parametrize("theirs", [None, {"s3": {"payload_signing_enabled": True}}])
def test_s3_requests_carry_no_sdk_body_checks_unless_asked(moto_s3: dict[str, Any], theirs: Any) -> None:
    """Objects carry the run's MAC over their bytes, so botocore's own body checks (CRC32 per upload, SHA-256 of the
    payload signed over plain HTTP) are off by default; a ``config_kwargs`` value the user gives is kept."""
    options = {**moto_s3["storage_options"], **({"config_kwargs": theirs} if theirs else {})}
    store = ObjectStore(_uri(moto_s3), options)
    assert store.put_create("k/first", b"x" * 4096) is True  # the client exists after a first request
    sent: list[dict[str, str]] = []
    store.fs.s3.meta.events.register(
        "before-send.s3.PutObject",
        lambda request, **_: sent.append({k.lower(): str(v) for k, v in request.headers.items()}),
    )
    assert store.put_create("k/second", b"y" * 4096) is True
    assert store.get("k/second") == b"y" * 4096
    (headers,) = sent
    assert not any(k.lower().startswith("x-amz-checksum-") for k in headers), headers
    signed = "UNSIGNED-PAYLOAD" not in headers["x-amz-content-sha256"]
    assert signed is bool(theirs), headers
    assert options == {**moto_s3["storage_options"], **({"config_kwargs": theirs} if theirs else {})}, "not mutated"


@pytest.mark.parametrize("compression", [None, "int8"])
def test_s3_allreduce_end_to_end(compression: str | None, moto_s3: dict[str, Any], run_replicas: RunReplicas) -> None:
    uri, world_size, n = _uri(moto_s3), 3, 2000

    def x(rank: int, round_id: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(17 * rank + round_id))

    def replica(rank: int) -> list[torch.Tensor]:
        ar = ObjectStoreAllReduce(
            uri,
            rank,
            world_size,
            timeout=30,
            storage_options=moto_s3["storage_options"],
            compression=compression,  # type: ignore[arg-type]
            secret=SECRET,
        )
        out = []
        for round_id in range(2):
            t = x(rank, round_id)
            ar.allreduce(t)
            out.append(t)
        assert ar.bytes_written > 0
        assert ar.bytes_read > 0
        return out

    results = run_replicas(replica, world_size, timeout=120)
    for round_id in range(2):
        expect = sum(x(r, round_id).double() for r in range(world_size)) / world_size
        for r in range(world_size):
            assert torch.equal(results[r][round_id], results[0][round_id])
        tol = 1e-6 if compression is None else 0.05
        torch.testing.assert_close(results[0][round_id].double(), expect, rtol=0, atol=tol)


def test_s3_diloco_through_mockmanager(
    moto_s3: dict[str, Any], run_replicas: RunReplicas, tiny_model: Callable[..., nn.Module]
) -> None:
    uri = _uri(moto_s3)
    init = tiny_model().state_dict()

    def replica(rank: int) -> list[torch.Tensor]:
        ar = ObjectStoreAllReduce(uri, rank, 2, timeout=30, storage_options=moto_s3["storage_options"])
        manager = MockManager(ar)
        model = tiny_model(init)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        g = torch.Generator().manual_seed(rank)
        with DiLoCo(manager, [model], inner, outer, sync_every=2):
            for _ in range(4):
                inner.zero_grad()
                nn.functional.mse_loss(model(torch.randn(4, 6, generator=g)), torch.zeros(4, 3)).backward()
                inner.step()
        manager.shutdown()
        assert manager.current_step() == 2
        return [p.detach().clone() for p in model.parameters()]

    results = run_replicas(replica, 2, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=False))
    store = ObjectStore(f"{uri}/default", moto_s3["storage_options"])
    assert store.list_names("state") == ["parts", "r00000000.safetensors", "r00000001.safetensors"]
    assert store.list_names("state/parts"), "the manifests' parts"


def test_s3_preflight(moto_s3: dict[str, Any]) -> None:
    ObjectStoreAllReduce(_uri(moto_s3), 0, 2, storage_options=moto_s3["storage_options"], preflight=True)
    with pytest.raises(AllReduceError, match=r"preflight|store error"):
        ObjectStoreAllReduce(
            "s3://no-such-bucket-crf/x", 0, 2, storage_options=moto_s3["storage_options"], retries=0, preflight=True
        )


def test_s3_forged_object_aborts_then_the_run_goes_on(moto_s3: dict[str, Any], run_replicas: RunReplicas) -> None:
    """An attacker with write access to the bucket plants a payload (a plain PUT) before rank 1 writes its own: every
    replica aborts round 0 with its tensor unchanged, and round 1 commits."""
    uri = _uri(moto_s3)
    forged = Authenticator("not-the-secret-" * 4, "default").seal_record("x", b"{}")
    ObjectStore(f"{uri}/default", moto_s3["storage_options"]).put_create(RoundKeys(0).data(1), forged)

    def replica(rank: int) -> tuple[str, bool]:
        ar = ObjectStoreAllReduce(
            uri, rank, 2, timeout=20, storage_options=moto_s3["storage_options"], secret=SECRET, poll_interval=0.02
        )
        t = torch.full((64,), float(rank))
        try:
            ar.allreduce(t)
            first = "commit"
        except AllReduceError as exc:
            first = str(exc)
        unchanged = torch.equal(t, torch.full((64,), float(rank)))
        ar.allreduce(t)
        return first, unchanged and torch.equal(ar.allreduce(torch.full((64,), float(rank))), torch.full((64,), 0.5))

    for first, ok in run_replicas(replica, 2, timeout=120):
        assert "r00000000/data/1.safetensors" in first
        assert ok


def test_s3_garbage_collection_keeps_only_tombstones_in_few_requests(
    moto_s3: dict[str, Any], run_replicas: RunReplicas
) -> None:
    """On S3 an old round is collected with one recursive listing and two bulk deletes (the quorum first, then the
    rest), never touching its decision (the tombstone) or the rounds still kept."""
    uri = _uri(moto_s3)

    def replica(rank: int) -> None:
        with ObjectStoreAllReduce(
            uri, rank, 2, timeout=30, keep_rounds=2, storage_options=moto_s3["storage_options"], secret=SECRET
        ) as ar:
            for i in range(5):
                ar.allreduce(torch.full((10,), float(rank + i)))
        # close() waits for the background garbage collection

    run_replicas(replica, 2, timeout=120)
    store = ObjectStore(f"{uri}/default", moto_s3["storage_options"])
    left = store.list_tree("")
    for r in range(3):  # collected: the decision alone
        assert [k for k in left if k.startswith(f"r{r:08d}/")] == [f"r{r:08d}/decision.json"]
    for r in (3, 4):  # kept whole
        kept = {k.split("/", 1)[1] for k in left if k.startswith(f"r{r:08d}/")}
        assert {"quorum.json", "decision.json", "data/0.safetensors", "data/1.safetensors"} <= kept
        assert {"members/0.json", "members/1.json", "reduced/0.safetensors", "reduced/1.safetensors"} <= kept
    from crf_diloco.rounds.frontier import collect
    from crf_diloco.rounds.peer import Peer

    peer = Peer(store, Authenticator(SECRET, "default"), 0, 2)
    before = store.traffic()
    collect(peer, 3, 2)
    spent = store.traffic() - before
    assert spent.requests == 3, spent  # list, delete the quorum, delete the rest
    assert [k for k in store.list_tree("") if k.startswith("r00000003/")] == ["r00000003/decision.json"]
    before = store.traffic()
    collect(peer, 3, 2)  # again: nothing left to delete
    assert (store.traffic() - before).requests == 1
