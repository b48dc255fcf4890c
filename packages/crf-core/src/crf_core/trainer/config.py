"""``ComposerConfig``: TRL's ``GRPOConfig`` plus the SDPO and trace-replay DPO channels.

Every TRL field keeps its meaning and default. The added fields are grouped by channel; each has its
help text in the dataclass field metadata, so ``transformers.HfArgumentParser(ComposerConfig)``
exposes them as command-line flags. SDPO defaults follow the SDPO paper's run configuration
(lasgroup/SDPO ``actor.yaml`` / ``sdpo.yaml``: alpha 0.5, top-k 100 with a tail bucket, IS clip 2,
EMA teacher at rate 0.05, reprompt switches on); TAID's follow the paper (t from 0.4 to 1.0, adaptive).
The config builds the frozen channel configs of ``crf_core.channels`` (:meth:`ComposerConfig.sdpo_config`,
:meth:`ComposerConfig.preference_config`, :meth:`ComposerConfig.chunk_plan`), which validate every value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl import GRPOConfig

from crf_core.channels import ChunkPlan, PreferenceConfig, SDPOConfig
from crf_core.channels._validate import check_weight
from crf_core.trainer.pairs import PAIR_RENDERINGS
from crf_core.trainer.reprompt import (
    DEFAULT_FEEDBACK_TEMPLATE,
    DEFAULT_REPROMPT_TEMPLATE,
    DEFAULT_SOLUTION_TEMPLATE,
    RepromptConfig,
)
from crf_core.trainer.sdpo_routing import SDPO_GROUP_WEIGHTS, SDPO_ROUTINGS, SDPOGroupWeight, SDPORouting
from crf_core.trainer.success import (
    SUCCESS_THRESHOLD_MODES,
    SuccessMonitor,
    SuccessThresholdMode,
    effective_success_threshold,
)
from crf_core.trainer.trl_sdpo import IS_CLIP_UNSET, resolve_trl_sdpo_options
from crf_distill import TAIDSchedule

__all__ = ["TRACE_REPLAY_REFERENCES", "ComposerConfig"]

#: Where the trace-replay DPO channel gets reference log-probs from (see ``trace_replay_reference``).
TRACE_REPLAY_REFERENCES: tuple[str, ...] = ("auto", "precomputed", "initial", "ref_model", "adapter", "none")


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

    sdpo_wrapper: str | None = field(
        default=None,
        metadata={
            "help": "Distillation wrapper of the SDPO divergence: None (generalised JSD), 'taid' (TAID's interpolated "
            "target between the current student and the teacher replaces the teacher; t from taid_alpha_min to "
            "taid_alpha_max) or 'entropy_opd' (reverse KL plus forward KL where the teacher entropy exceeds "
            "entropy_opd_h_max)."
        },
    )
    taid_alpha_min: float = field(
        default=0.4, metadata={"help": "TAID: t at the start of training (the paper's t_start)."}
    )
    taid_alpha_max: float = field(default=1.0, metadata={"help": "TAID: the final t (the paper's t_end)."})
    taid_adaptive: bool = field(
        default=True,
        metadata={
            "help": "TAID: adaptive schedule (momentum of the relative loss change pushes t above its linear floor, "
            "paper Alg. 1); False = the linear schedule t_start + (t_end - t_start)·step/max_steps."
        },
    )
    taid_step_size: float = field(default=5e-4, metadata={"help": "TAID: the adaptive step size of t (paper's α)."})
    taid_momentum: float = field(default=0.99, metadata={"help": "TAID: momentum of the adaptive update (paper's β)."})
    entropy_opd_h_max: float | None = field(
        default=None,
        metadata={"help": "Entropy-OPD: teacher-entropy threshold in nats (required with sdpo_wrapper='entropy_opd')."},
    )
    entropy_opd_gate: str = field(
        default="hard",
        metadata={
            "help": "Entropy-OPD gate on the teacher entropy H: 'hard' 1[H > h_max], 'sigmoid' σ(s·(H − h_max)) or "
            "'linear' clamp(H / h_max, 0, 1)."
        },
    )
    entropy_opd_sharpness: float = field(default=5.0, metadata={"help": "Entropy-OPD: s of the sigmoid gate."})
    entropy_opd_forward_weight: float = field(
        default=1.0, metadata={"help": "Entropy-OPD: weight of the gated forward-KL term."}
    )
    sdpo_truncate_below: float | None = field(
        default=None,
        metadata={
            "help": "First-error truncation (crf): a completion's first token whose teacher probability is below "
            "this is where the rollout went wrong; SDPO trains up to and including it and on nothing after it. "
            "None trains on every completion token (SDPO)."
        },
    )

    # ----------------------------------------------------------------- LM head execution
    lm_head_chunking: str = field(
        default="auto",
        metadata={
            "help": "Run the LM head in chunks of tokens so no (batch, tokens, vocab) logits tensor exists (GRPO "
            "log-probs and entropies, the SDPO student and teacher, the DPO pairs, the no-grad old/reference passes): "
            "'auto' chunks when a pass's logits would exceed 64 MiB (e.g. 110 tokens at Qwen's 151,936 "
            "vocabulary), 'on' always, 'off' never. Models without a separable linear head use TRL's own path."
        },
    )
    chunk_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per LM-head chunk; None sizes chunks to 8 MiB of float32 logits (13 at 151,936)."},
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

    # ----------------------------------------------------------------- SDPO: which rollouts, how much
    sdpo_routing: SDPORouting = field(
        default="all",
        metadata={
            "help": "'all': SDPO on every rollout with a teacher signal, GRPO on every rollout (SDPO); 'srpo': "
            "successful rollouts train through GRPO only and failed ones through SDPO only (their GRPO advantage "
            "is 0), SRPO arXiv 2604.02288."
        },
    )
    sdpo_group_weight: SDPOGroupWeight = field(
        default="uniform",
        metadata={
            "help": "'uniform': every rollout's SDPO term weighs 1; 'success_variance': weighs sqrt(p(1-p)), p the "
            "share of its group that succeeds (SC-SDPO, arXiv 2605.27765)."
        },
    )

    # ----------------------------------------------------------------- SDPO: reprompting
    sdpo_success_reward_threshold: float = field(
        default=1.0,
        metadata={
            "help": "A rollout is a success (a demonstration for its peers) when its weighted reward, the one GRPO "
            "uses (sum of reward_weights × rewards), is ≥ this ('absolute' mode, TRL SDPOConfig's "
            "success_reward_threshold), or ≥ this × sum(reward_weights) ('relative' mode). A NaN reward never is."
        },
    )
    success_reward_threshold: float | None = field(
        default=None,
        metadata={
            "help": "TRL SDPOConfig's name for sdpo_success_reward_threshold, same meaning; when set it is copied "
            "there (setting both to different values is an error)."
        },
    )
    sdpo_success_threshold_mode: SuccessThresholdMode = field(
        default="absolute",
        metadata={
            "help": "'absolute': the threshold is in weighted-reward units (TRL). 'relative': it is a fraction in "
            "(0, 1] of sum(reward_weights), the largest weighted reward when every reward function scores in [0, 1], "
            "so re-weighting the functions does not move it."
        },
    )
    sdpo_success_warning_steps: int = field(
        default=10,
        metadata={
            "help": "Warn once when the share of successful rollouts stays at 0 (or at 1) for this many generation "
            "batches in a row (the warning names the threshold and the observed rewards); 0 never warns."
        },
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
            "help": "JSONL pair file read through crf-replaysim's schema-checked reader: its records (schema 1.x) "
            "or TRL's standard/conversational preference rows. Bad lines are skipped and reported by line number."
        },
    )
    trace_replay_strict: bool = field(
        default=False, metadata={"help": "Fail on the first bad line of trace_replay_path instead of skipping it."}
    )
    dpo_variant: str = field(
        default="sigmoid",
        metadata={
            "help": "Preference loss: a TRL DPO `loss_type` name (sigmoid, hinge, ipo, robust, exo_pair, nca_pair, "
            "sigmoid_norm, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft), several of "
            "them comma-separated (or a list) combined with `dpo_loss_weights`, or 'simpo' (reference-free, "
            "length-normalised)."
        },
    )
    dpo_loss_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per loss type of a list `dpo_variant` (TRL's `loss_weights`); unset: all 1. The loss "
            "is the weighted sum of the per-type means."
        },
    )
    dpo_discopop_tau: float = field(
        default=0.05, metadata={"help": "τ > 0 of dpo_variant='discopop' (TRL's `discopop_tau`; paper default 0.05)."}
    )
    # TRL DPOConfig names, accepted as aliases where they cannot collide with a GRPOConfig field. TRL's `beta` and
    # `loss_type` are NOT aliased: GRPOConfig already owns both (the KL coefficient and the GRPO loss).
    label_smoothing: float | None = field(
        default=None, metadata={"help": "Alias of `dpo_label_smoothing` (TRL DPOConfig name)."}
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "Alias of `dpo_loss_weights` (TRL DPOConfig name)."}
    )
    discopop_tau: float | None = field(
        default=None, metadata={"help": "Alias of `dpo_discopop_tau` (TRL DPOConfig name)."}
    )
    ld_alpha: float | None = field(
        default=None,
        metadata={"help": "TRL DPOConfig option, not supported by the trace-replay DPO channel; must stay unset."},
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={"help": "TRL DPOConfig option; only 'reverse_kl' (standard DPO) is supported."},
    )
    use_weighting: bool = field(
        default=False, metadata={"help": "TRL DPOConfig option (WPO weighting), not supported; must stay False."}
    )
    # TRL SDPOConfig names (TRL 1.16 `trl.experimental.sdpo`), folded into the crf fields above by
    # `crf_core.trainer.trl_sdpo.resolve_trl_sdpo_options` following its table `TRL_SDPO_OPTIONS` (an error where
    # both names disagree or crf lacks the feature). Unset (None; NaN for distillation_is_clip) = crf's field rules.
    distillation_alpha: float | None = field(default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_alpha`."})
    distillation_mode: str | None = field(
        default=None,
        metadata={
            "help": "TRL SDPOConfig option: 'full_logits' sets sdpo_top_k=None, 'topk_logits' sdpo_top_k="
            "distillation_topk; 'sampled_token' is refused (use 'topk_logits'/'full_logits' with alpha 1)."
        },
    )
    distillation_topk: int | None = field(default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_top_k`."})
    distillation_is_clip: float | None = field(
        default=IS_CLIP_UNSET,
        metadata={"help": "TRL SDPOConfig name of `sdpo_is_clip` (None disables the IS weight; NaN = unset)."},
    )
    distillation_add_tail: bool | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_add_tail`."}
    )
    distillation_weight: float | None = field(
        default=None,
        metadata={"help": "TRL SDPOConfig option: w in [0, 1] sets grpo_weight = 1 - w and sdpo_weight = w."},
    )
    teacher_model_kind: str | None = field(
        default=None,
        metadata={
            "help": "TRL SDPOConfig option: 'ema'/'live' set sdpo_teacher; 'base' (frozen initial policy) sets "
            "sdpo_teacher='ema' with sdpo_teacher_update_rate=0."
        },
    )
    teacher_update_rate: float | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_teacher_update_rate`."}
    )
    teacher_sync_steps: int | None = field(
        default=None,
        metadata={"help": "TRL SDPOConfig option; only 1 (crf updates the EMA teacher after every optimizer step)."},
    )
    use_teacher_server: bool | None = field(
        default=None, metadata={"help": "TRL SDPOConfig option; only False (crf scores the teacher locally)."}
    )
    use_successful_as_teacher: bool | None = field(
        default=None,
        metadata={"help": "TRL SDPOConfig option; only True (crf always uses a successful peer as demonstration)."},
    )
    dont_reprompt_on_self_success: bool | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_dont_reprompt_on_self_success`."}
    )
    max_reprompt_len: int | None = field(
        default=None,
        metadata={
            "help": "TRL SDPOConfig name of `sdpo_max_reprompt_len`; also sets sdpo_reprompt_truncation='left' "
            "(TRL keeps the end) unless that was set."
        },
    )
    reprompt_template: str | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_reprompt_template`."}
    )
    solution_template: str | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_solution_template`."}
    )
    feedback_template: str | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_feedback_template`."}
    )
    include_environment_feedback: bool | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_include_environment_feedback`."}
    )
    environment_feedback_only_without_solution: bool | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_environment_feedback_only_without_solution`."}
    )
    remove_thinking_from_demonstration: bool | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_remove_thinking_from_demonstration`."}
    )
    diagnostics_warning_interval: int | None = field(
        default=None, metadata={"help": "TRL SDPOConfig name of `sdpo_success_warning_steps` (0 never warns)."}
    )
    diagnostics_flat_tolerance: float | None = field(
        default=None,
        metadata={"help": "TRL SDPOConfig option; only values <= 1e-8 (crf's degenerate-success test is exact)."},
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "TRL SDPOConfig option; only None (crf never truncates prompts: shorten them in the data)."},
    )
    dpo_beta: float = field(default=0.1, metadata={"help": "DPO β (inverse temperature of the implicit reward)."})
    dpo_label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "ε in [0, 0.5) for the variants that use it: sigmoid (cDPO), robust, exo_pair, aot, aot_unpaired "
            "and SimPO."
        },
    )
    simpo_beta: float = field(default=2.0, metadata={"help": "SimPO β (scale of the average log-prob margin)."})
    simpo_gamma: float = field(default=1.0, metadata={"help": "SimPO target margin γ (absolute, not γ/β)."})
    trace_replay_batch_size: int = field(
        default=2,
        metadata={
            "help": "Pairs per micro-batch and rank for the trace-replay DPO channel; ranks take disjoint slices of "
            "one shared, reshuffled order of all pairs."
        },
    )
    trace_replay_max_length: int = field(
        default=512,
        metadata={
            "help": "Longest prompt+response in tokens; the prompt is cut from the left, the response from the right."
        },
    )
    trace_replay_render: str = field(
        default="auto",
        metadata={
            "help": "How trace-replay pairs become tokens: 'chat' (prompt_messages + chosen/rejected_messages rendered "
            "with the chat template and the record's tools, the conversation intact; only the response's assistant "
            "turns, tool calls included, are scored, never tool results), 'flat' (the flat chosen/rejected text after "
            "the prompt), or 'auto' ('chat' for records with the message lists when the chat template renders tool "
            "calls and tool results, else 'flat')."
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
        self._resolve_trl_dpo_aliases()
        resolve_trl_sdpo_options(self)
        for name in ("grpo_weight", "sdpo_weight", "trace_replay_dpo_weight"):
            check_weight(name, getattr(self, name))
        if self.grpo_weight == self.sdpo_weight == self.trace_replay_dpo_weight == 0:
            raise ValueError("every channel weight is 0, so nothing would be trained; set at least one weight > 0")
        if self.sdpo_teacher not in ("ema", "live"):
            raise ValueError(f"sdpo_teacher must be 'ema' or 'live', got {self.sdpo_teacher!r}")
        if not 0.0 <= self.sdpo_teacher_update_rate <= 1.0:
            raise ValueError(f"sdpo_teacher_update_rate must be in [0, 1], got {self.sdpo_teacher_update_rate}")
        if self.sdpo_routing not in SDPO_ROUTINGS:
            raise ValueError(f"sdpo_routing must be one of {SDPO_ROUTINGS}, got {self.sdpo_routing!r}")
        if self.sdpo_group_weight not in SDPO_GROUP_WEIGHTS:
            raise ValueError(f"sdpo_group_weight must be one of {SDPO_GROUP_WEIGHTS}, got {self.sdpo_group_weight!r}")
        if self.sdpo_routing == "srpo" and self.grpo_weight == 0:
            raise ValueError(
                "sdpo_routing='srpo' sends successful rollouts to GRPO, which is off (grpo_weight=0); set "
                "grpo_weight > 0 or sdpo_routing='all'"
            )
        if self.sdpo_reprompt_truncation not in ("left", "right", "error"):
            raise ValueError(
                f"sdpo_reprompt_truncation must be 'left', 'right' or 'error', got {self.sdpo_reprompt_truncation!r}"
            )
        if not (isinstance(self.sdpo_max_reprompt_len, int) and self.sdpo_max_reprompt_len > 0):
            raise ValueError(f"sdpo_max_reprompt_len must be a positive int, got {self.sdpo_max_reprompt_len!r}")
        self._check_success_threshold()
        self.reprompt_config()  # validates the templates and the threshold
        self.sdpo_config()
        self.preference_config()
        self.chunk_plan()
        self.taid_schedule()
        if not (isinstance(self.trace_replay_batch_size, int) and self.trace_replay_batch_size >= 1):
            raise ValueError(f"trace_replay_batch_size must be a positive int, got {self.trace_replay_batch_size!r}")
        if not (isinstance(self.trace_replay_max_length, int) and self.trace_replay_max_length >= 2):
            raise ValueError(f"trace_replay_max_length must be an int ≥ 2, got {self.trace_replay_max_length!r}")
        if self.trace_replay_render not in PAIR_RENDERINGS:
            raise ValueError(f"trace_replay_render must be one of {PAIR_RENDERINGS}, got {self.trace_replay_render!r}")
        if self.trace_replay_reference not in TRACE_REPLAY_REFERENCES:
            raise ValueError(
                f"trace_replay_reference must be one of {TRACE_REPLAY_REFERENCES}, got {self.trace_replay_reference!r}"
            )
        if self.trace_replay_reference == "none" and self.dpo_variant != "simpo":
            raise ValueError(
                f"trace_replay_reference='none' only works with dpo_variant='simpo' (reference-free); "
                f"{self.dpo_variant!r} needs reference log-probs"
            )

    def _check_success_threshold(self) -> None:
        alias, value = self.success_reward_threshold, self.sdpo_success_reward_threshold
        for name, number in (("success_reward_threshold", alias), ("sdpo_success_reward_threshold", value)):
            if number is not None and (
                isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number)
            ):
                raise ValueError(f"{name} must be a finite number, got {number!r}")
        if alias is not None:
            default = type(self).__dataclass_fields__["sdpo_success_reward_threshold"].default
            if value not in (default, alias):
                raise ValueError(
                    f"success_reward_threshold={alias} (TRL's name) and sdpo_success_reward_threshold={value} "
                    "disagree; set only one of them"
                )
            self.sdpo_success_reward_threshold = value = float(alias)
        if self.sdpo_success_threshold_mode not in SUCCESS_THRESHOLD_MODES:
            raise ValueError(
                f"sdpo_success_threshold_mode must be one of {SUCCESS_THRESHOLD_MODES}, "
                f"got {self.sdpo_success_threshold_mode!r}"
            )
        if self.sdpo_success_threshold_mode == "relative" and not 0.0 < value <= 1.0:
            raise ValueError(
                f"sdpo_success_reward_threshold={value} with sdpo_success_threshold_mode='relative' must be a "
                "fraction in (0, 1] of sum(reward_weights); give a fraction, or use mode 'absolute' for a reward value"
            )
        if self.sdpo_success_threshold_mode == "relative" and self.reward_weights is not None:
            effective_success_threshold(value, "relative", self.reward_weights)  # positive sum of weights
        steps = self.sdpo_success_warning_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"sdpo_success_warning_steps must be an int ≥ 0 (0 never warns), got {steps!r}")

    def success_monitor(self, reward_weights: Sequence[float]) -> SuccessMonitor:
        """The success rule on ``reward_weights`` (the trainer's), as a :class:`SuccessMonitor`."""
        mode = self.sdpo_success_threshold_mode
        threshold = effective_success_threshold(self.sdpo_success_reward_threshold, mode, reward_weights)
        setting = f"sdpo_success_reward_threshold={self.sdpo_success_reward_threshold:g} ({mode})"
        return SuccessMonitor(threshold, setting, self.sdpo_success_warning_steps)

    def sdpo_config(self) -> SDPOConfig:
        """The SDPO channel's frozen config (raises ``ValueError`` naming a bad field)."""
        return SDPOConfig(
            alpha=self.sdpo_alpha,
            top_k=self.sdpo_top_k,
            add_tail=self.sdpo_add_tail,
            is_clip=self.sdpo_is_clip,
            wrapper=self.sdpo_wrapper,  # type: ignore[arg-type]
            entropy_opd_h_max=self.entropy_opd_h_max,
            entropy_opd_gate=self.entropy_opd_gate,  # type: ignore[arg-type]
            entropy_opd_sharpness=self.entropy_opd_sharpness,
            entropy_opd_forward_weight=self.entropy_opd_forward_weight,
            truncate_below=self.sdpo_truncate_below,
        )

    def _resolve_trl_dpo_aliases(self) -> None:
        """Fold TRL's DPOConfig names into the crf fields; refuse the TRL options crf does not implement."""
        defaults = {"dpo_label_smoothing": 0.0, "dpo_loss_weights": None, "dpo_discopop_tau": 0.05}
        for alias, target in (
            ("label_smoothing", "dpo_label_smoothing"),
            ("loss_weights", "dpo_loss_weights"),
            ("discopop_tau", "dpo_discopop_tau"),
        ):
            value = getattr(self, alias)
            if value is None:
                continue
            current = getattr(self, target)
            if current != defaults[target] and current != value:
                raise ValueError(
                    f"`{alias}` (TRL's name) is an alias of `{target}`, and both are set to different values "
                    f"({value!r} vs {current!r}); set only one"
                )
            setattr(self, target, value)
            setattr(self, alias, None)
        if self.ld_alpha is not None:
            raise ValueError(
                "ld_alpha (TRL's LD-DPO length desensitisation) is not supported by the trace-replay DPO channel; "
                "unset it, or use dpo_variant='sigmoid_norm' / 'ipo' (length-normalised) against verbosity"
            )
        if self.f_divergence_type != "reverse_kl":
            raise ValueError(
                f"f_divergence_type={self.f_divergence_type!r} is not supported; only 'reverse_kl' (standard DPO) is. "
                "Leave it at 'reverse_kl', or train with TRL's DPOTrainer for f-DPO"
            )
        if self.use_weighting:
            raise ValueError(
                "use_weighting (TRL's WPO weighting) needs per-token probabilities the trace-replay DPO channel does "
                "not keep; set use_weighting=False, or train with TRL's DPOTrainer for WPO"
            )

    def preference_config(self) -> PreferenceConfig:
        """The trace-replay DPO channel's frozen config."""
        return PreferenceConfig(
            variant=self.dpo_variant,
            beta=self.dpo_beta,
            label_smoothing=self.dpo_label_smoothing,
            simpo_beta=self.simpo_beta,
            simpo_gamma=self.simpo_gamma,
            loss_weights=None if self.dpo_loss_weights is None else tuple(self.dpo_loss_weights),
            discopop_tau=self.dpo_discopop_tau,
        )

    def chunk_plan(self) -> ChunkPlan:
        """When and how finely the LM head runs in chunks."""
        return ChunkPlan(mode=self.lm_head_chunking, chunk_size=self.chunk_size)  # type: ignore[arg-type]

    def taid_schedule(self) -> TAIDSchedule | None:
        """A fresh TAID schedule (state ``t``, previous loss, momentum) when ``sdpo_wrapper='taid'``, else None."""
        if self.sdpo_wrapper != "taid":
            for name in ("taid_alpha_min", "taid_alpha_max"):
                if getattr(self, name) != type(self).__dataclass_fields__[name].default:
                    raise ValueError(f"{name} was set but sdpo_wrapper is not 'taid'; set sdpo_wrapper='taid'")
            return None
        return TAIDSchedule(
            t_start=self.taid_alpha_min,
            t_end=self.taid_alpha_max,
            alpha=self.taid_step_size,
            beta=self.taid_momentum,
            disable_adaptive=not self.taid_adaptive,
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
