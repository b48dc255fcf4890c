"""The trainer's start-up line: which channels are on, their weights, and the model copies each one holds.

The bytes of a copy are those of its parameters as the trainer holds them (``numel × element_size`` of every
parameter, tied ones once), not an estimate from the model's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["ChannelCost", "parameter_bytes", "startup_line"]


@dataclass(frozen=True)
class ChannelCost:
    """One channel that is on: its metric name, its loss weight, and the extra model copy it holds.

    Attributes:
        name: the channel's metric name (``grpo``, ``sdpo_jsd``, ``trace_replay_dpo``).
        weight: its loss weight.
        copy: what extra copy it holds (e.g. ``"EMA teacher"``), or why it needs none.
        copy_bytes: the parameter bytes of that copy; 0 when it holds none.
    """

    name: str
    weight: float
    copy: str
    copy_bytes: int = 0


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters (a parameter shared by several submodules counts once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _size(n: int) -> str:
    return f"{n} B ({n / 2**20:.1f} MiB)"


def startup_line(costs: Sequence[ChannelCost], off: Sequence[str]) -> str:
    """``crf channels: on grpo ×1 (…), sdpo_jsd ×1 (EMA teacher: N B (x MiB)); off …; extra model memory N B``."""
    parts = [
        f"{c.name} ×{c.weight:g} ({c.copy}: {_size(c.copy_bytes)})"
        if c.copy_bytes
        else f"{c.name} ×{c.weight:g} ({c.copy})"
        for c in costs
    ]
    total = sum(c.copy_bytes for c in costs)
    return (
        f"crf channels: on {', '.join(parts)}; off {', '.join(off) if off else 'none'}; "
        f"extra model memory {_size(total)}"
    )
