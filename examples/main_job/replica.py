"""One DiLoCo replica of the main job: a process of its own, started by a crf-diloco executor.

The executor sets ``CRF_DILOCO_RANK``/``_WORLD_SIZE``/``_URI``/``_RUN_ID`` (and ``CRF_DILOCO_SECRET``);
``ObjectStoreAllReduce.from_env`` reads them. The replica loads the warm-started policy and the *train*
tasks named in ``job.json``, trains a ``ComposerReplicationTrainer`` inside ``torchft.local_sgd.DiLoCo``
(crf-diloco's ``MockManager`` on the object store), prints one line per step and writes
``replica<rank>.json``; rank 0 also saves the final weights to ``final/`` (every replica holds the same
weights after the last round, which ``weights_sha256`` lets the launcher check).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any

from main_job.feedback import FEEDBACK_CHARS
from main_job.policy import load_policy, save_policy
from main_job.records import (
    CHANNELS,
    STORAGE_OPTIONS_ENV,
    JobSpec,
    ReplicaReport,
    StepRecord,
    SyncStat,
    compression,
    read_record,
    write_record,
)
from main_job.tasks import load_tasks
from main_job.templates import TEMPLATE_FIELDS

__all__ = ["build_trainer", "run_replica", "weights_digest"]


def weights_digest(model: Any) -> str:
    """SHA-256 over every parameter's name and bytes, in order: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest()


def _progress(spec: JobSpec, rank: int, history: list[StepRecord], manager: Any, allreduce: Any, start: float) -> Any:
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            reward = None if not logs else logs.get("reward", logs.get("self_distillation/reward_mean"))  # TRL SDPO's
            if not logs or reward is None:
                return
            losses = {c: float(logs[c]) for c in CHANNELS if spec.weights[c] > 0 and logs.get(c) is not None}
            record = StepRecord(
                step=int(state.global_step),
                reward=float(reward),
                losses=losses,
                rounds=int(manager.current_step()),
                megabytes=(allreduce.bytes_written + allreduce.bytes_read) / 1e6,
                seconds=time.monotonic() - start,
            )
            history.append(record)
            parts = "  ".join(f"{c} {v:+.4f}" for c, v in losses.items())
            print(
                f"[replica {rank}] step {record.step:>3}/{spec.steps}  reward {record.reward:.3f}  {parts}  "
                f"rounds {record.rounds}  ({record.seconds:.0f} s)",
                flush=True,
            )

    return Progress()


def build_trainer(spec: JobSpec, rank: int, model: Any, tokenizer: Any, reward: Any, dataset: Any) -> Any:
    """The replica's trainer: crf's `ComposerReplicationTrainer` with the job's channels (``spec.trainer`` =
    ``crf``), or a peer at the same budget and settings: TRL's ``GRPOTrainer`` (``trl-grpo``) or TRL's
    ``trl.experimental.sdpo.SDPOTrainer`` (``trl-sdpo``: half policy gradient, half top-20 + tail JSD to its
    EMA self-teacher, as crf's SDPO channel is set here; TRL's SDPO reads feedback only from a static
    ``privileged_context`` column, so it gets the successful peers' demonstrations, not the sandbox's feedback)."""
    common: dict[str, Any] = {
        "output_dir": str(Path(spec.output_dir) / f"replica{rank}"),
        "per_device_train_batch_size": spec.prompts_per_step * spec.generations,
        "num_generations": spec.generations,
        "max_completion_length": spec.max_completion_length,
        "temperature": spec.temperature,
        "max_steps": spec.steps,
        "learning_rate": spec.lr,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": spec.device == "cpu",
        # on CPU float32 in every arm, crf's and TRL's alike (GRPOConfig's default, bf16 autocast, is meant for GPUs)
        "bf16": spec.device == "cuda",
        "disable_tqdm": True,
        "seed": spec.seed + 101 * rank,  # each replica samples its own rollouts
    }
    if spec.agent:  # --agent: a CodingEnvironment per rollout, no reward function (main_job.agent)
        from main_job.agent import agent_trainer

        return agent_trainer(spec, common, model, tokenizer, dataset)
    kwargs = {"model": model, "reward_funcs": reward, "train_dataset": dataset, "processing_class": tokenizer}
    if spec.trainer == "trl-grpo":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    if spec.trainer == "trl-sdpo":
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        sdpo = SDPOConfig(
            **common,
            distillation_weight=0.5,
            distillation_mode="full_logits" if spec.sdpo_top_k is None else "topk_logits",
            distillation_topk=spec.sdpo_top_k,
            distillation_add_tail=spec.sdpo_top_k is not None,
            distillation_alpha=spec.sdpo_alpha,
            teacher_update_rate=spec.sdpo_teacher_update_rate,
            **TEMPLATE_FIELDS,
        )
        return SDPOTrainer(args=sdpo, **kwargs)
    from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

    config = ComposerConfig(
        **common,
        grpo_weight=spec.weights["grpo"],
        sdpo_weight=spec.weights["sdpo_jsd"],
        trace_replay_dpo_weight=spec.weights["trace_replay_dpo"],
        trace_replay_path=spec.pairs if spec.weights["trace_replay_dpo"] > 0 else None,
        trace_replay_batch_size=4,
        sdpo_alpha=spec.sdpo_alpha,
        sdpo_top_k=spec.sdpo_top_k,
        sdpo_truncate_below=spec.sdpo_truncate_below,
        sdpo_teacher_update_rate=spec.sdpo_teacher_update_rate,
        sdpo_include_environment_feedback=spec.sdpo_feedback,
        sdpo_routing=spec.sdpo_routing,  # type: ignore[arg-type]
        sdpo_group_weight=spec.sdpo_group_weight,  # type: ignore[arg-type]
        **{f"sdpo_{name}": text for name, text in TEMPLATE_FIELDS.items()},
    )
    return ComposerReplicationTrainer(args=config, **kwargs)


