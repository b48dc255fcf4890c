"""The store-wide commit vote (``defer_decision=True`` + ``vote``) and the veto (``abort``).

Invariant checked everywhere: every participant of a round gets the same answer, and it is the
one decision object of the round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from crf_diloco import ObjectStoreAllReduce, PayloadMismatchError, RoundAbortedError
from crf_diloco.layout import RoundKeys
from crf_diloco.records import DecisionRecord

RunReplicas = Callable[..., list[Any]]
ReadRecord = Callable[[ObjectStoreAllReduce, str], dict[str, Any]]


def _x(rank: int, n: int = 40) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(101 + rank))


def _decision(ar: ObjectStoreAllReduce, round_id: int) -> DecisionRecord:
    decision = ar.read_decision(round_id)
    assert decision is not None
    return decision


@pytest.mark.parametrize("votes", [(True, True), (True, False), (False, False)], ids=["all-yes", "one-no", "all-no"])
def test_vote_decides_once_and_every_participant_follows(
    votes: tuple[bool, bool], memory_uri: str, run_replicas: RunReplicas, read_record: ReadRecord
) -> None:
    barrier = threading.Barrier(2)

    def replica(rank: int) -> tuple[bool, torch.Tensor, list[int]]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20)
        t = _x(rank)
        ar.allreduce(t, defer_decision=True)
        assert ar.open_rounds == [0]
        assert ar.last_round is not None
        assert ar.last_round.outcome == "pending"
        barrier.wait()  # both data phases are over before anyone votes
        committed = ar.vote(votes[rank], reason=f"rank {rank} says no")
        assert ar.open_rounds == []
        assert ar.last_round is not None
        assert ar.last_round.outcome == ("commit" if committed else "abort")
        return committed, t, [ar.round_id]

    results = run_replicas(replica, 2)
    expected = all(votes)
    assert [c for c, _, _ in results] == [expected, expected]
    mean = (_x(0).double() + _x(1).double()) / 2
    for _, t, round_ids in results:  # the reduced values are there either way; the vote says whether to use them
        torch.testing.assert_close(t.double(), mean, rtol=1e-6, atol=1e-6)
        assert round_ids == [1]
    ar = ObjectStoreAllReduce(memory_uri, 0, 2)
    decision = _decision(ar, 0)
    assert decision.outcome == ("commit" if expected else "abort")
    if not expected:
        assert "says no" in decision.reason
    for rank in range(2):
        vote = read_record(ar, RoundKeys(0).vote(rank))
        assert vote["ok"] is votes[rank]  # every participant's own vote is on record


def test_missing_vote_aborts_at_the_deadline_and_the_late_voter_follows(memory_uri: str) -> None:
    ars = [ObjectStoreAllReduce(memory_uri, r, 2, timeout=20) for r in range(2)]
    threads = [
        threading.Thread(target=ar.allreduce, args=(_x(r),), kwargs={"defer_decision": True})
        for r, ar in enumerate(ars)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ars[0].timeout = 0.5
    start = time.monotonic()
    assert ars[0].vote(True) is False  # rank 1 never voted in time
    assert 0.5 <= time.monotonic() - start < 10
    assert "votes of ranks [1]" in _decision(ars[0], 0).reason
    assert ars[1].vote(True) is False  # its yes comes too late: it follows the decision
    assert ars[1].last_round is not None
    assert ars[1].last_round.outcome == "abort"


def _data_phases(ars: list[ObjectStoreAllReduce]) -> None:
    """Every replica runs round ``ars[0].round_id``'s data phase with a deferred decision (concurrently)."""
    threads = [threading.Thread(target=ar.allreduce, args=(_x(r),), kwargs={"defer_decision": True})
               for r, ar in enumerate(ars)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(ar.open_rounds for ar in ars), "every data phase ended with the round open"


def test_the_last_voter_settles_the_round_in_two_round_trips(
    faulty_store: Any, fault_rule: Callable[..., dict[str, Any]]
) -> None:
    """Its vote goes out with the reads of the decision and of the other votes (one wave), then its decision (one
    more): two sequential round trips on the training thread's critical path, where a separate collection check,
    vote, poll and decision took four. Every request takes 100 ms here, so that requests sent together overlap even
    on a loaded machine (at 20 ms, a load of 14 on 2 cores started them a wave apart)."""
    for op in ("read", "write"):
        fault_rule(op, lambda p: True, lambda p: time.sleep(0.1), count=10**6)
    ars = [ObjectStoreAllReduce("crffaulty://last-voter", r, 2, timeout=20) for r in range(2)]
    _data_phases(ars)
    first: list[bool] = []
    voter = threading.Thread(target=lambda: first.append(ars[0].vote(True)))
    voter.start()
    deadline = time.monotonic() + 20
    while not ars[1].store.exists(RoundKeys(0).vote(0)) and time.monotonic() < deadline:
        time.sleep(0.01)
    ars[1].close()  # its data phase's background work is done: what follows is the vote
    before = ars[1].store.traffic()
    assert ars[1].vote(True) is True
    ars[1].close()  # and any background work `_finish` starts (none: every rank took part, nobody is to list)
    spent = ars[1].store.traffic() - before
    voter.join(20)
    assert first == [True]
    assert spent.requests == 5, spent  # vote + decision + rank 0's vote | decision create + read
    assert spent.round_trips == 2, spent  # the vote's two waves


def test_a_vote_into_a_collected_round_is_taken_back(memory_uri: str) -> None:
    """Rank 1 stalls between its data phase and its vote while rank 0 aborts that round (no vote in time) and goes
    on alone until the round is collected. Rank 1's vote, sent with its first reads, is deleted again once they show
    the round collected: nothing re-creates the round, and rank 1 gets the round's (abort) decision."""
    ars = [ObjectStoreAllReduce(memory_uri, r, 2, timeout=20, quorum_timeout=0.3, keep_rounds=1) for r in range(2)]
    _data_phases(ars)
    ars[0].timeout = 0.5
    assert ars[0].vote(True) is False  # rank 1 never voted in time
    for _ in range(3):
        ars[0].allreduce(_x(0))  # alone: rank 1 is stalled
    ars[0].close()  # the background collection of the old rounds
    keys = RoundKeys(0)
    assert ars[0].store.exists(keys.decision), "the decision is kept as a tombstone"
    assert not ars[0].store.exists(keys.quorum), "round 0 was collected"
    assert ars[1].vote(True) is False
    assert ars[1].last_round is not None
    assert ars[1].last_round.outcome == "abort"
    assert not ars[1].store.exists(keys.vote(1)), "the vote written into the collected round was taken back"


def test_observer_does_not_block_the_vote(memory_uri: str) -> None:
    """A latecomer observes the open round; the participant decides without waiting for it."""
    ar0 = ObjectStoreAllReduce(memory_uri, 0, 2, timeout=5, quorum_timeout=0.3)
    t0 = _x(0)
    ar0.allreduce(t0, defer_decision=True)
    ar1 = ObjectStoreAllReduce(memory_uri, 1, 2, timeout=5)
    ar1.join(0)
    t1 = _x(1)
    ar1.allreduce(t1, defer_decision=True)  # quorum is [0]: rank 1 reads the result as an observer
    assert ar1.last_round is not None
    assert not ar1.last_round.participated
    start = time.monotonic()
    assert ar0.vote(True) is True
    assert time.monotonic() - start < 2, "the participant waited for an observer's vote"
    assert ar1.vote(True) is True
    assert torch.equal(t1, t0)
    assert not ar1.store.exists(RoundKeys(0).vote(1)), "observers do not vote"


def test_vote_without_open_rounds_does_no_io(memory_uri: str) -> None:
    ar = ObjectStoreAllReduce(memory_uri, 0, 2)
    ar.store._fs = object()  # any store access would fail
    assert ar.vote(True) is True
    assert ar.vote(False) is True  # nothing was open, so nothing failed to commit
    with pytest.raises(TypeError, match="ok must be a bool"):
        ar.vote(1)  # type: ignore[arg-type]


def test_deferring_and_plain_replicas_disagree_loudly(memory_uri: str, run_replicas: RunReplicas) -> None:
    """Rank 1 runs a plain round where rank 0 defers: rank 1 (the tie goes to the lowest rank's payload) fails
    loudly with PayloadMismatchError; rank 0 runs the round alone and keeps it open for its vote."""

    def replica(rank: int) -> str:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20)
        if rank == 0:
            ar.allreduce(_x(rank), defer_decision=True)
            assert ar.open_rounds == [0]
            return "open"
        with pytest.raises(PayloadMismatchError, match="vote") as info:
            ar.allreduce(_x(rank), defer_decision=False)
        return str(info.value)

    opened, message = run_replicas(replica, 2)
    assert opened == "open"
    assert "40 elements (fp32, avg, vote)" in message


