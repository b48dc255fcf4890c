"""TRL 1.16 ``SDPOConfig`` options on ``ComposerConfig``: every one accepted (folded onto crf's field) or refused.

The option list is read from TRL itself (``fields(SDPOConfig) − fields(GRPOConfig)``) so a TRL release that adds an
option fails here until ``crf_core.trainer.trl_sdpo.TRL_SDPO_OPTIONS`` says what crf does with it. Each option is
exercised with a TRL-style value: an accepted one must change the crf fields the table names (or, for a "value"
option, leave crf's behaviour as is), a refused one must raise ``ValueError`` naming the option. The docs table is
checked against the module constant. The TRL-enumeration tests skip when trl is older than 1.16.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crf_core.trainer.trl_sdpo import TRL_SDPO_OPTIONS, is_unset, trl_sdpo_markdown

trl = pytest.importorskip("trl", reason="ComposerConfig needs the [train] extra (trl)")
_TRL = importlib.metadata.version("trl")
needs_trl_116 = pytest.mark.skipif(
    tuple(int(part) for part in _TRL.split(".")[:2]) < (1, 16),
    reason=f"trl.experimental.sdpo.SDPOConfig is TRL 1.16's; this interpreter has trl {_TRL}",
)


def _config(tmp_path: Any, **kwargs: Any) -> Any:
    from crf_core.trainer import ComposerConfig

    return ComposerConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def _crf_fields(cfg: Any) -> dict[str, Any]:
    """The values of every ComposerConfig field that is not a TRL SDPOConfig option (what crf acts on)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in TRL_SDPO_OPTIONS}


# TRL-style value of each option that crf accepts -> the crf fields it must set.
ACCEPTED: dict[str, tuple[Any, dict[str, Any]]] = {
    "distillation_alpha": (1.0, {"sdpo_alpha": 1.0}),
    "distillation_mode": ("full_logits", {"sdpo_top_k": None}),
    "distillation_topk": (20, {"sdpo_top_k": 20}),
    "distillation_is_clip": (None, {"sdpo_is_clip": None}),
    "distillation_add_tail": (False, {"sdpo_add_tail": False}),
    "distillation_weight": (0.25, {"grpo_weight": 0.75, "sdpo_weight": 0.25}),
    "teacher_model_kind": ("live", {"sdpo_teacher": "live"}),
    "teacher_update_rate": (0.5, {"sdpo_teacher_update_rate": 0.5}),
    "teacher_sync_steps": (1, {}),
    "use_teacher_server": (False, {}),
    "success_reward_threshold": (0.5, {"sdpo_success_reward_threshold": 0.5}),
    "use_successful_as_teacher": (True, {}),
    "dont_reprompt_on_self_success": (False, {"sdpo_dont_reprompt_on_self_success": False}),
    "max_reprompt_len": (64, {"sdpo_max_reprompt_len": 64, "sdpo_reprompt_truncation": "left"}),
    "reprompt_template": (
        "Q: {prompt}{solution}{feedback}",
        {"sdpo_reprompt_template": "Q: {prompt}{solution}{feedback}"},
    ),
    "solution_template": (
        "S: {successful_previous_attempt}",
        {"sdpo_solution_template": "S: {successful_previous_attempt}"},
    ),
    "feedback_template": ("F: {feedback_raw}", {"sdpo_feedback_template": "F: {feedback_raw}"}),
    "include_environment_feedback": (False, {"sdpo_include_environment_feedback": False}),
    "environment_feedback_only_without_solution": (False, {"sdpo_environment_feedback_only_without_solution": False}),
    "remove_thinking_from_demonstration": (False, {"sdpo_remove_thinking_from_demonstration": False}),
    "diagnostics_warning_interval": (0, {"sdpo_success_warning_steps": 0}),
    "diagnostics_flat_tolerance": (1e-8, {}),
    "max_prompt_length": (None, {}),
}

# TRL-style values crf refuses -> a fragment the error must contain (crf's alternative).
REFUSED: dict[str, tuple[Any, str]] = {
    "distillation_mode": ("sampled_token", "topk_logits"),
    "teacher_sync_steps": (4, "sdpo_teacher_update_rate"),
    "use_teacher_server": (True, "sdpo_teacher"),
    "use_successful_as_teacher": (False, "sdpo_success_reward_threshold"),
    "diagnostics_flat_tolerance": (0.1, "exact"),
    "max_prompt_length": (512, "dataset"),
}


