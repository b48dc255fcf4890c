"""``ComposerConfig``: TRL's ``GRPOConfig`` plus the SDPO and trace-replay DPO channels.

Every TRL field keeps its meaning and default. The added fields are grouped by channel; each has its
help text in the dataclass field metadata, so ``transformers.HfArgumentParser(ComposerConfig)``
exposes them as command-line flags. SDPO defaults follow the SDPO paper's run configuration
(lasgroup/SDPO ``actor.yaml`` / ``sdpo.yaml``: alpha 0.5, top-k 100 with a tail bucket, IS clip 2,
EMA teacher at rate 0.05, reprompt switches on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from crf_core.trainer.reprompt import (
    DEFAULT_FEEDBACK_TEMPLATE,
    DEFAULT_REPROMPT_TEMPLATE,
    DEFAULT_SOLUTION_TEMPLATE,
    RepromptConfig,
)

__all__ = ["TRACE_REPLAY_REFERENCES", "ComposerConfig"]

#: Where the trace-replay DPO channel gets reference log-probs from (see ``trace_replay_reference``).
TRACE_REPLAY_REFERENCES: tuple[str, ...] = ("auto", "precomputed", "initial", "ref_model", "adapter", "none")


def _weight(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number ≥ 0 (0 turns the channel off), got {value!r}")


@dataclass
class ComposerConfig(GRPOConfig):
    """Configuration of ``ComposerReplicationTrainer``: every ``GRPOConfig`` field plus the fields below.

    Channels and their loss terms (each logged under its own name):
    ``grpo`` (TRL's GRPO loss, untouched) × ``grpo_weight``; ``sdpo_jsd`` (self-distillation from the
    feedback-conditioned self-teacher) × ``sdpo_weight``; ``trace_replay_dpo`` (DPO on recorded
    trace pairs) × ``trace_replay_dpo_weight``. A weight of 0 turns a channel off.
    """

    # ----------------------------------------------------------------- channel weights
    grpo_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of TRL's GRPO loss (channel `grpo`). 0 skips its forward pass entirely."},
    )
    sdpo_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of the SDPO self-distillation loss (channel `sdpo_jsd`). 0 turns SDPO off."},
    )
    trace_replay_dpo_weight: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the trace-replay DPO loss (channel `trace_replay_dpo`). Needs pairs "
            "(`trace_replay_path` or the trainer's `trace_replay_pairs`); 0 turns the channel off."
        },
    )

    # ----------------------------------------------------------------- SDPO: divergence
    sdpo_alpha: float = field(
        default=0.5,
        metadata={
            "help": "Generalised JSD interpolation in [0, 1]: 0 = forward KL(teacher‖student), "
            "1 = reverse KL(student‖teacher), in between = JSD with mixture (1-α)·S + α·T."
        },
    )
    sdpo_top_k: int | None = field(
        default=100,
        metadata={
            "help": "Distil on the student's top-k tokens per position (full-vocab-normalised log-probs). "
            "None = the full vocabulary."
        },
    )
    sdpo_add_tail: bool = field(
        default=True,
        metadata={"help": "With top-k, add one tail bucket holding 1 − Σ top-k mass (else renormalise the top-k)."},
    )
    sdpo_is_clip: float | None = field(
        default=2.0,
        metadata={
            "help": "Truncated importance weight min(π_θ/π_old, clip) (detached) on each token's SDPO loss; "
            "None disables it. It is 1 when training is on-policy."
        },
    )

    # ----------------------------------------------------------------- SDPO: teacher
    sdpo_teacher: str = field(
        default="ema",
        metadata={
            "help": "Self-teacher weights: 'ema' = an exponential moving average of the policy, started from "
            "the initial policy; 'live' = the current policy itself (under no-grad)."
        },
    )
    sdpo_teacher_update_rate: float = field(
        default=0.05,
        metadata={
            "help": "EMA rate r in θ_T ← (1 − r)·θ_T + r·θ_S, applied after every optimizer step ('ema' teacher). "
            "0 freezes the teacher at the initial policy."
        },
    )

    # ----------------------------------------------------------------- SDPO: reprompting
    sdpo_success_reward_threshold: float = field(
        default=1.0,
        metadata={"help": "A rollout whose total (weighted) reward is ≥ this is a successful demonstration."},
    )
    sdpo_dont_reprompt_on_self_success: bool = field(
        default=True,
        metadata={"help": "Never use a sample's own response as its demonstration (use a peer's success)."},
    )
    sdpo_remove_thinking_from_demonstration: bool = field(
        default=True, metadata={"help": "Strip <think>…</think> blocks from demonstrations."}
    )
    sdpo_include_environment_feedback: bool = field(
        default=True,
        metadata={
            "help": "Use the feedback reward functions report through TRL's `log_extra(sdpo_feedback_key, values)`."
        },
    )
    sdpo_environment_feedback_only_without_solution: bool = field(
        default=True, metadata={"help": "Use feedback only for samples that have no successful demonstration."}
    )
    sdpo_feedback_key: str = field(
        default="feedback",
        metadata={"help": "The `log_extra` column name whose values are the SDPO environment feedback strings."},
    )
    sdpo_reprompt_template: str = field(
        default=DEFAULT_REPROMPT_TEMPLATE,
        metadata={"help": "Teacher prompt template with {prompt}, {solution} and {feedback}."},
    )
    sdpo_solution_template: str = field(
        default=DEFAULT_SOLUTION_TEMPLATE,
        metadata={"help": "Demonstration template with {successful_previous_attempt}."},
    )
    sdpo_feedback_template: str = field(
        default=DEFAULT_FEEDBACK_TEMPLATE, metadata={"help": "Feedback template with {feedback_raw}."}
    )
    sdpo_max_reprompt_len: int = field(
        default=10240,
        metadata={"help": "Longest teacher prompt in tokens; longer ones follow sdpo_reprompt_truncation."},
    )
    sdpo_reprompt_truncation: str = field(
        default="right",
        metadata={
            "help": "What to do with a too-long teacher prompt: 'right' drops its end, 'left' its beginning, "
            "'error' raises."
        },
    )

    # ----------------------------------------------------------------- trace-replay DPO
    trace_replay_path: str | None = field(
        default=None,
        metadata={
            "help": "JSONL file of DPO pair records written by crf-replaysim (normalised records with flat "
            "`prompt`/`chosen`/`rejected` strings)."
        },
    )
    dpo_variant: str = field(
        default="sigmoid",
        metadata={
            "help": "Preference loss: a TRL DPO `loss_type` name (sigmoid, hinge, ipo, robust, …) or 'simpo' "
            "(reference-free, length-normalised)."
        },
    )
    dpo_beta: float = field(default=0.1, metadata={"help": "DPO β (inverse temperature of the implicit reward)."})
    dpo_label_smoothing: float = field(
        default=0.0, metadata={"help": "ε for the variants that use it (robust, exo_pair); ignored by the others."}
    )
    simpo_beta: float = field(default=2.0, metadata={"help": "SimPO β (scale of the average log-prob margin)."})
    simpo_gamma: float = field(default=1.0, metadata={"help": "SimPO target margin γ (absolute, not γ/β)."})
    trace_replay_batch_size: int = field(
        default=2, metadata={"help": "Pairs per micro-batch for the trace-replay DPO channel (cycled, reshuffled)."}
    )
    trace_replay_max_length: int = field(
        default=512,
        metadata={
            "help": "Longest prompt+response in tokens; the prompt is cut from the left, the response from the right."
        },
    )
    trace_replay_reference: str = field(
        default="auto",
        metadata={
            "help": "Reference log-probs for DPO: 'precomputed' (record fields `ref_chosen_logps`/"
            "`ref_rejected_logps`), 'initial' (computed once from the initial policy at start), 'ref_model' "
            "(the trainer's reference model), 'adapter' (PEFT policy with its adapter disabled), 'none' (SimPO "
            "only), or 'auto' (none for SimPO, else precomputed if every record has them, else adapter for "
            "PEFT, else ref_model if there is one, else initial)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("grpo_weight", "sdpo_weight", "trace_replay_dpo_weight"):
            _weight(name, getattr(self, name))
        if self.grpo_weight == self.sdpo_weight == self.trace_replay_dpo_weight == 0:
            raise ValueError("every channel weight is 0, so nothing would be trained; set at least one weight > 0")
        if not 0.0 <= self.sdpo_alpha <= 1.0:
            raise ValueError(f"sdpo_alpha must be in [0, 1] (0 forward KL, 1 reverse KL), got {self.sdpo_alpha}")
        if self.sdpo_top_k is not None and (not isinstance(self.sdpo_top_k, int) or self.sdpo_top_k < 1):
            raise ValueError(f"sdpo_top_k must be a positive int or None (full vocabulary), got {self.sdpo_top_k!r}")
        if self.sdpo_is_clip is not None and not self.sdpo_is_clip > 0:
            raise ValueError(f"sdpo_is_clip must be > 0 or None (disabled), got {self.sdpo_is_clip!r}")
        if self.sdpo_teacher not in ("ema", "live"):
            raise ValueError(f"sdpo_teacher must be 'ema' or 'live', got {self.sdpo_teacher!r}")
        if not 0.0 <= self.sdpo_teacher_update_rate <= 1.0:
            raise ValueError(f"sdpo_teacher_update_rate must be in [0, 1], got {self.sdpo_teacher_update_rate}")
        if self.sdpo_reprompt_truncation not in ("left", "right", "error"):
            raise ValueError(
                f"sdpo_reprompt_truncation must be 'left', 'right' or 'error', got {self.sdpo_reprompt_truncation!r}"
            )
        if not (isinstance(self.sdpo_max_reprompt_len, int) and self.sdpo_max_reprompt_len > 0):
            raise ValueError(f"sdpo_max_reprompt_len must be a positive int, got {self.sdpo_max_reprompt_len!r}")
        self.reprompt_config()  # validates the templates and the threshold
        _check_dpo_variant(self.dpo_variant)
        if not self.dpo_beta > 0 or not self.simpo_beta > 0:
            raise ValueError(f"dpo_beta and simpo_beta must be > 0, got {self.dpo_beta} and {self.simpo_beta}")
        if not 0.0 <= self.dpo_label_smoothing < 0.5:
            raise ValueError(f"dpo_label_smoothing must be in [0, 0.5), got {self.dpo_label_smoothing}")
        if not (isinstance(self.trace_replay_batch_size, int) and self.trace_replay_batch_size >= 1):
            raise ValueError(f"trace_replay_batch_size must be a positive int, got {self.trace_replay_batch_size!r}")
        if not (isinstance(self.trace_replay_max_length, int) and self.trace_replay_max_length >= 2):
            raise ValueError(f"trace_replay_max_length must be an int ≥ 2, got {self.trace_replay_max_length!r}")
        if self.trace_replay_reference not in TRACE_REPLAY_REFERENCES:
            raise ValueError(
                f"trace_replay_reference must be one of {TRACE_REPLAY_REFERENCES}, got {self.trace_replay_reference!r}"
            )
        if self.trace_replay_reference == "none" and self.dpo_variant != "simpo":
            raise ValueError(
                f"trace_replay_reference='none' only works with dpo_variant='simpo' (reference-free); "
                f"{self.dpo_variant!r} needs reference log-probs"
            )

    def reprompt_config(self) -> RepromptConfig:
        """The ``RepromptConfig`` these fields describe."""
        return RepromptConfig(
            reprompt_template=self.sdpo_reprompt_template,
            solution_template=self.sdpo_solution_template,
            feedback_template=self.sdpo_feedback_template,
            success_reward_threshold=self.sdpo_success_reward_threshold,
            dont_reprompt_on_self_success=self.sdpo_dont_reprompt_on_self_success,
            remove_thinking_from_demonstration=self.sdpo_remove_thinking_from_demonstration,
            include_environment_feedback=self.sdpo_include_environment_feedback,
            environment_feedback_only_without_solution=self.sdpo_environment_feedback_only_without_solution,
        )


def _check_dpo_variant(variant: str) -> None:
    from crf_core.trainer.replay_dpo import DPO_VARIANTS

    if variant not in DPO_VARIANTS:
        raise ValueError(f"dpo_variant must be one of {sorted(DPO_VARIANTS)}, got {variant!r}")
