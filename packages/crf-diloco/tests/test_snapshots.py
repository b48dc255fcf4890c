"""Incremental state checkpoints: a manifest per round, content-named parts written once (`crf_diloco.snapshots`)."""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pytest
import torch
from thread_runs import run_threads

from crf_diloco import MockManager, ObjectStoreAllReduce
from crf_diloco.auth import Authenticator
from crf_diloco.checkpoint import (
    Packed,
    PartRef,
    dumps_state,
    pack_state,
    part_digest,
    referenced_parts,
    seal_packed,
    split_state,
)
from crf_diloco.errors import AllReduceError, CorruptObjectError
from crf_diloco.layout import part_key, state_key
from crf_diloco.snapshots import WRITE_LANES, StateSnapshots
from crf_diloco.store import ObjectStore
from crf_diloco.wire import READ_MIN, READ_WINDOW, read_header

SECRET = "snapshot-secret-0123456789abcdefgh"
AUTH = Authenticator(SECRET, "run")
WRONG = Authenticator("attacker-guess-0123456789abcdefghij", "run")


def _fragment(seed: int, width: int = 64) -> dict[str, Any]:
    """A Streaming DiLoCo fragment's state: outer SGD momentum and the global parameters."""
    g = torch.Generator().manual_seed(seed)
    return {
        "outer_optimizer": {
            "state": {0: {"momentum_buffer": torch.randn(width, width, generator=g)}},
            "param_groups": [{"lr": 0.7, "momentum": 0.9, "nesterov": True, "params": [0]}],
        },
        "original_parameters": {
            "weight": torch.randn(width, width, generator=g),
            "bias": torch.randn(width, generator=g),
        },
    }


def _state(round_id: int, seeds: tuple[int, ...]) -> dict[str, Any]:
    state: dict[str, Any] = {f"StreamingDiLoCoFragment_{i}": _fragment(s) for i, s in enumerate(seeds)}
    state["torchft"] = {"round": round_id, "step": round_id + 1, "batches_committed": 2 * (round_id + 1)}
    return state


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _snapshots(uri: str, keep: int = 3, **kwargs: Any) -> tuple[StateSnapshots, ObjectStore]:
    store = ObjectStore(uri)
    return StateSnapshots(store, AUTH, keep=keep, **kwargs), store


class _Batches:
    """A ``run`` for `StateSnapshots` that runs each batch of calls at once on threads and records its size; like
    `Peer.concurrently`, it raises the first exception once every call ended."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._pool = ThreadPoolExecutor(READ_WINDOW)

    def __call__(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        self.sizes.append(len(calls))
        futures = [self._pool.submit(call) for call in calls]
        wait(futures)
        return [f.result() for f in futures]


def test_a_checkpoint_after_one_fragment_synced_writes_that_fragment_and_a_manifest(memory_uri: str) -> None:
    """Round 0 writes three fragment parts and a manifest; round 1 (fragment 1 synced) writes one part and a
    manifest, about a third of round 0's bytes; both rounds read back bit-identical (int keys, tuples, scalars)."""
    snapshots, store = _snapshots(memory_uri)
    first, second = _state(0, (1, 2, 3)), _state(1, (1, 20, 3))
    assert snapshots.write(0, first)
    round0 = snapshots.bytes[0]
    assert snapshots.write(1, second)
    round1 = snapshots.bytes[0] - round0
    part = len(b"".join(dumps_state({"f": _fragment(20)}, "k", AUTH)))
    assert len(store.list_names("state/parts")) == 4
    assert part < round1 < part + 2048, "one part and a small manifest"
    assert round1 < 0.4 * round0
    assert _equal(snapshots.read(0), first)
    assert _equal(snapshots.read(1), second)
    stored = [len(store.get(state_key(r))) + sum(len(store.get(part_key(d))) for d in _manifest_refs(store, r))
              for r in (0, 1)]  # fmt: skip
    assert snapshots.bytes[1] == sum(stored), "reads counted: each manifest and the parts it names"


