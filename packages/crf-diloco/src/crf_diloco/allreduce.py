"""`ObjectStoreAllReduce`: allreduce through nothing but an object store.

Protocol of one round ``r`` (keys in :mod:`crf_diloco.layout`, wire format in :mod:`crf_diloco.wire`):

1. **Announce.** Each replica creates ``members/{rank}.json`` (incarnation nonce, payload spec). A
   replica that vetoes the round (:meth:`ObjectStoreAllReduce.abort`) announces with a ``veto``
   reason instead of a payload spec.
2. **Quorum.** When every expected replica has announced, or the quorum deadline passes, any
   replica creates ``quorum.json`` (first writer wins): the participants (sorted ranks), the shard
   plan and a fresh round token. Expected = all ranks in the first round, afterwards the previous
   round's participants and announcers, so survivors of a crash pay the quorum deadline once.
   Late replicas are observers of the round: they contribute nothing but read the result. If an
   announced participant vetoes, the replica that would write the quorum aborts the round instead:
   membership is settled first, so no peer can miss the veto and run on alone in the next round.
3. **Contribute.** Each participant creates ``data/{rank}.safetensors`` once (its whole payload).
4. **Reduce-scatter.** The owner of shard ``k`` (``participants[k]``) range-reads slice ``k`` of
   every payload, verifies its CRC, sums in fp32 in participant order (divides by the number of
   participants for ``avg``), and creates ``reduced/{k}.safetensors``. If a shard is still missing
   ``straggler_grace`` seconds into the data phase, any replica computes and creates it; the
   inputs and summation order are fixed by the quorum, so duplicates are bit-identical.
5. **All-gather.** Everyone reads and verifies the reduced shards.
6. **Decide.** A replica that holds every verified shard creates ``decision.json`` with
   ``commit``; a replica whose deadline passes, or that finds a corrupt or stale object, creates
   it with ``abort``. First writer wins and every replica follows what it reads there, so no round
   commits on one replica and aborts on another. Inputs are only written after a commit.
7. **Vote** (rounds run with ``defer_decision=True``, e.g. by ``MockManager``: the collective
   ``should_commit``). Step 6 never writes ``commit``; :meth:`ObjectStoreAllReduce.vote` does: each
   participant creates ``votes/{rank}.json`` (``ok`` true or false), and the first replica able to
   decide creates ``decision.json``: ``commit`` once every participant voted true, ``abort`` as soon
   as one voted false or when ``timeout`` passes with votes missing. Observers do not vote; they
   follow the decision. The inputs hold the reduced values from the end of step 5 on; the vote
   decides whether the caller uses them.

Bytes per participant with ``m`` participants and payload ``S``: up ``S + S/m``, down
``2·(m−1)/m·S`` (plus small headers), independent of the world size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from crf_diloco.errors import (
    AllReduceError,
    CorruptObjectError,
    RoundAbortedError,
    RoundDesyncError,
    RoundTimeoutError,
)
from crf_diloco.layout import LAYOUT_VERSION, RoundKeys, parse_round_dir, validate_name
from crf_diloco.replica_env import ENV_RANK, ENV_RUN_ID, ENV_URI, ENV_WORLD_SIZE
from crf_diloco.store import ObjectStore
from crf_diloco.wire import (
    CODECS,
    Header,
    ShardPlan,
    decode_reduced,
    encode_payload,
    encode_reduced,
    read_header,
    read_payload_shard,
    wire_roundtrip,
)

__all__ = ["ENV_RANK", "ENV_RUN_ID", "ENV_URI", "ENV_WORLD_SIZE", "ObjectStoreAllReduce", "RoundInfo"]


logger = logging.getLogger(__name__)
TensorOrList = TypeVar("TensorOrList", torch.Tensor, Sequence[torch.Tensor])
Compression = Literal["bf16", "int8"]
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_UNSET: Any = object()


@dataclass
class RoundInfo:
    """What this replica knows about the last round it took part in."""

    round_id: int
    outcome: Literal["commit", "abort", "passthrough", "pending"]
    participants: list[int] = field(default_factory=list)
    participated: bool = False
    reason: str = ""


@dataclass
class _OpenRound:
    """A round whose data phase is done and whose decision waits for the vote."""

    keys: RoundKeys
    quorum: dict[str, Any]
    participated: bool


class _Abort(Exception):
    """Internal: this replica wants the round aborted (reason in args[0])."""


class ObjectStoreAllReduce:
    """Allreduce over an fsspec object store, one fenced round per :meth:`allreduce` call.

    Args:
        uri: fsspec URI of the rendezvous prefix: a bare path, ``file://``, ``memory://``,
            ``s3://``, ``gs://``, ``az://``, ``hf://``… Local directories are created at once.
        rank: this replica's rank, ``0 <= rank < world_size``.
        world_size: number of replicas launched; ``1`` passes through without any I/O.
        run_id: name of the run under ``uri`` (a plain name; anything that could escape is rejected).
        timeout: seconds each wait of the data phase may take before the round aborts.
        quorum_timeout: seconds to wait for expected replicas to announce (default: ``timeout``).
        compression: ``None`` (fp32 on the wire), ``"bf16"`` or ``"int8"`` (row-wise scales).
            The reduction itself is always fp32.
        storage_options: fsspec options (e.g. ``{"endpoint_url": ...}``, credentials).
        min_participants: a quorum with fewer participants aborts the round.
        poll_interval: longest sleep between two polls of the store (seconds).
        straggler_grace: seconds into the data phase after which any replica covers a missing
            reduced shard (default ``timeout / 3``).
        keep_rounds: round directories older than this many rounds are deleted by the lowest
            participant after each decision.
        retries: extra attempts per store operation on transient errors.
        preflight: if True, resolve the adapter and write/read/delete a probe object now.
    """

    def __init__(
        self,
        uri: str,
        rank: int,
        world_size: int,
        *,
        run_id: str = "default",
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
        if compression not in (None, "bf16", "int8"):
            raise ValueError(f"compression must be None, 'bf16' or 'int8', got {compression!r}")
        if not 1 <= min_participants <= world_size:
            raise ValueError(f"min_participants must be in [1, world_size={world_size}], got {min_participants!r}")
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be >= 1, got {keep_rounds!r}")
        self.uri = uri
        self.rank = rank
        self.world_size = world_size
        self.run_id = validate_name(run_id, "run_id")
        self.timeout = float(timeout)
        self.quorum_timeout = float(quorum_timeout) if quorum_timeout is not None else self.timeout
        self.compression: Compression | None = compression
        self.min_participants = min_participants
        self.poll_interval = float(poll_interval)
        self.straggler_grace = float(straggler_grace) if straggler_grace is not None else self.timeout / 3
        self.keep_rounds = keep_rounds
        self.round_id = 0
        self.incarnation = uuid.uuid4().hex
        self.last_round: RoundInfo | None = None
        self.store = ObjectStore(f"{uri.rstrip('/')}/{self.run_id}", storage_options, retries=retries)
        self._joined = False
        self._layout_ok = False
        self._expected: set[int] | None = None
        self._open: list[_OpenRound] = []
        self._closed = False
        if preflight:
            self.preflight()

    # -- construction helpers ---------------------------------------------------------------
    @classmethod
    def from_env(cls, **kwargs: Any) -> ObjectStoreAllReduce:
        """Build from ``CRF_DILOCO_URI``, ``CRF_DILOCO_RANK``, ``CRF_DILOCO_WORLD_SIZE`` and
        ``CRF_DILOCO_RUN_ID`` (optional, default ``"default"``); ``kwargs`` override or extend them."""
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
        if ENV_URI in os.environ:
            params["uri"] = os.environ[ENV_URI]
        if ENV_RUN_ID in os.environ:
            params["run_id"] = os.environ[ENV_RUN_ID]
        params.update(kwargs)
        return cls(**params)

    def preflight(self) -> None:
        """Fail now, not at the first round, if the adapter is missing or the store unusable."""
        if self.world_size > 1:
            self.store.preflight()

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.store.bytes_written

    def close(self) -> None:
        """Mark the instance closed; further rounds raise."""
        self._closed = True

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
            tensors: one tensor or a sequence of tensors (fp32, fp16 or bf16, any shape, any
                device; reduced as one flat fp32 payload).
            op: ``"avg"`` (sum / number of participants) or ``"sum"``.
            compression: override the instance's wire compression for this round.
            participate: False to only read the round's result (a healing replica).
            name: optional label; every replica of the round must pass the same one.
            defer_decision: leave the round open after the data phase: ``tensors`` hold the
                reduced values, and :meth:`vote` later decides (store-wide) whether the round
                commits. Every replica of the round must pass the same value.

        Raises:
            RoundAbortedError, RoundTimeoutError, CorruptObjectError, RoundDesyncError (all
            :class:`AllReduceError`): the round did not commit here; inputs are unchanged.
        """
        if self._closed:
            raise AllReduceError("ObjectStoreAllReduce is closed")
        tensor_list = _as_tensor_list(tensors)
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        codec = _codec(self.compression if compression is _UNSET else compression)
        if name is not None:
            validate_name(name, "name")
        if not isinstance(defer_decision, bool):
            raise TypeError(f"defer_decision must be a bool, got {type(defer_decision).__name__}")
        if self.world_size == 1:
            self.last_round = RoundInfo(self.round_id, "passthrough", [self.rank], True)
            self.round_id += 1
            return tensors
        self._join()
        flat = _flatten(tensor_list)
        round_id = self.round_id
        try:
            pieces = self._run_round(round_id, flat, op, codec, participate, name, defer_decision)
        finally:
            self.round_id = round_id + 1
        _write_back(tensor_list, pieces)
        return tensors

    def abort(self, reason: str, *, participate: bool = True) -> None:
        """Veto the next round (a false vote cast before its data phase) and skip it; never raises
        :class:`RoundAbortedError`.

        The veto is announced in the round's member records; the round is aborted for everyone as
        soon as its membership is settled (every expected replica announced, or the quorum deadline
        passed), so a peer that has not joined yet cannot skip the decided round and run the next
        one alone. A veto that arrives after the quorum formed is late (this replica is not a
        participant) and leaves the round to its participants. ``participate=False`` (an observing
        replica) skips the round without any I/O.
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
        quorum: dict[str, Any] | None = None
        try:
            if self._read_json(keys.decision) is None:
                quorum = self._await_quorum(keys, self._announce(keys, None, True, veto=reason))
            late = f"rank {self.rank}'s veto came after round {round_id} was settled without it: {reason}"
            self._finish(keys, quorum, "abort", late, participated=False)
        except RoundAbortedError as exc:
            self._finish(keys, None, "abort", str(exc), participated=False)
        except (_Abort, AllReduceError) as exc:
            # membership settled with our veto (or local trouble): abort the round for everyone
            why = exc.args[0] if exc.args else repr(exc)
            decision = self._write_decision(keys, "abort", f"rank {self.rank}: {why}", None)
            self._finish(keys, None, "abort", str(decision.get("reason", "")), participated=False)
        finally:
            self.round_id = round_id + 1

    @property
    def open_rounds(self) -> list[int]:
        """Rounds run with ``defer_decision=True`` whose decision waits for :meth:`vote`."""
        return [o.keys.round_id for o in self._open]

    def vote(self, ok: bool, reason: str = "") -> bool:
        """Vote on every open round (in order) and return True iff all of them committed.

        A participant creates ``votes/{rank}.json``; the first replica able to decide creates the
        round's decision: ``commit`` when every participant voted true, ``abort`` when one voted
        false or ``timeout`` passed with votes missing. Every replica follows that decision, so the
        result is the same on all participants. Observers do not vote, they wait for the decision.
        Once a round aborts, this replica votes false on the rest. True when no round is open.
        Store trouble counts as not committed here (the round may still commit elsewhere; this
        replica is then behind and ``MockManager`` heals it). No I/O when no round is open.
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

    def latest_committed_round(self) -> int | None:
        """Highest round id whose decision in the store is ``commit`` (among retained rounds)."""
        for r in sorted(self._round_ids(), reverse=True):
            decision = self._read_json(RoundKeys(r).decision)
            if decision is not None and decision.get("outcome") == "commit":
                return r
        return None

    # -- round machinery ------------------------------------------------------------------------
    def _round_ids(self) -> list[int]:
        return sorted(r for r in (parse_round_dir(n) for n in self.store.list_names("")) if r is not None)

    def frontier(self) -> int:
        """The round replicas are in now: the newest round if undecided, else the one after it
        (never less than this instance's ``round_id``)."""
        self._check_layout()
        rounds = self._round_ids()
        frontier = self.round_id
        if rounds:
            last = rounds[-1]
            decided = self.store.exists(RoundKeys(last).decision)
            frontier = max(frontier, last + 1 if decided else last)
        return frontier

    def join(self, round_id: int | None = None) -> int:
        """Set the next round to ``round_id`` (default: the :meth:`frontier`) and return it.

        A new instance joins the frontier by itself at its first round, which skips rounds decided
        by an earlier run under the same ``run_id``; call this to choose the round explicitly.
        """
        if round_id is not None and round_id < 0:
            raise ValueError(f"round_id must be >= 0, got {round_id}")
        self.round_id = self.frontier() if round_id is None else round_id
        self._joined = True
        return self.round_id

    def _join(self) -> None:
        if not self._joined:
            self.join()

    def _check_layout(self) -> None:
        if self._layout_ok:
            return
        marker = json.dumps({"layout": "crf-diloco", "version": LAYOUT_VERSION}).encode()
        if not self.store.put_create("LAYOUT", marker):
            found = self._read_json("LAYOUT")
            if not found or found.get("version") != LAYOUT_VERSION:
                raise AllReduceError(
                    f"{self.store.uri!r} holds a crf-diloco layout {found!r}; this version writes layout "
                    f"{LAYOUT_VERSION}. Use a new run_id or a matching crf-diloco version."
                )
        self._layout_ok = True

    def _read_json(self, key: str) -> dict[str, Any] | None:
        blob = self.store.try_get(key)
        if blob is None:
            return None
        try:
            obj = json.loads(blob)
        except ValueError as exc:
            raise CorruptObjectError(f"{key}: not valid JSON") from exc
        if not isinstance(obj, dict):
            raise CorruptObjectError(f"{key}: expected a JSON object")
        return obj

    def _sleep(self, attempt: int) -> None:
        time.sleep(min(self.poll_interval, 0.002 * 1.5 ** min(attempt, 20)) * (0.75 + 0.5 * random.random()))

    def _write_decision(self, keys: RoundKeys, outcome: str, reason: str, token: str | None) -> dict[str, Any]:
        """Create the round's decision (first writer wins) and return the one that stands."""
        record = {"outcome": outcome, "reason": reason, "by": self.rank, "round": keys.round_id, "token": token}
        with contextlib.suppress(AllReduceError):  # the read below decides whose decision stands
            self.store.put_create(keys.decision, json.dumps(record).encode())
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            try:
                found = self._read_json(keys.decision)
            except AllReduceError:
                found = None
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise RoundTimeoutError(f"round {keys.round_id}: could neither write nor read its decision object")
            self._sleep(attempt)
            attempt += 1

    def _check_decided(self, keys: RoundKeys) -> None:
        decision = self._read_json(keys.decision)
        if decision is not None and decision.get("outcome") == "abort":
            raise RoundAbortedError(f"round {keys.round_id} aborted: {decision.get('reason', '')}")

    def _run_round(
        self,
        round_id: int,
        flat: torch.Tensor,
        op: str,
        codec: str,
        participate: bool,
        name: str | None,
        defer: bool,
    ) -> list[torch.Tensor]:
        keys = RoundKeys(round_id)
        spec = {"numel": flat.numel(), "codec": codec, "op": op, "name": name, "vote": defer}
        quorum: dict[str, Any] | None = None
        try:
            decision = self._read_json(keys.decision)
            if decision is not None:
                if decision.get("outcome") != "commit":
                    raise RoundAbortedError(f"round {round_id} aborted: {decision.get('reason', '')}")
                quorum = self._read_json(keys.quorum)
                if quorum is None:
                    raise CorruptObjectError(f"round {round_id} committed without a quorum record")
                quorum = _checked_quorum(quorum, keys)
                return self._follow_commit(keys, quorum, spec, decision)
            stale_self = self._announce(keys, spec, participate)
            quorum = self._await_quorum(keys, stale_self)
            return self._data_phase(keys, quorum, flat, spec, defer)
        except RoundAbortedError:
            self._finish(keys, quorum, "abort", "")
            raise
        except (RoundDesyncError, RoundTimeoutError):
            raise
        except (_Abort, AllReduceError) as exc:
            # local trouble (deadline, corrupt/stale object, store errors): vote abort, follow the decision
            reason = exc.args[0] if exc.args else repr(exc)
            token = quorum.get("token") if quorum else None
            decision = self._write_decision(keys, "abort", f"rank {self.rank}: {reason}", token)
            if decision.get("outcome") == "commit" and quorum is not None:
                return self._follow_commit(keys, quorum, spec, decision)
            self._finish(keys, quorum, "abort", str(decision.get("reason", "")))
            raise RoundAbortedError(f"round {round_id} aborted: {decision.get('reason', '')}") from None

    def _announce(
        self, keys: RoundKeys, spec: dict[str, Any] | None, participate: bool, veto: str | None = None
    ) -> bool:
        """Create this replica's member record. Returns True if a record of another incarnation of
        this rank is already there (a stale round, or our own previous life)."""
        record = {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "spec": spec,
            "observer": not participate,
            "veto": veto,
        }
        if self.store.put_create(keys.member(self.rank), json.dumps(record).encode()):
            return False
        existing = self._read_json(keys.member(self.rank))
        return existing is None or existing.get("incarnation") != self.incarnation

    def _await_quorum(self, keys: RoundKeys, stale_self: bool) -> dict[str, Any]:
        deadline = time.monotonic() + self.quorum_timeout
        members: dict[int, dict[str, Any]] = {}
        attempt = 0
        while True:
            quorum = self._read_json(keys.quorum)
            if quorum is not None:
                return _checked_quorum(quorum, keys)
            self._check_decided(keys)
            if stale_self:
                raise _Abort(f"round {keys.round_id} holds a member record of another incarnation of rank {self.rank}")
            for entry in self.store.list_names(keys.members_dir):
                rank = _rank_of(entry)
                if rank is not None and rank not in members:
                    record = self._read_json(f"{keys.members_dir}/{entry}")
                    if record is not None:
                        members[rank] = record
            announced = {r for r, m in members.items() if not m.get("observer")}
            expected = self._expected if self._expected is not None else set(range(self.world_size))
            if expected <= announced or time.monotonic() > deadline:
                self._propose_quorum(keys, members, announced)
                continue
            self._sleep(attempt)
            attempt += 1

    def _propose_quorum(self, keys: RoundKeys, members: dict[int, dict[str, Any]], announced: set[int]) -> None:
        if len(announced) < self.min_participants:
            raise _Abort(
                f"only {len(announced)} replica(s) announced before the quorum deadline "
                f"({self.quorum_timeout:.1f}s), min_participants={self.min_participants}"
            )
        participants = sorted(announced)
        vetoes = [
            f"rank {r} vetoed round {keys.round_id}: {members[r]['veto']}"
            for r in participants
            if members[r].get("veto")
        ]
        if vetoes:
            raise _Abort("; ".join(vetoes))
        specs = {json.dumps(members[r]["spec"], sort_keys=True) for r in participants}
        if len(specs) != 1:
            detail = {r: members[r]["spec"] for r in participants}
            raise _Abort(f"replicas disagree on the payload of round {keys.round_id}: {detail}")
        spec = members[participants[0]]["spec"]
        plan = ShardPlan.build(int(spec["numel"]), str(spec["codec"]), len(participants))
        record = {
            "round": keys.round_id,
            "token": uuid.uuid4().hex,
            "participants": participants,
            "incarnations": {str(r): members[r]["incarnation"] for r in participants},
            "spec": spec,
            "plan": plan.to_json(),
            "by": self.rank,
        }
        self.store.put_create(keys.quorum, json.dumps(record).encode())

    def _data_phase(
        self, keys: RoundKeys, quorum: dict[str, Any], flat: torch.Tensor, spec: dict[str, Any], defer: bool
    ) -> list[torch.Tensor]:
        participants = [int(r) for r in quorum["participants"]]
        plan = ShardPlan.from_json(quorum["plan"])
        token = str(quorum["token"])
        if quorum.get("spec") != spec:
            raise _Abort(f"this replica's payload {spec} differs from the round's {quorum.get('spec')}")
        start = time.monotonic()
        deadline = start + self.timeout
        mine = self.rank in participants
        if mine and quorum["incarnations"].get(str(self.rank)) != self.incarnation:
            if not self.store.exists(keys.data(self.rank)):
                raise _Abort(f"round {keys.round_id} lists rank {self.rank} from an incarnation that is gone")
            mine = False
        local: dict[int, torch.Tensor] = {}
        if mine:
            meta = {"token": token, "rank": str(self.rank), "round": str(keys.round_id)}
            blob = encode_payload(flat, plan, meta)
            if not self.store.put_create(keys.data(self.rank), blob):
                header = read_header(self.store, keys.data(self.rank))
                if header.metadata.get("token") != token:
                    raise _Abort(f"{keys.data(self.rank)} exists from another round attempt")
            del blob
            shard = participants.index(self.rank)
            local[shard] = self._reduce_shard(keys, quorum, plan, shard, deadline, own=flat)
        pieces = self._gather(keys, quorum, plan, deadline, start, local, own=flat if mine else None)
        if defer:
            self._open.append(_OpenRound(keys, quorum, mine))
            self.last_round = RoundInfo(keys.round_id, "pending", participants, mine)
            return pieces
        decision = self._write_decision(keys, "commit", "", token)
        if decision.get("outcome") != "commit":
            raise RoundAbortedError(f"round {keys.round_id} aborted: {decision.get('reason', '')}")
        self._finish(keys, quorum, "commit", "")
        return pieces

    def _settle(self, open_round: _OpenRound, ok: bool, reason: str) -> bool:
        """Cast this replica's vote on an open round, then decide or follow; True iff it committed."""
        keys, quorum = open_round.keys, open_round.quorum
        token = str(quorum["token"])
        participants = [int(r) for r in quorum["participants"]]
        try:
            if open_round.participated:
                record = {
                    "rank": self.rank,
                    "ok": ok,
                    "reason": reason,
                    "token": token,
                    "incarnation": self.incarnation,
                }
                self.store.put_create(keys.vote(self.rank), json.dumps(record).encode())
            decision = self._await_votes(keys, participants, token, ok, reason)
        except (_Abort, AllReduceError) as exc:
            why = exc.args[0] if exc.args else repr(exc)
            try:
                decision = self._write_decision(keys, "abort", f"rank {self.rank}: {why}", token)
            except AllReduceError as final:
                logger.warning("round %d: could not settle its vote: %s", keys.round_id, final)
                self._finish(keys, quorum, "abort", str(final), participated=open_round.participated)
                return False
        outcome: Literal["commit", "abort"] = "commit" if decision.get("outcome") == "commit" else "abort"
        self._finish(keys, quorum, outcome, str(decision.get("reason", "")), participated=open_round.participated)
        return outcome == "commit"

    def _await_votes(
        self, keys: RoundKeys, participants: list[int], token: str, ok: bool, reason: str
    ) -> dict[str, Any]:
        """Poll the round's votes until a decision stands (writing it when this replica can decide)."""
        if not ok:
            return self._write_decision(keys, "abort", f"rank {self.rank} voted to abort: {reason}", token)
        deadline = time.monotonic() + self.timeout
        votes: dict[int, dict[str, Any]] = {}
        attempt = 0
        while True:
            decision = self._read_json(keys.decision)
            if decision is not None:
                return decision
            for entry in self.store.list_names(keys.votes_dir):
                rank = _rank_of(entry)
                if rank in participants and rank not in votes:
                    record = self._read_json(keys.vote(rank))
                    if record is not None:
                        if record.get("token") != token:
                            raise _Abort(f"{keys.vote(rank)} belongs to another round attempt (stale object)")
                        votes[rank] = record
            against = sorted(r for r, v in votes.items() if v.get("ok") is not True)
            if against:
                why = "; ".join(f"rank {r} voted to abort: {votes[r].get('reason', '')}" for r in against)
                return self._write_decision(keys, "abort", why, token)
            if len(votes) == len(participants):
                return self._write_decision(keys, "commit", "", token)
            if time.monotonic() > deadline:
                missing = sorted(set(participants) - set(votes))
                return self._write_decision(
                    keys, "abort", f"votes of ranks {missing} did not appear within {self.timeout:.1f}s", token
                )
            self._sleep(attempt)
            attempt += 1

    def _reduce_shard(
        self,
        keys: RoundKeys,
        quorum: dict[str, Any],
        plan: ShardPlan,
        shard: int,
        deadline: float,
        own: torch.Tensor | None,
    ) -> torch.Tensor:
        """Sum shard ``shard`` over all participants in order, create its object, return its decoded values."""
        participants = [int(r) for r in quorum["participants"]]
        token = str(quorum["token"])
        lo, hi = plan.elem_range(shard)
        acc = torch.zeros(hi - lo, dtype=torch.float32)
        for r in participants:
            if r == self.rank and own is not None:
                acc += wire_roundtrip(own[lo:hi], plan.codec)  # exactly what others decode from our object
                continue
            header = self._await_header(keys, keys.data(r), token, deadline)
            try:
                acc += read_payload_shard(self.store, keys.data(r), header, plan, shard)
            except CorruptObjectError as exc:
                raise _Abort(str(exc)) from exc
        if quorum["spec"]["op"] == "avg":
            acc /= len(participants)
        meta = {"token": token, "round": str(keys.round_id), "contributors": json.dumps(participants)}
        blob, decoded = encode_reduced(acc, plan, shard, meta)
        self.store.put_create(keys.reduced(shard), blob)
        return decoded

    def _await_header(self, keys: RoundKeys, key: str, token: str, deadline: float) -> Header:
        attempt = 0
        while True:
            try:
                header = read_header(self.store, key)
            except FileNotFoundError:
                header = None
            except CorruptObjectError as exc:
                raise _Abort(str(exc)) from exc
            if header is not None:
                if header.metadata.get("token") != token:
                    raise _Abort(f"{key} belongs to another round attempt (stale object)")
                return header
            self._check_decided(keys)
            if time.monotonic() > deadline:
                raise _Abort(f"{key} did not appear within {self.timeout:.1f}s")
            self._sleep(attempt)
            attempt += 1

    def _gather(
        self,
        keys: RoundKeys,
        quorum: dict[str, Any],
        plan: ShardPlan,
        deadline: float,
        start: float,
        local: dict[int, torch.Tensor],
        own: torch.Tensor | None,
        cover: bool = True,
    ) -> list[torch.Tensor]:
        token = str(quorum["token"])
        shards = dict(local)
        attempt = 0
        while len(shards) < plan.n_shards:
            for k in range(plan.n_shards):
                if k in shards:
                    continue
                blob = self.store.try_view(keys.reduced(k))
                if blob is None:
                    continue
                try:
                    shards[k] = decode_reduced(blob, plan, k, keys.reduced(k), token)[0]
                except CorruptObjectError as exc:
                    raise _Abort(str(exc)) from exc
            if len(shards) == plan.n_shards:
                break
            self._check_decided(keys)
            now = time.monotonic()
            if now > deadline:
                missing = sorted(set(range(plan.n_shards)) - set(shards))
                raise _Abort(f"reduced shards {missing} did not appear within {self.timeout:.1f}s")
            if cover and now - start > self.straggler_grace:
                k = min(set(range(plan.n_shards)) - set(shards))
                shards[k] = self._reduce_shard(keys, quorum, plan, k, deadline, own)
                continue
            self._sleep(attempt)
            attempt += 1
        return [shards[k] for k in range(plan.n_shards)]

    def _follow_commit(
        self, keys: RoundKeys, quorum: dict[str, Any], spec: dict[str, Any], decision: dict[str, Any]
    ) -> list[torch.Tensor]:
        """The round committed: read its result (reduced shards are immutable and verified)."""
        if quorum.get("spec") != spec:
            raise AllReduceError(
                f"round {keys.round_id} committed a payload {quorum.get('spec')} that differs from this replica's {spec}"
            )
        plan = ShardPlan.from_json(quorum["plan"])
        now = time.monotonic()
        try:
            pieces = self._gather(keys, quorum, plan, now + self.timeout, now, {}, None, cover=False)
        except (_Abort, AllReduceError) as exc:
            self._finish(keys, quorum, "commit", "")
            raise RoundDesyncError(
                f"round {keys.round_id} committed but this replica could not read its result: {exc}"
            ) from None
        self._finish(keys, quorum, "commit", str(decision.get("reason", "")), participated=False)
        return pieces

    def _finish(
        self,
        keys: RoundKeys,
        quorum: dict[str, Any] | None,
        outcome: Literal["commit", "abort"],
        reason: str,
        participated: bool | None = None,
    ) -> None:
        participants = [int(r) for r in quorum["participants"]] if quorum else []
        if participated is None:
            participated = self.rank in participants
        self.last_round = RoundInfo(keys.round_id, outcome, participants, participated, reason)
        try:
            names = self.store.list_names(keys.members_dir)
        except AllReduceError:
            names = []
        announced = {r for r in (_rank_of(n) for n in names) if r is not None}
        self._expected = (set(participants) | announced) or None
        if participants and self.rank == min(participants) and keys.round_id >= self.keep_rounds:
            self.store.remove_tree(RoundKeys(keys.round_id - self.keep_rounds).prefix)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The round's flat fp32 payload (a view, without a copy, for one contiguous fp32 CPU tensor)."""
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])