def test_veto_waits_for_a_peer_that_has_not_joined_yet(memory_uri: str) -> None:
    """The race behind the flaky DiLoCo test, made deterministic: rank 1 vetoes round 0 before rank 0
    has even joined it. Rank 0 must land in round 0 and abort there, not skip the decided round and
    commit round 1 alone after the quorum deadline."""
    ar1 = ObjectStoreAllReduce(memory_uri, 1, 2, timeout=20, quorum_timeout=20)
    veto = threading.Thread(target=ar1.abort, args=("injected: loss became NaN",))
    veto.start()
    deadline = time.monotonic() + 20
    keys = RoundKeys(0)
    while not (ar1.store.exists(keys.member(1)) or ar1.store.exists(keys.decision)):  # the veto is in the store
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ar0 = ObjectStoreAllReduce(memory_uri, 0, 2, timeout=20, quorum_timeout=1.0)
    t = _x(0)
    before = t.clone()
    with pytest.raises(RoundAbortedError, match="loss became NaN"):
        ar0.allreduce(t)
    veto.join(20)
    assert not veto.is_alive()
    assert torch.equal(t, before)
    assert ar0.last_round is not None
    assert ar0.last_round.round_id == 0
    assert ar0.round_id == ar1.round_id == 1
    assert _decision(ar0, 0).outcome == "abort"
    # and the two go on together
    threads = [
        threading.Thread(target=ar.allreduce, args=(_x(r),), kwargs={"defer_decision": True})
        for r, ar in enumerate((ar0, ar1))
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    outcomes: list[bool] = []
    voters = [threading.Thread(target=lambda a=ar: outcomes.append(a.vote(True))) for ar in (ar0, ar1)]
    for th in voters:
        th.start()
    for th in voters:
        th.join(30)
    assert outcomes == [True, True]
    assert ar0.last_round is not None
    assert ar0.last_round.participants == [0, 1]


def test_veto_by_an_observer_touches_nothing(memory_uri: str) -> None:
    ar = ObjectStoreAllReduce(memory_uri, 0, 2)
    ar.store._fs = object()
    ar.abort("observer errored", participate=False)
    assert ar.round_id == 1
    with pytest.raises(TypeError, match="reason must be a str"):
        ar.abort(None)  # type: ignore[arg-type]
