"""The TRL internals the trainer relies on, and ComposerConfig's fields and validation."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import trl
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer

from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer._trl_contract import TRL_METHODS, TRLContractError, check_trl_contract


def test_installed_trl_is_in_the_tested_range() -> None:
    assert Version("1.10") <= Version(trl.__version__) < Version("1.17")


def test_grpo_trainer_internals_we_override_are_unchanged() -> None:
    check_trl_contract(GRPOTrainer)  # raises TRLContractError if TRL renamed or re-signed any of them
    for name, params in TRL_METHODS.items():
        signature = [p for p in inspect.signature(getattr(GRPOTrainer, name)).parameters if p != "self"]
        assert tuple(signature[: len(params)]) == params, name
        assert name in vars(GRPOTrainer) or name == "compute_loss", f"{name} is no longer defined by GRPOTrainer"
    # the overrides keep the parent's signatures
    for name in ("_generate_and_score_completions", "_calculate_rewards", "compute_loss", "_log_completion_extra"):
        ours = list(inspect.signature(getattr(ComposerReplicationTrainer, name)).parameters)
        theirs = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)
        assert ours == theirs, name


def test_contract_check_fails_loudly_on_a_changed_trl() -> None:
    class Renamed:
        def _generate_and_score_completions(self, inputs: Any) -> None: ...
        def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any) -> None: ...  # lost an argument
        def compute_loss(self, model: Any, inputs: Any, return_outputs: Any, num_items_in_batch: Any) -> None: ...
        def _compute_loss(self, model: Any, inputs: Any) -> None: ...

    with pytest.raises(TRLContractError) as info:
        check_trl_contract(Renamed)
    message = str(info.value)
    assert "_calculate_rewards" in message
    assert "_log_completion_extra is missing" in message
    assert "trl>=1.10,<1.17" in message


def test_every_added_field_has_help_text() -> None:
    added = [
        f for f in dataclasses.fields(ComposerConfig) if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}
    ]
    assert {f.name for f in added} >= {
        "grpo_weight",
        "sdpo_weight",
        "trace_replay_dpo_weight",
        "sdpo_alpha",
        "dpo_variant",
    }
    for f in added:
        assert f.metadata.get("help"), f"{f.name} has no help text"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sdpo_alpha": 1.5}, "sdpo_alpha"),
        ({"sdpo_weight": -1.0}, "sdpo_weight"),
        ({"grpo_weight": 0.0, "sdpo_weight": 0.0}, "every channel weight is 0"),
        ({"sdpo_top_k": 0}, "sdpo_top_k"),
        ({"sdpo_is_clip": 0.0}, "sdpo_is_clip"),
        ({"sdpo_teacher": "frozen"}, "sdpo_teacher"),
        ({"sdpo_teacher_update_rate": 2.0}, "sdpo_teacher_update_rate"),
        ({"sdpo_reprompt_truncation": "middle"}, "sdpo_reprompt_truncation"),
        ({"sdpo_reprompt_template": "{prompt}"}, "reprompt_template"),
        ({"dpo_variant": "kto"}, "dpo_variant"),
        ({"trace_replay_reference": "none"}, "only works with dpo_variant='simpo'"),
        ({"trace_replay_batch_size": 0}, "trace_replay_batch_size"),
        ({"sdpo_wrapper": "distill"}, "sdpo_wrapper"),
        ({"sdpo_wrapper": "entropy_opd"}, "entropy_opd_h_max"),
        ({"entropy_opd_h_max": 1.0}, "sdpo_wrapper is not 'entropy_opd'"),
        ({"sdpo_wrapper": "entropy_opd", "entropy_opd_h_max": 1.0, "entropy_opd_gate": "step"}, "entropy_opd_gate"),
        ({"sdpo_wrapper": "entropy_opd", "entropy_opd_h_max": 0.0, "entropy_opd_gate": "linear"}, "must be > 0"),
        ({"taid_alpha_min": 0.2}, "sdpo_wrapper='taid'"),
        ({"sdpo_wrapper": "taid", "taid_alpha_min": 0.9, "taid_alpha_max": 0.5}, "must not exceed"),
        ({"sdpo_wrapper": "taid", "taid_momentum": 1.5}, "beta"),
        ({"lm_head_chunking": "sometimes"}, "chunking mode"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"dpo_label_smoothing": 0.5}, "dpo_label_smoothing"),
        ({"simpo_gamma": -1.0}, "simpo_gamma"),
        ({"grpo_weight": float("nan")}, "grpo_weight"),
    ],
)
def test_bad_config_values_name_the_field(tmp_path: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ComposerConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_defaults_follow_the_sdpo_paper_runs(tmp_path: Any) -> None:
    cfg = ComposerConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert (cfg.sdpo_alpha, cfg.sdpo_top_k, cfg.sdpo_add_tail, cfg.sdpo_is_clip) == (0.5, 100, True, 2.0)
    assert (cfg.sdpo_teacher, cfg.sdpo_teacher_update_rate) == ("ema", 0.05)
    assert cfg.reprompt_config().reprompt_template.endswith("Correctly solve the original question.\n")
    assert (cfg.grpo_weight, cfg.sdpo_weight, cfg.trace_replay_dpo_weight) == (1.0, 1.0, 0.0)
