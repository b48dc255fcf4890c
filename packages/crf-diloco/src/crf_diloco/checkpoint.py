"""Checkpoints of nested state dicts as authenticated safetensors objects (no pickle).

A state such as ``{"StreamingDiLoCoFragment_0": {"outer_optimizer": {...}, "original_parameters":
{...}}, "torchft": {"step": 3, ...}}`` is split into its tensors (stored as safetensors tensors
``t0, t1, …``) and a JSON skeleton (stored in the safetensors metadata under ``skeleton``) that
records dict keys with their types (``int`` keys survive, as in optimizer ``state``), lists,
tuples, and JSON scalars. Anything else raises ``TypeError`` naming the path of the value. The object is sealed like
every other (:mod:`crf_diloco.wire`: header MAC, content tag), so a healing replica loads only authentic state.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from crf_diloco.auth import Authenticator
from crf_diloco.errors import CorruptObjectError
from crf_diloco.strictjson import parse_json_object
from crf_diloco.wire import Blob, decode_object, encode_object

__all__ = ["dumps_state", "loads_state"]

_FORMAT = "crf-diloco-state-2"


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


def dumps_state(state: dict[str, Any], key: str, auth: Authenticator) -> Blob:
    """Serialise a nested state dict as the authenticated safetensors object at ``key`` (one content tag)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _pack(state, tensors, "")
    # own contiguous CPU copies: the object must not change while it is written, nor share storage
    tensors = {name: t.detach().to("cpu").clone().contiguous() for name, t in tensors.items()}
    return encode_object(key, auth, "state", tensors, {"format": _FORMAT, "skeleton": json.dumps(skeleton)})


def loads_state(blob: bytes, key: str, auth: Authenticator) -> dict[str, Any]:
    """Inverse of :func:`dumps_state`; `CorruptObjectError` naming ``key`` for anything not authentic or malformed."""
    header, tensors = decode_object(blob, key, auth, "state")
    if header.metadata.get("format") != _FORMAT:
        raise CorruptObjectError(f"{key}: not a crf-diloco state checkpoint (format {header.metadata.get('format')!r})")
    skeleton = parse_json_object(b'{"root":' + header.meta("skeleton").encode() + b"}", key)["root"]
    try:
        state = _unpack(skeleton, tensors)
    except (KeyError, TypeError, ValueError, IndexError, RecursionError) as exc:
        raise CorruptObjectError(f"{key}: malformed state skeleton ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CorruptObjectError(f"{key}: checkpoint root is not a dict")
    return state
