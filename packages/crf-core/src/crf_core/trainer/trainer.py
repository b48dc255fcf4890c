"""``ComposerReplicationTrainer``: TRL's ``GRPOTrainer`` plus SDPO self-distillation and trace-replay DPO.

Loss of one micro-batch (``GA`` = gradient-accumulation steps in training, 1 in evaluation)::

    L = w_grpo · L_grpo  +  w_sdpo · L_sdpo / GA  +  w_dpo · L_dpo / GA

* ``L_grpo``: TRL's own ``GRPOTrainer.compute_loss`` (every loss type, its masking, clipping, KL and
  normalisation, already GA-scaled), fed per-token log-probs and entropies by ``crf_core.channels.grpo``: one
  decoder pass and an LM head chunked over the completion tokens, so no ``(B, C, V)`` logits exist.
* ``L_sdpo``: ``crf_core.channels.sdpo`` between the policy on ``[prompt ; completion]`` and the self-teacher
  (the policy, or its EMA copy) under no-grad on ``[reprompt ; completion]``. Its student divergence is scored
  in the same chunked pass as GRPO's log-probs (one policy forward for both).
* ``L_dpo``: ``crf_core.channels.trace_replay_dpo`` on the next trace-replay pairs (sharded across ranks).

The same chunked scoring serves TRL's no-grad old/reference log-prob passes: the trainer overrides
``_get_per_token_logps_and_entropies``. Models without a separable linear head, multimodal batches and MoE
auxiliary losses use TRL's own path (a warning says why).

Metrics (``self._metrics``, averaged per logging step like TRL's, gathered over ranks): ``grpo``,
``sdpo_jsd`` and ``trace_replay_dpo`` (each channel's per-micro-batch value before weight and GA scaling;
``sdpo_jsd`` is 0.0 for a micro-batch without teacher signal), ``taid_t``, ``self_distillation/*`` (reprompting
fractions) and ``trace_replay_dpo/*`` (implicit rewards). SDPO success is judged on the weighted reward GRPO uses
(``crf_core.trainer.success``). At construction one INFO line names the channels on, their weights and the
parameter bytes of the model copies they hold (``crf_core.trainer.startup``).

Data flow: ``_calculate_rewards`` is wrapped to keep each generation batch's prompts, completions and
gathered rewards; reward functions report feedback through TRL's ``log_extra(sdpo_feedback_key, …)``,
captured by the ``_log_completion_extra`` override, and the environments of multi-turn rollouts
(``environment_factory``) through their ``feedback`` attribute (``crf_core.trainer.episodes``);
``_generate_and_score_completions`` then adds
``sdpo_teacher_prompt_ids``/``sdpo_teacher_prompt_mask`` ``(B, L)`` and ``sdpo_mask`` ``(B,)`` to the batch.

State that outlives a step (EMA teacher, TAID schedule, pair cursor) is saved with every checkpoint, with the
channel settings it belongs to (:meth:`ComposerReplicationTrainer.channel_config`), and restored by
``train(resume_from_checkpoint=...)`` (``crf_core.trainer.state``); other settings, or a checkpoint without that
state while this run keeps some, are a ``ValueError``. Under PEFT the EMA teacher is the adapter's EMA over the
shared frozen base (``crf_core.trainer.teacher.AdapterEmaTeacher``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from crf_core.channels import (
    CompletionScores,
    HeadPrecision,
    HeadStates,
    LMHead,
    SDPOChannel,
    SDPOTargets,
    SequenceBatch,
    SequenceLogps,
    TraceReplayDPOChannel,
    first_error_mask,
    hidden_source,
    score_completions,
    token_mean,
)
from crf_core.trainer._trl_contract import (
    GENERATION_OUTPUT_KEYS,
    TRLContractError,
    check_trainer_attributes,
    check_trl_contract,
)
from crf_core.trainer.config import ComposerConfig
from crf_core.trainer.episodes import environment_feedback
from crf_core.trainer.pairs import PairCursor, TokenizedPair, check_pair_records, collate_pairs, tokenize_pairs
from crf_core.trainer.reprompt import PromptLike, build_reprompts
from crf_core.trainer.sdpo_routing import route_samples
from crf_core.trainer.startup import ChannelCost, parameter_bytes, startup_line
from crf_core.trainer.state import STATE_FILE, ChannelState, config_mismatch
from crf_core.trainer.teacher import AdapterEmaTeacher, EmaTeacher, is_peft_model
from crf_distill import RowTerm

__all__ = ["ComposerReplicationTrainer"]

logger = logging.getLogger(__name__)

_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class _SharedSDPO:
    """The SDPO student term of one micro-batch, waiting to ride along GRPO's scoring pass."""

    factory: Any
    shape: tuple[int, int]
    logits_to_keep: int
    scores: CompletionScores | None = field(default=None)


