"""ObjectStoreAllReduce: results against a float64 reference, layout, compression, bytes, validation."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import fsspec
import pytest
import torch

from crf_diloco import AllReduceError, ObjectStoreAllReduce
from crf_diloco.errors import PayloadMismatchError, RoundAbortedError, StoreBackendMissingError
from crf_diloco.wire import INT8_BLOCK

RunReplicas = Callable[..., list[Any]]


def _inputs(
    rank: int, round_id: int, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + round_id)
    return [(torch.randn(s, generator=g) * (1 + rank)).to(dtype) for s in shapes]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_allreduce_matches_float64_reference_and_is_bit_identical(
    world_size: int, op: str, memory_uri: str, run_replicas: RunReplicas
) -> None:
    shapes = [(37,), (5, 11), (2, 3, 4)]

    def replica(rank: int) -> list[list[torch.Tensor]]:
        ar = ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=20)
        out = []
        for round_id in range(2):
            ts = _inputs(rank, round_id, shapes)
            ret = ar.allreduce(ts, op)  # type: ignore[arg-type]
            assert ret is ts
            out.append([t.clone() for t in ts])
        assert ar.round_id == 2
        return out

    results = run_replicas(replica, world_size)
    for round_id in range(2):
        ref_inputs = [_inputs(r, round_id, shapes) for r in range(world_size)]
        for i in range(len(shapes)):
            expect = sum(x[i].double() for x in ref_inputs)
            if op == "avg":
                expect = expect / world_size
            for r in range(world_size):
                got = results[r][round_id][i]
                assert torch.equal(got, results[0][round_id][i]), "replicas must hold bit-identical results"
                torch.testing.assert_close(got.double(), expect, rtol=1e-6, atol=1e-6)


def test_allreduce_single_tensor_low_precision_inputs_reduced_in_fp32(tmp_path: Any, run_replicas: RunReplicas) -> None:
    def replica(rank: int) -> torch.Tensor:
        t = _inputs(rank, 0, [(300,)], torch.bfloat16)[0]
        ObjectStoreAllReduce(str(tmp_path), rank, 2, timeout=20).allreduce(t)
        assert t.dtype == torch.bfloat16
        return t

    out = run_replicas(replica, 2)
    expect = (
        _inputs(0, 0, [(300,)], torch.bfloat16)[0].float() + _inputs(1, 0, [(300,)], torch.bfloat16)[0].float()
    ) / 2
    assert torch.equal(out[0], expect.to(torch.bfloat16))
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize(("compression", "tol_fn"), [("bf16", "bf16"), ("int8", "int8")])
def test_compressed_allreduce_error_bounded(
    compression: str, tol_fn: str, memory_uri: str, run_replicas: RunReplicas
) -> None:
    world_size, n = 3, 5000

    def replica(rank: int) -> torch.Tensor:
        t = _inputs(rank, 0, [(n,)])[0]
        ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=20, compression=compression).allreduce(t)  # type: ignore[arg-type]
        return t

    out = run_replicas(replica, world_size)
    xs = [_inputs(r, 0, [(n,)])[0].double() for r in range(world_size)]
    exact = sum(xs) / world_size
    assert all(torch.equal(o, out[0]) for o in out)
    err = (out[0].double() - exact).abs()
    if tol_fn == "bf16":
        # each input and the reduced value are rounded once to bf16 (relative 2^-8 each)
        bound = sum(x.abs() for x in xs) / world_size * 2**-8 + exact.abs() * 2**-8 + 1e-12
    else:
        # per block: input quantisation error <= s_i/2 with s_i = absmax/127, plus the re-quantised result
        pad = (-n) % INT8_BLOCK

        def block_absmax(v: torch.Tensor) -> torch.Tensor:
            blocks = torch.cat([v.abs(), v.new_zeros(pad)]).view(-1, INT8_BLOCK).amax(dim=1)
            return blocks.repeat_interleave(INT8_BLOCK)[:n]

        inputs_err = sum(block_absmax(x) / 127 / 2 for x in xs) / world_size
        bound = inputs_err + block_absmax(exact + inputs_err) / 127 / 2 + 1e-9
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # compression really happened


def test_world_size_1_passthrough_does_no_io(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("world_size == 1 must not touch the store")

    monkeypatch.setattr(fsspec.core, "url_to_fs", boom)
    ar = ObjectStoreAllReduce("s3://no-such-bucket/never", 0, 1)
    t = torch.randn(7)
    before = t.clone()
    assert ar.allreduce(t) is t
    assert torch.equal(t, before)
    assert ar.round_id == 1
    assert ar.bytes_read == ar.bytes_written == 0


def test_file_uri_and_bare_path_create_directory(tmp_path: Any) -> None:
    bare = tmp_path / "bare" / "nested"
    ObjectStoreAllReduce(str(bare), 0, 2, run_id="run1")
    assert (bare / "run1").is_dir()
    uri_dir = tmp_path / "viauri"
    ObjectStoreAllReduce(f"file://{uri_dir}", 1, 2)
    assert (uri_dir / "default").is_dir()


def test_store_layout_and_garbage_collection(tmp_path: Any, run_replicas: RunReplicas) -> None:
    def replica(rank: int) -> None:
        with ObjectStoreAllReduce(str(tmp_path), rank, 2, timeout=20, keep_rounds=2) as ar:
            for i in range(5):
                ar.allreduce(torch.full((10,), float(rank + i)))
        # close() waits for the background garbage collection

    run_replicas(replica, 2)
    run = tmp_path / "default"
    ar = ObjectStoreAllReduce(str(tmp_path), 0, 2)
    assert json.loads((run / "LAYOUT").read_text())["body"] == {"layout": "crf-diloco", "version": 5, "world_size": 2}
    rounds = sorted(p.name for p in run.iterdir() if p.name.startswith("r"))
    assert rounds == [f"r{r:08d}" for r in range(5)]
    for old in rounds[:3]:  # rounds older than keep_rounds are collected, their decision kept as a tombstone
        assert [p.name for p in (run / old).iterdir()] == ["decision.json"], old
        assert ar.read_decision(int(old[1:])) is not None
    assert (run / "r00000003" / "quorum.json").exists()
    r4 = run / "r00000004"
    decision = ar.read_decision(4)
    assert decision is not None
    assert decision.outcome == "commit"
    quorum = ar.read_quorum(4)
    assert quorum is not None
    assert quorum.participants == (0, 1)
    assert sorted(p.name for p in (r4 / "data").iterdir()) == ["0.safetensors", "1.safetensors"]
    assert sorted(p.name for p in (r4 / "reduced").iterdir()) == ["0.safetensors", "1.safetensors"]
    assert not list(run.rglob(".tmp-*")), "temporary files are linked into place and removed"


def test_a_replica_never_reads_back_its_own_announcement(memory_uri: str, run_replicas: RunReplicas) -> None:
    """Its member record is the one it just created (create-only), so the quorum phase starts from it instead of
    spending a request per round (a network round trip's share of the bucket's work) on reading it back."""
    reads: dict[int, list[str]] = {}

    def replica(rank: int) -> list[float]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 3, timeout=20)
        get, seen = ar.store.try_get, reads.setdefault(rank, [])

        def try_get(key: str, limit: int | None = None) -> bytes | None:
            seen.append(key)
            return get(key, limit)

        ar.store.try_get = try_get  # type: ignore[method-assign]
        with ar:
            return [float(ar.allreduce(torch.full((4,), float(rank + i)))[0]) for i in range(3)]

    assert run_replicas(replica, 3) == [[1.0, 2.0, 3.0]] * 3
    for rank, keys in reads.items():
        assert any("/members/" in k for k in keys), "it reads the others' announcements"
        assert not [k for k in keys if k.endswith(f"/members/{rank}.json")], rank


def _record_listings(ar: ObjectStoreAllReduce, listed: list[str]) -> None:
    list_names = ar.store.list_names

    def recorded(key: str) -> list[str]:
        listed.append(key)
        return list_names(key)

    ar.store.list_names = recorded  # type: ignore[method-assign]


def test_members_are_listed_only_while_some_rank_is_not_expected(memory_uri: str, run_replicas: RunReplicas) -> None:
    """With every rank expected (the first round, and after rounds every rank took part in) a listing of
    ``members/`` could find no one else: no replica sends one. With a rank missing from the last round, the quorum
    wait lists ``members/`` to find it if it comes back."""
    listed: dict[int, list[str]] = {}

    def replica(rank: int, world_size: int, rounds: int) -> None:
        ar = ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=20, quorum_timeout=0.5, run_id=f"w{world_size}")
        ar.join()  # finding the live round may list a round's members/; the quorum waits are what is counted
        _record_listings(ar, listed.setdefault(rank + 10 * world_size, []))
        with ar:
            for i in range(rounds):
                ar.allreduce(torch.full((4,), float(i)))

    run_replicas(lambda rank: replica(rank, 3, 3), 3)
    assert not [k for r in (30, 31, 32) for k in listed[r] if "members" in k], listed
    run_replicas(lambda rank: replica(rank, 4, 2), 3)  # rank 3 never comes: round 0 waits out its quorum deadline
    for r in (40, 41, 42):
        assert "r00000001/members" in listed[r], listed[r]


def test_a_quorum_wait_reads_the_decision_at_most_every_decision_gap(memory_uri: str) -> None:
    """Rank 0 waits ~1 s for rank 1's announcement, polling every 10 ms: every poll reads the quorum, but the
    decision (a round decided before its quorum is rare) only on the first poll and then every `DECISION_GAP`."""
    from crf_diloco.rounds.round import DECISION_GAP

    ars = [ObjectStoreAllReduce(memory_uri, r, 2, timeout=20, poll_interval=0.01) for r in range(2)]
    seen: list[str] = []
    get = ars[0].store.try_get

    def try_get(key: str, limit: int | None = None) -> bytes | None:
        seen.append(key)
        return get(key, limit)

    ars[0].store.try_get = try_get  # type: ignore[method-assign]
    late = threading.Timer(1.0, lambda: ars[1].allreduce(torch.ones(4)))
    late.start()
    started = time.monotonic()
    ars[0].allreduce(torch.ones(4))
    waited = time.monotonic() - started
    late.join()
    for ar in ars:
        ar.close()
    quorum_reads = seen.count("r00000000/quorum.json")
    decision_reads = seen.count("r00000000/decision.json")
    assert quorum_reads >= 20, seen  # the wait polled
    # the quorum wait's first read and one per gap, then the data phase's (its collection check, its decision)
    assert decision_reads <= 6 + waited / DECISION_GAP, (decision_reads, quorum_reads, waited)


def test_wire_objects_are_safetensors_not_pickle(tmp_path: Any, run_replicas: RunReplicas) -> None:
    from safetensors import safe_open

    run_replicas(lambda r: ObjectStoreAllReduce(str(tmp_path), r, 2, timeout=20).allreduce(torch.ones(64) * r), 2)
    obj = tmp_path / "default" / "r00000000" / "data" / "1.safetensors"
    raw = obj.read_bytes()
    assert b"\x80\x04" not in raw[:2]
    assert not raw.startswith(b"PK")
    with safe_open(str(obj), framework="pt") as f:
        meta = f.metadata()
        assert meta["codec"] == "fp32"
        assert meta["numel"] == "64"
        assert meta["kind"] == "payload"
        assert len(json.loads(meta["tags"])) == 2, "one content tag per shard"
        assert len(meta["mac"]) == 64
        assert torch.equal(f.get_tensor("x"), torch.ones(64))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_bytes_per_replica_independent_of_world_size(
    world_size: int, memory_uri: str, run_replicas: RunReplicas
) -> None:
    n = 1 << 20  # 4 MiB of fp32: headers and records are negligible

    def replica(rank: int) -> tuple[int, int]:
        ar = ObjectStoreAllReduce(memory_uri, rank, world_size, timeout=60)
        ar.allreduce(torch.randn(n))
        return ar.bytes_read, ar.bytes_written

    size = 4 * n
    for read, written in run_replicas(replica, world_size):
        total = (read + written) / size
        assert total <= 2.9, total  # 1 + 1/m + 2(m-1)/m = 2.875 at m = 8
        # up S + S/m, down 2(m-1)/m S (+ headers)
        assert written / size == pytest.approx(1 + 1 / world_size, abs=0.02)
        assert read / size == pytest.approx(2 * (world_size - 1) / world_size, abs=0.1)


def test_int8_cuts_bytes_to_under_0_3(memory_uri: str, run_replicas: RunReplicas) -> None:
    n = 1 << 18

    def replica(rank: int, compression: str | None) -> int:
        ar = ObjectStoreAllReduce(memory_uri, rank, 4, timeout=60, run_id=f"c{compression}", compression=compression)  # type: ignore[arg-type]
        ar.allreduce(torch.randn(n))
        return ar.bytes_read + ar.bytes_written

    plain = run_replicas(lambda r: replica(r, None), 4)
    int8 = run_replicas(lambda r: replica(r, "int8"), 4)
    assert max(a / b for a, b in zip(int8, plain, strict=False)) <= 0.3


def test_round_id_increments_on_commit_and_abort(memory_uri: str, run_replicas: RunReplicas) -> None:
    def replica(rank: int) -> list[int]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20)
        ids = [ar.round_id]
        ar.allreduce(torch.ones(3))
        ids.append(ar.round_id)
        if rank == 0:
            ar.abort("test veto")
        else:
            with pytest.raises(RoundAbortedError, match="test veto"):
                ar.allreduce(torch.ones(3))
        ids.append(ar.round_id)
        ar.allreduce(torch.ones(3))
        ids.append(ar.round_id)
        return ids

    assert run_replicas(replica, 2) == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_late_replica_observes_committed_round(memory_uri: str, run_replicas: RunReplicas) -> None:
    """A replica that arrives after the quorum formed reads the committed result (not a participant)."""
    ar0 = ObjectStoreAllReduce(memory_uri, 0, 2, timeout=20, quorum_timeout=0.3)
    t0 = torch.full((9,), 2.0)
    ar0.allreduce(t0)
    assert ar0.last_round is not None
    assert ar0.last_round.participants == [0]
    ar1 = ObjectStoreAllReduce(memory_uri, 1, 2, timeout=20)
    assert ar1.frontier() == 1
    ar1.join(0)  # explicitly replay round 0 as a latecomer
    t1 = torch.full((9,), 100.0)
    ar1.allreduce(t1)
    assert torch.equal(t1, t0)
    assert ar1.last_round is not None
    assert not ar1.last_round.participated


def test_an_observer_announcement_settles_its_rank_so_nobody_waits_for_it(
    memory_uri: str, run_replicas: RunReplicas
) -> None:
    """A healing replica announces a round as an observer: it will never contribute to it, so the participants form
    the quorum at once instead of waiting ``quorum_timeout`` (an hour here) for it; it reads their result."""
    announced = threading.Barrier(2, timeout=30)

    def replica(rank: int) -> tuple[torch.Tensor, list[int], bool]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=3600, quorum_timeout=3600)
        if rank == 0:
            announced.wait()  # the observer's record is in the round before this replica looks
        t = torch.full((3,), 4.0 if rank == 0 else -1.0)
        if rank == 1:
            announce = ar._announce

            def announce_then_signal(*args: Any, **kwargs: Any) -> Any:
                record = announce(*args, **kwargs)
                announced.wait()
                return record

            ar._announce = announce_then_signal  # type: ignore[method-assign]
        ar.allreduce(t, participate=rank == 0)
        assert ar.last_round is not None
        return t, list(ar.last_round.participants), ar.last_round.participated

    results = run_replicas(replica, 2, timeout=60)
    assert [r[1] for r in results] == [[0], [0]]
    assert [r[2] for r in results] == [True, False]
    assert all(torch.equal(t, torch.full((3,), 4.0)) for t, _, _ in results)


def test_payload_mismatch_fails_loudly_alone(memory_uri: str, run_replicas: RunReplicas) -> None:
    """Rank 2 passes 5 elements where ranks 0 and 1 pass 4: it alone raises PayloadMismatchError (not an
    AllReduceError), with its tensor unchanged, and the other two commit their round without it, every round."""

    def replica(rank: int) -> list[tuple[str, torch.Tensor, list[int]]]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 3, timeout=20)
        out = []
        for round_id in range(2):
            t = torch.full((5 if rank == 2 else 4,), float(rank + round_id))
            before = t.clone()
            try:
                ar.allreduce(t)
            except PayloadMismatchError as exc:
                out.append((f"{type(exc).__mro__} {exc}", t, []))
                assert torch.equal(t, before), "a failed round leaves the inputs unchanged"
                continue
            assert ar.last_round is not None
            out.append(("commit", t, ar.last_round.participants))
        return out

    results = run_replicas(replica, 3)
    for round_id in range(2):
        for rank in (0, 1):
            outcome, t, participants = results[rank][round_id]
            assert (outcome, participants) == ("commit", [0, 1])
            assert torch.equal(t, torch.full((4,), 0.5 + round_id))
        message = results[2][round_id][0]
        assert "AllReduceError" not in message, "a configuration error, not a failed round"
        assert "rank 2 passed 5 elements" in message
        assert "settled on a payload of 4 elements" in message


def test_min_participants_aborts_small_quorum(memory_uri: str) -> None:
    ar = ObjectStoreAllReduce(memory_uri, 0, 3, timeout=5, quorum_timeout=0.2, min_participants=2)
    with pytest.raises(RoundAbortedError, match="min_participants=2"):
        ar.allreduce(torch.ones(3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, "rank must be"),
        ({"rank": 0, "world_size": 0}, "world_size must be"),
        ({"timeout": 0}, "timeout must be"),
        ({"compression": "fp8"}, "compression must be"),
        ({"run_id": "../escape"}, "could escape"),
        ({"run_id": "a/b"}, "could escape"),
        ({"run_id": ""}, "could escape"),
        ({"min_participants": 3}, "min_participants"),
    ],
)
def test_constructor_validation(kwargs: dict[str, Any], match: str, tmp_path: Any) -> None:
    params: dict[str, Any] = {"uri": str(tmp_path), "rank": 0, "world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        ObjectStoreAllReduce(**params)


def test_allreduce_input_validation(tmp_path: Any) -> None:
    ar = ObjectStoreAllReduce(str(tmp_path), 0, 2)
    with pytest.raises(TypeError, match=r"dtype torch\.int64"):
        ar.allreduce(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        ar.allreduce(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one tensor"):
        ar.allreduce([])
    with pytest.raises(ValueError, match="at least one element"):
        ar.allreduce(torch.ones(0))
    with pytest.raises(ValueError, match="op must be"):
        ar.allreduce(torch.ones(3), "max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="could escape"):
        ar.allreduce(torch.ones(3), name="../../etc")
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        ar.allreduce([torch.ones(2), "x"])  # type: ignore[list-item]
    assert ar.round_id == 0, "validation happens before any I/O"
    assert ar.bytes_written == 0


@pytest.mark.parametrize(("protocol", "package"), [("gs", "gcsfs"), ("az", "adlfs"), ("s3", "s3fs")])
def test_missing_adapter_names_the_package(protocol: str, package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = sys.modules["fsspec.registry"]._registry  # the module, not fsspec.registry (a mapping)
    monkeypatch.setitem(sys.modules, package, None)  # import now fails like an uninstalled package
    for proto in (protocol, "gcs", "abfs", "s3a"):
        monkeypatch.delitem(registry, proto, raising=False)
    ar = ObjectStoreAllReduce(f"{protocol}://bucket/prefix", 0, 2)  # lazy: constructing does not fail
    with pytest.raises(StoreBackendMissingError, match=f"install `{package}`") as info:
        ar.allreduce(torch.ones(2))
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value, AllReduceError)
    with pytest.raises(StoreBackendMissingError, match=package):
        ObjectStoreAllReduce(f"{protocol}://bucket/prefix", 0, 2, preflight=True)


def test_preflight_reports_unusable_store(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ar = ObjectStoreAllReduce("memory://preflight-ok", 0, 2, preflight=True)
    assert ar.store.list_names(".preflight") == []  # the probe is removed
    with pytest.raises((AllReduceError, OSError)):
        ObjectStoreAllReduce(str(blocker / "sub"), 0, 2, preflight=True)


def test_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("CRF_DILOCO_URI", str(tmp_path))
    monkeypatch.setenv("CRF_DILOCO_RANK", "1")
    monkeypatch.setenv("CRF_DILOCO_WORLD_SIZE", "3")
    monkeypatch.setenv("CRF_DILOCO_RUN_ID", "exp7")
    ar = ObjectStoreAllReduce.from_env(timeout=5.0)
    assert (ar.rank, ar.world_size, ar.run_id, ar.timeout) == (1, 3, "exp7", 5.0)
    assert (tmp_path / "exp7").is_dir()
    monkeypatch.setenv("CRF_DILOCO_RANK", "one")
    with pytest.raises(ValueError, match="CRF_DILOCO_RANK"):
        ObjectStoreAllReduce.from_env()
    monkeypatch.delenv("CRF_DILOCO_URI")
    with pytest.raises(KeyError, match="CRF_DILOCO_URI"):
        ObjectStoreAllReduce.from_env()


def test_layout_version_mismatch_is_refused(tmp_path: Any) -> None:
    run = tmp_path / "default"
    run.mkdir()
    (run / "LAYOUT").write_text(json.dumps({"layout": "crf-diloco", "version": 99}))
    ar = ObjectStoreAllReduce(str(tmp_path), 0, 2, timeout=2)
    with pytest.raises(AllReduceError, match="new run_id"):
        ar.allreduce(torch.ones(2))
    other = tmp_path / "other"
    sealed = ObjectStoreAllReduce(str(tmp_path), 0, 2, run_id="other", secret="layout-secret-0123456789abcdefgh")
    sealed._write_record("LAYOUT", {"layout": "crf-diloco", "version": 99})
    assert (other / "LAYOUT").exists()
    with pytest.raises(AllReduceError, match="holds a crf-diloco layout"):
        ObjectStoreAllReduce(str(tmp_path), 1, 2, run_id="other", secret="layout-secret-0123456789abcdefgh").allreduce(
            torch.ones(2)
        )
    with pytest.raises(AllReduceError, match="another run or secret"):
        ObjectStoreAllReduce(str(tmp_path), 1, 2, run_id="other", secret="wrong-secret-0123456789abcdefghi").allreduce(
            torch.ones(2)
        )
