"""``ComposerReplicationTrainer``: TRL's ``GRPOTrainer`` plus SDPO self-distillation and trace-replay DPO.

Loss of one micro-batch (``GA`` = gradient-accumulation steps in training, 1 in evaluation)::

    L = w_grpo · L_grpo  +  w_sdpo · L_sdpo / GA  +  w_dpo · L_dpo / GA

* ``L_grpo``: ``GRPOTrainer.compute_loss`` unchanged (TRL's own normalisation, already GA-scaled).
* ``L_sdpo``: generalised JSD between the policy on ``[prompt ; response]`` and the self-teacher (the
  policy, or its EMA copy) under no-grad on ``[reprompt ; response]``, token-mean over the response
  tokens of samples that have a teacher signal (a successful peer in the group or feedback).
* ``L_dpo``: DPO (a TRL loss_type, or SimPO) on a cycled mini-batch of trace-replay pairs.

Metrics (``self._metrics``, averaged per logging step like TRL's): ``grpo``, ``sdpo_jsd`` and
``trace_replay_dpo`` are each channel's per-micro-batch value before its weight and before GA
scaling; ``self_distillation/*`` are the reprompting fractions of the SDPO reference code;
``trace_replay_dpo/*`` are implicit rewards and accuracy. TRL's own metrics (reward, kl, entropy,
clip ratios, …) are untouched.

Data flow: ``_calculate_rewards`` is wrapped to keep each generation batch's prompts, completions and
gathered rewards; reward functions report feedback through TRL's ``log_extra(sdpo_feedback_key, …)``,
captured by the ``_log_completion_extra`` override; ``_generate_and_score_completions`` then adds
``sdpo_teacher_prompt_ids``/``sdpo_teacher_prompt_mask`` ``(B, L)`` and ``sdpo_mask`` ``(B,)`` to the
batch (batch-first, so TRL's shuffle/split keeps them aligned).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl import GRPOTrainer

from crf_core.trainer._trl_contract import (
    GENERATION_OUTPUT_KEYS,
    TRLContractError,
    check_trainer_attributes,
    check_trl_contract,
)
from crf_core.trainer.config import ComposerConfig
from crf_core.trainer.replay_dpo import (
    TokenizedPair,
    collate_pairs,
    load_pair_records,
    pair_logps,
    preference_loss,
    tokenize_pairs,
)
from crf_core.trainer.reprompt import PromptLike, build_reprompts
from crf_core.trainer.sdpo import EmaTeacher, response_logits, sdpo_loss

__all__ = ["ComposerReplicationTrainer"]

logger = logging.getLogger(__name__)


class _EmaUpdate(TrainerCallback):
    """Moves the EMA self-teacher toward the policy after every optimizer step."""

    def __init__(self, trainer: ComposerReplicationTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        teacher = self.trainer.sdpo_teacher
        if teacher is not None:
            teacher.update(self.trainer.accelerator.unwrap_model(self.trainer.model))


class ComposerReplicationTrainer(GRPOTrainer):
    """GRPO (TRL, untouched) + SDPO self-distillation + trace-replay DPO, each weighted and logged.

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
        self._reprompt_config = args.reprompt_config()
        self._capture: tuple[list[Any], list[Any], torch.Tensor] | None = None
        self._feedback_calls: list[list[Any]] = []

        self.sdpo_teacher: EmaTeacher | None = None
        if args.sdpo_weight > 0 and args.sdpo_teacher == "ema":
            self.sdpo_teacher = EmaTeacher(self.accelerator.unwrap_model(self.model), args.sdpo_teacher_update_rate)
            self.add_callback(_EmaUpdate(self))

        self._pairs: list[TokenizedPair] = []
        self._pair_ref: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pair_order: list[int] = []
        self._pair_cursor = 0
        self._pair_generator = torch.Generator().manual_seed(args.seed + 7919 * self.accelerator.process_index)
        self._trace_replay_ref_model = trace_replay_ref_model
        self.trace_replay_reference = "none"
        self._setup_trace_replay(trace_replay_pairs)

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
        if self.composer_args.sdpo_weight > 0:
            output.update(self._teacher_inputs(output))
        return output

    def _local_feedback(self, n: int) -> list[str | None] | None:
        if not self._feedback_calls:
            return None
        merged: list[str | None] = [None] * n
        for values in self._feedback_calls:
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
        start = self.accelerator.process_index * n_local
        local = batch.reprompts[start : start + n_local]
        ids = self._tokenize_teacher_prompts([r.prompt for r in local])
        width = max(len(x) for x in ids)
        teacher_ids = torch.full((n_local, width), self._pad_id(), dtype=torch.long)
        teacher_mask = torch.zeros((n_local, width), dtype=torch.long)
        for i, row in enumerate(ids):  # left padding, like TRL's prompts
            if row:
                teacher_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                teacher_mask[i, width - len(row) :] = 1
        signal = torch.tensor([float(r.has_signal) for r in local])
        return {
            "sdpo_teacher_prompt_ids": teacher_ids.to(device),
            "sdpo_teacher_prompt_mask": teacher_mask.to(device),
            "sdpo_mask": signal.to(device),
        }

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
        if cfg.grpo_weight > 0:
            grpo = super().compute_loss(model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)
            self._metrics[mode]["grpo"].append(float(grpo.detach()) * accumulation)
            terms.append(cfg.grpo_weight * grpo)
        if cfg.sdpo_weight > 0:
            sdpo = self.sdpo_channel_loss(model, inputs)
            if sdpo is not None:
                self._metrics[mode]["sdpo_jsd"].append(float(sdpo.detach()))
                terms.append(cfg.sdpo_weight * sdpo / accumulation)
        if cfg.trace_replay_dpo_weight > 0 and self._pairs and mode == "train":
            dpo = self.trace_replay_channel_loss(model)
            self._metrics[mode]["trace_replay_dpo"].append(float(dpo.detach()))
            terms.append(cfg.trace_replay_dpo_weight * dpo / accumulation)
        if not any(t.requires_grad for t in terms):
            # Every active channel was empty for this micro-batch (e.g. SDPO alone and no sample had a
            # teacher signal): return a zero that is still connected to the graph so backward() works.
            anchor = next(p for p in model.parameters() if p.requires_grad)
            terms.append(anchor.sum() * 0.0)
        return torch.stack([t.reshape(()) for t in terms]).sum()

    def sdpo_channel_loss(self, model: Any, inputs: Mapping[str, Any]) -> torch.Tensor | None:
        """The SDPO loss of one micro-batch (before weight and GA scaling); None if no sample has a teacher signal."""
        for key in ("sdpo_teacher_prompt_ids", "sdpo_teacher_prompt_mask", "sdpo_mask"):
            if key not in inputs:
                raise KeyError(f"the batch has no {key!r}: it was not produced by ComposerReplicationTrainer")
        keep = inputs["sdpo_mask"] > 0
        if not bool(keep.any()):
            return None
        rows = keep.nonzero(as_tuple=True)[0]
        completion_ids = inputs["completion_ids"][rows]
        completion_mask = inputs["completion_mask"][rows]
        if "tool_mask" in inputs:
            completion_mask = completion_mask * inputs["tool_mask"][rows]
        student = response_logits(
            model,
            inputs["prompt_ids"][rows],
            inputs["prompt_mask"][rows],
            completion_ids,
            completion_mask,
            temperature=self.temperature,
        )
        teacher_model = (
            self.sdpo_teacher.module if self.sdpo_teacher is not None else self.accelerator.unwrap_model(model)
        )
        with torch.no_grad():
            teacher = response_logits(
                teacher_model,
                inputs["sdpo_teacher_prompt_ids"][rows],
                inputs["sdpo_teacher_prompt_mask"][rows],
                completion_ids,
                completion_mask,
                temperature=self.temperature,
            )
        old = inputs.get("old_per_token_logps")
        cfg = self.composer_args
        return sdpo_loss(
            student,
            teacher,
            completion_ids,
            completion_mask,
            torch.ones(rows.numel(), device=student.device),
            alpha=cfg.sdpo_alpha,
            top_k=cfg.sdpo_top_k,
            add_tail=cfg.sdpo_add_tail,
            is_clip=cfg.sdpo_is_clip,
            old_logprobs=old[rows] if old is not None else None,
        )

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
        records = load_pair_records(source)
        tokenizer = getattr(self._processor, "tokenizer", self._processor)
        self._pairs = tokenize_pairs(records, tokenizer, cfg.trace_replay_max_length)
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
        if cfg.dpo_variant == "simpo":
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

    @torch.no_grad()
    def _score_all_pairs(self, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = [], []
        step = max(1, self.composer_args.trace_replay_batch_size)
        device = self.accelerator.device
        for start in range(0, len(self._pairs), step):
            batch = collate_pairs(self._pairs[start : start + step], self._pad_id(), device)
            c, r = pair_logps(model, batch, average=False)
            chosen.append(c.float().cpu())
            rejected.append(r.float().cpu())
        return torch.cat(chosen), torch.cat(rejected)

    def _next_pair_indices(self) -> list[int]:
        out = []
        for _ in range(self.composer_args.trace_replay_batch_size):
            if self._pair_cursor >= len(self._pair_order):
                self._pair_order = torch.randperm(len(self._pairs), generator=self._pair_generator).tolist()
                self._pair_cursor = 0
            out.append(self._pair_order[self._pair_cursor])
            self._pair_cursor += 1
        return out

    def _reference_context(self, model: Any) -> AbstractContextManager[Any]:
        if self.trace_replay_reference == "adapter":
            policy: Any = self.accelerator.unwrap_model(model)
            context: AbstractContextManager[Any] = policy.disable_adapter()
            return context
        return nullcontext()

    def trace_replay_channel_loss(self, model: Any, indices: Sequence[int] | None = None) -> torch.Tensor:
        """The trace-replay DPO loss on the next cycled pairs (or ``indices``), before weight and GA scaling."""
        cfg = self.composer_args
        idx = list(indices) if indices is not None else self._next_pair_indices()
        if not idx or not all(0 <= i < len(self._pairs) for i in idx):
            raise IndexError(f"pair indices must be in [0, {len(self._pairs)}), got {idx}")
        pairs = [self._pairs[i] for i in idx]
        batch = collate_pairs(pairs, self._pad_id(), self.accelerator.device)
        simpo = cfg.dpo_variant == "simpo"
        policy_c, policy_r = pair_logps(model, batch, average=simpo)
        ref_c = ref_r = None
        if not simpo:
            if self._pair_ref is not None:
                ref_c, ref_r = (t[idx].to(policy_c.device, policy_c.dtype) for t in self._pair_ref)
            else:
                ref: Any = (
                    self.accelerator.unwrap_model(model)
                    if self.trace_replay_reference == "adapter"
                    else (self._trace_replay_ref_model or self.ref_model)
                )
                with torch.no_grad(), self._reference_context(model):
                    ref_c, ref_r = pair_logps(ref, batch, average=False)
        lengths = batch.response_mask[:, 1:].sum(-1).to(policy_c.dtype)
        loss = preference_loss(
            policy_c,
            policy_r,
            ref_c,
            ref_r,
            variant=cfg.dpo_variant,
            beta=cfg.dpo_beta,
            label_smoothing=cfg.dpo_label_smoothing,
            simpo_beta=cfg.simpo_beta,
            simpo_gamma=cfg.simpo_gamma,
            chosen_lengths=lengths[: len(idx)],
            rejected_lengths=lengths[len(idx) :],
        )
        mode = self._mode()
        with torch.no_grad():
            if simpo:
                margin = cfg.simpo_beta * (policy_c - policy_r)
                chosen_reward, rejected_reward = cfg.simpo_beta * policy_c, cfg.simpo_beta * policy_r
            else:
                assert ref_c is not None
                assert ref_r is not None
                chosen_reward, rejected_reward = cfg.dpo_beta * (policy_c - ref_c), cfg.dpo_beta * (policy_r - ref_r)
                margin = chosen_reward - rejected_reward
        metrics = self._metrics[mode]
        metrics["trace_replay_dpo/rewards/chosen"].append(float(chosen_reward.mean()))
        metrics["trace_replay_dpo/rewards/rejected"].append(float(rejected_reward.mean()))
        metrics["trace_replay_dpo/rewards/margin"].append(float(margin.mean()))
        metrics["trace_replay_dpo/rewards/accuracy"].append(float((margin > 0).float().mean()))
        if not math.isfinite(float(loss.detach())):
            logger.warning("trace-replay DPO loss is not finite (%s); check the pairs and the reference", float(loss))
        return loss
