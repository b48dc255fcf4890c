"""Validation and extraction of ``compose_loss`` inputs (private).

Every error names the ``inputs`` key, the expected shape and dtype, and what was received.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["get_float", "get_ids", "get_mask", "logits_of", "require"]


def _shape(x: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in x.shape) + ")"


def require(inputs: Mapping[str, Any], key: str, why: str) -> Any:
    """``inputs[key]`` or a ``KeyError`` saying which channel needs it."""
    if key not in inputs or inputs[key] is None:
        raise KeyError(f"inputs[{key!r}] is required {why}")
    return inputs[key]


def _expect(key: str, value: Any, shape: tuple[int | str, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"inputs[{key!r}] must be a torch.Tensor of shape {shape}, got {type(value).__name__}")
    if value.dim() != len(shape) or any(isinstance(s, int) and s != d for s, d in zip(shape, value.shape, strict=True)):
        raise ValueError(f"inputs[{key!r}] must have shape {shape}, got {_shape(value)}")
    return value


def get_ids(inputs: Mapping[str, Any], key: str, shape: tuple[int | str, ...], why: str) -> torch.Tensor:
    """Required integer token-id tensor of ``shape`` (named dims are free)."""
    value = _expect(key, require(inputs, key, why), shape)
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise TypeError(f"inputs[{key!r}] must hold integer token ids (torch.long), got dtype {value.dtype}")
    return value


def get_mask(
    inputs: Mapping[str, Any], key: str, shape: tuple[int, ...], *, default: torch.Tensor | None = None, why: str = ""
) -> torch.Tensor:
    """0/1 (bool, int or float) mask of ``shape``; ``default`` when absent (required when ``default`` is None)."""
    if key not in inputs or inputs[key] is None:
        if default is None:
            raise KeyError(f"inputs[{key!r}] is required {why}".rstrip())
        return default
    value = _expect(key, inputs[key], shape)
    if value.is_complex():
        raise TypeError(f"inputs[{key!r}] must be a bool/int/float mask, got dtype {value.dtype}")
    if value.numel() and value.dtype != torch.bool and bool((value < 0).any()):
        raise ValueError(f"inputs[{key!r}] must be >= 0 (1 = keep, 0 = ignore)")
    return value


def get_float(inputs: Mapping[str, Any], key: str, shape: tuple[int | str, ...], why: str) -> torch.Tensor:
    """Required floating tensor of ``shape``."""
    value = _expect(key, require(inputs, key, why), shape)
    if not value.is_floating_point():
        raise TypeError(f"inputs[{key!r}] must be a floating-point tensor, got dtype {value.dtype}")
    return value


def logits_of(output: Any) -> torch.Tensor:
    """The ``logits`` of a model output (HF ``CausalLMOutput``, a tuple whose first item is logits, or a tensor)."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise TypeError(
            "the model must return (B, T, V) logits (an object with `.logits`, e.g. a Hugging Face causal LM); "
            f"got {type(output).__name__}"
        )
    return logits
