"""Faults: killed replica, corrupted object, stale round files, straggler, transient store errors.

Invariants checked everywhere: every replica of a round reaches the same outcome (one decision
object per round), committed results are bit-identical and equal the float64 mean over the round's
participants, and a failed round leaves the inputs unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from crf_diloco import ObjectStoreAllReduce, RoundAbortedError
from crf_diloco.layout import RoundKeys
from crf_diloco.records import PayloadSpec

RunReplicas = Callable[..., list[Any]]
FaultRule = Callable[..., dict[str, Any]]
WORKER = Path(__file__).with_name("replica_worker.py")


def _x(rank: int, round_id: int, n: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * rank + round_id)
    return torch.randn(n, generator=g)


def _mean(ranks: list[int], round_id: int, n: int = 300) -> torch.Tensor:
    return sum(_x(r, round_id, n).double() for r in ranks) / len(ranks)  # type: ignore[return-value]


def _two_rounds(ar: ObjectStoreAllReduce, rank: int) -> list[tuple[str, torch.Tensor]]:
    """Round 0 under the test's (short) deadline, round 1 with a generous one (loaded CI machines)."""
    first = _round(ar, rank, 0)
    ar.timeout = 30.0
    return [first, _round(ar, rank, 1)]


def _round(ar: ObjectStoreAllReduce, rank: int, round_id: int) -> tuple[str, torch.Tensor]:
    t = _x(rank, round_id)
    before = t.clone()
    try:
        ar.allreduce(t)
        return "commit", t
    except RoundAbortedError:
        assert torch.equal(t, before), "a failed round leaves the inputs unchanged"
        return "abort", t


def test_transient_store_errors_are_retried(
    faulty_store: Any, fault_rule: FaultRule, run_replicas: RunReplicas
) -> None:
    reads = fault_rule("read", lambda p: "/data/" in p or "/reduced/" in p, "oserror", count=4)
    writes = fault_rule("write", lambda p: "/data/" in p or "/decision" in p, "oserror", count=3)

    def replica(rank: int) -> tuple[str, torch.Tensor]:
        return _round(ObjectStoreAllReduce("crffaulty://transient", rank, 3, timeout=20), rank, 0)

    results = run_replicas(replica, 3)
    assert reads["fired"] == 4
    assert writes["fired"] == 3
    for outcome, t in results:
        assert outcome == "commit"
        assert torch.equal(t, results[0][1])
        torch.testing.assert_close(t.double(), _mean([0, 1, 2], 0), rtol=1e-6, atol=1e-6)


def test_persistent_store_error_aborts_everywhere(
    faulty_store: Any, fault_rule: FaultRule, run_replicas: RunReplicas
) -> None:
    fault_rule("write", lambda p: "r00000000/data/1" in p, "oserror", count=100)

    def replica(rank: int) -> list[str]:
        ar = ObjectStoreAllReduce("crffaulty://persistent", rank, 2, timeout=2, poll_interval=0.01)
        ar.store.retries = 1
        return [outcome for outcome, _ in _two_rounds(ar, rank)]

    assert run_replicas(replica, 2) == [["abort", "commit"], ["abort", "commit"]]


def test_corrupted_object_aborts_round_on_every_replica(
    faulty_store: Any, fault_rule: FaultRule, run_replicas: RunReplicas
) -> None:
    flips = fault_rule("read", lambda p: "r00000000/data/1" in p, "flip", count=1000)

    def replica(rank: int) -> list[tuple[str, torch.Tensor]]:
        ar = ObjectStoreAllReduce("crffaulty://corrupt", rank, 3, timeout=3, poll_interval=0.01)
        return _two_rounds(ar, rank)

    results = run_replicas(replica, 3)
    assert flips["fired"] > 0
    assert [r[0][0] for r in results] == ["abort"] * 3
    decision = ObjectStoreAllReduce("crffaulty://corrupt", 0, 3).read_decision(0)
    assert decision is not None
    assert decision.outcome == "abort"
    assert "r00000000/data/1.safetensors" in decision.reason, "the abort names the corrupt object's key"
    assert "checksum" in decision.reason or "authentication" in decision.reason
    for outcome, t in (r[1] for r in results):
        assert outcome == "commit"
        torch.testing.assert_close(t.double(), _mean([0, 1, 2], 1), rtol=1e-6, atol=1e-6)