@needs_trl_116
def test_table_lists_every_sdpo_config_option_grpo_config_lacks() -> None:
    from trl import GRPOConfig
    from trl.experimental.sdpo import SDPOConfig

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    trl_only = {f.name for f in dataclasses.fields(SDPOConfig)} - grpo
    assert trl_only == set(TRL_SDPO_OPTIONS)


def test_every_option_is_exercised_and_is_a_composer_config_field() -> None:
    from trl import GRPOConfig

    from crf_core.trainer import ComposerConfig

    names = {f.name for f in dataclasses.fields(ComposerConfig)}
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    for name, option in TRL_SDPO_OPTIONS.items():
        assert name in names, f"TRL option {name} is not a ComposerConfig field"
        assert name not in grpo, f"{name} is a GRPOConfig field: aliasing it would change GRPO's meaning"
        assert name in ACCEPTED or name in REFUSED, f"{name} is neither accepted nor refused by a test"
        if option.status in ("alias", "mapped"):
            assert name in ACCEPTED
        if option.status in ("value", "refused"):
            assert name in REFUSED, f"{name} ({option.status}) needs a refused value"
        if option.status == "refused":
            assert name not in ACCEPTED


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_option_lands_on_crf_fields(tmp_path: Any, name: str) -> None:
    value, expected = ACCEPTED[name]
    base = _crf_fields(_config(tmp_path))
    extra = {"distillation_topk": 20} if name == "distillation_mode" and value == "topk_logits" else {}
    cfg = _config(tmp_path, **{name: value}, **extra)
    got = _crf_fields(cfg)
    changed = {k: v for k, v in got.items() if v != base[k]}
    assert changed == expected, f"{name}={value!r} changed {changed}, expected {expected}"
    if name != "success_reward_threshold":  # the older alias keeps its value
        assert is_unset(name, getattr(cfg, name)), "a folded TRL option is reset to its unset marker"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_value_raises_naming_the_alternative(tmp_path: Any, name: str) -> None:
    value, alternative = REFUSED[name]
    with pytest.raises(ValueError, match=name) as info:
        _config(tmp_path, **{name: value})
    assert alternative in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"distillation_alpha": 1.0, "sdpo_alpha": 0.3}, "sdpo_alpha"),
        ({"distillation_topk": 20, "sdpo_top_k": 50}, "sdpo_top_k"),
        ({"distillation_mode": "full_logits", "sdpo_top_k": 50}, "sdpo_top_k"),
        ({"distillation_mode": "full_logits", "distillation_topk": 5}, "full_logits"),
        ({"distillation_mode": "topk_logits"}, "requires distillation_topk"),
        ({"distillation_mode": "logits"}, "distillation_mode"),
        ({"distillation_is_clip": None, "sdpo_is_clip": 3.0}, "sdpo_is_clip"),
        ({"distillation_add_tail": False, "sdpo_add_tail": False}, None),  # same value: fine
        ({"distillation_weight": 0.5, "grpo_weight": 0.2}, "grpo_weight"),
        ({"distillation_weight": 1.5}, "distillation_weight"),
        ({"teacher_model_kind": "base", "teacher_update_rate": 0.1}, "teacher_model_kind='base'"),
        ({"teacher_model_kind": "live", "sdpo_teacher": "ema"}, None),  # 'ema' is crf's default: not "set"
        ({"teacher_model_kind": "frozen"}, "teacher_model_kind"),
        ({"max_reprompt_len": 64, "sdpo_max_reprompt_len": 32}, "sdpo_max_reprompt_len"),
        (
            {
                "reprompt_template": "{prompt}{solution}{feedback}!",
                "sdpo_reprompt_template": "{prompt}{solution}{feedback}?",
            },
            "sdpo_reprompt_template",
        ),
        (
            {"include_environment_feedback": True, "sdpo_include_environment_feedback": False},
            "sdpo_include_environment_feedback",
        ),
        ({"diagnostics_warning_interval": 3, "sdpo_success_warning_steps": 5}, "sdpo_success_warning_steps"),
        ({"success_reward_threshold": 0.5, "sdpo_success_reward_threshold": 0.7}, "disagree"),
    ],
)
def test_both_names_given_differently_is_an_error(tmp_path: Any, kwargs: dict[str, Any], message: str | None) -> None:
    if message is None:
        _config(tmp_path, **kwargs)
        return
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **kwargs)