class _ChannelStep(TrainerCallback):
    """At the start of training: one EMA self-teacher on every rank. After every optimizer step: move the EMA
    self-teacher, advance TAID's schedule."""

    def __init__(self, trainer: ComposerReplicationTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.sdpo_teacher is not None:
            self.trainer.sdpo_teacher.synchronise()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer.sdpo_teacher is not None:
            trainer.sdpo_teacher.update(trainer.accelerator.unwrap_model(trainer.model))
        if trainer.taid_schedule is not None and trainer._taid_losses:
            loss = sum(trainer._taid_losses) / len(trainer._taid_losses)
            trainer.taid_schedule.update(loss, int(state.global_step), max(int(state.max_steps), 1))
        trainer._taid_losses.clear()


class ComposerReplicationTrainer(GRPOTrainer):
    """GRPO (TRL's math) + SDPO self-distillation + trace-replay DPO, each weighted and logged.

    Args:
        model, reward_funcs, train_dataset, eval_dataset, processing_class, …: as ``GRPOTrainer``.
        args: a :class:`ComposerConfig` (a ``GRPOConfig`` with the channel fields).
        trace_replay_pairs: pair records (dicts with ``prompt``/``chosen``/``rejected``, as crf-replaysim
            writes them) instead of ``args.trace_replay_path``.
        trace_replay_ref_model: reference model for ``trace_replay_reference='ref_model'`` when TRL has
            none (TRL only loads one when ``beta != 0``).
        **kwargs: passed to ``GRPOTrainer``.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: ComposerConfig | None = None,
        *pos_args: Any,
        trace_replay_pairs: Iterable[Mapping[str, Any]] | None = None,
        trace_replay_ref_model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        check_trl_contract(GRPOTrainer)
        if not isinstance(args, ComposerConfig):
            raise TypeError(
                f"args must be a ComposerConfig (GRPOConfig plus the channel fields), got {type(args).__name__}; "
                "build one with ComposerConfig(output_dir=..., ...)"
            )
        super().__init__(model, reward_funcs, args, *pos_args, **kwargs)
        check_trainer_attributes(self)
        self.composer_args: ComposerConfig = args
        self._chunk_plan = args.chunk_plan()
        # TRL's regime for every forward of every channel: the accelerator's autocast, cast_lm_head_to_fp32 honoured
        self._precision = HeadPrecision(self.accelerator.autocast, torch.float32 if args.cast_lm_head_to_fp32 else None)
        self._reprompt_config = args.reprompt_config()
        self._capture: tuple[list[Any], list[Any], torch.Tensor] | None = None
        self._feedback_calls: list[list[Any]] = []
        self._shared: _SharedSDPO | None = None
        self._warned: set[str] = set()

        self.sdpo = SDPOChannel(args.sdpo_config()) if args.sdpo_weight > 0 else None
        self.success = args.success_monitor(self.reward_weights.tolist()) if self.sdpo is not None else None
        if self.success is not None:  # both the reprompts and the routing use the effective threshold
            self._reprompt_config = replace(self._reprompt_config, success_reward_threshold=self.success.threshold)
        self.taid_schedule = args.taid_schedule() if self.sdpo is not None else None
        self._taid_losses: list[float] = []
        self.sdpo_teacher: EmaTeacher | AdapterEmaTeacher | None = None
        if self.sdpo is not None and args.sdpo_teacher == "ema":
            policy = self.accelerator.unwrap_model(self.model)
            # Under PEFT only the adapter trains: its EMA over the shared frozen base is the whole teacher.
            teacher_cls = AdapterEmaTeacher if is_peft_model(policy) else EmaTeacher
            self.sdpo_teacher = teacher_cls(policy, args.sdpo_teacher_update_rate)
        self.add_callback(_ChannelStep(self))

        self.preference = TraceReplayDPOChannel(args.preference_config())
        self._pairs: list[TokenizedPair] = []
        self._pair_ref: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pair_cursor: PairCursor | None = None
        self._trace_replay_ref_model = trace_replay_ref_model
        self.trace_replay_reference = "none"
        self._setup_trace_replay(trace_replay_pairs)
        self.channel_costs, off = self._channel_costs()
        if self.accelerator.is_main_process:
            logger.info(startup_line(self.channel_costs, off))

    def _channel_costs(self) -> tuple[list[ChannelCost], list[str]]:
        """The channels that are on, with the model copy each holds (its parameter bytes), and those that are off."""
        cfg = self.composer_args
        costs: list[ChannelCost] = []
        off: list[str] = []
        ref: Any = getattr(self, "ref_model", None)
        if cfg.grpo_weight > 0:
            if ref is not None:
                costs.append(
                    ChannelCost("grpo", cfg.grpo_weight, f"reference model, beta={self.beta:g}", parameter_bytes(ref))
                )
            elif self.beta != 0:
                costs.append(
                    ChannelCost("grpo", cfg.grpo_weight, "reference = the policy with its adapter off, no copy")
                )
            else:
                costs.append(ChannelCost("grpo", cfg.grpo_weight, "beta=0, no reference model"))
        else:
            off.append("grpo")
        if self.sdpo is not None:
            if isinstance(self.sdpo_teacher, AdapterEmaTeacher):
                teacher = ChannelCost(
                    "sdpo_jsd",
                    cfg.sdpo_weight,
                    "EMA teacher, adapter only over the shared base",
                    self.sdpo_teacher.nbytes,
                )
            elif self.sdpo_teacher is not None:
                teacher = ChannelCost(
                    "sdpo_jsd", cfg.sdpo_weight, "EMA teacher", parameter_bytes(self.sdpo_teacher.module)
                )
            else:
                teacher = ChannelCost("sdpo_jsd", cfg.sdpo_weight, "live teacher = the policy, no copy")
            costs.append(teacher)
        else:
            off.append("sdpo_jsd")
        if cfg.trace_replay_dpo_weight > 0:
            reference = self.trace_replay_reference
            if reference == "ref_model":
                model: Any = self._trace_replay_ref_model or ref
                if model is ref and cfg.grpo_weight > 0:
                    dpo = ChannelCost("trace_replay_dpo", cfg.trace_replay_dpo_weight, "shares GRPO's reference model")
                else:
                    dpo = ChannelCost(
                        "trace_replay_dpo", cfg.trace_replay_dpo_weight, "reference model", parameter_bytes(model)
                    )
            else:
                dpo = ChannelCost("trace_replay_dpo", cfg.trace_replay_dpo_weight, f"reference '{reference}', no copy")
            costs.append(dpo)
        else:
            off.append("trace_replay_dpo")
        return costs, off

    # ------------------------------------------------------------------ small helpers
    def _mode(self) -> str:
        model: Any = self.model
        return "train" if model.training else "eval"

    @property
    def _processor(self) -> Any:
        """The processing class (tokenizer or multimodal processor), untyped for TRL's union type."""
        return self.processing_class

    def _pad_id(self) -> int:
        tokenizer = getattr(self._processor, "tokenizer", self._processor)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return int(pad)

    def _head(self, model: Any) -> LMHead:
        """The policy (as the step calls it, possibly DDP-wrapped) as decoder + chunked head."""
        return LMHead(
            model,
            self._chunk_plan,
            unwrap=self.accelerator.unwrap_model,
            temperature=self.temperature,
            precision=self._precision,
        )

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    def _log_channel(self, mode: str, name: str, value: float) -> float:
        """Append the ranks' mean of ``value`` (NaN where a rank has none) to TRL's metrics; returns it."""
        local = torch.tensor([value], dtype=torch.float32, device=self.accelerator.device)
        gathered = self.accelerator.gather(local)
        finite = gathered[~torch.isnan(gathered)]
        mean = float(finite.mean()) if finite.numel() else math.nan
        self._metrics[mode][name].append(mean)
        return mean

    def _log_sdpo(self, mode: str, loss: torch.Tensor | None) -> float:
        """Log ``sdpo_jsd``: the ranks' mean loss, a rank without teacher signal counting 0.0 (the loss it adds,
        as TRL's SDPOTrainer logs it; never NaN for want of a signal). Returns the mean over the ranks that had a
        signal (NaN when none had), which TAID's schedule follows."""
        local = torch.tensor(
            [[0.0 if loss is None else float(loss.detach()), float(loss is not None)]],
            dtype=torch.float32,
            device=self.accelerator.device,
        )
        gathered = self.accelerator.gather(local).reshape(-1, 2)
        self._metrics[mode]["sdpo_jsd"].append(float(gathered[:, 0].mean()))
        signalled = gathered[gathered[:, 1] > 0, 0]
        return float(signalled.mean()) if signalled.numel() else math.nan

    # ------------------------------------------------------------------ generation-side hooks
    def _log_completion_extra(self, column: str, values: list[Any]) -> None:
        super()._log_completion_extra(column, values)
        if column == self.composer_args.sdpo_feedback_key:
            self._feedback_calls.append(list(values))

    def _calculate_rewards(
        self, inputs: Any, prompts: list[Any], completions: list[Any], completion_ids_list: list[Any]
    ) -> torch.Tensor:
        rewards_per_func: torch.Tensor = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._capture = (list(prompts), list(completions), rewards_per_func.detach())
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._capture = None
        self._feedback_calls = []
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        missing = [k for k in GENERATION_OUTPUT_KEYS if k not in output]
        if missing:
            raise TRLContractError(f"GRPOTrainer._generate_and_score_completions no longer returns {missing}")
        if self.sdpo is not None:
            output.update(self._teacher_inputs(output))
        return output

    def _local_feedback(self, n: int) -> list[str | None] | None:
        calls = list(self._feedback_calls)
        episode = environment_feedback(getattr(self, "environments", None), n)  # multi-turn rollouts' environments
        if episode is not None:
            calls.append(episode)
        if not calls:
            return None
        merged: list[str | None] = [None] * n
        for values in calls:
            if len(values) != n:
                raise ValueError(
                    f"a reward function logged {len(values)} '{self.composer_args.sdpo_feedback_key}' values for "
                    f"{n} completions; log exactly one feedback string (or None) per completion"
                )
            for i, value in enumerate(values):
                if value is None or (isinstance(value, str) and not value.strip()):
                    continue
                if not isinstance(value, str):
                    raise TypeError(f"feedback values must be str or None, got {type(value).__name__}")
                merged[i] = value if merged[i] is None else f"{merged[i]}\n\n{value}"
        return merged

    def _teacher_inputs(self, output: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if self._capture is None:
            raise TRLContractError("GRPOTrainer no longer calls _calculate_rewards during generation")
        prompts, completions, rewards_per_func = self._capture
        n_local = len(prompts)
        device = output["prompt_ids"].device
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        all_prompts = gather_object(prompts)
        all_completions = gather_object(completions)
        all_feedback = gather_object(self._local_feedback(n_local) or [None] * n_local)
        mode = self._mode()
        sizes: Any = (self.num_generations, getattr(self, "num_generations_eval", None))
        group = int(sizes[0] if mode == "train" or sizes[1] is None else sizes[1])
        batch = build_reprompts(
            all_prompts, all_completions, rewards.tolist(), all_feedback, group, self._reprompt_config
        )
        for name, value in batch.metrics.items():
            self._metrics[mode][f"self_distillation/{name}"].append(value)
        cfg = self.composer_args
        assert self.success is not None
        if mode == "train":
            warning = self.success.observe(rewards.tolist())
            if warning is not None and self.accelerator.is_main_process:
                logger.warning(warning)
        routing = route_samples(
            rewards.tolist(), group, self.success.threshold, cfg.sdpo_routing, cfg.sdpo_group_weight
        )
        start = self.accelerator.process_index * n_local
        local = batch.reprompts[start : start + n_local]
        local_weight = routing.sdpo_weight[start : start + n_local]
        ids = self._tokenize_teacher_prompts([r.prompt for r in local])
        width = max(len(x) for x in ids)
        teacher_ids = torch.full((n_local, width), self._pad_id(), dtype=torch.long)
        teacher_mask = torch.zeros((n_local, width), dtype=torch.long)
        for i, row in enumerate(ids):  # left padding, like TRL's prompts
            if row:
                teacher_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                teacher_mask[i, width - len(row) :] = 1
        signal = torch.tensor([float(r.has_signal) * w for r, w in zip(local, local_weight, strict=True)])
        inputs = {
            "sdpo_teacher_prompt_ids": teacher_ids.to(device),
            "sdpo_teacher_prompt_mask": teacher_mask.to(device),
            "sdpo_mask": signal.to(device),
        }
        if cfg.sdpo_routing == "srpo" and "advantages" in output:  # failed rollouts leave GRPO to SDPO
            kept = torch.tensor(routing.grpo_kept[start : start + n_local], device=output["advantages"].device)
            inputs["advantages"] = torch.where(kept, output["advantages"], torch.zeros_like(output["advantages"]))
        return inputs

    def _tokenize_teacher_prompts(self, prompts: Sequence[PromptLike]) -> list[list[int]]:
        cfg = self.composer_args
        if all(isinstance(p, str) for p in prompts):
            encoded = self._processor(text=list(prompts))["input_ids"]
        else:
            chat_kwargs: Any = self.chat_template_kwargs or {}
            encoded = self._processor.apply_chat_template(
                conversation=[list(p) for p in prompts],
                tools=getattr(self, "tools", None) or None,
                chat_template=getattr(self, "chat_template", None),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **chat_kwargs,
            )["input_ids"]
        out = []
        for row in encoded:
            row = [int(t) for t in row]
            if len(row) > cfg.sdpo_max_reprompt_len:
                if cfg.sdpo_reprompt_truncation == "error":
                    raise ValueError(
                        f"a teacher prompt has {len(row)} tokens > sdpo_max_reprompt_len={cfg.sdpo_max_reprompt_len}; "
                        "raise the limit or set sdpo_reprompt_truncation to 'left' or 'right'"
                    )
                row = (
                    row[: cfg.sdpo_max_reprompt_len]
                    if cfg.sdpo_reprompt_truncation == "right"
                    else row[-cfg.sdpo_max_reprompt_len :]
                )
            out.append(row)
        return out

    # ------------------------------------------------------------------ scoring (GRPO and TRL's no-grad passes)
    def _trl_path_reason(self, head: LMHead, compute_aux_loss: bool, extra: Mapping[str, Any]) -> str | None:
        if not head.separable:
            return f"the model's LM head cannot be run apart from it ({head.reason})"
        if compute_aux_loss:
            return "the model reports a MoE load-balancing loss (output_router_logits)"
        present = [k for k in _MULTIMODAL_KEYS if extra.get(k) is not None]
        if present:
            return f"the batch is multimodal ({', '.join(present)})"
        unknown = sorted(set(extra) - set(_MULTIMODAL_KEYS))
        if unknown:
            return f"TRL passed arguments this trainer does not know ({', '.join(unknown)})"
        return None

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        head = self._head(model)
        reason = self._trl_path_reason(head, compute_aux_loss, extra)
        if reason is not None:
            self._warn_once(f"crf: scoring with TRL's own log-prob path, LM head not chunked, because {reason}")
            result: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] = (
                super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=batch_size,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                    **extra,
                )
            )
            return result
        shared = self._shared
        if shared is not None and shared.shape == tuple(input_ids.shape) and shared.logits_to_keep == logits_to_keep:
            self._shared = None
            shared.scores = score_completions(
                head, input_ids, attention_mask, logits_to_keep, entropy=compute_entropy, extra=shared.factory
            )
            return shared.scores.logps, shared.scores.entropies, None
        step = batch_size or input_ids.shape[0]
        parts = [
            score_completions(
                head, input_ids[i : i + step], attention_mask[i : i + step], logits_to_keep, entropy=compute_entropy
            )
            for i in range(0, input_ids.shape[0], step)
        ]
        logps = torch.cat([p.logps for p in parts])
        entropies = torch.cat([p.entropies for p in parts if p.entropies is not None]) if compute_entropy else None
        return logps, entropies, None

    @contextmanager
    def _sharing(self, shared: _SharedSDPO | None) -> Iterator[_SharedSDPO | None]:
        self._shared = shared
        try:
            yield shared
        finally:
            self._shared = None

    # ------------------------------------------------------------------ loss
    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        if return_outputs:
            raise ValueError("ComposerReplicationTrainer does not support returning outputs")
        cfg = self.composer_args
        mode = self._mode()
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        terms: list[torch.Tensor] = []
        sdpo_step = self._sdpo_step(model, inputs) if self.sdpo is not None else None
        if cfg.grpo_weight > 0:
            with self._sharing(sdpo_step[0] if sdpo_step is not None else None):
                grpo = super().compute_loss(model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)
            self._log_channel(mode, "grpo", float(grpo.detach()) * accumulation)
            terms.append(cfg.grpo_weight * grpo)
        if self.sdpo is not None:
            sdpo = None if sdpo_step is None else self._sdpo_loss(model, inputs, *sdpo_step)
            value = self._log_sdpo(mode, sdpo)
            if mode == "train" and self.taid_schedule is not None:
                self._metrics[mode]["taid_t"].append(self.taid_schedule.t)
                if not math.isnan(value):
                    self._taid_losses.append(value)
            if sdpo is not None:
                terms.append(cfg.sdpo_weight * sdpo / accumulation)
        if cfg.trace_replay_dpo_weight > 0 and self._pairs and mode == "train":
            dpo = self.trace_replay_channel_loss(model)
            terms.append(cfg.trace_replay_dpo_weight * dpo / accumulation)
        if not any(t.requires_grad for t in terms):
            # Every active channel was empty for this micro-batch (e.g. SDPO alone and no sample had a teacher
            # signal): a zero connected to every trainable parameter, so backward() and DDP's reducer still work.
            terms.append(torch.stack([p.sum() for p in model.parameters() if p.requires_grad]).sum() * 0.0)
        return torch.stack([t.reshape(()).to(terms[0].dtype) for t in terms]).sum()

    def _sdpo_step(self, model: Any, inputs: Mapping[str, Any]) -> tuple[_SharedSDPO, torch.Tensor] | None:
        """The SDPO student term of this micro-batch and its ``(B, C)`` token weights; None without signal."""
        assert self.sdpo is not None
        for key in ("sdpo_teacher_prompt_ids", "sdpo_teacher_prompt_mask", "sdpo_mask"):
            if key not in inputs:
                raise KeyError(f"the batch has no {key!r}: it was not produced by ComposerReplicationTrainer")
        signal = inputs["sdpo_mask"] > 0
        if not bool(signal.any()):
            return None
        rows = signal.nonzero(as_tuple=True)[0]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        token_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        c = completion_ids.shape[1]
        prompt = inputs["sdpo_teacher_prompt_ids"][rows]
        t_ids = torch.cat([prompt, completion_ids[rows]], dim=1)
        t_mask = torch.cat([inputs["sdpo_teacher_prompt_mask"][rows], completion_mask[rows]], dim=1)
        teacher, states = self.teacher_states(model, t_ids, t_mask)
        t_states = states.tensor[:, prompt.shape[1] - 1 : prompt.shape[1] - 1 + c]
        flat = t_states.reshape(rows.numel() * c, -1)
        threshold = self.sdpo.config.truncate_below
        if threshold is not None:  # first-error truncation: nothing after the teacher's first disagreement
            with torch.no_grad():
                scored = teacher.score(flat, completion_ids[rows].reshape(-1), is_logits=states.is_logits)
            kept = first_error_mask(scored.logprobs.reshape(rows.numel(), c), token_mask[rows], threshold)
            token_mask = token_mask.clone()
            token_mask[rows] = kept.to(token_mask.dtype)
        slot = torch.full((signal.shape[0],), -1, dtype=torch.long, device=signal.device)
        slot[rows] = torch.arange(rows.numel(), device=signal.device)
        sdpo, taid_t = self.sdpo, None if self.taid_schedule is None else self.taid_schedule.t
        old = inputs.get("old_per_token_logps")

        def factory(sample: torch.Tensor, position: torch.Tensor) -> RowTerm:
            index = slot[sample].clamp_min(0) * c + position
            active = signal[sample] & (token_mask[sample, position] > 0)
            targets = SDPOTargets(
                hidden_source(teacher, flat, lambda r: index[r]),
                taid_t=taid_t,
                labels=completion_ids[sample, position],
                old_logprobs=None if old is None else old[sample, position],
            )
            return sdpo.term(targets, active)

        shape = (completion_ids.shape[0], inputs["prompt_ids"].shape[1] + c)
        return _SharedSDPO(factory, shape, c), token_mask * signal[:, None]

    def teacher_states(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[LMHead, HeadStates]:
        """The SDPO teacher on ``(B, T)`` tokens, under no-grad: its head and its ``(B, T, H)`` decoder states
        (``(B, T, V)`` logits when the head is not separable; ``head.project`` turns states into logits).

        The teacher is the EMA copy, the policy with its adapter's EMA swapped in (PEFT), or the live policy.
        """
        if self.sdpo is None:
            raise ValueError("the SDPO channel is off (sdpo_weight=0)")
        policy = self.accelerator.unwrap_model(model)
        context: AbstractContextManager[Any] = (
            nullcontext(policy) if self.sdpo_teacher is None else self.sdpo_teacher.applied(policy)
        )
        with context as teacher_model, torch.no_grad():
            # Under PEFT the head is the frozen base's (AdapterEmaTeacher checks), so it may project later.
            teacher = LMHead(teacher_model, self._chunk_plan, temperature=self.temperature, precision=self._precision)
            return teacher, teacher.states(input_ids, attention_mask)

    def _sdpo_loss(self, model: Any, inputs: Mapping[str, Any], shared: _SharedSDPO, weights: torch.Tensor) -> Any:
        assert self.sdpo is not None
        scores = shared.scores
        if scores is None:  # GRPO is off (or went through TRL's path): the student gets its own pass
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            scores = score_completions(self._head(model), ids, mask, shared.logits_to_keep, extra=shared.factory)
        assert scores.extra is not None
        # `sdpo_mask` is 1 per sample with a teacher signal, or that sample's routing weight (SC-SDPO); the
        # weight scales its terms while the mean still counts every signalled token once.
        return token_mean(scores.extra * inputs["sdpo_mask"][:, None].to(scores.extra.dtype), weights)

    def sdpo_channel_loss(self, model: Any, inputs: Mapping[str, Any]) -> torch.Tensor | None:
        """The SDPO loss of one micro-batch (before weight and GA scaling); None if no sample has a teacher signal."""
        if self.sdpo is None:
            raise ValueError("the SDPO channel is off (sdpo_weight=0)")
        step = self._sdpo_step(model, inputs)
        return None if step is None else self._sdpo_loss(model, inputs, *step)

    # ------------------------------------------------------------------ trace-replay DPO
    def _setup_trace_replay(self, pairs: Iterable[Mapping[str, Any]] | None) -> None:
        cfg = self.composer_args
        source: Any = pairs if pairs is not None else cfg.trace_replay_path
        if source is None:
            if cfg.trace_replay_dpo_weight > 0:
                raise ValueError(
                    f"trace_replay_dpo_weight={cfg.trace_replay_dpo_weight} but no pairs were given; set "
                    "trace_replay_path (a crf-replaysim pair file), pass trace_replay_pairs, or set the weight to 0"
                )
            return
        if cfg.trace_replay_dpo_weight == 0:
            raise ValueError(
                "trace-replay pairs were given but trace_replay_dpo_weight=0, so they would be ignored; "
                "set trace_replay_dpo_weight > 0 or drop the pairs"
            )
        records = _read_pairs(source, strict=cfg.trace_replay_strict)
        tokenizer = getattr(self._processor, "tokenizer", self._processor)
        self._pairs = tokenize_pairs(records, tokenizer, cfg.trace_replay_max_length, cfg.trace_replay_render)
        self.pair_cursor = PairCursor(
            len(self._pairs),
            cfg.trace_replay_batch_size,
            world_size=self.accelerator.num_processes,
            rank=self.accelerator.process_index,
            seed=cfg.seed,
        )
        self.trace_replay_reference = self._resolve_reference()
        if self.trace_replay_reference == "precomputed":
            self._pair_ref = (
                torch.tensor([float(p.ref_chosen_logps) for p in self._pairs]),  # type: ignore[arg-type]
                torch.tensor([float(p.ref_rejected_logps) for p in self._pairs]),  # type: ignore[arg-type]
            )
        elif self.trace_replay_reference == "initial":
            self._pair_ref = self._score_all_pairs(self.accelerator.unwrap_model(self.model))
        logger.info("trace-replay DPO: %d pairs, reference=%s", len(self._pairs), self.trace_replay_reference)

    def _resolve_reference(self) -> str:
        cfg = self.composer_args
        choice = cfg.trace_replay_reference
        has_precomputed = all(p.ref_chosen_logps is not None and p.ref_rejected_logps is not None for p in self._pairs)
        is_peft = hasattr(self.accelerator.unwrap_model(self.model), "disable_adapter")
        ref_model = self._trace_replay_ref_model or getattr(self, "ref_model", None)
        if self.preference.config.reference_free:
            if choice not in ("auto", "none"):
                logger.warning("dpo_variant='simpo' is reference-free; trace_replay_reference=%r is ignored", choice)
            return "none"
        if choice == "auto":
            if has_precomputed:
                return "precomputed"
            if is_peft:
                return "adapter"
            return "ref_model" if ref_model is not None else "initial"
        if choice == "precomputed" and not has_precomputed:
            raise ValueError(
                "trace_replay_reference='precomputed' but some records lack numeric ref_chosen_logps/"
                "ref_rejected_logps; add them or use 'initial'"
            )
        if choice == "adapter" and not is_peft:
            raise ValueError("trace_replay_reference='adapter' needs a PEFT policy (pass peft_config); use 'initial'")
        if choice == "ref_model" and ref_model is None:
            raise ValueError(
                "trace_replay_reference='ref_model' but there is no reference model: pass trace_replay_ref_model "
                "or set beta != 0 so TRL loads one; or use 'initial'"
            )
        return choice

    def _pair_logps(self, model: Any, batch: SequenceBatch) -> tuple[SequenceLogps, SequenceLogps]:
        """Chosen and rejected sequence log-probs (``P`` rows each) of a collated pair batch."""
        head = LMHead(model, self._chunk_plan, unwrap=self.accelerator.unwrap_model, precision=self._precision)
        logps = self.preference.sequence_logps(head, batch)
        p = batch.input_ids.shape[0] // 2
        return logps.rows(slice(0, p)), logps.rows(slice(p, 2 * p))

    @torch.no_grad()
    def _score_all_pairs(self, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = [], []
        step = max(1, self.composer_args.trace_replay_batch_size)
        for start in range(0, len(self._pairs), step):
            batch = collate_pairs(self._pairs[start : start + step], self._pad_id(), self.accelerator.device)
            c, r = self._pair_logps(model, batch)
            chosen.append(c.total.float().cpu())
            rejected.append(r.total.float().cpu())
        return torch.cat(chosen), torch.cat(rejected)

    def _reference_logps(self, model: Any, idx: list[int], batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pair_ref is not None:
            ref_c, ref_r = (t[idx] for t in self._pair_ref)
            return ref_c, ref_r
        with torch.no_grad():
            if self.trace_replay_reference == "adapter":
                policy: Any = self.accelerator.unwrap_model(model)
                with policy.disable_adapter():
                    c, r = self._pair_logps(policy, batch)
            else:
                c, r = self._pair_logps(self._trace_replay_ref_model or self.ref_model, batch)
        return c.total, r.total

    def trace_replay_channel_loss(self, model: Any, indices: Sequence[int] | None = None) -> torch.Tensor:
        """The trace-replay DPO loss on this rank's next pairs (or ``indices``), before weight and GA scaling."""
        if self.pair_cursor is None:
            raise ValueError("the trace-replay DPO channel has no pairs (trace_replay_dpo_weight=0)")
        idx = list(indices) if indices is not None else self.pair_cursor.next()
        if not idx or not all(0 <= i < len(self._pairs) for i in idx):
            raise IndexError(f"pair indices must be in [0, {len(self._pairs)}), got {idx}")
        batch = collate_pairs([self._pairs[i] for i in idx], self._pad_id(), self.accelerator.device)
        chosen, rejected = self._pair_logps(model, batch)
        ref_c = ref_r = None
        if not self.preference.config.reference_free:
            ref_c, ref_r = self._reference_logps(model, idx, batch)
            ref_c, ref_r = ref_c.to(chosen.total.device), ref_r.to(chosen.total.device)
        result = self.preference.loss(chosen, rejected, ref_c, ref_r)
        mode = self._mode()
        self._log_channel(mode, "trace_replay_dpo", float(result.loss.detach()))
        self._log_channel(mode, "trace_replay_dpo/rewards/chosen", float(result.chosen_reward.mean()))
        self._log_channel(mode, "trace_replay_dpo/rewards/rejected", float(result.rejected_reward.mean()))
        self._log_channel(mode, "trace_replay_dpo/rewards/margin", float(result.margin.mean()))
        self._log_channel(mode, "trace_replay_dpo/rewards/accuracy", float((result.margin > 0).float().mean()))
        if not math.isfinite(float(result.loss.detach())):
            self._warn_once("trace-replay DPO loss is not finite; check the pairs and the reference")
        return result.loss

    # ------------------------------------------------------------------ checkpoints
    def channel_config(self) -> dict[str, Any]:
        """The settings that decide which channel state exists and how it evolves (saved with it, compared on
        resume): the three weights, the SDPO teacher (``sdpo_teacher``, its EMA rate, ``sdpo_teacher_state``
        ``'full'`` or ``'adapter'``), ``sdpo_wrapper`` and, with TAID, its schedule; None where a channel is off."""
        cfg = self.composer_args
        sdpo = self.sdpo is not None
        config: dict[str, Any] = {
            "grpo_weight": float(cfg.grpo_weight),
            "sdpo_weight": float(cfg.sdpo_weight),
            "trace_replay_dpo_weight": float(cfg.trace_replay_dpo_weight),
            "sdpo_teacher": cfg.sdpo_teacher if sdpo else None,
            "sdpo_teacher_update_rate": None if self.sdpo_teacher is None else self.sdpo_teacher.rate,
            "sdpo_teacher_state": None if self.sdpo_teacher is None else self.sdpo_teacher.kind,
            "sdpo_wrapper": cfg.sdpo_wrapper if sdpo else None,
        }
        taid = self.taid_schedule is not None
        for name in ("taid_alpha_min", "taid_alpha_max", "taid_step_size", "taid_momentum", "taid_adaptive"):
            value = getattr(cfg, name)
            config[name] = None if not taid else bool(value) if isinstance(value, bool) else float(value)
        return config

    def channel_state(self) -> ChannelState:
        """The state of the channels that outlives a step (EMA teacher, TAID schedule, pair cursor) and
        :meth:`channel_config`."""
        return ChannelState(
            teacher=None if self.sdpo_teacher is None else self.sdpo_teacher.state_dict(),
            taid=None if self.taid_schedule is None else self.taid_schedule.state_dict(),
            pairs=None if self.pair_cursor is None else self.pair_cursor.state_dict(),
            config=self.channel_config(),
        )

    def _stateful_parts(self) -> list[str]:
        return [
            name
            for name, own in (
                ("EMA self-teacher", self.sdpo_teacher),
                ("TAID schedule", self.taid_schedule),
                ("trace-replay pair cursor", self.pair_cursor),
            )
            if own is not None
        ]

    def load_channel_state(self, state: ChannelState, where: str = "the checkpoint") -> None:
        """Restore :meth:`channel_state`. Any difference is a ``ValueError`` naming it: another channel config, a
        part this run has but the state lacks, or one the state has but this run does not use."""
        if state.config is None:
            raise ValueError(f"{where} records no channel config, so it cannot be checked against this run")
        message = config_mismatch(state.config, self.channel_config(), where)
        if message is not None:
            raise ValueError(message)
        for name, own, saved in (
            ("EMA self-teacher", self.sdpo_teacher, state.teacher),
            ("TAID schedule", self.taid_schedule, state.taid),
            ("trace-replay pair cursor", self.pair_cursor, state.pairs),
        ):
            if own is not None and saved is None:
                raise ValueError(
                    f"{where} has no {name} state, but this run has one; resume with the same ComposerConfig, "
                    "or start a fresh run"
                )
            if own is None and saved is not None:
                raise ValueError(
                    f"{where} has {name} state, but this run does not use one; resume with the same "
                    "ComposerConfig, or start a fresh run"
                )
        if self.sdpo_teacher is not None and state.teacher is not None:
            self.sdpo_teacher.load_state_dict(state.teacher)
        if self.taid_schedule is not None and state.taid is not None:
            self.taid_schedule.load_state_dict(state.taid)
        if self.pair_cursor is not None and state.pairs is not None:
            self.pair_cursor.load_state_dict(state.pairs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            self.channel_state().save(folder)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state = ChannelState.load(checkpoint)
        if state is not None:
            self.load_channel_state(state, where=f"checkpoint {checkpoint}")
            return
        parts = self._stateful_parts()
        if parts:
            raise ValueError(
                f"checkpoint {checkpoint} has no {STATE_FILE} (it was not saved by ComposerReplicationTrainer, e.g. "
                f"a TRL GRPOTrainer checkpoint), but this run keeps state across steps ({', '.join(parts)}); "
                "resuming would silently restart it from the resumed weights. Resume from a checkpoint this "
                "trainer saved with the same ComposerConfig, or start a fresh run from the checkpoint's weights "
                "(load the model from it, without resume_from_checkpoint)"
            )
        logger.info("checkpoint %s has no crf channel state; this run keeps none, so none is restored", checkpoint)


def _read_pairs(source: Any, *, strict: bool) -> list[dict[str, Any]]:
    """Pair records from a crf-replaysim pair file (schema-checked) or an iterable of mappings."""
    if isinstance(source, (str, os.PathLike)):
        from crf_core.trainer.pair_files import read_pair_file

        return check_pair_records(read_pair_file(source, strict=strict))
    return check_pair_records(source)
