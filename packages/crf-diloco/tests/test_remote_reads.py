"""What the protocol does on a store that costs a round trip per request (not a local folder or ``memory://``):
fetching a payload's shard beside its header, one ranged read per reduced shard, requests sent together, and the
request accounting (`ObjectStore.traffic`). A hostile store may serve other bytes to the early read than to the
header, truncate objects, or a peer may write another header layout: each one aborts cleanly or falls back.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

import crf_diloco.allreduce as allreduce_module
from crf_diloco import MockManager, ObjectStoreAllReduce, RoundAbortedError
from crf_diloco.auth import Authenticator
from crf_diloco.store import ObjectStore
from crf_diloco.wire import (
    Scratch,
    ShardPlan,
    decode_payload_blob,
    encode_object,
    encode_payload,
    header_probe,
    payload_data_start,
    prefetch_payload_shard,
    read_header,
    read_payload_shard,
    wire_roundtrip,
)

SECRET = "remote-reads-test-secret-0123456789abcdef"
AUTH = Authenticator(SECRET, "default")
RunReplicas = Callable[..., list[Any]]


def _x(rank: int, round_id: int, n: int = 3000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + round_id))


def _rounds(uri: str, run_replicas: RunReplicas, codec: str | None, world: int = 3) -> list[list[str]]:
    """Round 0 (the attack, if any) then round 1 on every replica: each round's outcome, and the inputs of a failed
    round unchanged."""

    def replica(rank: int) -> list[str]:
        ar = ObjectStoreAllReduce(uri, rank, world, secret=SECRET, timeout=8, quorum_timeout=8, poll_interval=0.01,
                                  compression=codec)  # fmt: skip
        log = []
        for round_id in range(2):
            x = _x(rank, round_id)
            try:
                ar.allreduce(x)
                log.append("commit")
            except RoundAbortedError as exc:
                assert torch.equal(x, _x(rank, round_id)), "a failed round leaves the inputs unchanged"
                log.append(f"abort: {exc}")
            ar.timeout = ar.quorum_timeout = 30.0
        return log

    return run_replicas(replica, world, timeout=180)


@pytest.mark.parametrize("codec", [None, "int8", "topk:4/64"], ids=["fp32", "int8", "topk"])
def test_rounds_on_a_remote_store_match_the_local_result(
    codec: str | None, remote: Any, memory_uri: str, run_replicas: RunReplicas
) -> None:
    """The early reads and one-request shards change no bit: a remote store's rounds equal memory://'s."""

    def replica(uri: str) -> Callable[[int], torch.Tensor]:
        def run(rank: int) -> torch.Tensor:
            ar = ObjectStoreAllReduce(uri, rank, 3, secret=SECRET, timeout=30, compression=codec)
            x = _x(rank, 0)
            ar.allreduce(x)
            return x

        return run

    far = run_replicas(replica(f"crfremote://run-{uuid.uuid4().hex[:6]}"), 3)
    near = run_replicas(replica(memory_uri), 3)
    for a, b in zip(far, near, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, far[0])


def test_a_store_serving_other_bytes_to_the_early_read_aborts_the_round(remote: Any, run_replicas: RunReplicas) -> None:
    """The store answers the first read of each payload range (the early read, made before the header is known)
    with forged bytes and later ones truly: the early bytes are checked against the shard's content tag, not
    adopted, and the round aborts on every replica; the next round commits."""
    first: set[tuple[str, int]] = set()
    forged = {"count": 0}

    def forge(start: int | None, end: int | None, key: str, answer: bytes) -> bytes | None:
        if "r00000000/data/" not in key or not start or not answer or (key, start) in first:
            return None
        first.add((key, start))
        forged["count"] += 1
        return bytes(b ^ 0x5A for b in answer)

    remote.hooks.append(forge)
    outcomes = _rounds(f"crfremote://forge-{uuid.uuid4().hex[:6]}", run_replicas, None)
    assert forged["count"] > 0
    assert all(log[0].startswith("abort") for log in outcomes), outcomes
    assert any("failed authentication" in log[0] for log in outcomes), outcomes
    assert all(log[1] == "commit" for log in outcomes), outcomes


def test_a_truncated_payload_on_a_remote_store_aborts_cleanly(remote: Any, run_replicas: RunReplicas) -> None:
    """Reads of rank 1's payload come back short (the early read, and the fallback read after the header): the
    round aborts everywhere with the truncation named; nothing is adopted."""

    def truncate(start: int | None, end: int | None, key: str, answer: bytes) -> bytes | None:
        if key.endswith("r00000000/data/1.safetensors") and start is not None and start > 0:
            return answer[: len(answer) // 2]
        return None

    remote.hooks.append(truncate)
    outcomes = _rounds(f"crfremote://trunc-{uuid.uuid4().hex[:6]}", run_replicas, "int8")
    assert all(log[0].startswith("abort") for log in outcomes), outcomes
    assert any("truncated" in log[0] for log in outcomes), outcomes
    assert all(log[1] == "commit" for log in outcomes), outcomes


def test_a_peer_whose_header_is_laid_out_otherwise_is_read_after_its_header(
    remote: Any, run_replicas: RunReplicas, monkeypatch: pytest.MonkeyPatch, memory_uri: str
) -> None:
    """Rank 2 writes its payloads without the padded header (another writer): the early reads miss its shards, the
    readers fall back to reading them after the header, and the round commits with the bits of a round where every
    header is padded."""
    real = allreduce_module.encode_payload

    def unpadded(key: str, auth: Authenticator, flat: torch.Tensor, plan: ShardPlan, meta: dict[str, str]) -> Any:
        if "/data/2." not in key:
            return real(key, auth, flat, plan, meta)
        from crf_diloco.wire import _encode_units

        items = [(plan.bounds[k], plan.bounds[k + 1]) for k in range(plan.n_shards)]
        meta = {"codec": plan.codec, "numel": str(plan.numel), **meta}
        return encode_object(key, auth, "payload", _encode_units(flat, plan.codec), meta, items)

    def replica(uri: str) -> Callable[[int], torch.Tensor]:
        def run(rank: int) -> torch.Tensor:
            ar = ObjectStoreAllReduce(uri, rank, 3, secret=SECRET, timeout=30, compression="int8")
            x = _x(rank, 0)
            ar.allreduce(x)
            return x

        return run

    padded = run_replicas(replica(memory_uri), 3)
    monkeypatch.setattr(allreduce_module, "encode_payload", unpadded)
    uri = f"crfremote://unpadded-{uuid.uuid4().hex[:6]}"
    results = run_replicas(replica(uri), 3)
    header = read_header(ObjectStore(f"{uri}/default"), "r00000000/data/2.safetensors", AUTH)
    assert header.data_start != payload_data_start(ShardPlan.build(3000, "int8", 3)), "rank 2's header is not padded"
    for x, want in zip(results, padded, strict=True):
        assert torch.equal(x, want)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4:64", "topk:4/64"])
@pytest.mark.parametrize("world", [1, 2, 5, 16])
def test_a_payload_shard_read_early_is_the_shard_read_after_the_header(codec: str, world: int, remote: Any) -> None:
    """Every codec and world size: the padded header puts the data where the early read looks, and what it read is
    exactly what reading after the header gives; bytes read at other offsets are not adopted."""
    plan = ShardPlan.build(5000, codec, world)
    store = ObjectStore("crfremote://early")
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(world))
    key = f"data-{codec}-{world}"
    blob = encode_payload(key, AUTH, flat, plan, {"token": "t"})
    store.put_create(key, blob)
    header = read_header(store, key, AUTH, payload_data_start(plan))
    assert header.data_start == payload_data_start(plan) <= header_probe(world) + 8
    assert torch.equal(decode_payload_blob(blob, plan, key).float(), wire_roundtrip(flat, codec).float())
    for shard in range(world):
        fills, early = prefetch_payload_shard(store, key, plan, shard, Scratch())
        assert all(fill() for fill in fills)
        got = read_payload_shard(store, header, AUTH, plan, shard, Scratch(), prefetched=early).clone()
        want = read_payload_shard(store, header, AUTH, plan, shard, Scratch()).clone()
        assert torch.equal(got, want)
        early.starts[next(iter(early.starts))] += 8  # read elsewhere: ignored, the shard is read again
        assert torch.equal(read_payload_shard(store, header, AUTH, plan, shard, Scratch(), prefetched=early), want)


def test_requests_sent_together_count_as_one_round_trip(remote: Any) -> None:
    """Two reads that overlap (each waits for the other inside the store) are one wave; a read of an absent object
    alone is an idle wave."""
    store = ObjectStore("crfremote://traffic")
    store.put_create("a", b"1" * 10)
    store.put_create("b", b"2" * 10)
    both = threading.Barrier(2, timeout=30)

    def meet(start: int | None, end: int | None, key: str, answer: bytes) -> bytes | None:
        both.wait()
        return None

    before = store.traffic()
    remote.hooks.append(meet)
    threads = [threading.Thread(target=store.get, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    remote.hooks.clear()
    assert store.try_get("missing") is None
    done = store.traffic() - before
    assert (done.requests, done.round_trips, done.idle_round_trips, done.bytes_read) == (3, 2, 1, 20)


def test_a_replica_in_step_settles_its_heal_check_without_a_request(memory_uri: str, run_replicas: RunReplicas) -> None:
    """After a committed sync, start_quorum asks the store nothing (neither the next round's decision nor the run's
    listing); a replica that is behind still heals (``test_adversarial_store.py`` covers one left behind between
    syncs)."""

    def replica(rank: int) -> int:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=30)
        manager = MockManager(ar, checkpoint=False)
        for _ in range(2):
            manager.start_quorum()
            manager.allreduce(torch.ones(4)).wait()
            assert manager.should_commit()
        ar._learn_expected()  # the background listing of the last round's announcers is done (it is not the check)
        before = ar.store.traffic()
        manager.start_quorum()
        return (ar.store.traffic() - before).requests

    assert run_replicas(replica, 2) == [0, 0]