def test_fragments_that_share_an_optimizer_are_one_part_and_keep_sharing_it(memory_uri: str) -> None:
    """torchft registers a shared outer optimizer under every fragment: those entries form one part (no tensor
    written twice) and a loaded state shares the tensor again; entries with no tensor stay in the manifest."""
    shared = {"state": {0: {"momentum_buffer": torch.randn(8)}}, "param_groups": [{"lr": 0.7, "params": [0]}]}
    state = {
        "a": {"outer_optimizer": shared, "original_parameters": {"w": torch.randn(8)}},
        "b": {"outer_optimizer": shared, "original_parameters": {"w": torch.randn(8)}},
        "c": {"original_parameters": {"w": torch.randn(3)}},
        "torchft": {"round": 0, "step": 1, "batches_committed": 2},
    }
    inline, parts = split_state(state)
    assert inline == {"torchft": state["torchft"]}
    assert [p.entries for p in parts] == [["a", "b"], ["c"]]
    assert len(parts[0].tensors) == 3, "the shared momentum once, two weights"
    snapshots, _ = _snapshots(memory_uri)
    snapshots.write(0, state)
    back = snapshots.read(0)
    assert back is not None
    assert _equal(back, state)
    m = "momentum_buffer"
    assert back["a"]["outer_optimizer"]["state"][0][m] is back["b"]["outer_optimizer"]["state"][0][m]


def test_freeze_copies_the_state_so_later_changes_are_not_written(memory_uri: str) -> None:
    """The manager freezes a state on the training thread and uploads it later: the tensors and the inline entries
    written are those of the freeze."""
    snapshots, _ = _snapshots(memory_uri)
    state = _state(0, (1,))
    expected = _state(0, (1,))
    frozen = snapshots.freeze(state)
    state["StreamingDiLoCoFragment_0"]["original_parameters"]["weight"].add_(1.0)
    state["torchft"]["step"] = 99
    assert snapshots.put(0, frozen)
    assert _equal(snapshots.read(0), expected)
    assert not snapshots.put(0, snapshots.freeze(state)), "create-only: a second manifest of round 0 is refused"
    assert _equal(snapshots.read(0), expected)


def test_part_names_are_keyed_with_the_secret() -> None:
    """Equal content gets equal names under one secret (every replica, every round) and a name nobody without the
    secret can predict (and plant junk under first)."""
    packed = pack_state({"f": _fragment(5)})
    assert part_digest(packed, AUTH) == part_digest(pack_state({"f": _fragment(5)}), AUTH)
    assert part_digest(packed, AUTH) != part_digest(packed, WRONG)
    assert part_digest(packed, AUTH) != part_digest(pack_state({"f": _fragment(6)}), AUTH)
    assert part_digest(packed, AUTH) != part_digest(pack_state({"g": _fragment(5)}), AUTH), "the entry's name counts"


def test_collection_deletes_a_part_with_the_last_manifest_that_refers_to_it(memory_uri: str) -> None:
    """keep=2 over rounds 0..3 where fragment 0 never changes and fragment 1 changes every round: fragment 0's part
    stays (every kept manifest refers to it), fragment 1's old parts go with their manifests, and junk named like a
    part is never deleted."""
    snapshots, store = _snapshots(memory_uri, keep=2)
    store.put_create(part_key("f" * 32), b"junk named like a part")
    for r in range(4):
        snapshots.write(r, _state(r, (1, 10 + r)))
    assert snapshots.listed() == [2, 3]
    assert len(store.list_names("state/parts")) == 1 + 2 + 1, "fragment 0, fragment 1 of rounds 2 and 3, the junk"
    assert store.get(part_key("f" * 32)) == b"junk named like a part"
    for r in (2, 3):
        assert _equal(snapshots.read(r), _state(r, (1, 10 + r)))


def test_a_checkpoint_costs_a_listing_its_new_parts_a_manifest_and_a_listing_until_there_is_one_to_drop(
    memory_uri: str,
) -> None:
    """With keep=2, the checkpoints of rounds 0 and 1 (fragment 1 changed) cost a listing of the parts, the new parts,
    the manifest and the collector's listing, and no manifest header is read while no more than ``keep`` are
    listed; round 2's collector reads the three headers and deletes round 0 (manifest and its own part)."""
    snapshots, store = _snapshots(memory_uri, keep=2)
    costs = []
    for r in range(3):
        before = store.traffic()
        assert snapshots.write(r, _state(r, (1, 10 + r)))
        costs.append((store.traffic() - before).requests)
    assert costs == [1 + 2 + 1 + 1, 1 + 1 + 1 + 1, 1 + 1 + 1 + 1 + 3 + 1 + 1]
    assert snapshots.listed() == [1, 2]


