"""Healing: how a replica that is behind the store finds the global state to load.

After a round commits, `MockManager` checkpoints the global state (every registered torchft state plus its own
``{"round", "step", "batches_committed"}`` under ``"torchft"``) as ``state/r{round}.safetensors`` and its parts,
sealed with the run's secret (`crf_diloco.snapshots`). `plan_heal` decides, from authenticated objects only, what
a replica behind the store loads at ``start_quorum()``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from crf_diloco.errors import CorruptObjectError, HealError
from crf_diloco.layout import state_key
from crf_diloco.rounds.round import poll_until

if TYPE_CHECKING:
    from crf_diloco.allreduce import ObjectStoreAllReduce
    from crf_diloco.checkpoint import Packed
    from crf_diloco.snapshots import StateSnapshots

__all__ = ["MANAGER_KEY", "Heal", "plan_heal"]

logger = logging.getLogger(__name__)
#: the key of the manager's own record in a state: ``{"round", "step", "batches_committed"}``
MANAGER_KEY = "torchft"
_MANAGER_FIELDS = ("round", "step", "batches_committed")


def read_manager_state(
    snapshots: StateSnapshots,
    round_id: int,
    registered: Collection[str],
    have: Callable[[], Mapping[str, Packed]] | None = None,
) -> dict[str, Any] | None:
    """The state of ``round_id`` as `MockManager` wrote it (``None`` if absent): `CorruptObjectError` if it is not
    authentic or its manager record is not round ``round_id``'s, `HealError` if it lacks a ``registered`` state.
    ``have``: the reader's own parts (`StateSnapshots.read`)."""
    state = snapshots.read(round_id, have)
    if state is None:
        return None
    meta = state.get(MANAGER_KEY)
    key = state_key(round_id)
    if (
        not isinstance(meta, dict)
        or not all(type(meta.get(f)) is int for f in _MANAGER_FIELDS)
        or meta["round"] != round_id
    ):
        raise CorruptObjectError(
            f"{key}: its torchft record is not round {round_id}'s {{round, step, batches_committed}}"
        )
    missing = sorted(set(registered) - set(state))
    if missing:
        raise HealError(
            f"{key} has no state for {missing} (has {sorted(state)}): the replicas register different state"
        )
    return state


@dataclass(frozen=True)
class Heal:
    """What a replica that is behind the store does: load ``state`` (committed round ``round_id``; ``None``: keep
    its own state), join round ``frontier`` as an observer, and stay ``stale`` (behind: heal again once a newer
    committed state exists) or not."""

    round_id: int | None
    state: dict[str, Any] | None
    frontier: int
    stale: bool


