"""Test support (not shipped): the tensors of a nested training state, to compare replicas bit for bit."""

from __future__ import annotations

from typing import Any

import torch


def nested_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state (dicts, lists, tuples), detached copies in a fixed order (dict keys sorted)."""
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in nested_tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in nested_tensors(v)]
    return []