def _manifest_refs(store: ObjectStore, round_id: int) -> list[str]:
    return sorted(referenced_parts(read_header(store, state_key(round_id), AUTH)))


def _plant_manifest(store: ObjectStore, round_id: int, state: dict[str, Any], auth: Authenticator = AUTH) -> None:
    store.put_create(state_key(round_id), dumps_state(state, state_key(round_id), auth))


ATTACKS = [
    "part deleted",
    "part replaced by junk",
    "part forged without the secret",
    "part sealed under another part's name",
    "part holding a reference",
    "manifest refers to a malformed digest",
    "manifest refers to a part without its entry",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_state_whose_parts_are_not_what_its_manifest_names_is_corrupt(memory_uri: str, attack: str) -> None:
    """Each attack on a state's parts makes reading it raise `CorruptObjectError` naming the object (a healing
    replica then falls back to an earlier state): nothing unauthentic or mismatched is ever returned."""
    snapshots, store = _snapshots(memory_uri)
    snapshots.write(0, _state(0, (1, 2)))
    digest = _manifest_refs(store, 0)[0]
    other = pack_state({"StreamingDiLoCoFragment_0": _fragment(99)})
    if attack == "part deleted":
        store.remove(part_key(digest))
    elif attack == "part replaced by junk":
        store.remove(part_key(digest))
        store.put_create(part_key(digest), b"\x00" * 64)
    elif attack == "part forged without the secret":
        store.remove(part_key(digest))
        store.put_create(part_key(digest), seal_packed(other, part_key(digest), WRONG))
    elif attack == "part sealed under another part's name":  # a writer with the secret, buggy or hostile
        store.remove(part_key(digest))
        store.put_create(part_key(digest), seal_packed(other, part_key(digest), AUTH))
    elif attack == "part holding a reference":
        store.remove(part_key(digest))
        sneaky = pack_state({"StreamingDiLoCoFragment_0": PartRef("a" * 32)})
        store.put_create(part_key(digest), seal_packed(sneaky, part_key(digest), AUTH))
    elif attack == "manifest refers to a malformed digest":  # a writer with the secret: a path, not a digest
        crafted = Packed({"__dict__": [["f", {"__part__": "../r00000000.safetensors"}]]}, {})
        store.put_create(state_key(1), seal_packed(crafted, state_key(1), AUTH))
        with pytest.raises(CorruptObjectError, match=r"r00000001\.safetensors: malformed state skeleton"):
            snapshots.read(1)
        _plant_manifest(store, 2, {"f": {"__part__": "../x"}, "torchft": {}})  # a user's dict, not a reference
        assert snapshots.read(2) == {"f": {"__part__": "../x"}, "torchft": {}}
        return
    elif attack == "manifest refers to a part without its entry":
        _plant_manifest(store, 1, {"Other": PartRef(digest), "torchft": {}})
        with pytest.raises(CorruptObjectError, match=f"part {digest} has no entry 'Other'"):
            snapshots.read(1)
        return
    with pytest.raises(CorruptObjectError, match="state/"):
        snapshots.read(0)


def test_a_manifest_that_is_not_authentic_is_refused_and_junk_does_not_stop_a_writer(memory_uri: str) -> None:
    """A manifest forged without the secret is corrupt; junk planted under ``state/parts`` does not make the writer
    skip a part it needs (the names are keyed) and is never collected."""
    snapshots, store = _snapshots(memory_uri, keep=1)
    _plant_manifest(store, 5, _state(5, (1,)), WRONG)
    with pytest.raises(CorruptObjectError, match="r00000005"):
        snapshots.read(5)
    store.put_create(part_key(part_digest(pack_state({"StreamingDiLoCoFragment_0": _fragment(1)}), WRONG)), b"x")
    for r in range(3):
        assert snapshots.write(r, _state(r, (1,)))
        assert _equal(snapshots.read(r), _state(r, (1,)))
    assert snapshots.listed() == [2, 5], "the forged manifest is neither kept in place of a real one nor deleted"
    assert len(store.list_names("state/parts")) == 2, "the real part and the junk"


def _fragments_manager(uri: str, rank: int, frags: dict[str, torch.Tensor], keep_rounds: int = 2) -> MockManager:
    """A 2-replica MockManager with one registered state per entry of ``frags`` (its "fragments")."""
    ar = ObjectStoreAllReduce(uri, rank, 2, secret=SECRET, timeout=20, quorum_timeout=0.5, poll_interval=0.01,
                              keep_rounds=keep_rounds)  # fmt: skip
    manager = MockManager(ar, heal_timeout=20)
    for name in frags:
        manager.register_state_dict_fn(
            name, lambda s, n=name: frags.update({n: s["w"].clone()}), lambda n=name: {"w": frags[n].clone()}
        )
    return manager


def _fragment_sync(
    manager: MockManager, frags: dict[str, torch.Tensor], rank: int, gate: threading.Barrier | None
) -> bool:
    """One sync; committed step s changes fragment ``s % len(frags)`` only (Streaming DiLoCo's pattern). ``gate``:
    both ranks meet after ``start_quorum``."""
    manager.start_quorum()
    if gate is not None:
        gate.wait(60)
    step = manager.current_step()
    delta = torch.full((16,), float(rank + 1 + step))
    manager.allreduce(delta).wait()
    ok = manager.should_commit()
    if ok:
        name = list(frags)[step % len(frags)]
        frags[name] = frags[name] + delta
    return ok


def test_a_restarted_replica_heals_from_parts_written_in_different_rounds(
    faulty_store: Any, fault_rule: Callable[..., dict[str, Any]]
) -> None:
    """Three registered states ("fragments"); committed round r changes ``f{r % 3}`` only (Streaming DiLoCo's
    pattern). Every checkpoint after round 0's uploads one part (10 parts for rounds 0..7, not 24). Rank 1
    dies after round 3, rank 0 commits rounds 4 and 5 alone; restarted with zeroed state, rank 1 heals from round
    5's manifest, whose parts were written in rounds 3, 4 and 5, observes round 6, takes part in round 7, and both
    end equal; the kept manifests 5..7 hold five distinct parts and nothing else is left."""
    uploads: list[str] = []
    fault_rule("write", lambda p: "/state/parts/" in p, uploads.append, count=10_000)
    uri = "crffaulty://fragments"
    restarted = threading.Event()
    finals: dict[int, dict[str, torch.Tensor]] = {}
    healed_read: list[tuple[int, int]] = []

    gate = threading.Barrier(2)

    def rank0() -> None:
        frags = {n: torch.zeros(16) for n in ("f0", "f1", "f2")}
        manager = _fragments_manager(uri, 0, frags)
        for i in range(6):  # rounds 0..3 with rank 1, 4 and 5 alone
            assert _fragment_sync(manager, frags, 0, gate if i < 4 else None)
        assert restarted.wait(60)
        for _ in range(2):  # rounds 6 and 7 (its start_quorum writes round 5's state)
            assert _fragment_sync(manager, frags, 0, gate)
        manager.shutdown()
        finals[0] = frags

    def rank1() -> None:
        frags = {n: torch.zeros(16) for n in ("f0", "f1", "f2")}
        manager = _fragments_manager(uri, 1, frags)
        for _ in range(4):
            assert _fragment_sync(manager, frags, 1, gate)
        manager.shutdown()
        while manager.allreduce_backend.latest_committed_round() != 5:  # then it "dies"
            time.sleep(0.01)
        frags = {n: torch.zeros(16) for n in ("f0", "f1", "f2")}
        manager = _fragments_manager(uri, 1, frags)
        restarted.set()
        committed = []
        for _ in range(2):  # heals from round 5 (observes round 6), takes part in round 7
            committed.append(_fragment_sync(manager, frags, 1, gate))
            if not healed_read:
                healed_read.append((manager.current_step(), manager.checkpoint_bytes[1]))
        manager.shutdown()
        assert committed == [True, True]
        finals[1] = frags

    run_threads(rank0, rank1)
    store = ObjectStore(f"{uri}/default")
    assert all(torch.equal(finals[0][n], finals[1][n]) for n in ("f0", "f1", "f2"))
    assert all(finals[0][n].abs().sum() > 0 for n in ("f0", "f1", "f2"))
    assert healed_read[0][0] == 7, "healed from round 5 (6 syncs), then observed round 6"
    # one part per checkpoint after the first: 3 + 7 (all three every time: 24); a replica's presence check may run
    # before the writer's upload of rounds 0..3 and repair it, uploading that round's one new part once more
    assert 3 + 7 <= len(uploads) <= 3 + 7 + 4, f"one part per checkpoint after the first: {uploads}"
    assert len(set(uploads)) == 3 + 7
    assert StateSnapshots(store, Authenticator(SECRET, "default")).listed() == [5, 6, 7]
    assert len(store.list_names("state/parts")) == 5


def test_incremental_checkpoints_and_their_collection_on_s3(moto_s3: dict[str, Any]) -> None:
    """The same on moto's S3 server through s3fs, parts uploaded and read at once: listing ``state/parts/`` (a prefix,
    not a folder), bulk deletes of collected manifests and parts, junk named like a part left alone."""
    store = ObjectStore(f"s3://{moto_s3['bucket']}/snapshots-{time.monotonic_ns()}", moto_s3["storage_options"])
    snapshots = StateSnapshots(store, AUTH, keep=1, run=_Batches())
    store.put_create(part_key("e" * 32), b"junk named like a part")
    for r in range(3):
        assert snapshots.write(r, _state(r, (1, 10 + r)))
    assert snapshots.listed() == [2]
    assert len(store.list_names("state/parts")) == 3, "fragment 0, fragment 1 of round 2, the junk"
    assert _equal(snapshots.read(2), _state(2, (1, 12)))
    assert snapshots.bytes[0] < 4 * len(b"".join(dumps_state({"f": _fragment(1)}, "k", AUTH))) + 3 * 2048


def test_over_a_network_a_state_of_four_parts_reads_in_two_round_trips(remote: Any) -> None:
    """A healing replica on a remote store (``crfremote://``) reads the manifest, then all four fragment parts at
    once, each in one ranged read of its header and data: 5 requests in 2 round trips (a part per round trip
    before). The part reads are proven in flight together: each waits inside the store for the other three."""
    batches = _Batches()
    snapshots, store = _snapshots("crfremote://heal", run=batches)
    state = _state(0, (1, 2, 3, 4))
    assert snapshots.write(0, state)
    together = threading.Barrier(4, timeout=30)

    def meet(start: int | None, end: int | None, key: str, answer: bytes) -> None:
        if "/parts/" in key:
            together.wait()

    remote.hooks.append(meet)
    before, batches.sizes = store.traffic(), []
    assert _equal(snapshots.read(0), state)
    done = store.traffic() - before
    assert (done.requests, done.round_trips) == (5, 2)
    assert batches.sizes == [4, 4], "the parts' reads at once, then their checks at once"


def _meeting_puts(store: ObjectStore, parties: int, fail: str | None = None) -> list[str]:
    """Make ``store``'s first ``parties`` part uploads wait inside the store for one another (a checkpoint that uploads
    its parts one after the other times out) and the upload of part ``fail`` fail as a dropped connection does
    (`AllReduceError`); returns the keys of the parts uploaded, as their uploads end."""
    together, done, put = threading.Barrier(parties, timeout=30), [], ObjectStore.put_create.__get__(store)
    calls = iter(range(1 << 30))

    def meeting(key: str, data: Any) -> bool:
        if "/parts/" in key:
            if next(calls) < parties:
                together.wait()
            if fail is not None and key == part_key(fail):
                raise AllReduceError(f"create {key}: OSError: connection reset (injected)")
            done.append(key)
        return put(key, data)

    store.put_create = meeting  # type: ignore[method-assign]
    return done


def test_over_a_network_a_checkpoint_uploads_its_parts_at_once(remote: Any) -> None:
    """The first checkpoint of four fragments lists the stored parts while it names its own, uploads its four parts
    at once (each waits inside the store for the other three), then its manifest; a state of ten parts goes out on
    `WRITE_LANES` lanes (eight at once, then the last two) so a round's reads beside it still find reader threads.
    Both read back bit-identical."""
    batches = _Batches()
    snapshots, store = _snapshots("crfremote://upload", run=batches)
    uploaded = _meeting_puts(store, 4)
    state = _state(0, (1, 2, 3, 4))
    assert snapshots.write(0, state)
    assert len(uploaded) == 4
    assert set(store.list_names("state/parts")) == {k.rsplit("/", 1)[-1] for k in uploaded}
    assert batches.sizes[:2] == [2, 4], "the listing beside the naming, then the uploads at once"
    assert _equal(snapshots.read(0), state)

    snapshots, store = _snapshots("crfremote://lanes", run=batches)
    uploaded, batches.sizes = _meeting_puts(store, WRITE_LANES), []
    state = _state(0, tuple(range(1, 11)))
    assert snapshots.write(0, state)
    assert len(uploaded) == 10
    assert batches.sizes[:2] == [2, WRITE_LANES]
    assert _equal(snapshots.read(0), state)


def test_uploads_at_once_hold_at_most_write_budget_part_bytes(remote: Any) -> None:
    """Each upload holds a copy of its part: with ``write_budget`` of two parts three parts go on two lanes, with a
    budget below one part they go one at a time (as before; s3fs splits a part of 100 MB or more itself), and both
    states read back bit-identical."""
    part = pack_state({"StreamingDiLoCoFragment_0": _fragment(1)}).nbytes
    for budget, lanes in ((2 * part + 100, 2), (part // 2, 1)):
        batches = _Batches()
        snapshots, store = _snapshots(f"crfremote://budget-{lanes}", run=batches, write_budget=budget)
        state = _state(0, (1, 2, 3))
        assert snapshots.write(0, state)
        assert batches.sizes[1:2] == ([lanes] if lanes > 1 else []), "one lane runs on the writer's thread"
        assert len(store.list_names("state/parts")) == 3
        assert _equal(snapshots.read(0), state)


def test_a_part_upload_that_fails_leaves_no_manifest_and_the_next_checkpoint_completes(remote: Any) -> None:
    """One of three part uploads fails (the link dropped): the others still end (none is abandoned half way), the
    error reaches the writer, no manifest names a part that is not there, and writing the round again uploads only
    the missing part and its manifest."""
    snapshots, store = _snapshots("crfremote://failed", run=_Batches())
    state = _state(0, (1, 2, 3))
    failing = part_digest(split_state(state)[1][1], AUTH)
    uploaded = _meeting_puts(store, 3, fail=failing)
    with pytest.raises(AllReduceError, match="connection reset"):
        snapshots.write(0, state)
    assert len(uploaded) == 2
    assert part_key(failing) not in uploaded
    assert not snapshots.exists(0)
    assert snapshots.read(0) is None
    uploaded = _meeting_puts(store, 1)
    assert snapshots.write(0, state)
    assert uploaded == [part_key(failing)], "only the part that failed"
    assert _equal(snapshots.read(0), state)


def test_large_parts_come_in_ranged_reads_of_read_chunk_bytes_a_window_at_a_time(memory_uri: str) -> None:
    """With ``read_chunk`` far below a part's size the rest of each part after its header comes in reads of at most
    ``read_chunk`` bytes, across parts, in batches of at most `READ_WINDOW`; the state reads back bit-identical."""
    batches = _Batches()
    snapshots, store = _snapshots(memory_uri, run=batches, read_chunk=1000)
    state = _state(0, (1, 2, 3))
    assert snapshots.write(0, state)
    before, batches.sizes = store.traffic(), []
    assert _equal(snapshots.read(0), state)
    requests = (store.traffic() - before).requests
    sizes = [len(store.get(part_key(d))) for d in _manifest_refs(store, 0)]
    heads = [len(read_header(store, part_key(d), AUTH).head) for d in _manifest_refs(store, 0)]
    reads = sum(-(-(size - min(head, size)) // 1000) for size, head in zip(sizes, heads, strict=True))
    assert reads > 2 * READ_WINDOW
    assert batches.sizes[0] == 3, "the parts' headers, at once"
    windows = [READ_WINDOW] * (reads // READ_WINDOW) + [reads % READ_WINDOW] * (reads % READ_WINDOW > 0)
    assert batches.sizes[1:] == [*windows, 3], "then the rest in windows, then the three parts' checks"
    assert requests == 1 + 3 + reads


def _reseal(blob: bytes, key: str, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``blob`` with its header JSON changed by ``edit`` and MAC'd again with the run's secret (a hostile writer
    that holds it)."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    edit(header)
    header["__metadata__"]["mac"] = "0" * 64
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    mac = AUTH.mac_hex("object", key, raw).encode()
    raw = raw.replace(b"0" * 64, mac, 1)
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n :]


def test_a_part_whose_header_claims_a_terabyte_is_refused_after_one_window(memory_uri: str) -> None:
    """A writer with the secret seals a part header that claims a 1 TiB tensor over an object of a few KB: the reader
    neither allocates the claim nor reads on: the first window of ranged reads comes back short and the state is
    `CorruptObjectError` (truncated), after at most `READ_WINDOW` reads."""
    snapshots, store = _snapshots(memory_uri, read_chunk=4096)
    assert snapshots.write(0, _state(0, (1,)))
    key = part_key(_manifest_refs(store, 0)[0])
    real = store.get(key)

    def claim(header: dict[str, Any]) -> None:
        last = max((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
        start = last["data_offsets"][0]
        last["shape"] = [1 << 38]
        last["data_offsets"] = [start, start + (4 << 38)]

    store.remove(key)
    store.put_create(key, _reseal(real, key, claim))
    before = store.traffic()
    with pytest.raises(CorruptObjectError, match=f"{key}: truncated object"):
        snapshots.read(0)
    assert (store.traffic() - before).requests <= 2 + READ_WINDOW


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8MB"])
@pytest.mark.parametrize("name", ["read_chunk", "write_budget"])
def test_a_read_chunk_or_write_budget_that_is_not_a_positive_int_is_refused(
    memory_uri: str, name: str, bad: Any
) -> None:
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
        StateSnapshots(ObjectStore(memory_uri), AUTH, **{name: bad})


def test_a_reader_takes_the_parts_it_holds_from_itself_on_a_remote_store(remote: Any) -> None:
    """A replica one sync behind holds every fragment but the synced one: reading round 1 with its own parts
    (`StateSnapshots.local_parts`) fetches the manifest and that one part only, returns the written state bit for
    bit, and the parts it took from itself are copies (changing its tensors afterwards changes nothing). A local
    part that differs in one element is fetched."""
    snapshots, store = _snapshots("crfremote://reuse")
    snapshots.write(1, _state(1, (1, 20, 3)))
    behind = {k: v for k, v in _state(0, (1, 2, 3)).items() if k != "torchft"}
    before = snapshots.bytes[1]
    got = snapshots.read(1, lambda: snapshots.local_parts(behind))
    changed = next(
        d
        for d in _manifest_refs(store, 1)
        if part_digest(pack_state({"StreamingDiLoCoFragment_1": _fragment(20)}), AUTH) == d
    )
    assert snapshots.bytes[1] - before == len(store.get(state_key(1))) + len(store.get(part_key(changed)))
    assert _equal(got, _state(1, (1, 20, 3)))
    behind["StreamingDiLoCoFragment_0"]["original_parameters"]["weight"].add_(1.0)
    assert _equal(got, _state(1, (1, 20, 3))), "its own parts were copied"
    before = snapshots.bytes[1]
    assert _equal(snapshots.read(1, lambda: snapshots.local_parts(behind)), _state(1, (1, 20, 3)))
    assert snapshots.bytes[1] - before > 2 * len(store.get(part_key(changed))), "fragment 0 differs now: fetched"


def test_on_a_local_store_a_reader_fetches_every_part(memory_uri: str) -> None:
    """Reading from a local or in-memory store costs less than hashing one's own state: ``have`` is not called."""
    snapshots, _ = _snapshots(memory_uri)
    snapshots.write(0, _state(0, (1, 2)))

    def have() -> dict[str, Packed]:
        raise AssertionError("hashed its own state for a local read")

    assert _equal(snapshots.read(0, have), _state(0, (1, 2)))


def test_a_replica_left_behind_heals_fetching_only_the_fragments_synced_without_it(remote: Any) -> None:
    """Streaming DiLoCo's pattern on a remote store (``crfremote://``): committed round r changes ``f{r % 5}``. Rank
    1 takes part in rounds 0..4, then stalls while rank 0 commits rounds 5..7 alone (round 5 collected:
    ``keep_rounds=1``). Resumed, its sync fails and its next ``start_quorum`` heals from round 7, fetching the
    manifest and the parts of f0, f1 and f2 (rounds 5..7) but not those of f3 and f4, which it holds (rounds 3 and
    4); it observes round 8, takes part in round 9, and both replicas end bit-identical."""
    names = [f"f{i}" for i in range(5)]
    uri = "crfremote://left-behind"
    resumed, healed = threading.Event(), threading.Event()
    finals: dict[int, dict[str, torch.Tensor]] = {}
    fetched: list[int] = []

    gate = threading.Barrier(2)

    def rank0() -> None:
        frags = {n: torch.zeros(16) for n in names}
        manager = _fragments_manager(uri, 0, frags, keep_rounds=1)
        for i in range(8):  # rounds 0..4 with rank 1, 5..7 alone
            assert _fragment_sync(manager, frags, 0, gate if i < 5 else None)
        manager.shutdown()  # round 7's state
        time.sleep(0.5)  # the background collection of round 5
        resumed.set()
        assert healed.wait(60)
        for _ in range(2):
            assert _fragment_sync(manager, frags, 0, gate)
        manager.shutdown()
        finals[0] = frags

    def rank1() -> None:
        frags = {n: torch.zeros(16) for n in names}
        manager = _fragments_manager(uri, 1, frags, keep_rounds=1)
        for _ in range(5):
            assert _fragment_sync(manager, frags, 1, gate)
        assert resumed.wait(60)
        assert not _fragment_sync(manager, frags, 1, None), "round 5 was decided and collected without it"
        before = manager.checkpoint_bytes[1]
        manager.start_quorum()  # heals from round 7
        fetched.append(manager.checkpoint_bytes[1] - before)
        healed.set()
        assert manager.current_step() == 8
        committed = [
            _fragment_sync(manager, frags, 1, gate) for _ in range(2)
        ]  # observes round 8, takes part in round 9
        manager.shutdown()
        assert committed == [True, True]
        finals[1] = frags

    run_threads(rank0, rank1)
    assert all(torch.equal(finals[0][n], finals[1][n]) for n in names)
    store = ObjectStore(f"{uri}/default")
    refs = referenced_parts(read_header(store, state_key(9), Authenticator(SECRET, "default")))
    parts = {d: len(store.get(part_key(d))) for d in refs}
    assert len(parts) == 5
    part = next(iter(parts.values()))
    assert all(size == part for size in parts.values()), "five parts of one size"
    manifest = len(store.get(state_key(9)))
    assert fetched == [manifest + 3 * part], "the manifest and three of five parts"


def test_a_replica_whose_own_state_cannot_be_cut_into_parts_fetches_every_part(
    remote: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Taking parts from itself only saves transfers: a replica's state that `split_state` refuses (here an object
    that is no tensor, dict, list or scalar) means no parts of its own, a warning, and a heal that fetches all."""
    from crf_diloco.healing import _own_parts

    snapshots, _ = _snapshots("crfremote://unsplittable")
    snapshots.write(0, _state(0, (1, 2)))
    own = _own_parts(snapshots, lambda: {"StreamingDiLoCoFragment_0": {"w": object()}}, 1)
    assert own == {}
    assert "rank 1 fetches every part" in caplog.text
    assert _equal(snapshots.read(0, lambda: own), _state(0, (1, 2)))


def test_over_a_network_one_large_part_is_spread_over_several_reads_at_once(remote: Any) -> None:
    """A replica one sync behind fetches one 8 MB part: its header read brings the first MiB (`READ_MIN`), and the
    rest goes out in reads of one MiB at once (a connection often carries less than a link), not in one read."""
    batches = _Batches()
    snapshots, store = _snapshots("crfremote://spread", run=batches)
    state = {"StreamingDiLoCoFragment_0": _fragment(7, width=1024), "torchft": {"round": 0}}
    assert snapshots.write(0, state)
    size = len(store.get(part_key(_manifest_refs(store, 0)[0])))
    before, batches.sizes = store.traffic(), []
    assert _equal(snapshots.read(0), state)
    reads = -(-(size - READ_MIN) // READ_MIN)
    assert 4 <= reads <= READ_WINDOW
    assert batches.sizes == [reads], "the rest of the part, at once"
    assert (store.traffic() - before).requests == 1 + 1 + reads
