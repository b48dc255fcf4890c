"""Typed records the launcher and the replica processes exchange as JSON files in the run folder.

``job.json`` (`JobSpec`) tells every replica what to train; each replica writes ``replica<rank>.json``
(`ReplicaReport`). Rank, world size, store URI and run id are not here: the executor hands them to each
replica in its environment (``crf_diloco.replica_env``), read by ``ObjectStoreAllReduce.from_env``. Nor are
the store's options, which may hold credentials: they travel in `STORAGE_OPTIONS_ENV`, never on disk.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from main_job.tasks import DATA

__all__ = [
    "CHANNELS",
    "STORAGE_OPTIONS_ENV",
    "TRAINERS",
    "JobSpec",
    "ReplicaReport",
    "StepRecord",
    "SyncStat",
    "check_schedule",
    "compression",
    "read_record",
    "write_record",
]

CHANNELS = ("grpo", "sdpo_jsd", "trace_replay_dpo")
"""The trainer's channels, in the order the job reports them."""

TRAINERS = ("crf", "trl-grpo", "trl-sdpo")
"""Who trains the replicas: crf's trainer, or TRL's GRPOTrainer / SDPOTrainer as peers (`replica.build_trainer`)."""

VOTE_SCOPES = ("run", "replica")
"""DiLoCo's ``should_commit`` scopes (``crf_diloco.manager.VOTE_SCOPES``, named here so that a job's records load
without crf-diloco installed): "run", a store-wide vote; "replica", torchft's scope, no request."""

STORAGE_OPTIONS_ENV = "CRF_MAIN_JOB_STORAGE_OPTIONS"
"""Environment variable holding the store's fsspec options as JSON (``--storage-option``), for the replicas."""


def compression(codec: str) -> str | None:
    """``ObjectStoreAllReduce``'s ``compression`` for a wire codec name: None for "fp32", else the name, checked by
    crf-diloco (a ValueError naming the codecs there are); "fp32" needs no crf-diloco installed."""
    if codec == "fp32":
        return None
    from crf_diloco.wire import parse_codec

    parse_codec(codec)
    return codec


def check_schedule(
    steps: int,
    sync_every: int,
    sync_delay: int = 0,
    *,
    names: tuple[str, str, str] = ("steps", "sync_every", "sync_delay"),
) -> None:
    """`JobSpec`'s schedule: ``steps`` a positive multiple of ``sync_every`` (itself >= 1), so the run ends on a DiLoCo
    round and every replica holds the same final weights, and ``0 <= sync_delay < sync_every`` (torchft's
    ``fragment_sync_delay``). A ValueError calls them by ``names`` (the launcher's parser checks its flags with this
    rule: ``("--steps", "--sync-every", "--sync-delay")``)."""
    if sync_every < 1:
        raise ValueError(f"{names[1]} must be >= 1, got {sync_every}")
    if not 0 <= sync_delay < sync_every:
        raise ValueError(
            f"{names[2]} must be in [0, {names[1]}) = [0, {sync_every}): a round starts that many inner steps before "
            f"it is applied, got {sync_delay}"
        )
    if steps < 1 or steps % sync_every:
        raise ValueError(
            f"{names[0]} ({steps}) must be a positive multiple of {names[1]} ({sync_every}) so the run ends on a "
            "DiLoCo round and every replica holds the same final weights"
        )


