"""The tests the seed document names exist under the same names, in the owning package (DESIGN.md's mapping)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SEED_TESTS = {
    "packages/crf-core/tests/test_compose_loss_integration.py": [
        "test_defaults_bit_exact_with_legacy_kwargs",
        "test_simpo_does_not_require_ref_logprobs",
        "test_taid_alpha_one_recovers_sdpo",
        "test_taid_requires_schedule_step",
        "test_taid_requires_total_steps",
        "test_taid_accepts_precomputed_student_init_logits",
    ],
    "packages/crf-distill/tests/test_distillation_losses.py": [
        "test_avg_sequence_logprob",
        "test_simpo_loss_returns_scalar",
        "test_simpo_loss_lower_for_better_separation",
    ],
    "packages/crf-primerl/tests/test_composer_loss.py": [
        "test_returns_finite_scalar",
        "test_dppo_mask_high_drops_positive_advantage_outliers",
        "test_dppo_mask_low_drops_negative_advantage_outliers",
        "test_dppo_mask_sign_conditioned_on_advantage",
        "test_dppo_bounds_can_be_disabled",
        "test_advantages_shape_validates_seq_accepted",
        "test_advantages_shape_validates_bt_rejected",
        "test_parity_with_prime_rl_default_loss_fn",
    ],
    "packages/crf-diloco/tests/test_serverless_local.py": [
        "test_mock_manager_shape_compat",
        "test_object_store_allreduce_local_paths_create_dir",
        "test_object_store_allreduce_world_size_1_passthrough",
        "test_object_store_allreduce_round_id_increments",
        "test_local_executor_runs_allreduce_across_replicas",
        "test_local_executor_handles_multiple_rounds",
        "test_local_executor_reports_failed_replicas",
    ],
    "packages/crf-diloco/tests/test_serverless_diloco_integration.py": [
        "test_mockmanager_has_full_diloco_call_surface",
        "test_mockmanager_diloco_outer_round_completes",
    ],
    "packages/crf-replaysim/tests/test_replaysim.py": [
        "test_dj_normalizer_skip_dj_passthrough",
        "test_dj_normalizer_skip_dj_preserves_count",
        "test_record_chosen_rejected_are_flat_strings_for_dj_text_ops",
        "test_record_chosen_rejected_messages_carry_chat_shape",
        "test_dj_normalizer_e2e_default_recipe",
    ],
}


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize(("module", "name"), [(module, name) for module, names in SEED_TESTS.items() for name in names])
def test_seed_named_test_exists(module: str, name: str) -> None:
    path = ROOT / module
    assert path.is_file(), f"{module} is missing"
    assert name in _functions(path), f"{module} lacks {name}"
