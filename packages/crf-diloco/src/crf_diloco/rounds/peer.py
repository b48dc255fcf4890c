"""`Peer`: one replica's typed view of a run's store (its identity, sealed records, decisions, background writes)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from crf_diloco.auth import Authenticator
from crf_diloco.errors import CorruptObjectError, RoundAbortedError, RoundDesyncError
from crf_diloco.layout import RoundKeys
from crf_diloco.records import DecisionRecord, MemberRecord, QuorumRecord
from crf_diloco.store import ObjectStore
from crf_diloco.strictjson import parse_json_object
from crf_diloco.wire import Scratch

__all__ = ["MAX_RECORD", "READERS", "Peer"]

logger = logging.getLogger(__name__)
R = TypeVar("R")
T = TypeVar("T")
#: background writer threads (payload, reduced shard, collection of an old round)
WRITERS = 4
#: threads that read at once (payload slices, reduced shards, records polled together)
READERS = 16
#: the largest sealed JSON record a replica reads
MAX_RECORD = 1 << 20


class Peer:
    """A replica of a run as the protocol sees it.

    Args:
        store: the run's prefix (``{uri}/{run_id}``).
        auth: MACs keyed with the run's secret.
        rank: this replica's rank, ``0 <= rank < world_size``.
        world_size: replicas launched; part of every record.
    """

    def __init__(self, store: ObjectStore, auth: Authenticator, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        self.store = store
        self.auth = auth
        self.rank = rank
        self.world_size = world_size
        #: a fresh nonce per process: a restarted replica is another incarnation of its rank
        self.incarnation = uuid.uuid4().hex
        #: set when this replica found its round collected under it: it joins the frontier before the next round
        self.needs_join = True
        #: reusable buffers of this replica's rounds (payload staging, result, read scratch)
        self.scratch = Scratch()
        self._scratches: dict[str, Scratch] = {}
        self._bad_decisions: set[int] = set()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        self._reader_prefix = f"crf-diloco-{rank}-{id(self):x}-read"
        self._pool_lock = threading.Lock()

    # -- background writes -----------------------------------------------------------------------------
    def submit(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        """Run ``fn(*args)`` on this replica's background writer threads."""
        with self._pool_lock:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(WRITERS, thread_name_prefix=f"crf-diloco-{self.rank}")
            return self.pool.submit(fn, *args)

    def read(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` (a read) on this replica's reader threads, so that reads overlap: over a network a
        round costs one round trip per *sequential* request, however many run at once."""
        with self._pool_lock:
            if self._readers is None:
                self._readers = concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix=self._reader_prefix)
            return self._readers.submit(fn, *args)

    def concurrently(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` at once (the first on this thread) and return their results in order; the first exception
        in that order is raised once all of them ended."""
        outcomes = self.outcomes(calls)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    def outcomes(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` at once (the first on this thread) and return, in order, each one's result or exception.
        Called from a reader thread, they run one after the other (a reader never waits for its own pool)."""
        if threading.current_thread().name.startswith(self._reader_prefix):
            return [_call_outcome(call) for call in calls]
        futures = [self.read(call) for call in calls[1:]]
        first: list[Any] = []
        try:
            first.append(calls[0]())
        except Exception as exc:
            first.append(exc)
        concurrent.futures.wait(futures)
        return first + [_outcome(f) for f in futures]

    def scratch_for(self, name: str) -> Scratch:
        """Buffers of one concurrent reader (``name``: e.g. the rank whose slice it reads), reused across rounds."""
        with self._pool_lock:
            return self._scratches.setdefault(name, Scratch())

    def close(self) -> None:
        """Finish the background writes and reads and stop their threads."""
        with self._pool_lock:
            pools, self.pool, self._readers = (self.pool, self._readers), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        self.scratch.clear()
        self._scratches.clear()

    # -- sealed records ----------------------------------------------------------------------------------
    def read_record(self, key: str, parse: Callable[[Any, str], R]) -> R | None:
        """The authenticated record at ``key`` parsed by ``parse``, ``None`` if absent, else `CorruptObjectError`."""
        blob = self.store.try_get(key, limit=MAX_RECORD)
        if blob is None:
            return None
        return parse(parse_json_object(self.auth.open_record(key, blob), key), key)

    def write_record(self, key: str, record: Any) -> bool:
        """Create the sealed record at ``key`` (``record`` has ``to_json`` or is a dict); False if one existed."""
        obj = record if isinstance(record, dict) else record.to_json()
        body = json.dumps(obj, separators=(",", ":")).encode()
        return self.store.put_create(key, self.auth.seal_record(key, body))

    def read_quorum(self, round_id: int) -> QuorumRecord | None:
        """The quorum of ``round_id`` (``None`` if not formed); `CorruptObjectError` if it is not authentic."""
        key = RoundKeys(round_id).quorum
        return self.read_record(key, lambda o, k: QuorumRecord.parse(o, k, self.world_size, round_id))

    def read_member(self, keys: RoundKeys, rank: int) -> MemberRecord | None:
        """Rank ``rank``'s announcement in the round of ``keys`` (``None`` if absent)."""
        key = keys.member(rank)
        record = self.read_record(key, lambda o, k: MemberRecord.parse(o, k, self.world_size))
        if record is not None and record.rank != rank:
            raise CorruptObjectError(f"{key}: the record is rank {record.rank}'s")
        return record

    # -- decisions -----------------------------------------------------------------------------------------
    def read_decision(self, round_id: int) -> DecisionRecord | None:
        """The decision of ``round_id`` (``None`` if undecided); one that is malformed or fails authentication reads
        as ``abort`` (it can never be replaced, and nobody may adopt it)."""
        keys = RoundKeys(round_id)
        try:
            return self.read_record(keys.decision, lambda o, k: DecisionRecord.parse(o, k, self.world_size, round_id))
        except CorruptObjectError as exc:
            if round_id not in self._bad_decisions:
                self._bad_decisions.add(round_id)
                logger.warning("rank %d: %s; round %d counts as aborted", self.rank, exc, round_id)
            reason = f"the decision object is corrupt or forged: {exc}"
            return DecisionRecord(round_id, "abort", reason, self.rank, None, world_size=self.world_size)

    def authentic_decision(self, round_id: int) -> DecisionRecord | None:
        """The decision of ``round_id`` if it exists and is authentic (a forged or garbage one is ``None`` here)."""
        key = RoundKeys(round_id).decision
        with contextlib.suppress(CorruptObjectError):
            return self.read_record(key, lambda o, k: DecisionRecord.parse(o, k, self.world_size, round_id))
        return None

    def check_decided(self, keys: RoundKeys, keep_rounds: int) -> None:
        """Raise if the round ended under this replica: `RoundAbortedError` if it aborted, `RoundDesyncError` if it
        committed and has been collected since (its quorum is gone: this replica stalled past ``keep_rounds``)."""
        decision = self.read_decision(keys.round_id)
        if decision is None:
            return
        if not decision.committed:
            raise RoundAbortedError(f"round {keys.round_id} aborted: {decision.reason}")
        if self.read_quorum(keys.round_id) is None:
            raise self.fell_behind(keys, decision, keep_rounds)

    def check_not_collected(self, keys: RoundKeys, keep_rounds: int) -> None:
        """Before a write into a round: raise if the round was collected under this replica (its decision is kept,
        its quorum gone), so that nothing re-creates it. A decided round that is not collected yet may still get the
        write (collection deletes it later)."""
        decision = self.read_decision(keys.round_id)
        if decision is not None and self.collected(keys):
            raise self.fell_behind(keys, decision, keep_rounds)

    def collected(self, keys: RoundKeys) -> bool:
        """Whether a decided round was collected: its quorum is gone (collection deletes the quorum first and keeps
        the decision). One read."""
        return self.read_quorum(keys.round_id) is None

    def fell_behind(
        self, keys: RoundKeys, decision: DecisionRecord, keep_rounds: int
    ) -> RoundDesyncError | RoundAbortedError:
        """This replica reached a round that was decided and collected: it joins the frontier before the next."""
        self.needs_join = True
        behind = (
            f"rank {self.rank} fell more than keep_rounds={keep_rounds} rounds behind the run. It joins the live "
            "round next (MockManager heals it first)"
        )
        if not decision.committed:
            return RoundAbortedError(f"round {keys.round_id} aborted and has been collected: {behind}")
        return RoundDesyncError(f"round {keys.round_id} committed and has been collected: {behind}")


def _call_outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:
        return exc


def _outcome(future: concurrent.futures.Future[Any]) -> Any:
    error = future.exception()
    return error if error is not None else future.result()
