"""TRL ``SDPOConfig`` options on ``ComposerConfig``: the one table of what is accepted, renamed or refused.

TRL 1.16 ships ``trl.experimental.sdpo.SDPOTrainer`` with its ``SDPOConfig``. Users coming from it bring its
option names. :data:`TRL_SDPO_OPTIONS` lists every ``SDPOConfig`` field that is not a ``GRPOConfig`` field
(``GRPOConfig`` names keep GRPO's meaning on ``ComposerConfig``) and says what crf does with it:

* ``"alias"``: accepted under TRL's name with TRL's meaning and copied onto a crf field; giving both names with
  different values is an error.
* ``"mapped"``: accepted, and translated onto one or more crf fields (e.g. ``distillation_weight`` onto
  ``grpo_weight`` and ``sdpo_weight``); a crf field already set to something else is an error.
* ``"value"``: accepted only for the values that match what crf does (e.g. ``teacher_sync_steps=1``); any other
  value raises ``ValueError`` naming crf's alternative.
* ``"refused"``: crf lacks the feature; any value raises ``ValueError`` naming crf's alternative.

A TRL option that is not given keeps crf's default, which is the SDPO paper's run configuration rather than TRL's
(crf: ``sdpo_alpha=0.5``, top-k 100 with a tail bucket, think-stripping and feedback on; TRL: reverse KL on the
sampled token, no feedback): give the TRL options you rely on. :func:`resolve_trl_sdpo_options` applies the table
(``ComposerConfig.__post_init__`` calls it); :func:`trl_sdpo_markdown` renders it for the docs (a test keeps
``docs/packages/crf-core-trainer.md`` equal to it). Pure Python: no TRL import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from crf_core._checks import is_number
from crf_core.trainer.teacher import SDPOTeacher

__all__ = [
    "IS_CLIP_UNSET",
    "TRL_SDPO_OPTIONS",
    "TRLSDPOOption",
    "is_unset",
    "resolve_trl_sdpo_options",
    "trl_sdpo_markdown",
]

TRLTeacherKind = Literal[SDPOTeacher, "base"]
"""TRL ``SDPOConfig.teacher_model_kind``: crf's teacher kinds plus ``"base"`` (the frozen initial policy)."""
TRL_TEACHER_KINDS: tuple[TRLTeacherKind, ...] = get_args(TRLTeacherKind)

Status = Literal["alias", "mapped", "value", "refused"]


@dataclass(frozen=True)
class TRLSDPOOption:
    """How ``ComposerConfig`` treats one TRL ``SDPOConfig`` option.

    Attributes:
        status: ``"alias"``, ``"mapped"``, ``"value"`` or ``"refused"`` (see the module docstring).
        crf: the crf field(s) it lands on, or crf's alternative.
        note: what differs, which values are accepted, or why it is refused.
    """

    status: Status
    crf: str
    note: str = ""


