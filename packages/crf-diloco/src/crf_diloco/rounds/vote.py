"""Decide: the round's single ``decision.json`` (first writer wins), and the store-wide vote that settles it."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Literal

from crf_diloco.errors import AllReduceError, RoundTimeoutError
from crf_diloco.layout import RoundKeys
from crf_diloco.records import DecisionRecord, QuorumRecord, VoteRecord
from crf_diloco.rounds.peer import Peer
from crf_diloco.rounds.round import RoundFailure, RoundSettings, poll_until

__all__ = ["Decide", "await_decision", "decide", "stands", "vote"]

#: ``decide(keys, outcome, reason, token, decide=may_write)``: write the decision if allowed, return the one standing
Decide = Callable[..., DecisionRecord]


def decide(
    peer: Peer,
    keys: RoundKeys,
    outcome: Literal["commit", "abort"],
    reason: str,
    token: str | None,
    *,
    may_write: bool,
    settings: RoundSettings,
) -> DecisionRecord:
    """Create the round's decision (first writer wins) if this replica ``may_write`` (a participant of the round, or
    a non-observing announcer before its quorum), and return the one that stands. Observers never write one: they
    wait for the participants' (`RoundTimeoutError` after ``timeout``).

    The write and a read of the decision go out together: whoever created it, one round trip usually settles it
    (ours if the create succeeded: create-only writes make it the one that stands; else the one read)."""
    if may_write:
        record = DecisionRecord(keys.round_id, outcome, reason, peer.rank, token, world_size=peer.world_size)
        created, found = peer.outcomes([partial(peer.write_record, keys.decision, record),
                                        partial(peer.read_decision, keys.round_id)])  # fmt: skip
        if created is True:
            return record
        if isinstance(found, DecisionRecord):
            return found
    return await_decision(peer, keys, settings)


def await_decision(peer: Peer, keys: RoundKeys, settings: RoundSettings) -> DecisionRecord:
    """The round's decision, polled for up to ``timeout`` seconds (`RoundTimeoutError` after that)."""

    def probe(late: bool) -> DecisionRecord | None:
        try:
            found = peer.read_decision(keys.round_id)
        except AllReduceError:
            found = None
        if found is None and late:
            raise RoundTimeoutError(
                f"round {keys.round_id}: no decision object could be read within {settings.timeout:.1f}s"
            )
        return found

    return poll_until(time.monotonic() + settings.timeout, probe, interval=settings.poll_interval)


def stands(decision: DecisionRecord, quorum: QuorumRecord | None) -> bool:
    """True if ``decision`` commits the round that ``quorum`` describes (a commit of another attempt does not)."""
    return decision.committed and quorum is not None and decision.token == quorum.token


def vote(
    peer: Peer,
    keys: RoundKeys,
    quorum: QuorumRecord,
    settings: RoundSettings,
    ok: bool,
    reason: str,
    write: Decide,
) -> DecisionRecord:
    """(A participant) create this replica's ``votes/{rank}.json`` and poll the round's votes until a decision
    stands, writing it with ``write`` once the votes settle it: ``commit`` when every participant voted true,
    ``abort`` as soon as one voted false or when ``timeout`` passes with votes missing.

    The vote goes out in one wave with the first reads (the decision, the other participants' votes), so the last
    voter settles the round in two round trips: that wave, then its decision. Should that read show the round decided
    and collected under this replica (its decision kept, its quorum gone), the vote just created is deleted again
    (nothing re-creates a collected round) and `fell_behind` is raised."""
    token, participants = quorum.token, quorum.participants
    mine = VoteRecord(peer.rank, ok, reason, token, peer.incarnation, world_size=peer.world_size)
    votes: dict[int, VoteRecord] = {peer.rank: mine}

    def read_vote(rank: int) -> VoteRecord | None:
        key = keys.vote(rank)
        record = peer.read_record(key, lambda o, k: VoteRecord.parse(o, k, peer.world_size))
        if record is not None and (record.rank != rank or record.token != token):
            raise RoundFailure(f"{key} belongs to another rank or round attempt (stale object)")
        return record

    def unread() -> list[int]:
        return [r for r in participants if r not in votes]

    def reads(missing: list[int]) -> list[Callable[[], object]]:  # the decision and the votes not read yet
        return [partial(peer.read_decision, keys.round_id), *(partial(read_vote, r) for r in missing)]

    def settle(missing: list[int], outcomes: list[object], late: bool) -> DecisionRecord | None:
        decision, *records = outcomes
        if isinstance(decision, BaseException):
            raise decision
        if isinstance(decision, DecisionRecord):
            return decision
        for rank, record in zip(missing, records, strict=True):
            if isinstance(record, BaseException):
                raise record
            if isinstance(record, VoteRecord):
                votes[rank] = record
        against = sorted(r for r, v in votes.items() if not v.ok)
        if against:
            why = "; ".join(f"rank {r} voted to abort: {votes[r].reason}" for r in against)
            return write(keys, "abort", why, token, decide=True)
        if len(votes) == len(participants):
            return write(keys, "commit", "", token, decide=True)
        if late:
            absent = sorted(set(participants) - set(votes))
            why = f"votes of ranks {absent} did not appear within {settings.timeout:.1f}s"
            return write(keys, "abort", why, token, decide=True)
        return None

    deadline = time.monotonic() + settings.timeout
    missing = unread()
    created, *first = peer.outcomes([partial(peer.write_record, keys.vote(peer.rank), mine), *reads(missing)])
    if isinstance(created, BaseException):
        raise created
    if isinstance(first[0], DecisionRecord) and peer.collected(keys):
        if created:
            peer.store.remove(keys.vote(peer.rank))
        raise peer.fell_behind(keys, first[0], settings.keep_rounds)
    found = settle(missing, first, late=False)
    if found is not None:
        return found

    def probe(late: bool) -> DecisionRecord | None:
        missing = unread()
        return settle(missing, peer.outcomes(reads(missing)), late)  # one wave

    return poll_until(deadline, probe, interval=settings.poll_interval)
