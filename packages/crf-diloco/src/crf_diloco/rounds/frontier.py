"""Where a run stands: its layout marker, the live round (the frontier), the latest commit, and collection."""

from __future__ import annotations

import contextlib

from crf_diloco.errors import AllReduceError, CorruptObjectError
from crf_diloco.layout import LAYOUT_VERSION, RoundKeys, parse_round_dir
from crf_diloco.records import DecisionRecord, ranks_named
from crf_diloco.rounds.peer import Peer

__all__ = ["check_layout", "collect", "frontier", "latest_committed_round", "round_ids"]

#: what collection deletes from a round (its decision stays as the tombstone)
ROUND_PARTS = ("quorum.json", "members", "data", "reduced", "votes")  # quorum first: then a check sees it gone


def check_layout(peer: Peer) -> None:
    """Create the run's ``LAYOUT`` marker, or check the one there: `AllReduceError` naming the fix when it belongs to
    another secret, crf-diloco layout or world size."""
    marker = {"layout": "crf-diloco", "version": LAYOUT_VERSION, "world_size": peer.world_size}
    if peer.write_record("LAYOUT", marker):
        return
    try:
        found = peer.read_record("LAYOUT", lambda o, k: o)
    except CorruptObjectError as exc:
        raise AllReduceError(
            f"{peer.store.uri!r} belongs to another run or secret, or to an older crf-diloco ({exc}). "
            "Use a new run_id, or this run's CRF_DILOCO_SECRET."
        ) from None
    theirs = found.get("world_size") if isinstance(found, dict) else None
    if found is not None and found != marker and {**found, "world_size": peer.world_size} == marker:
        raise AllReduceError(
            f"{peer.store.uri!r} is a run of world_size={theirs!r}; this replica was started with "
            f"world_size={peer.world_size}. Launch every replica of a run with the same world size (or use a "
            "new run_id)"
        )
    if found != marker:
        raise AllReduceError(
            f"{peer.store.uri!r} holds a crf-diloco layout {found!r}; this version writes layout "
            f"{LAYOUT_VERSION}. Use a new run_id or a matching crf-diloco version."
        )


def round_ids(peer: Peer) -> list[int]:
    """The rounds listed under the run's prefix (by directory name only: nothing here is authenticated)."""
    return sorted(r for r in (parse_round_dir(n) for n in peer.store.list_names("")) if r is not None)


def decided_from(peer: Peer, round_id: int) -> int:
    """The first round from ``round_id`` on without an authentic decision (decisions outlive collection)."""
    while peer.authentic_decision(round_id) is not None:
        round_id += 1
    return round_id


def holds_our_objects(peer: Peer, round_id: int) -> bool:
    """Whether the directory of ``round_id`` holds an object authenticated for this run."""
    keys = RoundKeys(round_id)
    if peer.authentic_decision(round_id) is not None:
        return True
    try:
        if peer.read_quorum(round_id) is not None:
            return True
        for rank in ranks_named(peer.store.list_names(keys.members_dir), peer.world_size):
            with contextlib.suppress(CorruptObjectError):
                if peer.read_member(keys, rank) is not None:
                    return True
    except CorruptObjectError:
        pass
    return False


def frontier(peer: Peer, at_least: int) -> int:
    """The round replicas are in now (never less than ``at_least``), from authenticated objects only: the newest
    round holding one (a decision, the quorum or a member record sealed with the run's secret) if it is undecided,
    else the one after it; then past every round whose authentic decision exists, which a listing that lags behind
    does not show. Directories planted by name (``r99999999/...``) are ignored."""
    found = at_least
    for r in sorted(round_ids(peer), reverse=True):
        if r < found:
            break
        if holds_our_objects(peer, r):
            found = r + 1 if peer.store.exists(RoundKeys(r).decision) else r
            break
    return decided_from(peer, found)


def latest_committed_round(peer: Peer) -> int | None:
    """Highest round whose authentic decision is ``commit``: among the listed rounds and those a lagging listing does
    not show yet (found by reading the decisions after the newest listed round)."""
    listed = round_ids(peer)
    after = listed[-1] + 1 if listed else 0
    for r in sorted({*listed, *range(after, decided_from(peer, after))}, reverse=True):
        decision = peer.read_decision(r)
        if decision is not None and decision.committed:
            return r
    return None


def collect(peer: Peer, round_id: int, keep_rounds: int) -> None:
    """(Background) collect a round ``keep_rounds`` behind this replica's decided one: delete its members, quorum,
    data, reduced shards and votes, and keep its decision as a tombstone (writing ``abort`` if it has none), so that
    a replica that stalled or reads a lagging listing finds the round decided and never re-creates it. Nothing else
    under the prefix is touched."""
    keys = RoundKeys(round_id)
    remote = peer.store.remote  # one recursive listing and two bulk deletes instead of a listing and delete per part
    names = peer.store.list_tree(keys.prefix) if remote else peer.store.list_names(keys.prefix)
    if not names:
        return
    if "decision.json" not in names:
        reason = f"collected by rank {peer.rank} after round {round_id + keep_rounds} was decided"
        record = DecisionRecord(round_id, "abort", reason, peer.rank, None, world_size=peer.world_size)
        peer.write_record(keys.decision, record)
    if not remote:
        for name in ROUND_PARTS:
            if name in names:
                peer.store.remove_tree(f"{keys.prefix}/{name}")
        return
    doomed = [n for n in names if n.split("/", 1)[0] in ROUND_PARTS]
    first = [n for n in doomed if n == ROUND_PARTS[0]]
    for batch in (first, [n for n in doomed if n != ROUND_PARTS[0]]):
        peer.store.remove_keys([f"{keys.prefix}/{n}" for n in batch])
