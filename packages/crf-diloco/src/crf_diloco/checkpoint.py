"""Checkpoints of nested state dicts as authenticated safetensors objects (no pickle).

A state such as ``{"StreamingDiLoCoFragment_0": {"outer_optimizer": {...}, "original_parameters":
{...}}, "torchft": {"step": 3, ...}}`` is split into its tensors (stored as safetensors tensors
``t0, t1, …``) and a JSON skeleton (stored in the safetensors metadata under ``skeleton``) that
records dict keys with their types (``int`` keys survive, as in optimizer ``state``), lists,
tuples, JSON scalars and `PartRef` s (a value stored in another object, named by its digest). Anything else raises
``TypeError`` naming the path of the value. The object is sealed like every other (:mod:`crf_diloco.wire`: header
MAC, content tag), so a healing replica loads only authentic state.

`split_state` cuts a state into parts for incremental checkpoints (:mod:`crf_diloco.snapshots`): its top-level
entries that hold tensors, grouped so that no tensor is in two parts, each named by `part_digest`, a MAC of its
content with the run's secret: a part that did not change since the last checkpoint has the same name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from crf_diloco.auth import Authenticator
from crf_diloco.errors import CorruptObjectError
from crf_diloco.strictjson import parse_json_object
from crf_diloco.wire import Blob, Header, decode_object, encode_object, tensor_bytes

__all__ = [
    "Packed",
    "PartRef",
    "dumps_state",
    "loads_state",
    "pack_state",
    "part_digest",
    "referenced_parts",
    "seal_packed",
    "split_state",
    "unpack_state",
]

_FORMAT = "crf-diloco-state-3"
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class PartRef:
    """A value stored in the part object named by ``digest`` (32 hex characters, `part_digest`)."""

    digest: str

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or not _DIGEST_RE.fullmatch(self.digest):
            raise ValueError(f"a part digest is 32 lowercase hex characters, got {self.digest!r}")


@dataclass(frozen=True)
class Packed:
    """A state as its JSON ``skeleton`` and its own contiguous CPU ``tensors`` (``t0, t1, …``), ready to seal."""

    skeleton: Any
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def entries(self) -> list[str]:
        """The top-level keys of a packed dict state, in order."""
        return [k for k, _ in self.skeleton["__dict__"]]


def _pack(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        for name, seen in tensors.items():
            if seen is value:  # the same tensor reached twice (e.g. an optimizer shared by fragments)
                return {"__tensor__": name}
        name = f"t{len(tensors)}"
        tensors[name] = value
        return {"__tensor__": name}
    if isinstance(value, PartRef):
        return {"__part__": value.digest}
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
        if "__part__" in value:
            return PartRef(value["__part__"])
        if "__tuple__" in value:
            return tuple(_unpack(v, tensors) for v in value["__tuple__"])
        return {k: _unpack(v, tensors) for k, v in value["__dict__"]}
    return value


def pack_state(state: dict[str, Any], *, copy: bool = True) -> Packed:
    """``state`` as a skeleton and copies of its tensors: the copy is what gets written, so the state may change
    once this returns. ``copy=False``: the state's own CPU tensors (to hash a state nothing changes meanwhile)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _pack(state, tensors, "")
    if not copy:
        return Packed(skeleton, tensors)
    return Packed(skeleton, {name: t.detach().to("cpu").clone().contiguous() for name, t in tensors.items()})


def unpack_state(packed: Packed) -> dict[str, Any]:
    """The dict state that ``packed`` holds, built on its tensors (not copies: `pack_state` made them)."""
    state = _unpack(packed.skeleton, packed.tensors)
    if not isinstance(state, dict):
        raise TypeError("a packed state must be a dict")
    return state


def seal_packed(packed: Packed, key: str, auth: Authenticator) -> Blob:
    """The authenticated safetensors object of a `pack_state` d state at ``key`` (one content tag)."""
    return encode_object(
        key, auth, "state", packed.tensors, {"format": _FORMAT, "skeleton": json.dumps(packed.skeleton)}
    )


def dumps_state(state: dict[str, Any], key: str, auth: Authenticator) -> Blob:
    """Serialise a nested state dict as the authenticated safetensors object at ``key`` (one content tag)."""
    return seal_packed(pack_state(state), key, auth)


def loads_state(blob: bytes, key: str, auth: Authenticator) -> dict[str, Any]:
    """Inverse of :func:`dumps_state`; `CorruptObjectError` naming ``key`` for anything not authentic or malformed."""
    header, tensors = decode_object(blob, key, auth, "state")
    skeleton = _skeleton(header)
    try:
        state = _unpack(skeleton, tensors)
    except (KeyError, TypeError, ValueError, IndexError, RecursionError) as exc:
        raise CorruptObjectError(f"{key}: malformed state skeleton ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CorruptObjectError(f"{key}: checkpoint root is not a dict")
    return state


def _skeleton(header: Header) -> Any:
    if header.metadata.get("kind") != "state" or header.metadata.get("format") != _FORMAT:
        raise CorruptObjectError(
            f"{header.key}: not a crf-diloco state checkpoint (format {header.metadata.get('format')!r})"
        )
    return parse_json_object(b'{"root":' + header.meta("skeleton").encode() + b"}", header.key)["root"]


def referenced_parts(header: Header) -> set[str]:
    """The digests of the parts an authenticated state header (a manifest's) refers to at its top level;
    `CorruptObjectError` if it is not a state's."""
    skeleton = _skeleton(header)
    items = skeleton.get("__dict__") if isinstance(skeleton, dict) else None
    if not isinstance(items, list):
        raise CorruptObjectError(f"{header.key}: checkpoint root is not a dict")
    refs = (item[1] for item in items if isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict))
    return {ref["__part__"] for ref in refs if isinstance(ref.get("__part__"), str)}


def part_digest(packed: Packed, auth: Authenticator) -> str:
    """The name of a part: ``HMAC-SHA256(secret, skeleton ‖ tensor dtypes and shapes ‖ tensor bytes)``, 32 hex
    characters. Equal parts get equal names on every replica; without the secret nobody can predict one."""
    layout = json.dumps([packed.skeleton, [[n, str(t.dtype), list(t.shape)] for n, t in packed.tensors.items()]])
    return auth.mac_hex("state-part", "state/parts", layout.encode(), *map(tensor_bytes, packed.tensors.values()))[:32]


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], list[Packed]]:
    """``state``'s top-level entries without tensors (kept inline in the manifest), and the others as packed parts:
    entries that share a tensor (e.g. fragments sharing one outer optimizer) go into the same part, so no tensor is
    written twice."""
    inline: dict[str, Any] = {}
    groups: list[tuple[list[str], set[int]]] = []
    for key, value in state.items():
        found: dict[str, torch.Tensor] = {}
        _pack(value, found, f"/{key}")  # validates, and finds the entry's tensors
        if not found:
            inline[key] = value
            continue
        ids = {id(t) for t in found.values()}
        joined = [g for g in groups if g[1] & ids]
        keys, merged = [key], set(ids)
        for g in joined:
            groups.remove(g)
            keys, merged = g[0] + keys, merged | g[1]
        groups.append((keys, merged))
    order = list(state)
    parts = [pack_state({k: state[k] for k in sorted(keys, key=order.index)}) for keys, _ in groups]
    return inline, parts
