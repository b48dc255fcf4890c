"""The production trainer: TRL ``GRPOTrainer`` + SDPO self-distillation + trace-replay DPO.

``ComposerReplicationTrainer`` and ``ComposerConfig`` need the ``[train]`` extra (TRL, transformers);
they are imported on first access, so ``crf_core.trainer.reprompt`` (pure Python) works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crf_core.trainer.config import ComposerConfig
    from crf_core.trainer.trainer import ComposerReplicationTrainer

__all__ = ["ComposerConfig", "ComposerReplicationTrainer"]

_LAZY = {
    "ComposerConfig": "crf_core.trainer.config",
    "ComposerReplicationTrainer": "crf_core.trainer.trainer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'crf_core.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