def test_topk_mode_and_trl_loss_settings_together(tmp_path: Any) -> None:
    cfg = _config(
        tmp_path,
        distillation_mode="topk_logits",
        distillation_topk=32,
        distillation_alpha=0.0,
        distillation_add_tail=False,
        distillation_is_clip=1.5,
        distillation_weight=1.0,
        teacher_model_kind="live",
        max_reprompt_len=128,
        sdpo_reprompt_truncation="error",
    )
    sdpo = cfg.sdpo_config()
    assert (sdpo.top_k, sdpo.alpha, sdpo.add_tail, sdpo.is_clip) == (32, 0.0, False, 1.5)
    assert (cfg.grpo_weight, cfg.sdpo_weight, cfg.sdpo_teacher) == (0.0, 1.0, "live")
    assert (cfg.sdpo_max_reprompt_len, cfg.sdpo_reprompt_truncation) == (128, "error")  # a set truncation stays


def test_base_teacher_is_a_frozen_ema(tmp_path: Any) -> None:
    cfg = _config(tmp_path, teacher_model_kind="base")
    assert (cfg.sdpo_teacher, cfg.sdpo_teacher_update_rate) == ("ema", 0.0)
    cfg = _config(tmp_path, teacher_model_kind="ema", teacher_update_rate=0.2)
    assert (cfg.sdpo_teacher, cfg.sdpo_teacher_update_rate) == ("ema", 0.2)


def test_unset_markers() -> None:
    assert is_unset("distillation_is_clip", math.nan)
    assert not is_unset("distillation_is_clip", None)
    assert is_unset("distillation_alpha", None)
    assert not is_unset("distillation_alpha", 0.0)


def test_hf_argument_parser_takes_trl_names(tmp_path: Any) -> None:
    from transformers import HfArgumentParser

    from crf_core.trainer import ComposerConfig

    argv = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--distillation_mode", "full_logits"]
    argv += ["--include_environment_feedback", "false", "--teacher_model_kind", "live", "--distillation_alpha", "1"]
    (cfg,) = HfArgumentParser(ComposerConfig).parse_args_into_dataclasses(argv)
    assert (cfg.sdpo_top_k, cfg.sdpo_include_environment_feedback, cfg.sdpo_teacher, cfg.sdpo_alpha) == (
        None,
        False,
        "live",
        1.0,
    )


def test_docs_embed_the_mapping_table(repo_root: Path) -> None:
    page = (repo_root / "docs/packages/crf-core-trainer.md").read_text(encoding="utf-8")
    assert trl_sdpo_markdown() in page, (
        "docs/packages/crf-core-trainer.md's TRL SDPOConfig table is stale: paste "
        "crf_core.trainer.trl_sdpo.trl_sdpo_markdown() into it"
    )


def test_trainer_from_trl_names_equals_trainer_from_crf_names(tiny_config: Callable[..., Any], tmp_path: Path) -> None:
    """A trainer configured with TRL's SDPOConfig names computes the same SDPO loss as one with crf's names."""
    import torch
    from datasets import Dataset

    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
    from crf_core.trainer import ComposerReplicationTrainer

    def half_success(completions: list[str], **kwargs: Any) -> list[float]:
        kwargs["log_extra"]("feedback", [None if i % 2 else f"wrong answer #{i}" for i in range(len(completions))])
        return [float(i % 2) for i in range(len(completions))]

    def trainer(out: Path, **options: Any) -> Any:
        tokenizer = build_char_tokenizer()
        torch.manual_seed(0)
        return ComposerReplicationTrainer(
            model=build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2),
            reward_funcs=half_success,
            args=tiny_config(out, **options),
            train_dataset=Dataset.from_list([{"prompt": "def add(a, b):\n    return"}] * 8),
            processing_class=tokenizer,
        )

    trl_names = trainer(
        tmp_path / "trl",
        distillation_mode="topk_logits",
        distillation_topk=8,
        distillation_alpha=1.0,
        distillation_add_tail=False,
        distillation_weight=1.0,
        teacher_model_kind="live",
        include_environment_feedback=True,
        environment_feedback_only_without_solution=False,
        success_reward_threshold=1.0,
    )
    crf_names = trainer(
        tmp_path / "crf",
        sdpo_top_k=8,
        sdpo_alpha=1.0,
        sdpo_add_tail=False,
        grpo_weight=0.0,
        sdpo_teacher="live",
        sdpo_environment_feedback_only_without_solution=False,
    )
    assert trl_names.sdpo.config == crf_names.sdpo.config
    losses = []
    for t in (trl_names, crf_names):
        t.model.train()
        torch.manual_seed(0)
        batch = t._generate_and_score_completions([{"prompt": "def add(a, b):\n    return"}] * 4)
        assert batch["sdpo_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]  # failures: a solved peer and feedback
        losses.append(t.sdpo_channel_loss(t.model, batch))
    assert float(losses[0]) > 0
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)
    trl_names.train()  # one optimizer step on TRL-named options
