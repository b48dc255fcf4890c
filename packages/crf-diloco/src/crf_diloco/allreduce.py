"""`ObjectStoreAllReduce`: allreduce through nothing but an object store.

Protocol of one round ``r`` (keys in :mod:`crf_diloco.layout`, records in :mod:`crf_diloco.records`, wire format in
:mod:`crf_diloco.wire`; every object is authenticated with the run's secret, :mod:`crf_diloco.auth`):

1. **Announce.** Each replica creates ``members/{rank}.json`` (incarnation nonce, payload spec). A replica that
   vetoes the round (:meth:`ObjectStoreAllReduce.abort`, or a contribution with NaN/inf) announces a ``veto``.
2. **Quorum.** When every expected replica has announced, or the quorum deadline passes, any replica creates
   ``quorum.json`` (first writer wins): the participants (sorted ranks), their incarnations and a fresh round token.
   The round's payload spec is the one most announcers share (ties: the lowest rank's); announcers with another
   spec are ``rejected`` and raise `PayloadMismatchError`, alone. Expected = all ranks in the first round,
   afterwards the previous round's participants and announcers, so survivors of a crash pay the quorum deadline
   once. Late replicas observe the round: they contribute nothing but read the result. If an announced
   participant vetoes, the replica that would write the quorum aborts the round instead.
3. **Contribute.** Each participant creates ``data/{rank}.safetensors`` once (its whole payload; written in the
   background while it reads the others' slices).
4. **Reduce-scatter.** The owner of shard ``k`` (``participants[k]``) range-reads slice ``k`` of every payload,
   verifies its tag, sums in fp32 in participant order (divides by the number of participants for ``avg``),
   checks that the sum is finite (naming the ranks that sent NaN/inf), and finite again after the codec in the
   payload's own dtypes (a float16 sum can overflow), and creates ``reduced/{k}.safetensors``.
   If a shard is still missing ``straggler_grace`` seconds into the data phase, any replica computes and creates
   it; the inputs and summation order are fixed by the quorum, so duplicates are bit-identical.
5. **All-gather.** Everyone reads and verifies the reduced shards.
6. **Decide.** A replica that holds every verified shard creates ``decision.json`` with ``commit``; a replica
   whose deadline passes, or that finds a corrupt, forged or stale object, creates it with ``abort``. First writer
   wins and every replica follows what it reads there; a decision that fails authentication counts as ``abort``
   for everyone. Only participants (before the quorum: replicas that announced to take part) write decisions;
   observers wait for them. Inputs are only written after a commit.
7. **Vote** (rounds run with ``defer_decision=True``, e.g. by ``MockManager``). Step 6 never writes ``commit``;
   :meth:`ObjectStoreAllReduce.vote` does: each participant creates ``votes/{rank}.json``, and the first replica
   able to decide creates ``decision.json``: ``commit`` once every participant voted true, ``abort`` as soon as
   one voted false or when ``timeout`` passes with votes missing. Observers follow the decision.

Bytes per participant with ``m`` participants and payload ``S``: up ``S + S/m``, down ``2·(m−1)/m·S`` (plus small
headers), independent of the world size.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from crf_diloco.auth import Authenticator
from crf_diloco.errors import (
    AllReduceError,
    CorruptObjectError,
    PayloadMismatchError,
    RoundAbortedError,
    RoundDesyncError,
    RoundTimeoutError,
)
from crf_diloco.layout import LAYOUT_VERSION, RoundKeys, parse_round_dir, validate_name
from crf_diloco.payload import (
    as_tensor_list,
    codec_of,
    count_nonfinite,
    dtype_runs,
    flatten,
    nonfinite_as_dtypes,
    write_back,
)
from crf_diloco.records import (
    DecisionRecord,
    MemberRecord,
    PayloadSpec,
    QuorumRecord,
    VoteRecord,
    ranks_named,
)
from crf_diloco.replica_env import ENV_RANK, ENV_RUN_ID, ENV_SECRET, ENV_URI, ENV_WORLD_SIZE
from crf_diloco.store import ObjectStore, validate_uri
from crf_diloco.strictjson import parse_json_object
from crf_diloco.wire import (
    Header,
    Scratch,
    check_payload_header,
    encode_payload,
    encode_reduced,
    header_probe,
    parse_codec,
    read_header,
    read_payload_shard,
    read_reduced,
    wire_roundtrip,
)

__all__ = ["ObjectStoreAllReduce", "RoundInfo"]


logger = logging.getLogger(__name__)
TensorOrList = TypeVar("TensorOrList", torch.Tensor, Sequence[torch.Tensor])
R = TypeVar("R")
#: ``"bf16"``, ``"int8"``, ``"int4"``, ``"int4:<block>"``, ``"topk"`` or ``"topk:<k>/<block>"`` (`crf_diloco.wire.parse_codec`)
Compression = str
_UNSET: Any = object()
_MAX_RECORD = 1 << 20
#: what collection deletes from a round (its decision stays as the tombstone)
_ROUND_PARTS = ("quorum.json", "members", "data", "reduced", "votes")  # quorum first: then a check sees it gone
Pending = list["concurrent.futures.Future[None]"]


@dataclass(frozen=True)
class RoundInfo:
    """What this replica knows about the last round it took part in."""

    round_id: int
    outcome: Literal["commit", "abort", "passthrough", "pending"]
    participants: list[int] = field(default_factory=list)
    participated: bool = False
    reason: str = ""


@dataclass(frozen=True)
class _OpenRound:
    """A round whose data phase is done and whose decision waits for the vote."""

    keys: RoundKeys
    quorum: QuorumRecord
    participated: bool
    staged: tuple[str, torch.Tensor] | None = None


class _Abort(Exception):
    """Internal: this replica wants the round aborted (reason in args[0])."""


class ObjectStoreAllReduce:
    """Allreduce over an fsspec object store, one fenced round per :meth:`allreduce` call.

    Args:
        uri: fsspec URI of the rendezvous prefix: a bare path, ``file://``, ``memory://``, ``s3://``, ``gs://``,
            ``az://``, ``hf://``… Local directories are created at once.
        rank: this replica's rank, ``0 <= rank < world_size``.
        world_size: number of replicas launched; ``1`` passes through without any I/O.
        run_id: name of the run under ``uri`` (a plain name; anything that could escape is rejected).
        secret: the run's secret (at least 32 characters; `crf-diloco launch` makes one and `from_env` reads it).
            Every object is authenticated with it; objects that fail are corrupt and never adopted. ``None``: the
            store must be trusted (objects carry checksums only; a warning says so once).
        timeout: seconds each wait of the data phase may take before the round aborts.
        quorum_timeout: seconds to wait for expected replicas to announce (default: ``timeout``).
        compression: ``None`` (fp32 on the wire), ``"bf16"``, ``"int8"`` (row-wise scales), ``"int4"`` /
            ``"int4:<block>"`` (block-wise absmax, two values per byte) or ``"topk"`` / ``"topk:<k>/<block>"`` (the
            ``k`` largest of every block, int8 values; default 1 %). The reduction itself is always fp32. ``int4`` and
            ``topk`` keep a per-replica error-feedback residual (:meth:`state_dict`).
        storage_options: fsspec options (e.g. ``{"endpoint_url": ...}``, credentials).
        min_participants: a quorum with fewer participants aborts the round.
        poll_interval: longest sleep between two polls of the store (seconds).
        straggler_grace: seconds into the data phase after which any replica covers a missing reduced shard
            (default ``timeout / 3``).
        keep_rounds: round directories older than this many rounds are deleted by the lowest participant after
            each decision.
        retries: extra attempts per store operation on transient errors.
        preflight: if True, prove the store usable and create-only now (:meth:`preflight`); otherwise that check
            runs before the first round.
    """

    def __init__(
        self,
        uri: str,
        rank: int,
        world_size: int,
        *,
        run_id: str = "default",
        secret: str | bytes | None = None,
        timeout: float = 60.0,
        quorum_timeout: float | None = None,
        compression: Compression | None = None,
        storage_options: dict[str, Any] | None = None,
        min_participants: int = 1,
        poll_interval: float = 0.05,
        straggler_grace: float | None = None,
        keep_rounds: int = 2,
        retries: int = 3,
        preflight: bool = False,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        for label, value in (("timeout", timeout), ("poll_interval", poll_interval)):
            if not value > 0:
                raise ValueError(f"{label} must be > 0 seconds, got {value!r}")
        if quorum_timeout is not None and not quorum_timeout > 0:
            raise ValueError(f"quorum_timeout must be > 0 seconds or None, got {quorum_timeout!r}")
        if straggler_grace is not None and not straggler_grace > 0:
            raise ValueError(f"straggler_grace must be > 0 seconds or None, got {straggler_grace!r}")
        codec = codec_of(compression)  # ValueError naming the fix
        if not 1 <= min_participants <= world_size:
            raise ValueError(f"min_participants must be in [1, world_size={world_size}], got {min_participants!r}")
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be >= 1, got {keep_rounds!r}")
        self.uri = validate_uri(uri)
        self.rank = rank
        self.world_size = world_size
        self.run_id = validate_name(run_id, "run_id")
        self.auth = Authenticator(secret, self.run_id)
        self.timeout = float(timeout)
        self.quorum_timeout = float(quorum_timeout) if quorum_timeout is not None else self.timeout
        self.compression: Compression | None = None if compression is None else codec
        self.min_participants = min_participants
        self.poll_interval = float(poll_interval)
        self.straggler_grace = float(straggler_grace) if straggler_grace is not None else self.timeout / 3
        self.keep_rounds = keep_rounds
        self.round_id = 0
        self.incarnation = uuid.uuid4().hex
        self.last_round: RoundInfo | None = None
        self.store = ObjectStore(f"{uri.rstrip('/')}/{self.run_id}", storage_options, retries=retries)
        self._joined = False
        self._store_checked = False
        self._layout_ok = False
        self._expected: set[int] | None = None
        self._open: list[_OpenRound] = []
        self._bad_decisions: set[int] = set()
        self._closed = False
        self._scratch = Scratch()
        self._residuals: dict[str, torch.Tensor] = {}
        self._staged: tuple[str, torch.Tensor] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        if preflight:
            self.preflight()

    # -- construction helpers ---------------------------------------------------------------
    @classmethod
    def from_env(cls, **kwargs: Any) -> ObjectStoreAllReduce:
        """Build from ``CRF_DILOCO_URI``, ``CRF_DILOCO_RANK``, ``CRF_DILOCO_WORLD_SIZE``, ``CRF_DILOCO_RUN_ID``
        (optional, default ``"default"``) and ``CRF_DILOCO_SECRET`` (optional: without it the store must be
        trusted); ``kwargs`` override or extend them."""
        required = ((ENV_URI, "uri"), (ENV_RANK, "rank"), (ENV_WORLD_SIZE, "world_size"))
        missing = [env for env, name in required if env not in os.environ and name not in kwargs]
        if missing:
            raise KeyError(f"environment variables {missing} are not set; launch replicas with `crf-diloco launch`")
        params: dict[str, Any] = {}
        for env, name in ((ENV_RANK, "rank"), (ENV_WORLD_SIZE, "world_size")):
            raw = os.environ.get(env)
            if raw is not None:
                try:
                    params[name] = int(raw)
                except ValueError as exc:
                    raise ValueError(f"{env}={raw!r} is not an integer") from exc
        for env, name in ((ENV_URI, "uri"), (ENV_RUN_ID, "run_id"), (ENV_SECRET, "secret")):
            if os.environ.get(env):
                params[name] = os.environ[env]
        params.update(kwargs)
        return cls(**params)

    def preflight(self) -> None:
        """Fail now, not at the first round, if the adapter is missing, the store unusable, or it overwrites
        (`ObjectStore.preflight`: the second create of one key must fail)."""
        if self.world_size > 1 and not self._store_checked:
            self.store.preflight()
            self._store_checked = True

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.store.bytes_written

    def close(self) -> None:
        """Mark the instance closed (further rounds raise), finish background work, free buffers."""
        self._closed = True
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._scratch.clear()

    def __enter__(self) -> ObjectStoreAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public round API ---------------------------------------------------------------------
    def allreduce(
        self,
        tensors: TensorOrList,
        op: Literal["avg", "sum"] = "avg",
        *,
        compression: Compression | None = _UNSET,
        participate: bool = True,
        name: str | None = None,
        defer_decision: bool = False,
    ) -> TensorOrList:
        """Reduce ``tensors`` across replicas in place (one round) and return the same object.

        Args:
            tensors: one tensor or a sequence of tensors (fp32, fp16 or bf16, any shape, any device; reduced as one
                flat fp32 payload).
            op: ``"avg"`` (sum / number of participants) or ``"sum"``.
            compression: override the instance's wire compression for this round.
            participate: False to only read the round's result (a healing replica).
            name: optional label; every replica of the round must pass the same one.
            defer_decision: leave the round open after the data phase: ``tensors`` hold the reduced values, and
                :meth:`vote` later decides (store-wide) whether the round commits. Every replica of the round must
                pass the same value.

        Raises:
            RoundAbortedError, RoundTimeoutError, CorruptObjectError, RoundDesyncError (all
            :class:`AllReduceError`): the round did not commit here; inputs are unchanged. A contribution with
            NaN/inf vetoes the round (``RoundAbortedError`` naming this rank).
            PayloadMismatchError: this replica's payload differs from the one the round settled on.
        """
        if self._closed:
            raise AllReduceError("ObjectStoreAllReduce is closed")
        tensor_list = as_tensor_list(tensors)
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        codec = codec_of(self.compression if compression is _UNSET else compression)
        if name is not None:
            validate_name(name, "name")
        if not isinstance(defer_decision, bool):
            raise TypeError(f"defer_decision must be a bool, got {type(defer_decision).__name__}")
        if self.world_size == 1:
            self.last_round = RoundInfo(self.round_id, "passthrough", [self.rank], True)
            self.round_id += 1
            return tensors
        self._join()
        flat = flatten(tensor_list, self._scratch)
        spec = PayloadSpec(flat.numel(), codec, op, name, defer_decision, dtype_runs(tensor_list))
        residual = self._residual_for(_stream_key(spec)) if participate else None
        if residual is not None:
            flat = flat + residual  # a new tensor: the inputs stay as they are if the round fails
        veto = self._veto_for(flat) if participate else None
        if veto is not None and residual is not None:
            veto += " (its input plus its error-feedback residual)"
        if veto is not None:
            round_id = self.round_id
            self.abort(veto)
            raise RoundAbortedError(f"round {round_id} aborted: {veto} (this replica vetoed it)")
        round_id = self.round_id
        self._staged = None
        try:
            result = self._run_round(round_id, flat, spec, participate)
        finally:
            self._staged = None
            self.round_id = round_id + 1
        write_back(tensor_list, result)
        return tensors

    def _veto_for(self, flat: torch.Tensor) -> str | None:
        """Why this replica must veto its contribution (NaN/inf in it), or ``None``."""
        bad = count_nonfinite(flat)
        return f"rank {self.rank}'s contribution has {bad} NaN/inf value(s)" if bad else None

    # -- error feedback -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This replica's own state: ``{"residuals": {stream: fp32 tensor}}``, the error-feedback residuals of the
        ``int4``/``topk`` payloads it reduced (one per ``(codec, op, numel, name)``), as of its last committed round.

        Per replica, not global: save it with the replica's own checkpoint (e.g. `crf_diloco.checkpoint.dumps_state`)
        and give it back to :meth:`load_state_dict` on resume. Copies."""
        return {"residuals": {key: r.clone() for key, r in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s residuals; `ValueError` for anything that is not exactly such a state (a
        stream name that does not parse, a codec without error feedback, a tensor that is not 1-D fp32 of the
        stream's element count, or one holding NaN/inf). Nothing is changed when it raises."""
        if not isinstance(state, dict) or set(state) != {"residuals"} or not isinstance(state["residuals"], dict):
            raise ValueError("state must be {'residuals': {stream: tensor}} as returned by state_dict()")
        loaded: dict[str, torch.Tensor] = {}
        for key, value in state["residuals"].items():
            numel = _parse_stream_key(key)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.shape != (numel,):
                raise ValueError(f"residual {key!r} must be a 1-D float32 tensor of {numel} elements")
            if count_nonfinite(value):
                raise ValueError(f"residual {key!r} holds NaN/inf values; drop it (start that stream from zero)")
            loaded[key] = value.detach().to("cpu").clone()
        self._residuals = loaded

    def _stage_feedback(self, spec: PayloadSpec, flat: torch.Tensor, codec: str) -> torch.Tensor:
        """The residual this round leaves if it commits: what the codec loses of ``flat`` (the contribution plus the
        old residual). The shard owner adds the broadcast leg's loss to it (`_reduce_shard`)."""
        residual = flat - wire_roundtrip(flat, codec)
        if count_nonfinite(residual):
            raise _Abort(f"rank {self.rank}: the error-feedback residual is not finite (its values overflow fp32)")
        self._staged = (_stream_key(spec), residual)
        return residual

    def _residual_for(self, stream: str) -> torch.Tensor | None:
        """The residual the next round of ``stream`` starts from: that of the newest open (deferred) round of the
        stream if there is one (it stands if that round commits; if it aborts, this replica votes false on every
        later round of the vote, so they abort too), else the committed one."""
        for open_round in reversed(self._open):
            if open_round.staged is not None and open_round.staged[0] == stream:
                return open_round.staged[1]
        return self._residuals.get(stream)

    def _apply_staged(self, staged: tuple[str, torch.Tensor] | None) -> None:
        if staged is not None:
            self._residuals[staged[0]] = staged[1]

    def abort(self, reason: str, *, participate: bool = True) -> None:
        """Veto the next round (a false vote cast before its data phase) and skip it; never raises
        :class:`RoundAbortedError`.

        The veto is announced in the round's member records; the round is aborted for everyone as soon as its
        membership is settled (every expected replica announced, or the quorum deadline passed), so a peer that has
        not joined yet cannot skip the decided round and run the next one alone. A veto that arrives after the
        quorum formed is late (this replica is not a participant) and leaves the round to its participants.
        ``participate=False`` (an observing replica) skips the round without any I/O.
        """
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {type(reason).__name__}")
        round_id = self.round_id
        if self.world_size == 1 or not participate:
            self.last_round = RoundInfo(round_id, "abort", [], False, reason)
            self.round_id = round_id + 1
            return
        self._join()
        round_id = self.round_id
        keys = RoundKeys(round_id)
        quorum: QuorumRecord | None = None
        try:
            if self.read_decision(round_id) is None:
                quorum = self._await_quorum(keys, self._announce(keys, None, True, veto=reason))
            late = f"rank {self.rank}'s veto came after round {round_id} was settled without it: {reason}"
            self._finish(keys, quorum, "abort", late, participated=False)
        except RoundAbortedError as exc:
            self._finish(keys, None, "abort", str(exc), participated=False)
        except (_Abort, AllReduceError) as exc:
            # membership settled with our veto (or local trouble): abort the round for everyone
            decision = self._write_decision(keys, "abort", f"rank {self.rank}: {_why(exc)}", None, decide=True)
            self._finish(keys, None, "abort", decision.reason, participated=False)
        finally:
            self.round_id = round_id + 1

    @property
    def open_rounds(self) -> list[int]:
        """Rounds run with ``defer_decision=True`` whose decision waits for :meth:`vote`."""
        return [o.keys.round_id for o in self._open]

    def vote(self, ok: bool, reason: str = "") -> bool:
        """Vote on every open round (in order) and return True iff all of them committed.

        A participant creates ``votes/{rank}.json``; the first replica able to decide creates the round's decision:
        ``commit`` when every participant voted true, ``abort`` when one voted false or ``timeout`` passed with
        votes missing. Every replica follows that decision, so the result is the same on all participants.
        Observers do not vote, they wait for the decision. Once a round aborts, this replica votes false on the
        rest. True when no round is open. Store trouble counts as not committed here (the round may still commit
        elsewhere; this replica is then behind and ``MockManager`` heals it). No I/O when no round is open.
        """
        if not isinstance(ok, bool):
            raise TypeError(f"ok must be a bool, got {type(ok).__name__}")
        rounds, self._open = self._open, []
        committed = True
        for open_round in rounds:
            if ok and not committed:
                why = f"an earlier round of this sync (before round {open_round.keys.round_id}) aborted"
            else:
                why = reason
            committed = self._settle(open_round, ok and committed, why) and committed
        return committed

    def read_decision(self, round_id: int) -> DecisionRecord | None:
        """The decision of ``round_id`` as stored (``None`` if undecided). A decision object that is malformed or
        fails authentication reads as ``abort`` (it can never be replaced, and nobody may adopt it)."""
        keys = RoundKeys(round_id)
        try:
            return self._read_record(keys.decision, lambda o, k: DecisionRecord.parse(o, k, self.world_size, round_id))
        except CorruptObjectError as exc:
            if round_id not in self._bad_decisions:
                self._bad_decisions.add(round_id)
                logger.warning("rank %d: %s; round %d counts as aborted", self.rank, exc, round_id)
            return DecisionRecord(
                round_id,
                "abort",
                f"the decision object is corrupt or forged: {exc}",
                self.rank,
                None,
                world_size=self.world_size,
            )

    def read_quorum(self, round_id: int) -> QuorumRecord | None:
        """The quorum record of ``round_id`` (``None`` if not formed); `CorruptObjectError` if it is not authentic."""
        key = RoundKeys(round_id).quorum
        return self._read_record(key, lambda o, k: QuorumRecord.parse(o, k, self.world_size, round_id))

    def latest_committed_round(self) -> int | None:
        """Highest round id whose authentic decision in the store is ``commit``: among the listed rounds and those a
        lagging listing does not show yet (found by reading the decisions after the newest listed round)."""
        listed = self._round_ids()
        after = listed[-1] + 1 if listed else 0
        for r in sorted({*listed, *range(after, self._decided_from(after))}, reverse=True):
            decision = self.read_decision(r)
            if decision is not None and decision.committed:
                return r
        return None

    def frontier(self) -> int:
        """The round replicas are in now (never less than this instance's ``round_id``), from authenticated objects
        only: the newest round holding one (a decision, the quorum or a member record sealed with the run's secret)
        if it is undecided, else the one after it; then past every round whose authentic decision exists, which a
        listing that lags behind does not show. Directories planted by name (``r99999999/...``) are ignored."""
        self._check_layout()
        frontier = self.round_id
        for r in sorted(self._round_ids(), reverse=True):
            if r < frontier:
                break
            if self._holds_our_objects(r):
                frontier = r + 1 if self.store.exists(RoundKeys(r).decision) else r
                break
        return self._decided_from(frontier)

    def _authentic_decision(self, round_id: int) -> DecisionRecord | None:
        """The decision of ``round_id`` if it exists and is authentic (a forged or garbage one is ``None`` here)."""
        key = RoundKeys(round_id).decision
        with contextlib.suppress(CorruptObjectError):
            return self._read_record(key, lambda o, k: DecisionRecord.parse(o, k, self.world_size, round_id))
        return None

    def _decided_from(self, round_id: int) -> int:
        """The first round from ``round_id`` on without an authentic decision (decisions outlive collection)."""
        while self._authentic_decision(round_id) is not None:
            round_id += 1
        return round_id

    def _holds_our_objects(self, round_id: int) -> bool:
        """Whether the directory of ``round_id`` holds an object authenticated for this run."""
        keys = RoundKeys(round_id)
        if self._authentic_decision(round_id) is not None:
            return True
        try:
            if self.read_quorum(round_id) is not None:
                return True
            for rank in ranks_named(self.store.list_names(keys.members_dir), self.world_size):
                with contextlib.suppress(CorruptObjectError):
                    if self._read_member(keys, rank) is not None:
                        return True
        except CorruptObjectError:
            pass
        return False

    def _collect(self, round_id: int) -> None:
        """(Background) collect a round ``keep_rounds`` behind this replica's decided one: delete its members, quorum,
        data, reduced shards and votes, and keep its decision as a tombstone (writing ``abort`` if it has none), so
        that a replica that stalled or reads a lagging listing finds the round decided and never re-creates it.
        Nothing else under the prefix is touched."""
        keys = RoundKeys(round_id)
        names = self.store.list_names(keys.prefix)
        if not names:
            return
        if "decision.json" not in names:
            reason = f"collected by rank {self.rank} after round {round_id + self.keep_rounds} was decided"
            record = DecisionRecord(round_id, "abort", reason, self.rank, None, world_size=self.world_size)
            self._write_record(keys.decision, record)
        for name in _ROUND_PARTS:
            if name in names:
                self.store.remove_tree(f"{keys.prefix}/{name}")

    def join(self, round_id: int | None = None) -> int:
        """Set the next round to ``round_id`` (default: the :meth:`frontier`) and return it.

        A new instance joins the frontier by itself at its first round, which skips rounds decided by an earlier
        run under the same ``run_id``; call this to choose the round explicitly.
        """
        if round_id is not None and round_id < 0:
            raise ValueError(f"round_id must be >= 0, got {round_id}")
        self.preflight()
        self._check_layout()  # also for an explicit round: a replica of another world size fails here, alone
        self.round_id = self.frontier() if round_id is None else round_id
        self._joined = True
        return self.round_id

    # -- store helpers --------------------------------------------------------------------------
    def _join(self) -> None:
        if not self._joined:
            self.join()

    def _round_ids(self) -> list[int]:
        return sorted(r for r in (parse_round_dir(n) for n in self.store.list_names("")) if r is not None)

    def _check_layout(self) -> None:
        if self._layout_ok:
            return
        marker = {"layout": "crf-diloco", "version": LAYOUT_VERSION, "world_size": self.world_size}
        if not self._write_record("LAYOUT", marker):
            try:
                found = self._read_record("LAYOUT", lambda o, k: o)
            except CorruptObjectError as exc:
                raise AllReduceError(
                    f"{self.store.uri!r} belongs to another run or secret, or to an older crf-diloco ({exc}). "
                    "Use a new run_id, or this run's CRF_DILOCO_SECRET."
                ) from None
            theirs = found.get("world_size") if isinstance(found, dict) else None
            if found is not None and found != marker and {**found, "world_size": self.world_size} == marker:
                raise AllReduceError(
                    f"{self.store.uri!r} is a run of world_size={theirs!r}; this replica was started with "
                    f"world_size={self.world_size}. Launch every replica of a run with the same world size (or use a "
                    "new run_id)"
                )
            if found != marker:
                raise AllReduceError(
                    f"{self.store.uri!r} holds a crf-diloco layout {found!r}; this version writes layout "
                    f"{LAYOUT_VERSION}. Use a new run_id or a matching crf-diloco version."
                )
        self._layout_ok = True

    def _read_record(self, key: str, parse: Callable[[dict[str, Any], str], R]) -> R | None:
        """The authenticated record at ``key`` parsed by ``parse``, ``None`` if absent, else `CorruptObjectError`."""
        blob = self.store.try_get(key, limit=_MAX_RECORD)
        if blob is None:
            return None
        return parse(parse_json_object(self.auth.open_record(key, blob), key), key)

    def _write_record(self, key: str, record: Any) -> bool:
        """Create the sealed record at ``key`` (``record`` has ``to_json`` or is a dict); False if it existed."""
        obj = record if isinstance(record, dict) else record.to_json()
        body = json.dumps(obj, separators=(",", ":")).encode()
        return self.store.put_create(key, self.auth.seal_record(key, body))

    def _sleep(self, attempt: int) -> None:
        time.sleep(min(self.poll_interval, 0.002 * 1.5 ** min(attempt, 20)) * (0.75 + 0.5 * random.random()))

    def _submit(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        """Run ``fn(*args)`` on this instance's background writer threads."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"crf-diloco-{self.rank}")
            return self._pool.submit(fn, *args)

    @staticmethod
    def _check_pending(pending: Pending) -> None:
        """Raise `_Abort` as soon as a background write of this round failed."""
        for future in pending:
            if future.done() and future.exception() is not None:
                raise _Abort(f"writing this replica's object failed: {_why(future.exception())}")

    @staticmethod
    def _drain(pending: Pending) -> None:
        """Wait for every background write of this round; raise `_Abort` for the first failure."""
        errors = [e for e in (f.exception() for f in pending) if e is not None]
        if errors:
            raise _Abort(f"writing this replica's object failed: {_why(errors[0])}")

    # -- decisions --------------------------------------------------------------------------------
    def _write_decision(
        self, keys: RoundKeys, outcome: str, reason: str, token: str | None, *, decide: bool
    ) -> DecisionRecord:
        """Create the round's decision (first writer wins) if this replica ``decide``s (a participant of the round,
        or a non-observing announcer before its quorum), and return the one that stands. Observers never write one:
        they wait for the participants' (`RoundTimeoutError` after ``timeout``)."""
        if decide:
            record = DecisionRecord(keys.round_id, outcome, reason, self.rank, token, world_size=self.world_size)  # type: ignore[arg-type]
            with contextlib.suppress(AllReduceError):  # the read below decides whose decision stands
                self._write_record(keys.decision, record)
        return self._await_decision(keys)

    def _await_decision(self, keys: RoundKeys) -> DecisionRecord:
        """The round's decision, polled for up to ``timeout`` seconds (`RoundTimeoutError` after that)."""
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            try:
                found = self.read_decision(keys.round_id)
            except AllReduceError:
                found = None
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise RoundTimeoutError(
                    f"round {keys.round_id}: no decision object could be read within {self.timeout:.1f}s"
                )
            self._sleep(attempt)
            attempt += 1

    def _may_decide(self, quorum: QuorumRecord | None, participate: bool) -> bool:
        """Whether this replica may write the round's decision: its rank is a participant of the quorum (also a
        restarted incarnation, which aborts a round its previous life cannot finish), or, before a quorum exists, it
        announced to participate. Observers never decide."""
        return participate and (quorum is None or self.rank in quorum.participants)

    def _check_decided(self, keys: RoundKeys) -> None:
        """Raise if the round ended under this replica: `RoundAbortedError` if it aborted, `RoundDesyncError` if it
        committed and has been collected since (its quorum is gone: this replica stalled past ``keep_rounds``)."""
        decision = self.read_decision(keys.round_id)
        if decision is None:
            return
        if not decision.committed:
            raise RoundAbortedError(f"round {keys.round_id} aborted: {decision.reason}")
        if self.read_quorum(keys.round_id) is None:
            raise self._fell_behind(keys, decision)

    def _check_not_collected(self, keys: RoundKeys) -> None:
        """Before a write into a round: raise if the round was collected under this replica (its decision is kept,
        its quorum gone), so that nothing re-creates it. A decided round that is not collected yet may still get the
        write (collection deletes it later)."""
        decision = self.read_decision(keys.round_id)
        if decision is not None and self.read_quorum(keys.round_id) is None:
            raise self._fell_behind(keys, decision)

    def _fell_behind(self, keys: RoundKeys, decision: DecisionRecord) -> RoundDesyncError | RoundAbortedError:
        """This replica reached a round that was decided and collected: rejoin at the frontier next time."""
        self._joined = False
        behind = (
            f"rank {self.rank} fell more than keep_rounds={self.keep_rounds} rounds behind the run. It joins the live "
            "round next (MockManager heals it first)"
        )
        if not decision.committed:
            return RoundAbortedError(f"round {keys.round_id} aborted and has been collected: {behind}")
        return RoundDesyncError(f"round {keys.round_id} committed and has been collected: {behind}")

    @staticmethod
    def _stands(decision: DecisionRecord, quorum: QuorumRecord | None) -> bool:
        """True if ``decision`` commits the round that ``quorum`` describes (a commit of another attempt does not)."""
        return decision.committed and quorum is not None and decision.token == quorum.token

    # -- one round ------------------------------------------------------------------------------
    def _run_round(self, round_id: int, flat: torch.Tensor, spec: PayloadSpec, participate: bool) -> torch.Tensor:
        keys = RoundKeys(round_id)
        quorum: QuorumRecord | None = None
        try:
            decision = self.read_decision(round_id)
            if decision is not None:  # decided before this replica came
                if not decision.committed:
                    if not self.store.list_names(keys.members_dir):  # and collected: rejoin at the frontier next
                        self._joined = False
                    raise RoundAbortedError(f"round {round_id} aborted: {decision.reason}")
                quorum = self.read_quorum(round_id)
                if quorum is None:
                    raise self._fell_behind(keys, decision)
                if not self._stands(decision, quorum):
                    raise CorruptObjectError(f"{keys.decision}: commits a round attempt without a matching quorum")
                return self._follow_commit(keys, quorum, spec, decision)
            stale_self = self._announce(keys, spec, participate)
            quorum = self._await_quorum(keys, stale_self)
            return self._data_phase(keys, quorum, flat, spec)
        except RoundAbortedError:
            self._finish(keys, quorum, "abort", "")
            raise
        except (RoundDesyncError, RoundTimeoutError):
            raise
        except (_Abort, AllReduceError) as exc:
            # local trouble (deadline, corrupt/forged/stale object, store errors): abort, follow the decision
            token = quorum.token if quorum else None
            decide = self._may_decide(quorum, participate)
            decision = self._write_decision(keys, "abort", f"rank {self.rank}: {_why(exc)}", token, decide=decide)
            if self._stands(decision, quorum):
                assert quorum is not None
                result = self._follow_commit(keys, quorum, spec, decision)
                if self.rank in quorum.participants:  # our payload went into the committed round
                    self._apply_staged(self._staged)
                return result
            self._finish(keys, quorum, "abort", decision.reason)
            corrupt = exc if isinstance(exc, CorruptObjectError) else exc.__cause__
            raise RoundAbortedError(f"round {round_id} aborted: {decision.reason}") from (
                corrupt if isinstance(corrupt, CorruptObjectError) else None
            )

    def _announce(self, keys: RoundKeys, spec: PayloadSpec | None, participate: bool, veto: str | None = None) -> bool:
        """Create this replica's member record. Returns True if a record of another incarnation of this rank is
        already there (a stale round, or our own previous life)."""
        record = MemberRecord(self.rank, self.incarnation, spec, not participate, veto, world_size=self.world_size)
        if self._write_record(keys.member(self.rank), record):
            return False
        existing = self._read_member(keys, self.rank)
        return existing is None or existing.incarnation != self.incarnation

    def _read_member(self, keys: RoundKeys, rank: int) -> MemberRecord | None:
        key = keys.member(rank)
        record = self._read_record(key, lambda o, k: MemberRecord.parse(o, k, self.world_size))
        if record is not None and record.rank != rank:
            raise CorruptObjectError(f"{key}: the record is rank {record.rank}'s")
        return record

    def _await_quorum(self, keys: RoundKeys, stale_self: bool) -> QuorumRecord:
        deadline = time.monotonic() + self.quorum_timeout
        members: dict[int, MemberRecord] = {}
        attempt = 0
        while True:
            quorum = self.read_quorum(keys.round_id)
            if quorum is not None:
                return quorum
            self._check_decided(keys)
            if stale_self:
                raise _Abort(f"round {keys.round_id} holds a member record of another incarnation of rank {self.rank}")
            for rank in ranks_named(self.store.list_names(keys.members_dir), self.world_size):
                if rank not in members:
                    record = self._read_member(keys, rank)
                    if record is not None:
                        members[rank] = record
            announced = {r for r, m in members.items() if not m.observer}
            expected = self._expected if self._expected is not None else set(range(self.world_size))
            if expected <= announced or time.monotonic() > deadline:
                self._propose_quorum(keys, members, announced)
                continue
            self._sleep(attempt)
            attempt += 1

    def _propose_quorum(self, keys: RoundKeys, members: dict[int, MemberRecord], announced: set[int]) -> None:
        vetoes = [
            f"rank {r} vetoed round {keys.round_id}: {members[r].veto}" for r in sorted(announced) if members[r].veto
        ]
        if vetoes:
            raise _Abort("; ".join(vetoes))
        specs = {r: s for r in sorted(announced) if (s := members[r].spec) is not None}
        counts = Counter(specs.values())
        # the spec most announcers share; ties go to the lowest rank's (ranks are in order, max keeps the first)
        spec = max(counts, key=counts.__getitem__) if counts else None
        participants = [r for r, s in specs.items() if s == spec]
        if spec is None or len(participants) < self.min_participants:
            raise _Abort(
                f"only {len(participants)} replica(s) with a matching payload announced before the quorum deadline "
                f"({self.quorum_timeout:.1f}s), min_participants={self.min_participants}"
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
            self.rank,
            rejected,
            world_size=self.world_size,
        )
        self._write_record(keys.quorum, record)

    def _check_spec(self, keys: RoundKeys, quorum: QuorumRecord, spec: PayloadSpec) -> None:
        if self.rank in quorum.rejected or quorum.spec != spec:
            raise PayloadMismatchError(
                f"round {keys.round_id} settled on a payload of {quorum.spec.describe()}, but rank {self.rank} "
                f"passed {spec.describe()}; every replica must allreduce the same tensors (shapes, op, compression, "
                "name) in the same order"
            )

    def _data_phase(self, keys: RoundKeys, quorum: QuorumRecord, flat: torch.Tensor, spec: PayloadSpec) -> torch.Tensor:
        self._check_spec(keys, quorum, spec)
        participants, plan, token = quorum.participants, quorum.plan, quorum.token
        start = time.monotonic()
        deadline = start + self.timeout
        mine = self.rank in participants
        if mine and quorum.incarnations[self.rank] != self.incarnation:
            if not self.store.exists(keys.data(self.rank)):
                raise _Abort(f"round {keys.round_id} lists rank {self.rank} from an incarnation that is gone")
            mine = False
        pending: Pending = []
        done: set[int] = set()
        try:
            if mine:
                self._check_not_collected(keys)  # never re-create a round collected meanwhile
                feedback = self._stage_feedback(spec, flat, plan.codec) if plan.spec.error_feedback else None
                key = keys.data(self.rank)
                meta = {"token": token, "rank": str(self.rank), "round": str(keys.round_id)}
                pending.append(
                    self._submit(self._create_payload, key, encode_payload(key, self.auth, flat, plan, meta), token)
                )
                shard = participants.index(self.rank)
                self._reduce_shard(keys, quorum, shard, deadline, flat, pending, feedback)
                done.add(shard)
            result = self._gather(keys, quorum, deadline, start, done, flat if mine else None, pending)
            self._drain(pending)
        finally:
            concurrent.futures.wait(pending)
        if spec.vote:
            self._open.append(_OpenRound(keys, quorum, mine, self._staged))
            self.last_round = RoundInfo(keys.round_id, "pending", list(participants), mine)
            return result
        decision = self._write_decision(keys, "commit", "", token, decide=mine)
        if not self._stands(decision, quorum):
            raise RoundAbortedError(f"round {keys.round_id} aborted: {decision.reason}")
        self._apply_staged(self._staged)
        self._finish(keys, quorum, "commit", "")
        return result

    def _create_payload(self, key: str, blob: list[memoryview], token: str) -> None:
        """(Background) create this replica's payload; an object already there must be ours (a retried write)."""
        if not self.store.put_create(key, blob):
            header = read_header(self.store, key, self.auth)
            if header.metadata.get("token") != token:
                raise _Abort(f"{key} exists from another round attempt")

    def _create_reduced(self, key: str, blob: list[memoryview], check: Callable[[], None]) -> None:
        """(Background) create a reduced shard; if one is already there, ``check`` that it holds our values."""
        if not self.store.put_create(key, blob):
            check()

    def _reduce_shard(
        self,
        keys: RoundKeys,
        quorum: QuorumRecord,
        shard: int,
        deadline: float,
        own: torch.Tensor | None,
        pending: Pending,
        feedback: torch.Tensor | None = None,
    ) -> None:
        """Sum shard ``shard`` over all participants in order into the result buffer and create its object.

        ``feedback``: the shard owner's staged residual (error-feedback codecs); the broadcast leg's loss (the exact
        reduction minus what its codec delivers, in sum units: times the participants for ``avg``) is added to it
        over the shard's elements, so the next round's contribution of the owner carries it."""
        plan, participants, token = quorum.plan, quorum.participants, quorum.token
        lo, hi = plan.elem_range(shard)
        acc = self._result(plan.numel)[lo:hi]
        for i, r in enumerate(participants):
            if r == self.rank and own is not None:
                values = wire_roundtrip(own[lo:hi], plan.codec)  # exactly what others decode from our object
            else:
                header = self._await_payload(keys, quorum, r, deadline, pending)
                try:
                    values = read_payload_shard(
                        self.store, header, self.auth, plan, shard, self._scratch, out=acc if i == 0 else None
                    )
                except CorruptObjectError as exc:
                    raise _Abort(str(exc)) from exc
            if i == 0:
                if values.data_ptr() != acc.data_ptr():
                    acc.copy_(values)
            else:
                acc.add_(values)
        if quorum.spec.op == "avg":
            acc /= len(participants)
        if count_nonfinite(acc):
            raise _Abort(self._blame(keys, quorum, shard, own))
        key = keys.reduced(shard)
        meta = {"token": token, "round": str(keys.round_id), "contributors": json.dumps(list(participants))}
        blob, decoded = encode_reduced(key, self.auth, acc, plan, shard, meta)
        overflow = nonfinite_as_dtypes(decoded, lo, quorum.spec.dtypes)
        if overflow:
            what = ", ".join(f"{n} in {dtype}" for dtype, n in sorted(overflow.items()))
            raise _Abort(f"shard {shard} of round {keys.round_id}: the reduced values overflow their dtype ({what})")
        if feedback is not None:
            lost = acc - decoded
            if quorum.spec.op == "avg":
                lost *= len(participants)
            feedback[lo:hi] += lost
            if count_nonfinite(feedback[lo:hi]):
                raise _Abort(f"rank {self.rank}: the error-feedback residual of shard {shard} is not finite")
        if decoded.data_ptr() != acc.data_ptr():
            acc.copy_(decoded)

        def check() -> None:
            theirs = torch.empty_like(acc)
            read_reduced(self.store, key, self.auth, plan, shard, theirs, Scratch(), token=token)
            if not torch.equal(theirs, acc):
                raise _Abort(f"{key} already exists with other values than this replica's reduction")

        pending.append(self._submit(self._create_reduced, key, blob, check))

    def _blame(self, keys: RoundKeys, quorum: QuorumRecord, shard: int, own: torch.Tensor | None) -> str:
        """Why shard ``shard`` is not finite: the ranks whose slices hold NaN/inf, or an fp32 overflow."""
        plan = quorum.plan
        lo, hi = plan.elem_range(shard)
        culprits = []
        for r in quorum.participants:
            try:
                if r == self.rank and own is not None:
                    values = wire_roundtrip(own[lo:hi], plan.codec)
                else:
                    header = read_header(self.store, keys.data(r), self.auth)
                    values = read_payload_shard(self.store, header, self.auth, plan, shard, self._scratch)
            except (OSError, AllReduceError) as exc:
                culprits.append(f"rank {r}'s slice could not be read again ({_why(exc)})")
                continue
            bad = count_nonfinite(values.float())
            if bad:
                culprits.append(f"rank {r} contributed {bad} NaN/inf value(s) to shard {shard}")
        return "; ".join(culprits) or f"shard {shard} of round {keys.round_id} overflows fp32"

    def _await_payload(
        self, keys: RoundKeys, quorum: QuorumRecord, rank: int, deadline: float, pending: Pending
    ) -> Header:
        key = keys.data(rank)
        attempt = 0
        while True:
            try:
                header = read_header(self.store, key, self.auth, header_probe(len(quorum.participants)))
            except FileNotFoundError:
                header = None
            except CorruptObjectError as exc:
                raise _Abort(str(exc)) from exc
            if header is not None:
                if header.metadata.get("token") != quorum.token:
                    raise _Abort(f"{key} belongs to another round attempt (stale object)")
                try:
                    check_payload_header(header, quorum.plan, rank=str(rank), round=str(keys.round_id))
                except CorruptObjectError as exc:
                    raise _Abort(str(exc)) from exc
                return header
            self._check_decided(keys)
            self._check_pending(pending)
            if time.monotonic() > deadline:
                raise _Abort(f"{key} did not appear within {self.timeout:.1f}s")
            self._sleep(attempt)
            attempt += 1

    def _result(self, numel: int) -> torch.Tensor:
        """The round's result buffer (fp32, ``numel``), reused across rounds."""
        return self._scratch.get("result", 4 * numel).view(torch.float32)

    def _gather(
        self,
        keys: RoundKeys,
        quorum: QuorumRecord,
        deadline: float,
        start: float,
        done: set[int],
        own: torch.Tensor | None,
        pending: Pending,
        cover: bool = True,
    ) -> torch.Tensor:
        """Read every reduced shard not in ``done`` into the result buffer (covering stragglers); return it."""
        plan, token = quorum.plan, quorum.token
        result = self._result(plan.numel)
        contributors = json.dumps(list(quorum.participants))
        done = set(done)
        attempt = 0
        while len(done) < plan.n_shards:
            for k in range(plan.n_shards):
                if k in done:
                    continue
                lo, hi = plan.elem_range(k)
                try:
                    read_reduced(self.store, keys.reduced(k), self.auth, plan, k, result[lo:hi], self._scratch,
                                 token=token, round=str(keys.round_id), contributors=contributors)  # fmt: skip
                except FileNotFoundError:
                    continue
                except CorruptObjectError as exc:
                    raise _Abort(str(exc)) from exc
                done.add(k)
            if len(done) == plan.n_shards:
                break
            self._check_decided(keys)
            self._check_pending(pending)
            now = time.monotonic()
            if now > deadline:
                missing = sorted(set(range(plan.n_shards)) - done)
                raise _Abort(f"reduced shards {missing} did not appear within {self.timeout:.1f}s")
            if cover and now - start > self.straggler_grace:
                k = min(set(range(plan.n_shards)) - done)
                self._reduce_shard(keys, quorum, k, deadline, own, pending)
                done.add(k)
                continue
            self._sleep(attempt)
            attempt += 1
        return result

    def _follow_commit(
        self, keys: RoundKeys, quorum: QuorumRecord, spec: PayloadSpec, decision: DecisionRecord
    ) -> torch.Tensor:
        """The round committed: read its result (reduced shards are immutable and verified)."""
        self._check_spec(keys, quorum, spec)
        now = time.monotonic()
        try:
            result = self._gather(keys, quorum, now + self.timeout, now, set(), None, [], cover=False)
        except (_Abort, AllReduceError) as exc:
            self._finish(keys, quorum, "commit", "")
            raise RoundDesyncError(
                f"round {keys.round_id} committed but this replica could not read its result: {_why(exc)}"
            ) from None
        self._finish(keys, quorum, "commit", decision.reason, participated=False)
        return result

    # -- the vote -------------------------------------------------------------------------------
    def _settle(self, open_round: _OpenRound, ok: bool, reason: str) -> bool:
        """Cast this replica's vote on an open round, then decide or follow; True iff it committed."""
        keys, quorum = open_round.keys, open_round.quorum
        try:
            if open_round.participated:
                self._check_not_collected(keys)  # a vote into a collected round would re-create it
                vote = VoteRecord(self.rank, ok, reason, quorum.token, self.incarnation, world_size=self.world_size)
                self._write_record(keys.vote(self.rank), vote)
            if open_round.participated:
                decision = self._await_votes(keys, quorum, ok, reason)
            else:  # observers do not vote and never decide
                decision = self._await_decision(keys)
        except (_Abort, AllReduceError) as exc:
            try:
                why = f"rank {self.rank}: {_why(exc)}"
                decision = self._write_decision(keys, "abort", why, quorum.token, decide=open_round.participated)
            except AllReduceError as final:
                logger.warning("round %d: could not settle its vote: %s", keys.round_id, final)
                self._finish(keys, quorum, "abort", str(final), participated=open_round.participated)
                return False
        committed = self._stands(decision, quorum)
        if committed and open_round.participated:
            self._apply_staged(open_round.staged)
        outcome: Literal["commit", "abort"] = "commit" if committed else "abort"
        self._finish(keys, quorum, outcome, decision.reason, participated=open_round.participated)
        return committed

    def _await_votes(self, keys: RoundKeys, quorum: QuorumRecord, ok: bool, reason: str) -> DecisionRecord:
        """(A participant) poll the round's votes until a decision stands, writing it once the votes settle it."""
        token, participants = quorum.token, quorum.participants
        if not ok:
            return self._write_decision(keys, "abort", f"rank {self.rank} voted to abort: {reason}", token, decide=True)
        deadline = time.monotonic() + self.timeout
        votes: dict[int, VoteRecord] = {}
        attempt = 0
        while True:
            decision = self.read_decision(keys.round_id)
            if decision is not None:
                return decision
            for rank in ranks_named(self.store.list_names(keys.votes_dir), self.world_size):
                if rank in participants and rank not in votes:
                    key = keys.vote(rank)
                    record = self._read_record(key, lambda o, k: VoteRecord.parse(o, k, self.world_size))
                    if record is not None:
                        if record.rank != rank or record.token != token:
                            raise _Abort(f"{key} belongs to another rank or round attempt (stale object)")
                        votes[rank] = record
            against = sorted(r for r, v in votes.items() if not v.ok)
            if against:
                why = "; ".join(f"rank {r} voted to abort: {votes[r].reason}" for r in against)
                return self._write_decision(keys, "abort", why, token, decide=True)
            if len(votes) == len(participants):
                return self._write_decision(keys, "commit", "", token, decide=True)
            if time.monotonic() > deadline:
                missing = sorted(set(participants) - set(votes))
                why = f"votes of ranks {missing} did not appear within {self.timeout:.1f}s"
                return self._write_decision(keys, "abort", why, token, decide=True)
            self._sleep(attempt)
            attempt += 1

    def _finish(
        self,
        keys: RoundKeys,
        quorum: QuorumRecord | None,
        outcome: Literal["commit", "abort"],
        reason: str,
        participated: bool | None = None,
    ) -> None:
        participants = list(quorum.participants) if quorum else []
        if participated is None:
            participated = self.rank in participants
        self.last_round = RoundInfo(keys.round_id, outcome, participants, participated, reason)
        try:
            names = self.store.list_names(keys.members_dir)
        except AllReduceError:
            names = []
        announced = set(ranks_named(names, self.world_size))
        if quorum is not None:  # the next round expects this one's participants and announcers
            self._expected = ((set(participants) | announced) - set(quorum.rejected)) or None
        elif self._expected is not None:  # aborted before its quorum: who was expected still is
            self._expected |= announced
        if participants and self.rank == min(participants) and keys.round_id >= self.keep_rounds:
            self._submit(self._collect, keys.round_id - self.keep_rounds)


def _stream_key(spec: PayloadSpec) -> str:
    """The error-feedback stream of a payload: ``codec|op|numel|name``."""
    return f"{spec.codec}|{spec.op}|{spec.numel}|{spec.name or ''}"


def _parse_stream_key(key: Any) -> int:
    """The element count of a stream key made by `_stream_key`; `ValueError` if it is not one."""
    parts = key.split("|") if isinstance(key, str) else []
    try:
        ok = len(parts) == 4 and parse_codec(parts[0]).name == parts[0] and parse_codec(parts[0]).error_feedback
        ok = ok and parts[1] in ("avg", "sum") and parts[2].isdigit() and int(parts[2]) >= 1
        if ok and parts[3]:
            validate_name(parts[3], "name")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{key!r} is not an error-feedback stream 'codec|op|numel|name' of an int4/topk codec")
    return int(parts[2])


def _why(exc: BaseException | None) -> str:
    """The reason carried by an exception (its first argument), for abort records."""
    if exc is None:
        return ""
    return str(exc.args[0]) if exc.args else repr(exc)
