"""Channel state that outlives a step, saved with the Trainer's checkpoints and restored on resume.

What: the EMA self-teacher's tensors (``crf_sdpo_teacher.safetensors``: the full policy copy, or under PEFT the
adapter's EMA tensors only), TAID's schedule state, the trace-replay pair cursor and the channel config that
state belongs to (``crf_channel_state.json``), next to the files ``Trainer`` writes in ``checkpoint-<step>/``.
The same two hooks TRL uses for its own entropy-controller state carry them: ``_save_checkpoint`` writes,
``_load_optimizer_and_scheduler`` (called by ``train(resume_from_checkpoint=…)``) reads. Nothing is unpickled:
tensors go through safetensors, the rest through JSON.

Version 2 (this one) added ``config``: the trainer compares it with the resuming run's and refuses any
difference (:func:`config_mismatch`). Version 1 files (no config) are refused with a message saying so.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["STATE_FILE", "STATE_VERSION", "TEACHER_FILE", "ChannelState", "config_mismatch"]

STATE_FILE = "crf_channel_state.json"
TEACHER_FILE = "crf_sdpo_teacher.safetensors"
STATE_VERSION = 2
_FRESH = "resume with the same ComposerConfig (and model/adapter setup), or start a fresh run"


@dataclass(frozen=True)
class ChannelState:
    """A snapshot of the channels' state; any part may be absent (that channel is off).

    Attributes:
        teacher: the EMA self-teacher's tensors by name (``EmaTeacher``/``AdapterEmaTeacher.state_dict()``).
        taid: TAID's schedule state (``t``, ``prev_loss``, ``momentum``).
        pairs: the trace-replay pair cursor's state.
        config: the channel settings the state belongs to (JSON scalars by field name), compared on resume.
    """

    teacher: dict[str, torch.Tensor] | None = None
    taid: dict[str, float] | None = None
    pairs: dict[str, Any] | None = None
    config: dict[str, Any] | None = None

    def save(self, directory: str) -> None:
        """Write the snapshot into a checkpoint ``directory`` (which must exist)."""
        from safetensors.torch import save_file

        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
        if self.teacher is not None:
            save_file({k: v.contiguous().cpu() for k, v in self.teacher.items()}, os.path.join(directory, TEACHER_FILE))
        taid = None if self.taid is None else {k: _json_float(v) for k, v in self.taid.items()}
        record = {
            "version": STATE_VERSION,
            "config": self.config,
            "teacher": self.teacher is not None,
            "taid": taid,
            "pairs": self.pairs,
        }
        tmp = os.path.join(directory, STATE_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh, allow_nan=False)
        os.replace(tmp, os.path.join(directory, STATE_FILE))

    @classmethod
    def load(cls, directory: str) -> ChannelState | None:
        """Read a snapshot from a checkpoint ``directory``; None if it has none (a checkpoint of another trainer,
        e.g. TRL's ``GRPOTrainer``). A file of another version, or an unreadable one, is a ``ValueError``."""
        from safetensors.torch import load_file

        path = os.path.join(directory, STATE_FILE)
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path} is not readable JSON ({err}); the checkpoint is damaged") from err
        version = record.get("version") if isinstance(record, dict) else None
        if version != STATE_VERSION:
            if isinstance(version, int) and version < STATE_VERSION:
                raise ValueError(
                    f"{path} has crf channel-state version {version}, written by an older crf-core; this one reads "
                    f"version {STATE_VERSION}, which also records the channel config so a resume can be checked. "
                    "Resume with the crf-core that wrote it, or start a fresh run (e.g. from the checkpoint's "
                    "model weights, without resume_from_checkpoint)"
                )
            raise ValueError(
                f"{path} is not a crf channel state of version {STATE_VERSION} (found version {version!r}); "
                "it cannot be resumed by this crf-core"
            )
        config = record.get("config")
        if not isinstance(config, dict):
            raise ValueError(f"{path} records no channel config; the checkpoint is damaged")
        teacher = None
        if record.get("teacher"):
            teacher_path = os.path.join(directory, TEACHER_FILE)
            if not os.path.exists(teacher_path):
                raise ValueError(f"{path} says the checkpoint has an EMA teacher, but {teacher_path} is missing")
            teacher = load_file(teacher_path)
        taid = record.get("taid")
        if taid is not None:
            taid = {k: float(v) for k, v in taid.items()}
        return cls(teacher=teacher, taid=taid, pairs=record.get("pairs"), config=config)


def config_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any], where: str = "the checkpoint") -> str | None:
    """A message naming every setting that differs between ``saved`` and ``current`` (and the fix), or None."""
    diffs = [
        f"{key}: {where} has {saved.get(key, '<unset>')!r}, this run has {current.get(key, '<unset>')!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key, "<unset>") != current.get(key, "<unset>")
    ]
    if not diffs:
        return None
    return (
        f"{where} was saved with other channel settings than this run ({'; '.join(diffs)}), so its channel state "
        f"does not belong to this run; {_FRESH}"
    )


def _json_float(value: float) -> float | str:
    """JSON has no infinity: TAID's ``prev_loss`` starts at ``inf``."""
    return value if math.isfinite(value) else repr(float(value))
