"""Create-only writes per backend (and the preflight that proves them), the typed records, the run secret."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from crf_diloco import AllReduceError, CorruptObjectError, ObjectStoreAllReduce
from crf_diloco import auth as auth_module
from crf_diloco.auth import Authenticator, launch_secret, new_secret, validate_secret
from crf_diloco.records import DecisionRecord, MemberRecord, PayloadSpec, QuorumRecord, VoteRecord, parse_rank
from crf_diloco.store import ObjectStore

SECRET = "records-secret-0123456789abcdefg"
E40 = "launch-secret-e-0123456789abcdefghijklmn"
F40 = "launch-secret-f-0123456789abcdefghijklmn"


def test_memory_create_only_has_exactly_one_winner_per_key(memory_uri: str) -> None:
    """8 threads race to create the same 2,000 keys: every key has exactly one winner, holding its bytes."""
    store = ObjectStore(memory_uri)
    wins: list[list[int]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def racer(t: int) -> None:
        start.wait()
        for k in range(2000):
            if store.put_create(f"k/{k}", f"{t}".encode()):
                wins[t].append(k)

    threads = [threading.Thread(target=racer, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = {k: t for t, keys in enumerate(wins) for k in keys}
    assert sum(len(w) for w in wins) == 2000 == len(winners)
    assert all(store.get(f"k/{k}") == f"{t}".encode() for k, t in winners.items())


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_preflight_passes_on_create_only_stores(kind: str, tmp_path: Any, memory_uri: str) -> None:
    store = ObjectStore(str(tmp_path) if kind == "local" else memory_uri)
    store.preflight()
    assert store.list_names(".preflight") == [], "the probe is removed"


def test_preflight_refuses_a_store_that_overwrites(overwriting_store: Any) -> None:
    store = ObjectStore("crfoverwrite://bucket/run")
    with pytest.raises(AllReduceError, match="does not enforce create-only writes"):
        store.preflight()
    with pytest.raises(AllReduceError, match="create-only"):
        ObjectStoreAllReduce("crfoverwrite://bucket", 0, 2, preflight=True)


def test_replicas_refuse_an_overwriting_store_before_any_round(overwriting_store: Any, run_replicas: Any) -> None:
    """Without an explicit preflight the check still runs before the first round: no replica adopts anything."""

    def replica(rank: int) -> str:
        ar = ObjectStoreAllReduce("crfoverwrite://bucket", rank, 2, timeout=5, secret=SECRET)
        t = torch.full((8,), float(rank))
        with pytest.raises(AllReduceError, match="create-only") as info:
            ar.allreduce(t)
        assert torch.equal(t, torch.full((8,), float(rank)))
        return str(info.value)

    run_replicas(replica, 2)
    assert not [k for k in overwriting_store.objects if "/r0000" in k], "no round object was ever written"


@pytest.mark.parametrize(
    ("text", "world_size", "rank"),
    [("0", 4, 0), ("3", 4, 3), ("4", 4, None), ("1_0", 20, None), ("-1", 4, None), ("+1", 4, None),
     (" 1", 4, None), ("01", 4, None), ("1.0", 4, None), ("", 4, None), ("١", 4, None), ("9" * 12, 10**13, None)],
)  # fmt: skip
def test_parse_rank_accepts_plain_decimal_ranks_only(text: str, world_size: int, rank: int | None) -> None:
    assert parse_rank(text, world_size) == rank


def _member(**overrides: Any) -> dict[str, Any]:
    spec = PayloadSpec(10, "fp32", "avg", None, False)
    return {**MemberRecord(1, "a" * 32, spec, False, None, world_size=4).to_json(), **overrides}


@pytest.mark.parametrize(
    "obj",
    [
        _member(rank=4),
        _member(rank=-1),
        _member(rank=True),
        _member(rank="1"),
        _member(incarnation="not-hex"),
        _member(spec=None),  # neither spec nor veto
        _member(veto="no"),  # both
        _member(observer="no"),
        _member(spec={"numel": 0, "codec": "fp32", "op": "avg", "name": None, "vote": False, "dtypes": []}),
        _member(spec={"numel": 10, "codec": "fp8", "op": "avg", "name": None, "vote": False, "dtypes": []}),
        _member(spec={"numel": 10, "codec": "fp32", "op": "max", "name": None, "vote": False, "dtypes": []}),
        _member(spec=[1, 2]),
        _member(extra=1),
        {"rank": 1},
        [],
    ],
)
def test_member_records_are_parsed_strictly(obj: Any) -> None:
    with pytest.raises(CorruptObjectError, match=r"^r0/members/1\.json: "):
        MemberRecord.parse(obj, "r0/members/1.json", 4)


def test_records_round_trip_and_reject_inconsistent_quorums() -> None:
    spec = PayloadSpec(10, "int8", "sum", "grads", True)
    quorum = QuorumRecord(3, "b" * 32, (0, 2), {0: "a" * 32, 2: "c" * 32}, spec, 2, {1: "mismatch"}, world_size=3)
    assert QuorumRecord.parse(quorum.to_json(), "q", 3, 3) == quorum
    assert quorum.plan.n_shards == 2
    for bad in [
        {**quorum.to_json(), "participants": [2, 0]},
        {**quorum.to_json(), "participants": [0, 0, 2]},
        {**quorum.to_json(), "participants": []},
        {**quorum.to_json(), "incarnations": {"0": "a" * 32}},
        {**quorum.to_json(), "rejected": {"0": "both"}},
        {**quorum.to_json(), "round": 4},
        {**quorum.to_json(), "token": 5},
    ]:
        with pytest.raises(CorruptObjectError, match=r"^q: "):
            QuorumRecord.parse(bad, "q", 3, 3)
    vote = VoteRecord(1, False, "nan", "b" * 32, "a" * 32, world_size=2)
    assert VoteRecord.parse(vote.to_json(), "v", 2) == vote
    decision = DecisionRecord(3, "commit", "", 0, "b" * 32, world_size=2)
    assert DecisionRecord.parse(decision.to_json(), "d", 2, 3) == decision
    with pytest.raises(CorruptObjectError, match="names its round token"):
        DecisionRecord.parse({**decision.to_json(), "token": None}, "d", 2, 3)
    with pytest.raises(CorruptObjectError, match="outcome"):
        DecisionRecord.parse({**decision.to_json(), "outcome": "maybe"}, "d", 2, 3)


def test_sealed_records_are_bound_to_key_run_and_secret() -> None:
    auth = Authenticator(SECRET, "run")
    blob = auth.seal_record("r1/decision.json", b'{"a":1}')
    assert auth.open_record("r1/decision.json", blob) == b'{"a":1}'
    for key, other in [
        ("r2/decision.json", auth),
        ("r1/decision.json", Authenticator(SECRET, "run2")),
        ("r1/decision.json", Authenticator("another-secret-0123456789abcdefg", "run")),
        ("r1/decision.json", Authenticator(None, "run")),
    ]:
        with pytest.raises(CorruptObjectError, match=r"^r[12]/decision\.json: failed"):
            other.open_record(key, blob)
    tampered = blob.replace(b'"a":1', b'"a":2')
    with pytest.raises(CorruptObjectError, match="failed authentication"):
        auth.open_record("r1/decision.json", tampered)
    for junk in [b"", b"{}", b'{"mac":"zz","body":{}}', blob[:-1], b"\xff" * 100]:
        with pytest.raises(CorruptObjectError, match=r"r1/decision\.json"):
            auth.open_record("r1/decision.json", junk)


def test_secret_validation_and_launch_secret_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(new_secret()) == 64
    assert new_secret() != new_secret()
    with pytest.raises(ValueError, match="at least 32"):
        validate_secret("short")
    with pytest.raises(ValueError, match="at least 32"):
        ObjectStoreAllReduce("memory://x", 0, 2, secret="short")
    with pytest.raises(TypeError):
        validate_secret(32)  # type: ignore[arg-type]
    monkeypatch.delenv("CRF_DILOCO_SECRET", raising=False)
    fresh = launch_secret()
    assert len(fresh) == 64
    assert launch_secret({"CRF_DILOCO_SECRET": E40}) == E40
    monkeypatch.setenv("CRF_DILOCO_SECRET", F40)
    assert launch_secret() == F40, "a launcher that has a secret reuses it (relaunching into a run)"
    assert launch_secret({"CRF_DILOCO_SECRET": E40}) == E40
    with pytest.raises(ValueError, match="at least 32"):
        launch_secret({"CRF_DILOCO_SECRET": "weak"})


def test_from_env_reads_the_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("CRF_DILOCO_URI", str(tmp_path))
    monkeypatch.setenv("CRF_DILOCO_RANK", "0")
    monkeypatch.setenv("CRF_DILOCO_WORLD_SIZE", "2")
    monkeypatch.setenv("CRF_DILOCO_SECRET", "from-env-secret-0123456789abcdef" * 2)
    assert ObjectStoreAllReduce.from_env().auth.authenticated
    assert "from-env-secret-0123456789abcdef" * 2 not in repr(ObjectStoreAllReduce.from_env().auth)
    monkeypatch.delenv("CRF_DILOCO_SECRET")
    assert not ObjectStoreAllReduce.from_env().auth.authenticated


def test_running_without_a_secret_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setattr(auth_module, "_warned", threading.Event())
    with caplog.at_level(logging.WARNING, logger="crf_diloco.auth"):
        Authenticator(None, "a")
        Authenticator(None, "b")
        Authenticator(SECRET, "c")
    warnings = [r.getMessage() for r in caplog.records if r.name == "crf_diloco.auth"]
    assert len(warnings) == 1
    assert "the store must be trusted" in warnings[0]


def test_bulk_listing_and_deleting_are_for_remote_stores_only(tmp_path: Any) -> None:
    store = ObjectStore(str(tmp_path))
    with pytest.raises(ValueError, match="list_names"):
        store.list_tree("")
    with pytest.raises(ValueError, match="remove_tree"):
        store.remove_keys(["a"])
