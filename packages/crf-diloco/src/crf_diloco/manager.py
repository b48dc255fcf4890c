"""`MockManager`: the torchft ``Manager`` surface that ``torchft.local_sgd.DiLoCo`` uses, on an object store.

torchft 0.2 ``DiLoCo`` (``torchft/local_sgd.py``) touches exactly these Manager members:
``_use_async_quorum`` (attribute, must be False), ``register_state_dict_fn``,
``disallow_state_dict_read``, ``allow_state_dict_read``, ``start_quorum``, ``current_step``,
``allreduce(tensor, should_quantize=...)`` and ``should_commit``. torchft's own ``Manager.allreduce``
and ``_ManagedWork`` additionally use ``errored``, ``report_error``, ``wrap_future``,
``num_participants`` and ``is_participating``; they are provided too, as are ``rank``,
``participating_rank``, ``batches_committed``, ``state_dict``/``load_state_dict`` and ``shutdown``.
``tests/test_serverless_diloco_integration.py`` runs real ``DiLoCo`` against a proxy that fails on
any member not listed here, so a torchft upgrade that needs more fails loudly.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar, get_args

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from crf_diloco.allreduce import ObjectStoreAllReduce
from crf_diloco.errors import AllReduceError, PayloadMismatchError
from crf_diloco.healing import MANAGER_KEY, plan_heal
from crf_diloco.snapshots import FrozenState
from crf_diloco.store import Traffic

__all__ = ["DILOCO_MANAGER_SURFACE", "VOTE_SCOPES", "MockManager", "ObjectStoreWork", "SyncRecord", "VoteScope"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Manager members that torchft 0.2's DiLoCo (and its _StreamingDiLoCoFragment) touch.
DILOCO_MANAGER_SURFACE: tuple[str, ...] = (
    "_use_async_quorum",
    "allreduce",
    "allow_state_dict_read",
    "current_step",
    "disallow_state_dict_read",
    "register_state_dict_fn",
    "should_commit",
    "start_quorum",
)

#: ``MockManager(vote_scope=...)``: "run", a store-wide vote at ``should_commit``; "replica", torchft's scope
VoteScope = Literal["run", "replica"]
VOTE_SCOPES: tuple[VoteScope, ...] = get_args(VoteScope)


@dataclass(frozen=True)
class SyncRecord:
    """One sync as this replica saw it (`MockManager.syncs`).

    ``round_id``: its last object-store round; ``committed``: what ``should_commit()`` returned; ``seconds``: wall
    time of its rounds and vote (not of the training they overlapped); ``traffic``: what this replica's store carried
    meanwhile (background work of the protocol included). With a `crf_diloco.link.Link`,
    ``link.floor_s(traffic.bytes_read + traffic.bytes_written, traffic.busy_round_trips)`` is the time the sync could
    not beat on that network.
    """

    round_id: int | None
    committed: bool
    seconds: float
    traffic: Traffic


class _FlushingFuture(torch.futures.Future[Any]):
    """A future that starts the queued object-store rounds and waits for them when waited on."""

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__()
        self._flush = flush

    def wait(self) -> Any:
        self._flush()
        return super().wait()

    def value(self) -> Any:
        self._flush()
        return super().value()


class ObjectStoreWork(dist._Work):
    """Work handle returned by :meth:`MockManager.allreduce`, shaped like torchft's ``_ManagedWork``.

    The tensor is reduced in place. Every tensor handed to ``allreduce`` before the manager's next other call
    travels in one object-store round (per ``(op, compression)``), which runs in the background from that call on
    (``MockManager(overlap=True)``, the default: training goes on while it syncs) or inside the first ``wait()``
    (``overlap=False``). ``wait()`` blocks until the round ran and returns True once its data phase succeeded (the
    tensor then holds the reduced values; whether the sync commits is decided at ``should_commit()``, as in
    torchft), and False instead of raising: the error goes to the manager, so ``should_commit()`` votes False.
    ``get_future()`` completes with the tensor (unchanged on failure) when the round ends and supports ``.then``
    (callbacks run on the thread that ran the round).
    """

    def __init__(self, manager: MockManager, tensor: torch.Tensor) -> None:
        super().__init__()
        self._manager = manager
        self._tensor = tensor
        self._ok: bool | None = None
        self._future = _FlushingFuture(manager._flush_safely)

    def _complete(self, ok: bool) -> None:
        self._ok = ok
        self._future.set_result(self._tensor)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._manager._flush_safely()
        return bool(self._ok)

    def is_completed(self) -> bool:
        return self._ok is not None

    def is_success(self) -> bool:
        return bool(self._ok)

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self, timeout: timedelta | None = None) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class _DoneWork(dist._Work):
    """No-op work for ``allreduce`` after an error (torchft's ``_DummyWork``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self._future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._future.set_result(tensor)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class MockManager:
    """Duck-typed ``torchft.Manager`` for ``torchft.local_sgd.DiLoCo``, backed by :class:`ObjectStoreAllReduce`.

    Members DiLoCo touches: ``_use_async_quorum`` (False), ``register_state_dict_fn``,
    ``allow_state_dict_read``, ``disallow_state_dict_read``, ``start_quorum``, ``current_step``,
    ``allreduce(tensor, should_quantize=False, reduce_op=ReduceOp.AVG)`` and ``should_commit``.
    Also: ``num_participants``, ``is_participating``, ``participating_rank``, ``rank``,
    ``errored``, ``report_error``, ``wrap_future``, ``batches_committed``, ``state_dict``,
    ``load_state_dict``, ``shutdown``.

    Semantics:

    * ``allreduce`` queues the tensor and returns at once; the tensors queued before the manager's next
      other call (DiLoCo's next inner step calls ``disallow_state_dict_read()``; ``wait()``,
      ``should_commit()``, ``start_quorum()``, ``current_step()`` too) go in one round (one round per
      distinct ``(reduce_op, quantize)`` pair, in call order), which that call starts on a background
      thread (``overlap=True``): Streaming DiLoCo's inner steps run while a fragment syncs
      (``fragment_sync_delay``), and ``wait()`` / ``should_commit()`` block only for what is left.
      Every replica makes the same calls, so the rounds are the same everywhere. ``should_quantize=True``
      uses int8 row-wise compression unless the allreduce already compresses.
    * ``should_commit()``: this replica's vote is True only if all its rounds succeeded, it reported no
      error (even one reported after the allreduce finished) and at least ``min_replica_size`` replicas
      took part. ``vote_scope="run"`` (the default) makes it a store-wide vote: the sync's rounds run
      with ``defer_decision=True`` and one decision object per round settles the votes
      (``ObjectStoreAllReduce.vote``), so every participant gets the same answer, at the price of a
      barrier at ``should_commit()`` (two round trips and the wait for the slowest voter).
      ``vote_scope="replica"`` is torchft's own scope (its ``should_commit`` is a collective within a
      replica group; different groups may return different values): each round decides itself when
      its data phase completes, and ``should_commit()`` returns this replica's vote without a request;
      a replica that votes False on a round that committed is behind the store and heals from that
      round's state at its next ``start_quorum()`` (``min_replica_size`` must then not exceed the
      allreduce's ``min_participants``, which aborts a round with too few participants in the store).
      In both scopes a replica that errored before its round ran vetoes that round
      (``ObjectStoreAllReduce.abort``), observers (healing replicas) do not vote, and on True the step
      advances.
    * Healing: one participant of a committed round (``participants[round % len(participants)]``, so the
      uploads rotate) writes the global state (every ``register_state_dict_fn`` state plus
      ``{"step", "batches_committed"}``) to ``state/r{round}.safetensors``: copied at its next call after the
      outer step and uploaded from then on, on a thread of its own (beside the rounds, never ahead of them: in
      the gap before the next sync's round); the others check during their next sync (after its rounds) that it
      exists, and write it if it is missing. At ``start_quorum()`` a replica that is behind the store's last
      committed round (restarted, late, or one that could not read a committed result) loads that state and
      observes (does not contribute to) its next round. A replica in step asks the store nothing there: one left
      behind between syncs learns it from its next round (`crf_diloco.healing.plan_heal`). With
      ``checkpoint_every=N`` only a committed round at least N rounds after the last checkpointed one is written
      (1/N of the bytes); a replica behind a round without a state loads the newest one, observes, and is in step
      from the next checkpointed round on (up to N syncs later).

    Args:
        allreduce: the replica's :class:`ObjectStoreAllReduce`.
        min_replica_size: fewest participants for ``should_commit()`` to return True.
        checkpoint: write post-commit states so that replicas can heal (default True).
        checkpoint_every: write the state of a committed round only if it is at least this many rounds after the
            last one written (default 1: every committed round). A state is about twice the model's fp32 bytes,
            written by one replica per round: N > 1 divides that traffic by N, and a replica that heals may
            observe up to N syncs (training, not contributing) before it is in step.
        heal_timeout: seconds to wait for the state of the last committed round (default: the
            allreduce's ``timeout``).
        use_async_quorum: must be False (DiLoCo requires a synchronous quorum).
        overlap: run each sync's rounds on a background thread from the manager's first call after the
            ``allreduce`` calls (default True); False runs them inside the first ``wait()``.
        vote_scope: ``"run"`` (default): ``should_commit()`` is a store-wide vote, the same answer everywhere;
            ``"replica"``: torchft's scope, no barrier at ``should_commit()`` (a replica that disagrees heals).
    """

    def __init__(
        self,
        allreduce: ObjectStoreAllReduce,
        *,
        min_replica_size: int = 1,
        checkpoint: bool = True,
        checkpoint_every: int = 1,
        heal_timeout: float | None = None,
        use_async_quorum: bool = False,
        overlap: bool = True,
        vote_scope: VoteScope = "run",
    ) -> None:
        if not isinstance(allreduce, ObjectStoreAllReduce):
            raise TypeError(f"allreduce must be an ObjectStoreAllReduce, got {type(allreduce).__name__}")
        if use_async_quorum:
            raise ValueError("MockManager only implements a synchronous quorum; DiLoCo requires use_async_quorum=False")
        if not 1 <= min_replica_size <= allreduce.world_size:
            raise ValueError(
                f"min_replica_size must be in [1, world_size={allreduce.world_size}], got {min_replica_size}"
            )
        if not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool) or checkpoint_every < 1:
            raise ValueError(
                "checkpoint_every must be an int >= 1 (write the global state after a committed round at least that "
                f"many rounds after the last one written), got {checkpoint_every!r}"
            )
        if heal_timeout is not None and not heal_timeout > 0:
            raise ValueError(f"heal_timeout must be > 0 seconds or None, got {heal_timeout!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool (True: sync in the background), got {type(overlap).__name__}")
        if vote_scope not in VOTE_SCOPES:
            raise ValueError(
                f"vote_scope must be 'run' (a store-wide vote at should_commit) or 'replica' (torchft's scope: each "
                f"replica decides for itself, one that disagrees heals), got {vote_scope!r}"
            )
        if vote_scope == "replica" and min_replica_size > allreduce.min_participants:
            raise ValueError(
                f"with vote_scope='replica' the rounds decide themselves, so a round with fewer than "
                f"min_replica_size={min_replica_size} participants must abort in the store: pass "
                f"ObjectStoreAllReduce(min_participants={min_replica_size}) (it has {allreduce.min_participants})"
            )
        self._use_async_quorum = False
        self._overlap = overlap
        self._vote_scope = vote_scope
        self._threads: dict[str, concurrent.futures.ThreadPoolExecutor] = {}  # "sync" and "upload" (`_background`)
        self._job: concurrent.futures.Future[None] | None = None  # the last sync's rounds
        self._tail: concurrent.futures.Future[Any] | None = None  # the last task of the sync thread
        self._upload: concurrent.futures.Future[None] | None = None  # the last checkpoint upload
        self._ensured: int | None = None  # the last committed round whose checkpoint was checked
        self._presence: tuple[int, concurrent.futures.Future[bool] | None] | None = None  # that check, when pending
        self._allreduce = allreduce
        self._min_replica_size = min_replica_size
        self._checkpoint = checkpoint and allreduce.world_size > 1  # a lone replica never needs healing
        self._checkpoint_every = checkpoint_every
        self._last_checkpointed: int | None = None  # the last committed round whose state is written
        self._heal_timeout = heal_timeout if heal_timeout is not None else allreduce.timeout
        self._step = 0
        self._batches_committed = 0
        self._errored: Exception | None = None
        self._pending: list[tuple[torch.Tensor, ObjectStoreWork, str, str | None]] = []
        self._rounds_ok: list[bool] = []
        self._load_fns: dict[str, Callable[[Any], None]] = {}
        self._save_fns: dict[str, Callable[[], Any]] = {}
        self._state_dict_read_allowed = True
        self._last_committed_round: int | None = None
        self._checkpoint_due: int | None = None
        self._observe_next = False
        self._stale = False
        self._participants: list[int] = []
        self._snapshots = allreduce.snapshots()
        self._sync_seconds = 0.0
        self._sync_traffic = Traffic()
        self._syncs: list[SyncRecord] = []

    # -- identity / quorum -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This replica's rank among the launched replicas."""
        return self._allreduce.rank

    @property
    def allreduce_backend(self) -> ObjectStoreAllReduce:
        return self._allreduce

    def num_participants(self) -> int:
        """Participants of the last round (the launched world size before the first round)."""
        return len(self._participants) if self._participants else self._allreduce.world_size

    def is_participating(self) -> bool:
        return not self._observe_next

    def participating_rank(self) -> int | None:
        """Index of this replica among the last round's participants, or None if it did not take part."""
        if not self._participants:
            return None if self._observe_next else self.rank
        return self._participants.index(self.rank) if self.rank in self._participants else None

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Begin a sync: finish the last one's rounds, write a due checkpoint, clear errors, heal from the store if
        behind."""
        self._finish_rounds()
        self._write_checkpoint_if_due()
        self._ensure_checkpoint()
        if self._allreduce.open_rounds:  # a sync that never reached should_commit(): vote it down
            self._vote(False, "the sync ended without should_commit()")
        self._sync_seconds, self._sync_traffic = 0.0, Traffic()  # a sync that never ended is not recorded
        self._errored = None
        self._rounds_ok = []
        if allow_heal:
            self._maybe_heal()

    def wait_quorum(self) -> None:
        """No-op: the quorum is formed inside each object-store round."""

    # -- state dict plumbing -------------------------------------------------------------------
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"state dict key must be a non-empty str, got {key!r}")
        if key in self._load_fns or key == MANAGER_KEY:
            raise ValueError(f"state dict key {key!r} is already registered")
        self._load_fns[key] = load_state_dict
        self._save_fns[key] = state_dict

    def allow_state_dict_read(self) -> None:
        self._start_rounds()
        self._state_dict_read_allowed = True

    def disallow_state_dict_read(self) -> None:
        self._start_rounds()
        self._write_checkpoint_if_due()
        self._state_dict_read_allowed = False

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        for key in ("step", "batches_committed"):
            if key not in state_dict:
                raise KeyError(f"manager state dict needs {key!r}, got keys {sorted(state_dict)}")
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def current_step(self) -> int:
        self._start_rounds()
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    # -- errors --------------------------------------------------------------------------------
    def report_error(self, e: Exception) -> None:
        self._errored = e

    def errored(self) -> Exception | None:
        return self._errored

    def wrap_future(
        self, fut: torch.futures.Future[T], default: T, timeout: timedelta | None = None
    ) -> torch.futures.Future[T]:
        """Chain a callback that turns an exception of ``fut`` into ``report_error`` plus ``default``."""

        def callback(f: torch.futures.Future[T]) -> T:
            try:
                return f.value()
            except Exception as e:
                self.report_error(e)
                return default

        return fut.then(callback)

    # -- allreduce / commit -------------------------------------------------------------------
    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp.RedOpType = ReduceOp.AVG
    ) -> dist._Work:
        """Queue ``tensor`` for the next round; returns a Work (reduced in place once waited on)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"allreduce expects a torch.Tensor, got {type(tensor).__name__}")
        if reduce_op == ReduceOp.AVG:
            if not torch.is_floating_point(tensor):
                raise ValueError("average reduce op is only supported for floating point tensors")
            op = "avg"
        elif reduce_op == ReduceOp.SUM:
            op = "sum"
        else:
            raise ValueError(f"reduce_op must be ReduceOp.AVG or ReduceOp.SUM, got {reduce_op}")
        if self._errored is not None:
            return _DoneWork(tensor)
        compression = self._allreduce.compression or ("int8" if should_quantize else None)
        work = ObjectStoreWork(self, tensor)
        self._pending.append((tensor, work, op, compression))
        return work

    @property
    def checkpoint_bytes(self) -> tuple[int, int]:
        """(written, read): bytes of the global states this replica uploaded after committed rounds and of those it
        loaded to heal; part of the store's traffic (``allreduce_backend.bytes_written``/``bytes_read``), which also
        counts the rounds."""
        return self._snapshots.bytes

    @property
    def syncs(self) -> tuple[SyncRecord, ...]:
        """Every sync this manager ended (`should_commit`), oldest first."""
        return tuple(self._syncs)

    def _timed(self, work: Callable[[], T]) -> T:
        """Run ``work``, adding its wall time and store traffic to the current sync's."""
        before, start = self._allreduce.store.traffic(), time.perf_counter()
        try:
            return work()
        finally:
            self._sync_seconds += time.perf_counter() - start
            self._sync_traffic += self._allreduce.store.traffic() - before

    @property
    def syncing(self) -> bool:
        """True while a sync's rounds are queued (``allreduce`` called, not yet started) or running."""
        return bool(self._pending) or (self._job is not None and not self._job.done())

    def _flush_safely(self) -> None:
        try:
            self._finish_rounds()
        except Exception as e:  # never raise out of wait()
            self.report_error(e)

    def _start_rounds(self) -> None:
        """Start the rounds of the tensors queued since the last start: on the background thread (``overlap``), or
        now, on this one."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if not self._overlap:
            self._run_rounds(pending)
            return
        self._job = self._tail = self._background("sync").submit(self._run_rounds, pending)
        if self._presence is not None and self._presence[1] is None:  # after the rounds: the writer had its time
            r = self._presence[0]
            self._presence = (r, self._background("sync").submit(self._snapshots.exists, r))

    def _background(self, kind: Literal["sync", "upload"]) -> concurrent.futures.ThreadPoolExecutor:
        """The background thread of ``kind``, each running its tasks in the order they were handed over: ``sync``
        the rounds (and the checks after them), ``upload`` the checkpoints, beside them: a round never waits behind
        a checkpoint (several times a round's bytes) on its way to the bucket."""
        if kind not in self._threads:
            name = f"crf-diloco-{kind}-{self.rank}"
            self._threads[kind] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        return self._threads[kind]

    def _on_background(self) -> bool:
        """Whether the caller is one of this manager's background threads (which never wait for themselves)."""
        return threading.current_thread().name.startswith((f"crf-diloco-sync-{self.rank}_",
                                                           f"crf-diloco-upload-{self.rank}_"))  # fmt: skip

    def _finish_rounds(self) -> None:
        """Start what is queued and wait until every round started has run (a callback of a round, which runs on
        the background thread, does not wait for itself)."""
        self._start_rounds()
        job = self._job
        if job is None or self._on_background():
            return
        job.result()  # _run_rounds never raises
        if self._job is job:
            self._job = None

    def _run_rounds(self, pending: list[tuple[torch.Tensor, ObjectStoreWork, str, str | None]]) -> None:
        self._timed(lambda: self._run_groups(pending))

    def _run_groups(self, pending: list[tuple[torch.Tensor, ObjectStoreWork, str, str | None]]) -> None:
        """Run queued tensors as object-store rounds (one per (op, compression) group, in order). Never raises: an
        error goes to ``report_error``; after one that is not a round's failure (e.g. `PayloadMismatchError`) the
        remaining groups do not run, and every work completes (False unless its round ran)."""
        groups: dict[tuple[str, str | None], list[tuple[torch.Tensor, ObjectStoreWork]]] = {}
        for tensor, work, op, compression in pending:
            groups.setdefault((op, compression), []).append((tensor, work))
        stopped = False
        for (op, compression), items in groups.items():
            ok = False
            if stopped:
                for _, work in items:
                    work._complete(False)
                continue
            try:
                if self._errored is not None:
                    self._veto()
                else:
                    self._allreduce.allreduce(
                        [t for t, _ in items],
                        op,  # type: ignore[arg-type]
                        compression=compression,
                        participate=not self._observe_next,
                        defer_decision=self._vote_scope == "run",
                    )
                    ok = True
            except AllReduceError as e:
                self.report_error(e)
            except Exception as e:
                self.report_error(e)
                stopped = True
            finally:
                info = self._allreduce.last_round
                if info is not None and info.participants:
                    self._participants = list(info.participants)
                self._rounds_ok.append(ok)
                for _, work in items:
                    work._complete(ok)

    def _veto(self) -> None:
        """Veto the round the others are in (this replica errored before it ran)."""
        self._allreduce.abort(f"replica reported an error: {self._errored!r}", participate=not self._observe_next)

    def _vote(self, ok: bool, reason: str) -> bool:
        """Settle the sync's open rounds by the store-wide vote; False on store trouble."""
        try:
            return self._allreduce.vote(ok, reason)
        except AllReduceError as e:
            self.report_error(e)
            return False

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Finish pending rounds, vote, and return whether this sync commits here.

        This replica votes True iff all its rounds succeeded, no error was reported (also after the
        allreduce) and at least ``min_replica_size`` replicas took part. ``vote_scope="run"``: the sync
        commits iff every participant voted True, and every participant gets the same answer;
        ``"replica"``: the vote is the answer (its rounds decided themselves; no request).
        """
        self._finish_rounds()
        if self._errored is not None and not self._rounds_ok:
            # an error before any allreduce: veto the round the others are in
            try:
                self._veto()
            except AllReduceError as e:
                logger.warning("rank %d could not veto its round: %s", self.rank, e)
            self._rounds_ok.append(False)
        if isinstance(self._errored, PayloadMismatchError):
            raise self._errored  # this replica's configuration differs from its peers': fail loudly
        enough = self.num_participants() >= self._min_replica_size
        local_ok = bool(self._rounds_ok) and all(self._rounds_ok) and self._errored is None and enough
        if self._errored is not None:
            reason = f"replica reported an error: {self._errored!r}"
        elif not enough:
            reason = f"{self.num_participants()} participant(s) < min_replica_size={self._min_replica_size}"
        else:
            reason = "a round of this sync failed"
        if self._vote_scope == "run":
            ok = self._timed(lambda: self._vote(local_ok, reason)) and local_ok
        else:
            ok = local_ok
        info = self._allreduce.last_round
        self._rounds_ok = []
        self._syncs.append(
            SyncRecord(info.round_id if info is not None else None, ok, self._sync_seconds, self._sync_traffic)
        )
        self._sync_seconds, self._sync_traffic = 0.0, Traffic()
        if ok:
            self._step += 1
            self._batches_committed += self.num_participants()
            self._observe_next = False
            if info is not None:
                self._last_committed_round = info.round_id
                last = self._last_checkpointed
                if last is None or info.round_id - last >= self._checkpoint_every:
                    self._last_checkpointed = info.round_id
                    writer = info.participants[info.round_id % len(info.participants)] if info.participants else None
                    if self._checkpoint and self.rank == writer:  # the writer rotates: no one link carries them all
                        self._checkpoint_due = info.round_id
        return ok

    def shutdown(self, wait: bool = True) -> None:
        """Finish the rounds started, write a due checkpoint and stop the background threads; the allreduce itself is
        left to its owner."""
        self._flush_safely()
        self._write_checkpoint_if_due()
        self._wait_background()
        threads, self._threads = self._threads, {}
        for thread in threads.values():
            thread.shutdown(wait=wait)

    # -- checkpoints & healing (crf_diloco.healing) ---------------------------------------------------------
    def _state(self, round_id: int) -> dict[str, Any]:
        state: dict[str, Any] = {key: fn() for key, fn in self._save_fns.items()}
        state[MANAGER_KEY] = {**self.state_dict(), "round": round_id}
        return state

    def _write_state(self, round_id: int) -> None:
        if self._save_fns:
            self._snapshots.write(round_id, self._state(round_id))

    def _write_checkpoint_if_due(self) -> None:
        """Write the state of the round this replica committed last and must checkpoint: copied now (it is the state
        right after the outer step) and uploaded from now on, on the upload thread (``overlap``: in the gap before
        the next sync's round rather than beside it on the replica's link) or on this one."""
        self._check_presence()
        if self._checkpoint_due is None or not self._save_fns:
            self._checkpoint_due = None
            return
        round_id, self._checkpoint_due = self._checkpoint_due, None
        self._ensured = round_id  # this replica writes it: no check of its own upload (it may still be under way)
        try:
            frozen = self._snapshots.freeze(self._state(round_id))
        except AllReduceError as e:
            logger.warning("could not write the checkpoint of round %d: %s", round_id, e)
            return
        if not self._overlap:
            self._put_checkpoint(round_id, frozen)
            return
        self._upload = self._background("upload").submit(self._put_checkpoint, round_id, frozen)  # in round order

    def _put_checkpoint(self, round_id: int, frozen: FrozenState) -> None:
        try:
            self._snapshots.put(round_id, frozen)
        except AllReduceError as e:
            logger.warning("could not write the checkpoint of round %d: %s", round_id, e)

    def _wait_background(self) -> None:
        """Wait for everything handed to the background threads (rounds and checkpoint uploads)."""
        if self._on_background():
            return
        for tail in (self._tail, self._upload):
            if tail is not None:
                tail.result()

    def _ensure_checkpoint(self) -> None:
        """Write the last committed state if its writer did not (never from a replica that is behind: its state is
        not the committed one). With ``overlap`` the check runs on the sync thread after this sync's rounds (by
        then the writer's upload, which started before them, is usually done: a late one costs a second, refused
        create), and a missing state is copied at the manager's next call, if this replica still holds that
        round's state."""
        r = self._last_committed_round
        if not self._checkpoint or r is None or not self._save_fns or self._stale or r == self._ensured:
            return
        if r != self._last_checkpointed:  # checkpoint_every skips this round
            return
        self._ensured = r
        if self._overlap:
            self._presence = (r, None)  # submitted behind this sync's rounds (`_start_rounds`)
            return
        try:
            if not self._snapshots.exists(r):
                self._write_state(r)
        except AllReduceError as e:
            logger.warning("could not write the checkpoint of round %d: %s", r, e)

    def _check_presence(self) -> None:
        """Act on a finished background check of the last committed state: missing, and still this replica's
        state, it becomes due (copied and uploaded by `_write_checkpoint_if_due`)."""
        r, check = self._presence if self._presence is not None else (None, None)
        if r is None or check is None or not check.done():
            return
        self._presence = None
        try:
            present = bool(check.result())
        except AllReduceError as e:
            logger.warning("could not check the checkpoint of round %d: %s", r, e)
            return
        if not present and r == self._last_committed_round and not self._stale and self._checkpoint_due is None:
            self._checkpoint_due = r

    def _maybe_heal(self) -> None:
        """Load the last committed state if this replica is behind the store, then observe one round
        (`crf_diloco.healing.plan_heal` says what to load)."""
        if self._allreduce.world_size == 1:
            return
        heal = plan_heal(
            self._allreduce,
            last_committed=self._last_committed_round,
            stale=self._stale,
            registered=set(self._load_fns),
            timeout=self._heal_timeout,
            checkpoint_every=self._checkpoint_every,
            local=lambda: {key: fn() for key, fn in self._save_fns.items()},
        )
        if heal is None:
            return
        if heal.state is not None and heal.round_id is not None:
            for key, load_fn in self._load_fns.items():
                load_fn(heal.state[key])
            self.load_state_dict(heal.state[MANAGER_KEY])
            self._last_committed_round = self._last_checkpointed = heal.round_id
            how = "falling back to an earlier committed state" if heal.stale else "in step with the store"
            logger.info("rank %d healed from round %d (step %d), %s", self.rank, heal.round_id, self._step, how)
        self._stale = heal.stale  # stale: heal again once a newer committed state exists
        self._allreduce.join(heal.frontier)
        self._observe_next = True