def test_stale_round_files_are_ignored(memory_uri: str, run_replicas: RunReplicas) -> None:
    """A previous run left decided rounds and a half-finished round under the same run_id."""

    # an old run: two decided rounds, then a crash mid-round 2 (members + quorum, no data, no decision)
    def old_run(rank: int) -> ObjectStoreAllReduce:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=5)
        for _ in range(2):
            ar.allreduce(torch.ones(5))
        return ar

    old = run_replicas(old_run, 2)
    keys = RoundKeys(2)
    mine = [ar._announce(keys, PayloadSpec(300, "fp32", "avg", None, False), True) for ar in old]
    old[0]._await_quorum(keys, mine[0])

    def replica(rank: int) -> tuple[dict[int, tuple[str, torch.Tensor]], float]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=30, poll_interval=0.01)
        start = time.monotonic()
        ar.join()
        assert ar.round_id >= 2, "decided rounds of the old run are skipped"
        seen = {}
        while ar.round_id < 4:
            round_id = ar.round_id
            seen[round_id] = _round(ar, rank, round_id)
        return seen, time.monotonic() - start

    results = run_replicas(replica, 2)
    for seen, elapsed in results:
        assert elapsed < 10, "no deadline had to pass"
        assert seen.get(2, ("abort",))[0] == "abort"  # a replica may see round 2 decided before it starts
        outcome, t = seen[3]
        assert outcome == "commit"
        torch.testing.assert_close(t.double(), _mean([0, 1], 3), rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0][0][3][1], results[1][0][3][1])
    decision = ObjectStoreAllReduce(memory_uri, 0, 2).read_decision(2)
    assert decision is not None
    assert "incarnation" in decision.reason


def test_straggler_past_deadline_aborts_consistently(
    faulty_store: Any, fault_rule: FaultRule, run_replicas: RunReplicas
) -> None:
    def wait_for_abort(path: str) -> None:  # rank 2 only writes its payload once the round is decided
        deadline = time.monotonic() + 60
        while not faulty_store().exists("/straggler/default/r00000000/decision.json"):
            assert time.monotonic() < deadline
            time.sleep(0.01)

    fault_rule("write", lambda p: "r00000000/data/2" in p, wait_for_abort)

    def replica(rank: int) -> list[tuple[str, torch.Tensor]]:
        ar = ObjectStoreAllReduce("crffaulty://straggler", rank, 3, timeout=1.0, poll_interval=0.01)
        return _two_rounds(ar, rank)

    results = run_replicas(replica, 3)
    assert [r[0][0] for r in results] == ["abort"] * 3
    assert [r[1][0] for r in results] == ["commit"] * 3, "the straggler rejoins the next round"
    assert all(torch.equal(r[1][1], results[0][1][1]) for r in results)


def test_slow_shard_owner_is_covered(faulty_store: Any, fault_rule: FaultRule, run_replicas: RunReplicas) -> None:
    slow = fault_rule("write", lambda p: "r00000000/reduced/1" in p, lambda p: time.sleep(1.5))

    def replica(rank: int) -> tuple[str, torch.Tensor]:
        ar = ObjectStoreAllReduce("crffaulty://cover", rank, 3, timeout=10, straggler_grace=0.3, poll_interval=0.01)
        return _round(ar, rank, 0)

    results = run_replicas(replica, 3)
    assert slow["fired"] >= 1
    for outcome, t in results:
        assert outcome == "commit"
        assert torch.equal(t, results[0][1])
        torch.testing.assert_close(t.double(), _mean([0, 1, 2], 0), rtol=1e-6, atol=1e-6)


class _Killed(BaseException):
    pass


def test_owner_killed_after_contributing_round_still_commits(memory_uri: str, run_replicas: RunReplicas) -> None:
    """Rank 1 dies after writing its payload but before its reduced shard: the others cover the
    shard, the round commits with all three contributions, and survivors go on with two."""

    def replica(rank: int) -> list[tuple[str, list[int], torch.Tensor]]:
        ar = ObjectStoreAllReduce(
            memory_uri, rank, 3, timeout=10, quorum_timeout=2.0, straggler_grace=0.3, poll_interval=0.01
        )
        if rank == 1:
            original = ar._reduce_shard

            def reduce_shard(keys: RoundKeys, *args: Any) -> None:
                if keys.round_id == 0:  # its payload is written (or being written): die before reducing
                    raise _Killed
                original(keys, *args)

            ar._reduce_shard = reduce_shard  # type: ignore[method-assign]
        out = []
        for r in range(3):
            try:
                outcome, t = _round(ar, rank, r)
            except _Killed:
                return out
            assert ar.last_round is not None
            out.append((outcome, ar.last_round.participants, t))
        return out

    results = run_replicas(replica, 3)
    assert results[1] == []
    for rank in (0, 2):
        (o0, p0, t0), (o1, p1, _t1), (o2, p2, t2) = results[rank]
        assert (o0, p0) == ("commit", [0, 1, 2])
        torch.testing.assert_close(t0.double(), _mean([0, 1, 2], 0), rtol=1e-6, atol=1e-6)
        assert (o1, p1, o2, p2) == ("commit", [0, 2], "commit", [0, 2])
        torch.testing.assert_close(t2.double(), _mean([0, 2], 2), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a[2], b[2]) for a, b in zip(results[0], results[2], strict=False))


