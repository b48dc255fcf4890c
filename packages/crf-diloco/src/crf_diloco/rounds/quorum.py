"""Quorum phase: announce (``members/{rank}.json``), then wait for or propose the round's ``quorum.json``."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from functools import partial

from crf_diloco.layout import RoundKeys
from crf_diloco.records import MemberRecord, PayloadSpec, QuorumRecord, ranks_named
from crf_diloco.rounds.peer import Peer
from crf_diloco.rounds.round import DecisionChecks, RoundFailure, RoundSettings, poll_until

__all__ = ["announce", "await_quorum", "propose"]


def announce(
    peer: Peer, keys: RoundKeys, spec: PayloadSpec | None, participate: bool, veto: str | None = None
) -> MemberRecord | None:
    """Create this replica's member record and return the one of this incarnation in the round (the one created, or
    its own earlier one); ``None`` if a record of another incarnation of this rank is there (a stale round, or this
    replica's own previous life)."""
    record = MemberRecord(peer.rank, peer.incarnation, spec, not participate, veto, world_size=peer.world_size)
    if peer.write_record(keys.member(peer.rank), record):
        return record
    existing = peer.read_member(keys, peer.rank)
    return existing if existing is not None and existing.incarnation == peer.incarnation else None


def await_quorum(
    peer: Peer, keys: RoundKeys, settings: RoundSettings, expected: set[int] | None, mine: MemberRecord | None
) -> QuorumRecord:
    """The round's quorum: read it once it exists; propose it (first writer wins) once every ``expected`` replica
    (default: all ranks) announced, as a participant or as an observer (a healing replica), or ``quorum_timeout``
    passed. ``mine``: this replica's record in the round (`announce`; never read back), ``None`` when it found
    another incarnation's there. Raises when the round was decided meanwhile, or `RoundFailure` when a record of
    another incarnation of this rank is in the round."""
    members: dict[int, MemberRecord] = {} if mine is None else {peer.rank: mine}
    want = expected if expected is not None else set(range(peer.world_size))

    everyone = want >= set(range(peer.world_size))  # a listing of members/ could find no one beyond them
    decisions = DecisionChecks()  # the first wave reads the decision, later ones at most every DECISION_GAP

    def probe(late: bool) -> QuorumRecord | None:
        # one wave: the quorum, the decision when due (a round decided before its quorum is rare), the listing
        # (unless every rank is expected) and the expected announcements not read yet
        unread = sorted(want - set(members))
        named: dict[str, Callable[[], object]] = {"quorum": partial(peer.read_quorum, keys.round_id)}
        if decisions.due(late):
            named["decided"] = partial(peer.check_decided, keys, settings.keep_rounds)
        if not everyone:
            named["names"] = partial(peer.store.list_names, keys.members_dir)
        found = peer.outcomes([*named.values(), *(partial(peer.read_member, keys, r) for r in unread)])
        got, records = dict(zip(named, found, strict=False)), found[len(named) :]
        quorum, decided, names = got["quorum"], got.get("decided"), got.get("names", [])
        if isinstance(quorum, BaseException):
            raise quorum
        if quorum is not None:
            return quorum
        if isinstance(decided, BaseException):
            raise decided
        if mine is None:
            raise RoundFailure(
                f"round {keys.round_id} holds a member record of another incarnation of rank {peer.rank}"
            )
        if isinstance(names, BaseException):
            raise names
        listed = [r for r in ranks_named(names, peer.world_size) if r not in members and r not in unread]
        records += peer.outcomes([partial(peer.read_member, keys, r) for r in listed]) if listed else []
        for rank, record in zip([*unread, *listed], records, strict=True):
            if isinstance(record, BaseException):
                raise record
            if record is not None:
                members[rank] = record
        announced = {r for r, m in members.items() if not m.observer}
        # an observer's record settles its rank too: it never contributes to this round, so nobody waits for it
        if want <= set(members) or late:
            return propose(peer, keys, settings, members, announced) or peer.read_quorum(keys.round_id)
        return None

    return poll_until(time.monotonic() + settings.quorum_timeout, probe, interval=settings.poll_interval)


def propose(
    peer: Peer, keys: RoundKeys, settings: RoundSettings, members: dict[int, MemberRecord], announced: set[int]
) -> QuorumRecord | None:
    """Create the round's quorum from the announcements and return the one that stands (read beside the write, so
    one round trip settles it; ``None`` if that read missed another replica's, which came first); `RoundFailure`
    when an announcer vetoed or too few announced a matching payload. The round's spec is the one most announcers share (ties: the
    lowest rank's); announcers of another spec are ``rejected``."""
    vetoes = [f"rank {r} vetoed round {keys.round_id}: {members[r].veto}" for r in sorted(announced) if members[r].veto]
    if vetoes:
        raise RoundFailure("; ".join(vetoes))
    specs = {r: s for r in sorted(announced) if (s := members[r].spec) is not None}
    counts = Counter(specs.values())
    # the spec most announcers share; ties go to the lowest rank's (ranks are in order, max keeps the first)
    spec = max(counts, key=counts.__getitem__) if counts else None
    participants = [r for r, s in specs.items() if s == spec]
    if spec is None or len(participants) < settings.min_participants:
        raise RoundFailure(
            f"only {len(participants)} replica(s) with a matching payload announced before the quorum deadline "
            f"({settings.quorum_timeout:.1f}s), min_participants={settings.min_participants}"
        )
    rejected = {
        r: f"rank {r} announced a payload of {s.describe()}, the round's is {spec.describe()}"
        for r, s in specs.items()
        if s != spec
    }
    record = QuorumRecord(
        keys.round_id,
        uuid.uuid4().hex,
        tuple(participants),
        {r: members[r].incarnation for r in participants},
        spec,
        peer.rank,
        rejected,
        world_size=peer.world_size,
    )
    created, found = peer.outcomes([partial(peer.write_record, keys.quorum, record),
                                    partial(peer.read_quorum, keys.round_id)])  # fmt: skip
    if isinstance(created, BaseException):
        raise created
    if created:
        return record
    if isinstance(found, BaseException):
        raise found
    return found