#: Every TRL 1.16 ``SDPOConfig`` field that ``GRPOConfig`` lacks, and what ``ComposerConfig`` does with it.
TRL_SDPO_OPTIONS: dict[str, TRLSDPOOption] = {
    # ------------------------------------------------------------------ the distillation loss
    "distillation_alpha": TRLSDPOOption(
        "alias", "sdpo_alpha", "same generalised-JSD convention: 0 forward KL, 1 reverse KL, mixture (1-α)·S + α·T"
    ),
    "distillation_mode": TRLSDPOOption(
        "mapped",
        "sdpo_top_k",
        "'full_logits' → sdpo_top_k=None; 'topk_logits' → sdpo_top_k=distillation_topk (required, as in TRL); "
        "'sampled_token' (TRL's single-token reverse-KL estimator) is refused: crf computes the divergence exactly "
        "on a token support, so use 'topk_logits' or 'full_logits' with distillation_alpha=1.0 (reverse KL)",
    ),
    "distillation_topk": TRLSDPOOption(
        "alias", "sdpo_top_k", "the student's top-k support, as in TRL; an error with distillation_mode='full_logits'"
    ),
    "distillation_is_clip": TRLSDPOOption(
        "alias", "sdpo_is_clip", "None disables the IS weight, as in TRL (the field's unset marker is NaN)"
    ),
    "distillation_add_tail": TRLSDPOOption("alias", "sdpo_add_tail", "crf's default is True, TRL's False"),
    "distillation_weight": TRLSDPOOption(
        "mapped",
        "grpo_weight, sdpo_weight",
        "w in [0, 1] → grpo_weight = 1 − w, sdpo_weight = w (TRL's (1 − w)·policy + w·distillation); crf's policy "
        "term is TRL's GRPO loss",
    ),
    # ------------------------------------------------------------------ the teacher
    "teacher_model_kind": TRLSDPOOption(
        "mapped",
        "sdpo_teacher, sdpo_teacher_update_rate",
        "'ema' → sdpo_teacher='ema'; 'live' → 'live'; 'base' (the initial student, frozen) → 'ema' with "
        "sdpo_teacher_update_rate=0",
    ),
    "teacher_update_rate": TRLSDPOOption("alias", "sdpo_teacher_update_rate", "θ_T ← (1 − r)·θ_T + r·θ_S, as in TRL"),
    "teacher_sync_steps": TRLSDPOOption(
        "value",
        "sdpo_teacher_update_rate",
        "only 1: crf updates the EMA teacher after every optimizer step; for a teacher that moves as TRL's every N "
        "steps, set sdpo_teacher_update_rate = 1 − (1 − r)^(1/N)",
    ),
    "use_teacher_server": TRLSDPOOption(
        "value",
        "sdpo_teacher, lm_head_chunking",
        "only False: crf scores the teacher locally (sdpo_teacher='live' holds no copy of the policy; the chunked "
        "LM head keeps the teacher's logits small)",
    ),
    # ------------------------------------------------------------------ reprompting
    "success_reward_threshold": TRLSDPOOption(
        "alias", "sdpo_success_reward_threshold", "weighted reward ≥ threshold, as in TRL ('absolute' mode)"
    ),
    "use_successful_as_teacher": TRLSDPOOption(
        "value",
        "sdpo_success_reward_threshold",
        "only True: crf always uses a successful peer as the demonstration; for a feedback-only teacher set "
        "sdpo_success_reward_threshold above every reachable reward",
    ),
    "dont_reprompt_on_self_success": TRLSDPOOption(
        "alias", "sdpo_dont_reprompt_on_self_success", "a sample's own response is never its demonstration"
    ),
    "max_reprompt_len": TRLSDPOOption(
        "alias",
        "sdpo_max_reprompt_len, sdpo_reprompt_truncation",
        "TRL keeps the last tokens of a longer teacher prompt, so sdpo_reprompt_truncation becomes 'left' unless "
        "it was set",
    ),
    "reprompt_template": TRLSDPOOption("alias", "sdpo_reprompt_template", "same placeholders and default"),
    "solution_template": TRLSDPOOption("alias", "sdpo_solution_template", "same placeholders and default"),
    "feedback_template": TRLSDPOOption("alias", "sdpo_feedback_template", "same placeholders and default"),
    "include_environment_feedback": TRLSDPOOption(
        "alias",
        "sdpo_include_environment_feedback",
        "crf reads the feedback reward functions report through log_extra(sdpo_feedback_key, …), not a "
        "'privileged_context' dataset column; crf's default is True, TRL's False",
    ),
    "environment_feedback_only_without_solution": TRLSDPOOption(
        "alias", "sdpo_environment_feedback_only_without_solution", "crf's default is True, TRL's False"
    ),
    "remove_thinking_from_demonstration": TRLSDPOOption(
        "alias", "sdpo_remove_thinking_from_demonstration", "same `<think>…</think>` removal; crf's default is True"
    ),
    # ------------------------------------------------------------------ diagnostics, data
    "diagnostics_warning_interval": TRLSDPOOption(
        "alias",
        "sdpo_success_warning_steps",
        "0 never warns, as in TRL; crf warns once when the degenerate streak reaches N (TRL at its first step and "
        "every N)",
    ),
    "diagnostics_flat_tolerance": TRLSDPOOption(
        "value",
        "sdpo_success_warning_steps",
        "only values ≤ 1e-8 (TRL's default): crf's degenerate-success test is exact (share of successes 0 or 1)",
    ),
    "max_prompt_length": TRLSDPOOption(
        "value",
        "the dataset",
        "only None: crf never truncates prompts (TRL 1.16's GRPOConfig dropped max_prompt_length); shorten them in "
        "the dataset (teacher prompts: sdpo_max_reprompt_len)",
    ),
}