def _read_logs(paths: list[Path]) -> dict[int, list[dict[str, Any]]]:
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                by_round[rec["round"]].append(rec)
    return by_round


@pytest.mark.slow
@pytest.mark.integration
def test_replica_process_killed_mid_round_survivors_continue_and_restart_rejoins(tmp_path: Path) -> None:
    """Real processes on a local folder: rank 1 is killed mid-round 1 (announced, in the quorum, no
    payload). Round 1 aborts on every survivor; ranks 0 and 2 go on with two participants; a
    restarted rank 1 joins the round the others are in and later rounds have three participants."""
    uri, stop = str(tmp_path / "store"), tmp_path / "stop"
    logs = [tmp_path / f"rank{r}.jsonl" for r in range(3)]
    restart_log = tmp_path / "rank1-restarted.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def spawn(rank: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, str(WORKER), uri, str(rank), "3", "400", str(log), str(stop), *extra]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait_for(path: Path, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
        deadline = time.monotonic() + 120
        while not (path.exists() and any(predicate(json.loads(x)) for x in path.read_text().splitlines())):
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    procs = [spawn(0, logs[0]), spawn(1, logs[1], "--die-before-data", "1"), spawn(2, logs[2])]
    try:
        assert procs[1].wait(timeout=120) == 17, "rank 1 was killed mid-round"
        wait_for(logs[0], lambda rec: rec["outcome"] == "commit" and rec["participants"] == [0, 2], "survivors go on")
        procs.append(spawn(1, restart_log))
        wait_for(restart_log, lambda rec: rec["outcome"] == "commit" and rec["participants"] == [0, 1, 2], "rejoin")
        stop.touch()
        for p in (procs[0], procs[2], procs[3]):
            out = p.communicate(timeout=120)[0]
            assert p.returncode == 0, out.decode()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    by_round = _read_logs([*logs, restart_log])
    assert {rec["outcome"] for rec in by_round[1]} == {"abort"}, "the round rank 1 died in aborts on every survivor"
    for round_id, recs in by_round.items():
        outcomes = {rec["outcome"] for rec in recs}
        assert len(outcomes) == 1, f"round {round_id}: replicas disagree {outcomes}"
        if outcomes == {"commit"}:
            participants = recs[0]["participants"]
            assert all(rec["participants"] == participants for rec in recs)
            values = [torch.tensor(rec["values"]) for rec in recs]
            assert all(torch.equal(v, values[0]) for v in values), f"round {round_id} not bit-identical"
            g = [torch.Generator().manual_seed(100_003 * r + round_id) for r in participants]
            expect = sum(torch.randn(257, generator=gen).double() for gen in g) / len(participants)
            torch.testing.assert_close(values[0].double(), expect, rtol=1e-6, atol=1e-6)


def test_replica_that_cannot_read_a_committed_result_raises_desync(faulty_store: Any, fault_rule: FaultRule) -> None:
    """The round committed (decision object) but this replica cannot read it: it must not report an
    abort (the others committed) — it raises RoundDesyncError and the store shows the commit."""
    from crf_diloco import RoundDesyncError

    ar0 = ObjectStoreAllReduce("crffaulty://desync", 0, 2, timeout=5, quorum_timeout=0.2, poll_interval=0.01)
    assert _round(ar0, 0, 0)[0] == "commit"  # rank 1 is late: rank 0 commits alone
    fault_rule("read", lambda p: "r00000000/reduced/" in p, "oserror", count=10_000)
    ar1 = ObjectStoreAllReduce("crffaulty://desync", 1, 2, timeout=0.5, poll_interval=0.01, retries=0)
    ar1.join(0)  # replay round 0 as the late replica
    t = _x(1, 0)
    before = t.clone()
    with pytest.raises(RoundDesyncError, match="committed but this replica could not read"):
        ar1.allreduce(t)
    assert torch.equal(t, before)
    assert ar1.latest_committed_round() == 0


def test_malformed_quorum_record_aborts(memory_uri: str) -> None:
    ar = ObjectStoreAllReduce(memory_uri, 0, 2, timeout=5, poll_interval=0.01)
    ar.join(0)
    ar.store.put_create(RoundKeys(0).quorum, b'{"participants": [1, 0], "token": 5}')
    t = torch.ones(4)
    with pytest.raises(RoundAbortedError, match=r"quorum\.json"):
        ar.allreduce(t)
    assert torch.equal(t, torch.ones(4))
    decision = ar.read_decision(0)
    assert decision is not None
    assert decision.outcome == "abort"