def _write_back(tensors: list[torch.Tensor], pieces: list[torch.Tensor]) -> None:
    """Copy the concatenation of ``pieces`` (fp32) into ``tensors`` in order, casting to their dtype."""
    with torch.no_grad():
        only = tensors[0]
        if len(tensors) == 1 and only.dtype == torch.float32 and only.is_contiguous() and only.device.type == "cpu":
            torch.cat(pieces, out=only.view(-1))
            return
        flat = torch.cat(pieces)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view(t.shape))
            offset += n


def _checked_quorum(quorum: dict[str, Any], keys: RoundKeys) -> dict[str, Any]:
    """The quorum record, after checking the fields the protocol relies on."""
    try:
        participants = [int(r) for r in quorum["participants"]]
        ok = (
            participants == sorted(set(participants))
            and isinstance(quorum["token"], str)
            and isinstance(quorum["incarnations"], dict)
            and isinstance(quorum["spec"], dict)
            and ShardPlan.from_json(quorum["plan"]).n_shards == len(participants)
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(f"{keys.quorum}: malformed quorum record ({exc!r})") from exc
    if not ok:
        raise CorruptObjectError(f"{keys.quorum}: inconsistent quorum record {quorum!r}")
    return quorum


def _rank_of(entry: str) -> int | None:
    stem = entry.rsplit("/", 1)[-1]
    if not stem.endswith(".json"):
        return None
    try:
        return int(stem[: -len(".json")])
    except ValueError:
        return None


def _codec(compression: str | None) -> str:
    codec = "fp32" if compression is None else compression
    if codec not in CODECS or (codec == "fp32" and compression is not None):
        raise ValueError(f"compression must be None, 'bf16' or 'int8', got {compression!r}")
    return codec


def _as_tensor_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    tensor_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not tensor_list:
        raise ValueError("allreduce needs at least one tensor")
    for i, t in enumerate(tensor_list):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"tensors[{i}] has dtype {t.dtype}; ObjectStoreAllReduce reduces float32, float16 and "
                "bfloat16 tensors (cast others first)"
            )
    if sum(t.numel() for t in tensor_list) == 0:
        raise ValueError("allreduce needs at least one element across its tensors")
    return tensor_list