#: Marker of an unset ``distillation_is_clip`` (TRL's ``None`` means "no clipping").
IS_CLIP_UNSET = math.nan


def is_unset(name: str, value: Any) -> bool:
    """Whether TRL option ``name`` still holds its "not given" marker (None; NaN for ``distillation_is_clip``)."""
    if name == "distillation_is_clip":
        return isinstance(value, float) and math.isnan(value)
    return value is None


def _default(config: Any, name: str) -> Any:
    return type(config).__dataclass_fields__[name].default


def _put(config: Any, alias: str, target: str, value: Any) -> None:
    """Copy TRL option ``alias``'s value onto crf field ``target`` (an error if ``target`` was set differently)."""
    current = getattr(config, target)
    if current != _default(config, target) and current != value:
        raise ValueError(
            f"`{alias}` (TRL SDPOConfig's name) sets `{target}`={value!r}, but `{target}` is already {current!r}; "
            "set only one of them"
        )
    setattr(config, target, value)


def _refuse(name: str, value: Any) -> ValueError:
    option = TRL_SDPO_OPTIONS[name]
    return ValueError(f"`{name}`={value!r} (TRL SDPOConfig) is not supported by crf: {option.note}")


def resolve_trl_sdpo_options(config: Any) -> None:
    """Fold the TRL ``SDPOConfig`` options given on ``config`` (a ``ComposerConfig``) into crf's fields.

    Each option follows :data:`TRL_SDPO_OPTIONS`; refused options and conflicts raise ``ValueError``. A folded
    option is reset to its unset marker, so running this twice (``dataclasses.replace``) is harmless.
    ``success_reward_threshold`` is left to ``ComposerConfig`` (it predates this table and keeps its value).
    """
    given = {name: getattr(config, name) for name in TRL_SDPO_OPTIONS if name != "success_reward_threshold"}
    given = {name: value for name, value in given.items() if not is_unset(name, value)}

    # ---- values crf only accepts where they equal crf's behaviour
    accepted = {
        "teacher_sync_steps": lambda v: v == 1 and not isinstance(v, bool),
        "use_teacher_server": lambda v: v is False,
        "use_successful_as_teacher": lambda v: v is True,
        "diagnostics_flat_tolerance": lambda v: isinstance(v, (int, float)) and 0 <= v <= 1e-8,
        "max_prompt_length": lambda v: v is None,  # None is also the unset marker: never reaches here
    }
    for name, ok in accepted.items():
        if name in given and not ok(given[name]):
            raise _refuse(name, given[name])

    # ---- the loss support
    mode = given.get("distillation_mode")
    topk = given.get("distillation_topk")
    if mode is not None:
        if mode == "sampled_token":
            raise ValueError(
                "distillation_mode='sampled_token' (TRL's single-token reverse-KL estimator) is not supported by crf, "
                "which computes the divergence exactly on a token support: use distillation_mode='topk_logits' (with "
                "distillation_topk) or 'full_logits', with distillation_alpha=1.0 for TRL's reverse KL (crf fields: "
                "sdpo_top_k, sdpo_alpha)"
            )
        if mode == "full_logits":
            if topk is not None:
                raise ValueError(
                    f"distillation_topk={topk} was given with distillation_mode='full_logits'; TRL's top-k is for "
                    "'topk_logits' only: drop one of them"
                )
            _put(config, "distillation_mode", "sdpo_top_k", None)
        elif mode == "topk_logits":
            if topk is None:
                raise ValueError("distillation_mode='topk_logits' requires distillation_topk (as in TRL)")
        else:
            raise ValueError(
                f"distillation_mode must be 'full_logits' or 'topk_logits' ('sampled_token' is refused), got {mode!r}"
            )
    if topk is not None:
        _put(config, "distillation_topk", "sdpo_top_k", topk)
    for alias, target in (
        ("distillation_alpha", "sdpo_alpha"),
        ("distillation_add_tail", "sdpo_add_tail"),
        ("distillation_is_clip", "sdpo_is_clip"),
    ):
        if alias in given:
            _put(config, alias, target, given[alias])

    # ---- channel weights
    if "distillation_weight" in given:
        w = given["distillation_weight"]
        if not is_number(w) or not 0.0 <= w <= 1.0:
            raise ValueError(f"distillation_weight must be in [0, 1] (as in TRL), got {w!r}")
        _put(config, "distillation_weight", "grpo_weight", 1.0 - float(w))
        _put(config, "distillation_weight", "sdpo_weight", float(w))

    # ---- the teacher
    if "teacher_update_rate" in given:
        _put(config, "teacher_update_rate", "sdpo_teacher_update_rate", given["teacher_update_rate"])
    kind = given.get("teacher_model_kind")
    if kind is not None:
        if kind not in TRL_TEACHER_KINDS:
            raise ValueError(f"teacher_model_kind must be 'ema', 'live' or 'base' (as in TRL), got {kind!r}")
        _put(config, "teacher_model_kind", "sdpo_teacher", "live" if kind == "live" else "ema")
        if kind == "base":
            if config.sdpo_teacher_update_rate != _default(config, "sdpo_teacher_update_rate") and (
                config.sdpo_teacher_update_rate != 0.0
            ):
                raise ValueError(
                    "teacher_model_kind='base' is the frozen initial policy (crf: sdpo_teacher='ema' with "
                    f"sdpo_teacher_update_rate=0), but the update rate is {config.sdpo_teacher_update_rate}; "
                    "drop the rate or use teacher_model_kind='ema'"
                )
            config.sdpo_teacher_update_rate = 0.0

    # ---- reprompting
    for alias in (
        "dont_reprompt_on_self_success",
        "reprompt_template",
        "solution_template",
        "feedback_template",
        "include_environment_feedback",
        "environment_feedback_only_without_solution",
        "remove_thinking_from_demonstration",
    ):
        if alias in given:
            _put(config, alias, f"sdpo_{alias}", given[alias])
    if "max_reprompt_len" in given:
        _put(config, "max_reprompt_len", "sdpo_max_reprompt_len", given["max_reprompt_len"])
        if config.sdpo_reprompt_truncation == _default(config, "sdpo_reprompt_truncation"):
            config.sdpo_reprompt_truncation = "left"  # TRL keeps `ids[-max_reprompt_len:]`
    if "diagnostics_warning_interval" in given:
        _put(
            config, "diagnostics_warning_interval", "sdpo_success_warning_steps", given["diagnostics_warning_interval"]
        )

    for name in given:
        setattr(config, name, IS_CLIP_UNSET if name == "distillation_is_clip" else None)


_STATUS_TEXT = {
    "alias": "renamed",
    "mapped": "mapped",
    "value": "only crf's value",
    "refused": "refused",
}


def trl_sdpo_markdown() -> str:
    """The Markdown table of :data:`TRL_SDPO_OPTIONS` (the docs embed it verbatim)."""
    lines = ["| TRL `SDPOConfig` option | crf | lands on / alternative | notes |", "| --- | --- | --- | --- |"]
    for name, option in TRL_SDPO_OPTIONS.items():
        targets = ", ".join(
            f"`{t.strip()}`" if t.strip().startswith(("sdpo_", "grpo_", "lm_")) else t.strip()
            for t in option.crf.split(",")
        )
        lines.append(f"| `{name}` | {_STATUS_TEXT[option.status]} | {targets} | {option.note} |")
    return "\n".join(lines) + "\n"
