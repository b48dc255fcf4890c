"""compose_loss and ComposerReplicationTrainer: GRPO + SDPO self-distillation + trace-replay DPO on TRL."""

from crf_core._version import __version__
from crf_core.loss import LossComponents, compose_loss

__all__ = ["LossComponents", "__version__", "compose_loss"]