def run_replica(job: Path) -> ReplicaReport:
    """Train this process's replica as ``job`` (a ``job.json``) says; returns and writes its report."""
    import torch
    from datasets import Dataset
    from torchft.local_sgd import DiLoCo
    from transformers import PrinterCallback
    from transformers.utils import logging as hf_logging

    from crf_core.rewards import UnitTestReward
    from crf_diloco import MockManager, ObjectStoreAllReduce

    hf_logging.disable_progress_bar()
    # TRL calls transformers' gradient-checkpointing helpers under their pre-v6 names; nothing a user can act on.
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)
    start = time.monotonic()
    spec = read_record(JobSpec, job)
    torch.set_num_threads(spec.threads)
    # Built first, with a probe write/read, so a wrong URI or missing credentials fail before training.
    allreduce = ObjectStoreAllReduce.from_env(
        timeout=spec.sync_timeout,
        compression=compression(spec.codec),
        storage_options=json.loads(os.environ.get(STORAGE_OPTIONS_ENV) or "{}") or None,
        preflight=True,
    )
    rank = allreduce.rank
    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model, tokenizer = load_policy(Path(spec.model_dir), spec.device)
    rows = [task.row() for task in load_tasks(Path(spec.train_tasks))]
    if spec.agent:  # --agent: chat prompts with visible and hidden tests (main_job.agent)
        from main_job.agent import agent_row

        rows = [agent_row(task) for task in load_tasks(Path(spec.train_tasks))]
    random.Random(spec.seed + 101 * rank).shuffle(rows)  # each replica its own data order
    output = Path(spec.output_dir)
    reward = UnitTestReward(
        timeout_s=spec.sandbox_timeout,
        max_workers=1,
        isolation=spec.isolation,  # type: ignore[arg-type]
        max_feedback_chars=FEEDBACK_CHARS,  # the length the warm start showed
    )
    repeats = -(-spec.steps * spec.prompts_per_step // len(rows)) + 1
    trainer = build_trainer(spec, rank, model, tokenizer, reward, Dataset.from_list(rows * repeats))
    trainer.remove_callback(PrinterCallback)  # the progress callback prints a compact line instead
    # overlap=True: with --sync-delay a round runs on its background thread
    manager = MockManager(allreduce, vote_scope=spec.vote_scope, checkpoint_every=spec.checkpoint_every)  # type: ignore[arg-type]
    history: list[StepRecord] = []
    trainer.add_callback(_progress(spec, rank, history, manager, allreduce, start))
    trainer.create_optimizer()
    policy: Any = trainer.model
    outer = torch.optim.SGD(
        policy.parameters(), lr=spec.outer_lr, momentum=spec.outer_momentum, nesterov=spec.outer_momentum > 0
    )
    with DiLoCo(
        manager,
        [policy],
        trainer.optimizer,
        outer,
        sync_every=spec.sync_every,
        fragment_sync_delay=spec.sync_delay,
        pin_memory=False,
    ):
        trainer.train()
    report = ReplicaReport(
        rank=rank,
        history=tuple(history),
        rounds_committed=int(manager.current_step()),
        bytes_written=allreduce.bytes_written,
        bytes_read=allreduce.bytes_read,
        seconds=time.monotonic() - start,
        weights_sha256=weights_digest(policy),
        syncs=tuple(
            SyncStat(
                s.round_id,
                s.committed,
                s.seconds,
                (s.traffic.bytes_read + s.traffic.bytes_written) / 1e6,
                s.traffic.busy_round_trips,
            )
            for s in manager.syncs
        ),
        checkpoint_bytes=sum(manager.checkpoint_bytes),
    )
    if rank == 0:
        save_policy(policy, tokenizer, output / "final")
    write_record(report, output / f"replica{rank}.json")
    return report