@dataclass(frozen=True)
class JobSpec:
    """What every replica trains: the warm-started policy, the *train* tasks, the pairs and the schedule.

    Held-out tasks are deliberately absent: a replica cannot read what it is never given.
    """

    output_dir: str
    model_dir: str
    train_tasks: str
    pairs: str | None
    steps: int
    sync_every: int
    prompts_per_step: int
    generations: int
    max_completion_length: int
    lr: float
    temperature: float
    weights: dict[str, float]
    sdpo_feedback: bool
    sdpo_alpha: float
    sdpo_top_k: int | None
    sdpo_truncate_below: float | None
    sdpo_teacher_update_rate: float
    sdpo_routing: str
    sdpo_group_weight: str
    trainer: str
    outer_lr: float
    outer_momentum: float
    sync_timeout: float
    codec: str  # wire codec of the outer gradients (crf_diloco.wire.parse_codec): "fp32" sends them uncompressed
    isolation: str
    sandbox_timeout: float
    seed: int
    threads: int
    device: str
    agent: bool = False  # --agent: multi-turn episodes in a CodingEnvironment (main_job.agent)
    sync_delay: int = 0  # torchft's fragment_sync_delay: a round starts this many inner steps early, in the background
    vote_scope: str = "run"  # MockManager(vote_scope=...), one of VOTE_SCOPES
    checkpoint_every: int = 1  # MockManager(checkpoint_every=...): the global state after every Nth committed round

    @classmethod
    def from_options(cls, opts: Any, *, output: Path, pairs: Path, isolation: str, agent: bool = False) -> JobSpec:
        """What the replicas are told, from the job's parsed flags (``composer_main.parse_args``)."""
        return cls(
            output_dir=str(output),
            model_dir=str(output / "warm_start"),
            train_tasks=str(DATA / "tasks_train.jsonl"),
            pairs=str(pairs),
            steps=opts.steps,
            sync_every=opts.sync_every,
            prompts_per_step=opts.prompts_per_step,
            generations=opts.generations,
            max_completion_length=opts.max_completion_length,
            lr=opts.lr,
            temperature=opts.temperature,
            weights=opts.weights,
            sdpo_feedback=opts.sdpo_feedback,
            sdpo_alpha=opts.sdpo_alpha,
            sdpo_top_k=opts.sdpo_top_k or None,
            sdpo_truncate_below=opts.sdpo_truncate_below,
            sdpo_teacher_update_rate=opts.sdpo_teacher_update_rate,
            sdpo_routing=opts.sdpo_routing,
            sdpo_group_weight=opts.sdpo_group_weight,
            trainer=opts.trainer,
            outer_lr=opts.outer_lr,
            outer_momentum=opts.outer_momentum,
            sync_timeout=opts.sync_timeout,
            codec=opts.codec,
            isolation=isolation,
            sandbox_timeout=opts.sandbox_timeout,
            seed=opts.seed,
            threads=max(1, (os.cpu_count() or 1) // opts.replicas),
            device=opts.device,
            agent=agent,
            sync_delay=opts.sync_delay,
            vote_scope=opts.vote_scope,
            checkpoint_every=opts.checkpoint_every,
        )

    def __post_init__(self) -> None:
        if sorted(self.weights) != sorted(CHANNELS):
            raise ValueError(f"weights must name exactly the channels {CHANNELS}, got {sorted(self.weights)}")
        compression(self.codec)
        if self.vote_scope not in VOTE_SCOPES:
            raise ValueError(f"vote_scope must be {' or '.join(map(repr, VOTE_SCOPES))}, got {self.vote_scope!r}")
        if type(self.checkpoint_every) is not int or self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be an int >= 1, got {self.checkpoint_every!r}")
        check_schedule(self.steps, self.sync_every, self.sync_delay)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of one replica: mean rollout reward, each active channel's loss, and DiLoCo so far."""

    step: int
    reward: float
    losses: dict[str, float]
    rounds: int
    megabytes: float
    seconds: float


@dataclass(frozen=True)
class SyncStat:
    """One DiLoCo sync of one replica (crf-diloco's ``SyncRecord``): its last round, whether it committed, the wall
    seconds of its rounds and vote, the megabytes its store moved meanwhile and the sequential round trips that
    found something (``Traffic.busy_round_trips``)."""

    round: int | None
    committed: bool
    seconds: float
    megabytes: float
    round_trips: int


@dataclass(frozen=True)
class ReplicaReport:
    """How one replica's training went: its steps, DiLoCo rounds committed, bytes through the store (of which
    ``checkpoint_bytes`` are the global states it wrote or loaded), wall time, a SHA-256 of its final weights (equal
    on every replica after the last round) and its syncs."""

    rank: int
    history: tuple[StepRecord, ...]
    rounds_committed: int
    bytes_written: int
    bytes_read: int
    seconds: float
    weights_sha256: str
    syncs: tuple[SyncStat, ...] = ()
    checkpoint_bytes: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaReport:
        history = tuple(StepRecord(**row) for row in data["history"])
        syncs = tuple(SyncStat(**row) for row in data["syncs"])
        return cls(**{**data, "history": history, "syncs": syncs})


T = TypeVar("T", JobSpec, ReplicaReport)


def write_record(record: JobSpec | ReplicaReport, path: Path) -> None:
    """Write ``record`` as JSON, atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=1), encoding="utf-8")
    os.replace(tmp, path)


def read_record(cls: type[T], path: Path) -> T:
    """Read a record `write_record` wrote; a missing or unknown field is an error naming the file."""
    data = json.loads(path.read_text(encoding="utf-8"))
    names = {f.name for f in fields(cls)}
    if set(data) != names:
        raise ValueError(f"{path}: expected the fields {sorted(names)}, got {sorted(data)}")
    if cls is ReplicaReport:
        return ReplicaReport.from_json(data)  # type: ignore[return-value]
    return cls(**data)
