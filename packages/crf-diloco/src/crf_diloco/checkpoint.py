"""Checkpoints of nested state dicts as safetensors (no pickle).

A state such as ``{"StreamingDiLoCoFragment_0": {"outer_optimizer": {...}, "original_parameters":
{...}}, "torchft": {"step": 3, ...}}`` is split into its tensors (stored as safetensors tensors
``t0, t1, …``) and a JSON skeleton (stored in the safetensors metadata under ``skeleton``) that
records dict keys with their types (``int`` keys survive, as in optimizer ``state``), lists,
tuples, and JSON scalars. Anything else raises ``TypeError`` naming the path of the value.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

__all__ = ["dumps_state", "loads_state"]

_FORMAT = "crf-diloco-state-1"


def _pack(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        for name, seen in tensors.items():
            if seen is value:  # the same tensor reached twice (e.g. an optimizer shared by fragments)
                return {"__tensor__": name}
        name = f"t{len(tensors)}"
        tensors[name] = value
        return {"__tensor__": name}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"state key {k!r} at {path or '<root>'} must be str or int")
            items.append([k, _pack(v, tensors, f"{path}/{k}")])
        return {"__dict__": items}
    if isinstance(value, tuple):
        return {"__tuple__": [_pack(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_pack(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"cannot checkpoint {type(value).__name__} at {path or '<root>'}: only tensors, dicts, lists, tuples and JSON scalars"
    )


def _unpack(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_unpack(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(_unpack(v, tensors) for v in value["__tuple__"])
        return {k: _unpack(v, tensors) for k, v in value["__dict__"]}
    return value


def _crc(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        crc = zlib.crc32(t.contiguous().reshape(-1).numpy().tobytes(), crc)
    return crc


def dumps_state(state: dict[str, Any]) -> bytes:
    """Serialise a nested state dict to safetensors bytes (with a CRC-32 over all tensor bytes)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _pack(state, tensors, "")
    # own copies: safetensors refuses tensors that share storage
    tensors = {name: t.detach().to("cpu").clone() for name, t in tensors.items()}
    meta = {"format": _FORMAT, "skeleton": json.dumps(skeleton), "crc": str(_crc(tensors))}
    return st_save(tensors, metadata=meta)


def loads_state(blob: bytes) -> dict[str, Any]:
    """Inverse of :func:`dumps_state`."""
    if len(blob) < 8:
        raise ValueError("checkpoint is truncated")
    header_len = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8 : 8 + header_len]).get("__metadata__") or {}
    if meta.get("format") != _FORMAT:
        raise ValueError(f"not a crf-diloco state checkpoint (format {meta.get('format')!r})")
    tensors = st_load(blob)
    if str(_crc(tensors)) != meta.get("crc"):
        raise ValueError("checkpoint CRC-32 mismatch: the object is corrupt")
    state = _unpack(json.loads(meta["skeleton"]), tensors)
    if not isinstance(state, dict):
        raise ValueError("checkpoint root is not a dict")
    return state
