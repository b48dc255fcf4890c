"""Channel state that outlives a step, saved with the Trainer's checkpoints and restored on resume.

What: the EMA self-teacher's weights (``crf_sdpo_teacher.safetensors``), TAID's schedule state and the
trace-replay pair cursor (``crf_channel_state.json``), next to the files ``Trainer`` writes in
``checkpoint-<step>/``. The same two hooks TRL uses for its own entropy-controller state carry them:
``_save_checkpoint`` writes, ``_load_optimizer_and_scheduler`` (called by ``train(resume_from_checkpoint=…)``)
reads. Nothing is unpickled: tensors go through safetensors, the rest through JSON.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["STATE_FILE", "TEACHER_FILE", "ChannelState"]

STATE_FILE = "crf_channel_state.json"
TEACHER_FILE = "crf_sdpo_teacher.safetensors"
_VERSION = 1


@dataclass(frozen=True)
class ChannelState:
    """A snapshot of the channels' state; any part may be absent (that channel is off)."""

    teacher: dict[str, torch.Tensor] | None = None
    taid: dict[str, float] | None = None
    pairs: dict[str, Any] | None = None

    def save(self, directory: str) -> None:
        """Write the snapshot into a checkpoint ``directory`` (which must exist)."""
        from safetensors.torch import save_file

        if self.teacher is not None:
            save_file({k: v.contiguous().cpu() for k, v in self.teacher.items()}, os.path.join(directory, TEACHER_FILE))
        taid = None if self.taid is None else {k: _json_float(v) for k, v in self.taid.items()}
        record = {"version": _VERSION, "teacher": self.teacher is not None, "taid": taid, "pairs": self.pairs}
        tmp = os.path.join(directory, STATE_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(tmp, os.path.join(directory, STATE_FILE))

    @classmethod
    def load(cls, directory: str) -> ChannelState | None:
        """Read a snapshot from a checkpoint ``directory``; None if it has none (a checkpoint of another trainer)."""
        from safetensors.torch import load_file

        path = os.path.join(directory, STATE_FILE)
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
        if not isinstance(record, dict) or record.get("version") != _VERSION:
            raise ValueError(f"{path} is not a crf channel state of version {_VERSION}; it cannot be resumed here")
        teacher = None
        if record.get("teacher"):
            teacher = load_file(os.path.join(directory, TEACHER_FILE))
        taid = record.get("taid")
        if taid is not None:
            taid = {k: float(v) for k, v in taid.items()}
        return cls(teacher=teacher, taid=taid, pairs=record.get("pairs"))


def _json_float(value: float) -> float | str:
    """JSON has no infinity: TAID's ``prev_loss`` starts at ``inf``."""
    return value if math.isfinite(value) else repr(float(value))
