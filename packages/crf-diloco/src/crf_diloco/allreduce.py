"""`ObjectStoreAllReduce`: allreduce through nothing but an object store.

This module is the public API and the order of a round's phases; each phase lives in its own module of
:mod:`crf_diloco.rounds` (``round``: the `Round` record and `poll_until`; ``quorum``; ``reduce``: contribute and
reduce-scatter; ``gather``; ``vote``: decisions and votes; ``frontier``: joining and collection), and healing with
state snapshots in :mod:`crf_diloco.healing`.

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
import dataclasses
import logging
import os
from collections.abc import Sequence
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
from crf_diloco.layout import RoundKeys, validate_name
from crf_diloco.payload import as_tensor_list, codec_of, count_nonfinite, dtype_runs, flatten, write_back
from crf_diloco.records import DecisionRecord, MemberRecord, PayloadSpec, QuorumRecord, ranks_named
from crf_diloco.replica_env import ENV_RANK, ENV_RUN_ID, ENV_SECRET, ENV_URI, ENV_WORLD_SIZE
from crf_diloco.rounds import frontier as run_frontier
from crf_diloco.rounds import quorum as quorum_phase
from crf_diloco.rounds import reduce as reduce_phase
from crf_diloco.rounds import vote as vote_phase
from crf_diloco.rounds.feedback import parse_stream_key, residual_of, stream_key
from crf_diloco.rounds.gather import gather
from crf_diloco.rounds.peer import Peer
from crf_diloco.rounds.round import Round, RoundFailure, RoundSettings, why
from crf_diloco.snapshots import StateSnapshots
from crf_diloco.store import ObjectStore, validate_uri
from crf_diloco.wire import decode_payload_blob, encode_payload

__all__ = ["ObjectStoreAllReduce", "RoundInfo"]


logger = logging.getLogger(__name__)
TensorOrList = TypeVar("TensorOrList", torch.Tensor, Sequence[torch.Tensor])
#: ``"bf16"``, ``"int8"``, ``"int4"``, ``"int4:<block>"``, ``"topk"`` or ``"topk:<k>/<block>"`` (`crf_diloco.wire.parse_codec`)
Compression = str
_UNSET: Any = object()


@dataclass(frozen=True)
class RoundInfo:
    """What this replica knows about the last round it took part in."""

    round_id: int
    outcome: Literal["commit", "abort", "passthrough", "pending"]
    participants: list[int] = field(default_factory=list)
    participated: bool = False
    reason: str = ""


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
        poll_interval: longest sleep between two polls of the store (seconds); default 0.01 on a local folder or
            ``memory://`` (a poll costs microseconds there), 0.05 elsewhere (each poll is a request).
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
        poll_interval: float | None = None,
        straggler_grace: float | None = None,
        keep_rounds: int = 2,
        retries: int = 3,
        preflight: bool = False,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        for label, value in (("timeout", timeout), ("poll_interval", 1.0 if poll_interval is None else poll_interval)):
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
        self.straggler_grace = float(straggler_grace) if straggler_grace is not None else self.timeout / 3
        self.keep_rounds = keep_rounds
        self.round_id = 0
        self.last_round: RoundInfo | None = None
        self.store = ObjectStore(f"{uri.rstrip('/')}/{self.run_id}", storage_options, retries=retries)
        self._peer = Peer(self.store, self.auth, rank, world_size)
        if poll_interval is None:
            poll_interval = 0.01 if self.store.protocol in ("file", "local", "memory") else 0.05
        self.poll_interval = float(poll_interval)
        self._snapshots: StateSnapshots | None = None
        self._store_checked = False
        self._layout_ok = False
        self._expected: set[int] | None = None
        self._announcers: tuple[QuorumRecord | None, concurrent.futures.Future[set[int]] | None] | None = None
        self._open: list[Round] = []
        self._closed = False
        self._residuals: dict[str, torch.Tensor] = {}
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
    def incarnation(self) -> str:
        """This process's nonce: a restarted replica is another incarnation of its rank."""
        return self._peer.incarnation

    @property
    def _pool(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """The background writer threads (``None`` until the first background write)."""
        return self._peer.pool

    def snapshots(self) -> StateSnapshots:
        """The run's global state snapshots (``state/r{round}.safetensors`` and their parts), authenticated with its
        secret; what `MockManager` writes after a commit and a replica that is behind heals from
        (:mod:`crf_diloco.healing`)."""
        if self._snapshots is None:
            self._snapshots = StateSnapshots(self.store, self.auth, run=self._peer.concurrently)
        return self._snapshots

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.store.bytes_written

    def close(self) -> None:
        """Mark the instance closed (further rounds raise), finish background work, free buffers."""
        self._closed = True
        self._peer.close()

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
        flat = flatten(tensor_list, self._peer.scratch)
        spec = PayloadSpec(flat.numel(), codec, op, name, defer_decision, dtype_runs(tensor_list))
        residual = self._residual_for(stream_key(spec)) if participate else None
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
        rnd = Round(RoundKeys(round_id), self._settings(), spec, participate)
        try:
            result = self._run_round(rnd, flat)
        finally:
            self.round_id = round_id + 1
        write_back(tensor_list, result)
        return tensors

    def _veto_for(self, flat: torch.Tensor) -> str | None:
        """Why this replica must veto its contribution (NaN/inf in it), or ``None``."""
        bad = count_nonfinite(flat)
        return f"rank {self.rank}'s contribution has {bad} NaN/inf value(s)" if bad else None

    def _settings(self) -> RoundSettings:
        return RoundSettings(self.timeout, self.quorum_timeout, self.poll_interval, self.straggler_grace,
                             self.min_participants, self.keep_rounds)  # fmt: skip

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
            numel = parse_stream_key(key)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.shape != (numel,):
                raise ValueError(f"residual {key!r} must be a 1-D float32 tensor of {numel} elements")
            if count_nonfinite(value):
                raise ValueError(f"residual {key!r} holds NaN/inf values; drop it (start that stream from zero)")
            loaded[key] = value.detach().to("cpu").clone()
        self._residuals = loaded

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

    # -- vetoes and votes -------------------------------------------------------------------------
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
        rnd = Round(RoundKeys(round_id), self._settings(), None, True)
        try:
            if self.read_decision(round_id) is None:
                rnd.quorum = self._await_quorum(rnd.keys, self._announce(rnd.keys, None, True, veto=reason))
            late = f"rank {self.rank}'s veto came after round {round_id} was settled without it: {reason}"
            self._finish(rnd, "abort", late, participated=False)
        except RoundAbortedError as exc:
            self._finish(dataclasses.replace(rnd, quorum=None), "abort", str(exc), participated=False)
        except AllReduceError as exc:
            # membership settled with our veto (or local trouble): abort the round for everyone
            decision = self._write_decision(rnd.keys, "abort", f"rank {self.rank}: {why(exc)}", None, decide=True)
            self._finish(dataclasses.replace(rnd, quorum=None), "abort", decision.reason, participated=False)
        finally:
            self.round_id = round_id + 1

    @property
    def open_rounds(self) -> list[int]:
        """Rounds run with ``defer_decision=True`` whose decision waits for :meth:`vote`."""
        return [o.round_id for o in self._open]

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
                reason_here = f"an earlier round of this sync (before round {open_round.round_id}) aborted"
            else:
                reason_here = reason
            committed = self._settle(open_round, ok and committed, reason_here) and committed
        return committed

    # -- where the run is ----------------------------------------------------------------------------
    def read_decision(self, round_id: int) -> DecisionRecord | None:
        """The decision of ``round_id`` as stored (``None`` if undecided). A decision object that is malformed or
        fails authentication reads as ``abort`` (it can never be replaced, and nobody may adopt it)."""
        return self._peer.read_decision(round_id)

    def read_quorum(self, round_id: int) -> QuorumRecord | None:
        """The quorum record of ``round_id`` (``None`` if not formed); `CorruptObjectError` if it is not authentic."""
        return self._peer.read_quorum(round_id)

    def latest_committed_round(self) -> int | None:
        """Highest round id whose authentic decision in the store is ``commit``: among the listed rounds and those a
        lagging listing does not show yet (found by reading the decisions after the newest listed round)."""
        return run_frontier.latest_committed_round(self._peer)

    def frontier(self) -> int:
        """The round replicas are in now (never less than this instance's ``round_id``), from authenticated objects
        only (`crf_diloco.rounds.frontier.frontier`); directories planted by name (``r99999999/...``) are ignored."""
        self._check_layout()
        return run_frontier.frontier(self._peer, self.round_id)

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
        self._peer.needs_join = False
        return self.round_id

    def _join(self) -> None:
        if self._peer.needs_join:
            self.join()

    def _write_record(self, key: str, record: Any) -> bool:
        """Create the sealed record at ``key`` (`crf_diloco.rounds.peer.Peer.write_record`); False if one existed."""
        return self._peer.write_record(key, record)

    def _check_layout(self) -> None:
        if not self._layout_ok:
            run_frontier.check_layout(self._peer)
            self._layout_ok = True

    # -- one round: the phases in order -----------------------------------------------------------
    def _run_round(self, rnd: Round, flat: torch.Tensor) -> torch.Tensor:
        try:
            decision = self.read_decision(rnd.round_id)
            if decision is not None:  # decided before this replica came
                return self._join_decided(rnd, decision)
            mine = self._announce(rnd.keys, rnd.spec, rnd.participate)
            rnd.quorum = self._await_quorum(rnd.keys, mine)
            return self._data_phase(rnd, flat)
        except AllReduceError as exc:
            return self._conclude(rnd, exc)

    def _conclude(self, rnd: Round, exc: AllReduceError) -> torch.Tensor:
        """What a failed round means here. The store decided ``abort``: follow it. A commit this replica cannot read
        (`RoundDesyncError`) or a decision it cannot read (`RoundTimeoutError`): raise it. Anything else is trouble
        of this replica (a deadline, a corrupt, forged or stale object, a store error): write ``abort`` if it may
        decide, and follow the decision that stands (another participant may have committed the round)."""
        if isinstance(exc, RoundAbortedError):
            self._finish(rnd, "abort", "")
            raise exc
        if isinstance(exc, (RoundDesyncError, RoundTimeoutError)):
            raise exc
        quorum = rnd.quorum
        may_decide = rnd.participate and (quorum is None or self.rank in quorum.participants)
        reason = f"rank {self.rank}: {why(exc)}"
        decision = self._write_decision(rnd.keys, "abort", reason, rnd.token, decide=may_decide)
        if quorum is not None and vote_phase.stands(decision, quorum):
            result = self._follow_commit(rnd, decision)
            if self.rank in quorum.participants:  # our payload went into the committed round
                self._apply_staged(rnd.staged)
            return result
        self._finish(rnd, "abort", decision.reason)
        corrupt = exc if isinstance(exc, CorruptObjectError) else exc.__cause__
        raise RoundAbortedError(f"round {rnd.round_id} aborted: {decision.reason}") from (
            corrupt if isinstance(corrupt, CorruptObjectError) else None
        )

    def _join_decided(self, rnd: Round, decision: DecisionRecord) -> torch.Tensor:
        """The round was decided before this replica came: raise if it aborted or was collected, else read its
        committed result."""
        if not decision.committed:
            if not self.store.list_names(rnd.keys.members_dir):  # and collected: rejoin at the frontier next
                self._peer.needs_join = True
            raise RoundAbortedError(f"round {rnd.round_id} aborted: {decision.reason}")
        rnd.quorum = self.read_quorum(rnd.round_id)
        if rnd.quorum is None:
            raise self._peer.fell_behind(rnd.keys, decision, rnd.settings.keep_rounds)
        if not vote_phase.stands(decision, rnd.quorum):
            raise CorruptObjectError(f"{rnd.keys.decision}: commits a round attempt without a matching quorum")
        return self._follow_commit(rnd, decision)

    def _data_phase(self, rnd: Round, flat: torch.Tensor) -> torch.Tensor:
        """Contribute (if a participant), reduce this replica's shard, gather the rest; then decide, or leave the
        round open for :meth:`vote`."""
        self._check_spec(rnd)
        quorum, keys, spec = rnd.formed, rnd.keys, rnd.formed.spec
        participants, plan, token = quorum.participants, quorum.plan, quorum.token
        rnd.start_data_phase()
        mine = self.rank in participants
        if mine and quorum.incarnations[self.rank] != self.incarnation:
            if not self.store.exists(keys.data(self.rank)):
                raise RoundFailure(f"round {keys.round_id} lists rank {self.rank} from an incarnation that is gone")
            mine = False
        rnd.contributed = mine
        done: set[int] = set()
        try:
            if mine:
                # never re-create a collected round: checked while the payload is encoded, before it is written
                collected = self._peer.read(self._peer.check_not_collected, keys, rnd.settings.keep_rounds)
                try:
                    key = keys.data(self.rank)
                    meta = {"token": token, "rank": str(self.rank), "round": str(keys.round_id)}
                    blob = encode_payload(key, self.auth, flat, plan, meta)
                    sent = decode_payload_blob(blob, plan, key)  # what every reader decodes from it
                    feedback = None
                    if plan.spec.error_feedback:
                        feedback = residual_of(flat, sent, self.rank)
                        rnd.staged = (stream_key(spec), feedback)
                finally:
                    collected.result()
                reduce_phase.contribute(self._peer, rnd, blob)
                shard = participants.index(self.rank)
                self._reduce_shard(rnd, shard, sent, feedback)
                done.add(shard)
            own = sent if mine else None
            result = gather(self._peer, rnd, done, lambda k: self._reduce_shard(rnd, k, own))
            rnd.drain()
        finally:
            concurrent.futures.wait(rnd.pending)
        if spec.vote:
            self._open.append(rnd)
            self.last_round = RoundInfo(keys.round_id, "pending", list(participants), mine)
            return result
        decision = self._write_decision(keys, "commit", "", token, decide=mine)
        if not vote_phase.stands(decision, quorum):
            raise RoundAbortedError(f"round {keys.round_id} aborted: {decision.reason}")
        self._apply_staged(rnd.staged)
        self._finish(rnd, "commit", "")
        return result

    def _follow_commit(self, rnd: Round, decision: DecisionRecord) -> torch.Tensor:
        """The round committed: read its result (reduced shards are immutable and verified)."""
        self._check_spec(rnd)
        reader = dataclasses.replace(rnd, pending=[])
        reader.start_data_phase()
        try:
            result = gather(self._peer, reader, set(), None)
        except AllReduceError as exc:
            self._finish(rnd, "commit", "")
            raise RoundDesyncError(
                f"round {rnd.round_id} committed but this replica could not read its result: {why(exc)}"
            ) from None
        self._finish(rnd, "commit", decision.reason, participated=False)
        return result

    def _settle(self, rnd: Round, ok: bool, reason: str) -> bool:
        """Cast this replica's vote on an open round, then decide or follow; True iff it committed."""
        keys, quorum, settings = rnd.keys, rnd.formed, self._settings()
        try:
            if rnd.contributed:
                decision = vote_phase.vote(self._peer, keys, quorum, settings, ok, reason, self._write_decision)
            else:  # observers do not vote and never decide
                decision = vote_phase.await_decision(self._peer, keys, settings)
        except AllReduceError as exc:
            try:
                why_here = f"rank {self.rank}: {why(exc)}"
                decision = self._write_decision(keys, "abort", why_here, quorum.token, decide=rnd.contributed)
            except AllReduceError as final:
                logger.warning("round %d: could not settle its vote: %s", keys.round_id, final)
                self._finish(rnd, "abort", str(final), participated=rnd.contributed)
                return False
        committed = vote_phase.stands(decision, quorum)
        if committed and rnd.contributed:
            self._apply_staged(rnd.staged)
        self._finish(rnd, "commit" if committed else "abort", decision.reason, participated=rnd.contributed)
        return committed

    def _finish(
        self, rnd: Round, outcome: Literal["commit", "abort"], reason: str, participated: bool | None = None
    ) -> None:
        """Record the round's outcome, start learning who the next round expects (its announcers, listed in the
        background), and collect an old round (lowest participant only, in the background)."""
        participants = list(rnd.participants)
        if participated is None:
            participated = self.rank in participants
        self.last_round = RoundInfo(rnd.round_id, outcome, participants, participated, reason)
        self._learn_expected()  # the previous round's, before this one's
        everyone = rnd.quorum is not None and len(rnd.quorum.participants) == self.world_size
        # when every rank took part, no announcer can add to who the next round expects: nothing to list
        self._announcers = (rnd.quorum, None if everyone else self._peer.read(self._announced, rnd.keys))
        keep = self.keep_rounds
        if participants and self.rank == min(participants) and rnd.round_id >= keep:
            self._peer.submit(run_frontier.collect, self._peer, rnd.round_id - keep, keep)

    def _announced(self, keys: RoundKeys) -> set[int]:
        """The ranks that announced in a round (none when the store cannot list them)."""
        try:
            return set(ranks_named(self.store.list_names(keys.members_dir), self.world_size))
        except AllReduceError:
            return set()

    def _learn_expected(self) -> set[int] | None:
        """The replicas the next round waits for: the last round's participants and announcers (all ranks before
        any round; after a round aborted before its quorum, who was expected and who announced)."""
        if self._announcers is not None:
            (quorum, listing), self._announcers = self._announcers, None
            announced = listing.result() if listing is not None else set()
            if quorum is not None:
                self._expected = ((set(quorum.participants) | announced) - set(quorum.rejected)) or None
            elif self._expected is not None:
                self._expected |= announced
        return self._expected

    # -- the steps tests and subclasses hook (each one call into its phase) ------------------------------
    def _announce(
        self, keys: RoundKeys, spec: PayloadSpec | None, participate: bool, veto: str | None = None
    ) -> MemberRecord | None:
        """`crf_diloco.rounds.quorum.announce`: this incarnation's record, ``None`` if another incarnation of this
        rank announced already."""
        return quorum_phase.announce(self._peer, keys, spec, participate, veto)

    def _await_quorum(self, keys: RoundKeys, mine: MemberRecord | None) -> QuorumRecord:
        """`crf_diloco.rounds.quorum.await_quorum` with the replicas this round expects."""
        return quorum_phase.await_quorum(self._peer, keys, self._settings(), self._learn_expected(), mine)

    def _check_spec(self, rnd: Round) -> None:
        """`PayloadMismatchError` (this replica alone) when the round settled on another payload than its own."""
        quorum, spec = rnd.formed, rnd.spec
        if self.rank in quorum.rejected or quorum.spec != spec:
            raise PayloadMismatchError(
                f"round {rnd.round_id} settled on a payload of {quorum.spec.describe()}, but rank {self.rank} "
                f"passed {spec.describe() if spec else 'a veto'}; every replica must allreduce the same tensors "
                "(shapes, op, compression, name) in the same order"
            )

    def _reduce_shard(
        self, rnd: Round, shard: int, own: torch.Tensor | None, feedback: torch.Tensor | None = None
    ) -> None:
        """`crf_diloco.rounds.reduce.reduce_shard`: sum shard ``shard`` and create its object (``own``: what the
        others decode from this replica's payload, if it contributed)."""
        reduce_phase.reduce_shard(self._peer, rnd, shard, own, feedback)

    def _write_decision(
        self, keys: RoundKeys, outcome: Literal["commit", "abort"], reason: str, token: str | None, *, decide: bool
    ) -> DecisionRecord:
        """`crf_diloco.rounds.vote.decide`: write the decision if this replica may, return the one that stands."""
        return vote_phase.decide(self._peer, keys, outcome, reason, token, may_write=decide, settings=self._settings())
