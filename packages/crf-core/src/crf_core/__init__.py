"""compose_loss and ComposerReplicationTrainer: GRPO + SDPO self-distillation + trace-replay DPO on TRL."""

from crf_core._version import __version__

__all__ = ["__version__"]
