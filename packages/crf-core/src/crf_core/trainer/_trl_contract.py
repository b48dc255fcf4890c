"""The TRL ``GRPOTrainer`` internals ``ComposerReplicationTrainer`` relies on, checked at construction.

The trainer overrides or calls these private members. They are the same in every TRL release of the
supported range (``trl>=1.10,<1.17``; tested on 1.14.2 and 1.16.0). If a TRL release renames one or
changes its parameters, ``check_trl_contract`` raises instead of letting the trainer misbehave.
"""

from __future__ import annotations

import inspect

__all__ = ["GENERATION_OUTPUT_KEYS", "TRL_METHODS", "TRLContractError", "check_trl_contract"]

#: method name -> the parameter names (after ``self``) the trainer relies on, in order.
TRL_METHODS: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("inputs",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "_compute_loss": ("model", "inputs"),
    "_log_completion_extra": ("column", "values"),
    # (TRL 1.14 spells it (model, *args, **kwargs); both pass input_ids, attention_mask, logits_to_keep first)
    "_get_per_token_logps_and_entropies": ("model",),
    "_save_checkpoint": ("model", "trial"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
}

#: Keys of ``_generate_and_score_completions``' output the SDPO channel reads.
GENERATION_OUTPUT_KEYS: tuple[str, ...] = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")

#: Attributes ``GRPOTrainer.__init__`` sets that the trainer reads.
TRL_ATTRIBUTES: tuple[str, ...] = (
    "_metrics",
    "temperature",
    "num_generations",
    "reward_weights",
    "chat_template_kwargs",
)


class TRLContractError(RuntimeError):
    """The installed TRL does not have the GRPOTrainer internals this trainer was written against."""


def _installed_version() -> str:
    try:
        import trl

        return str(trl.__version__)
    except Exception:  # pragma: no cover - trl missing is reported by the import itself
        return "unknown"


def check_trl_contract(grpo_trainer_cls: type | None = None) -> None:
    """Raise ``TRLContractError`` if a relied-on ``GRPOTrainer`` method is missing or changed its parameters."""
    if grpo_trainer_cls is None:
        from trl import GRPOTrainer

        grpo_trainer_cls = GRPOTrainer
    problems = []
    for name, expected in TRL_METHODS.items():
        method = getattr(grpo_trainer_cls, name, None)
        if method is None or not callable(method):
            problems.append(f"GRPOTrainer.{name} is missing")
            continue
        params = [p for p in inspect.signature(method).parameters if p != "self"]
        if tuple(params[: len(expected)]) != expected:
            problems.append(f"GRPOTrainer.{name}{tuple(params)} no longer starts with {expected}")
    if problems:
        raise TRLContractError(
            f"trl {_installed_version()} changed GRPOTrainer internals that ComposerReplicationTrainer overrides: "
            + "; ".join(problems)
            + ". Install a tested TRL (pip install 'trl>=1.10,<1.17') or update crf_core.trainer."
        )


def check_trainer_attributes(trainer: object) -> None:
    """Raise ``TRLContractError`` if ``GRPOTrainer.__init__`` no longer sets an attribute the trainer reads."""
    missing = [name for name in TRL_ATTRIBUTES if not hasattr(trainer, name)]
    if missing:
        raise TRLContractError(
            f"trl {_installed_version()} GRPOTrainer no longer sets {missing}; install 'trl>=1.10,<1.17' "
            "or update crf_core.trainer"
        )