def plan_heal(
    allreduce: ObjectStoreAllReduce,
    *,
    last_committed: int | None,
    stale: bool,
    registered: Collection[str],
    timeout: float,
    checkpoint_every: int = 1,
    local: Callable[[], dict[str, Any]] | None = None,
) -> Heal | None:
    """What this replica must load to be in step with the store, or ``None`` when it is.

    Only authentic state is loaded. If the latest committed round's state is corrupt or forged (it can never be
    replaced: objects are create-only), or does not appear within ``timeout`` seconds (its writer may have died;
    others write it at their ``start_quorum``), the newest authentic earlier state newer than ``last_committed`` is
    loaded and the replica stays ``stale``; with none, it keeps its own state (or `HealError` if it never had one).
    With ``checkpoint_every`` N > 1 a state less than N rounds after the newest one listed is never written, so
    the replica falls back at once instead of waiting ``timeout`` for it.

    ``local``: this replica's registered states as it would checkpoint them. A replica that was in step before
    (``last_committed`` set: it fell behind by a sync or a few) still holds the parts that did not change since (in
    Streaming DiLoCo, every fragment but those synced without it) and fetches only the others from a remote store;
    a replica that starts afresh hashes nothing.

    In step, no request: a replica whose last round (``allreduce.round_id - 1``) is ``last_committed`` is behind
    only if the next round was decided without it, and that round tells it so (`RoundDesyncError` before it writes
    anything, or it observes a quorum formed without it and reads the committed result): its sync does not commit
    and the next call plans the heal. That costs a replica left behind one sync instead of costing every sync of
    every replica a round trip on the training thread.
    """
    if last_committed is not None and not stale and last_committed == allreduce.round_id - 1:
        return None
    snapshots = allreduce.snapshots()
    rank = allreduce.rank
    have = (
        None if local is None or last_committed is None else functools.cache(lambda: _own_parts(snapshots, local, rank))
    )
    latest: int | None = None
    frontier = 0

    coming: dict[int, bool] = {}  # per latest committed round: may its state still appear (one listing each)

    def probe(late: bool) -> Heal | Literal["in step", "fall back"] | None:
        nonlocal latest, frontier
        # frontier first: every round between the latest commit read afterwards and it aborted
        frontier = allreduce.frontier()
        latest = allreduce.latest_committed_round()
        if latest is None or (latest == last_committed and not stale):
            return "in step"
        if not registered:
            raise HealError(
                f"rank {rank} is behind the store (last committed round {latest}) but no state is registered to "
                "load; use MockManager with torchft DiLoCo (it registers its state)"
            )
        try:
            state = read_manager_state(snapshots, latest, registered, have)
        except CorruptObjectError as e:
            logger.warning("rank %d cannot heal from round %d: %s", rank, latest, e)
            return "fall back"
        if state is not None:
            return Heal(latest, state, frontier, stale=False)
        if latest not in coming:
            coming[latest] = _state_coming(snapshots, latest, checkpoint_every)
        if not coming[latest]:
            logger.info("rank %d: committed round %d has no state (checkpoint_every=%d); loading an earlier one and "
                        "observing until the next checkpointed round", rank, latest, checkpoint_every)  # fmt: skip
            return "fall back"
        if late:
            logger.warning("rank %d: the state of committed round %d (%s) did not appear within %.1fs",
                           rank, latest, state_key(latest), timeout)  # fmt: skip
            return "fall back"
        return None

    found = poll_until(time.monotonic() + timeout, probe, interval=allreduce.poll_interval)
    if isinstance(found, Heal):
        return found
    if found == "in step" or latest is None:
        return None
    return _fall_back(snapshots, rank, latest, frontier, last_committed, stale, registered, have)


def _own_parts(snapshots: StateSnapshots, local: Callable[[], dict[str, Any]], rank: int) -> Mapping[str, Packed]:
    """This replica's own parts, or none if its state cannot be cut into parts (then every part is fetched: taking
    parts from itself only saves transfers, it never decides what is loaded)."""
    try:
        return snapshots.local_parts(local())
    except (TypeError, ValueError, RuntimeError) as e:
        logger.warning("rank %d fetches every part: its own state could not be cut into parts (%s)", rank, e)
        return {}


def _state_coming(snapshots: StateSnapshots, latest: int, every: int) -> bool:
    """Whether the state of committed round ``latest`` may still be written: always for ``every`` 1; else only if
    no state is listed (by name) fewer than ``every`` rounds before it. A name planted to look like such a state
    only makes a healing replica observe until the next one (nothing unauthenticated is loaded)."""
    if every == 1:
        return True
    newest = max((r for r in snapshots.listed() if r < latest), default=None)
    return newest is None or latest - newest >= every


def _fall_back(
    snapshots: StateSnapshots,
    rank: int,
    latest: int,
    frontier: int,
    last_committed: int | None,
    stale: bool,
    registered: Collection[str],
    have: Callable[[], Mapping[str, Packed]] | None,
) -> Heal:
    """The newest authentic state older than ``latest`` (and newer than this replica's own), or keep its own."""
    own = last_committed if last_committed is not None else -1
    for r in sorted((r for r in snapshots.listed() if own < r < latest), reverse=True):
        try:
            state = read_manager_state(snapshots, r, registered, have)
        except CorruptObjectError as e:
            logger.warning("rank %d skips a checkpoint: %s", rank, e)
            continue
        if state is not None:
            return Heal(r, state, frontier, stale=True)
    if last_committed is None and not stale:
        raise HealError(
            f"rank {rank} is behind the store (last committed round {latest}) and found no authentic committed "
            "state to load; check that every replica runs with the run's CRF_DILOCO_SECRET"
        )
    return Heal(None, None, frontier, stale=True)
