"""Wire format: safetensors objects with per-shard CRC-32 checksums, fp32/bf16/int8 codecs.

A payload is the flat fp32 concatenation ``x`` of all tensors of a round (``numel`` elements).
It is cut into *units* (one element for ``fp32``/``bf16``, one row of :data:`INT8_BLOCK` elements
for ``int8``) and the units are split into one contiguous shard per participant.

Codecs (tensor names inside the safetensors object):

* ``fp32``: ``x`` (F32, ``[numel]``).
* ``bf16``: ``x`` (BF16, ``[numel]``), round-to-nearest-even of ``x``.
* ``int8``: row-wise absmax quantisation of ``x`` zero-padded to ``[rows, INT8_BLOCK]``:
  ``s_i = max_j |x_ij| / 127`` (F32, ``[rows]``), ``q_ij = round(x_ij / s_i)`` (I8), decoded as
  ``q_ij · s_i``. Like torchft's row-wise quantised allreduce (one fp32 scale per row), except
  that rows are fixed-size blocks of the flattened payload instead of the tensors' own rows.

The object's safetensors metadata (``__metadata__``) carries ``crf_diloco`` (format version),
``codec``, ``numel``, round ``token``, and ``crc``: the CRC-32 of each shard's bytes (the slice
of every tensor, tensors in name order), so a replica that range-reads one shard can verify it
without reading the rest. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from crf_diloco.errors import CorruptObjectError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from crf_diloco.store import ObjectStore

__all__ = [
    "CODECS",
    "INT8_BLOCK",
    "WIRE_VERSION",
    "Blob",
    "Header",
    "ShardPlan",
    "decode_reduced",
    "encode_payload",
    "encode_reduced",
    "read_header",
    "read_payload_shard",
    "wire_roundtrip",
]

WIRE_VERSION = "1"
CODECS = ("fp32", "bf16", "int8")
INT8_BLOCK = 512
_INT8_MAX = 127.0
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

#: An encoded object as a list of buffers (header first), written without joining on local disks.
Blob = list[memoryview]
_HEADER_PROBE = 2048


@dataclass(frozen=True)
class ShardPlan:
    """How a payload of ``numel`` elements is cut into ``len(bounds) - 1`` shards of units."""

    codec: str
    numel: int
    bounds: tuple[int, ...]

    @staticmethod
    def build(numel: int, codec: str, n_shards: int) -> ShardPlan:
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        if numel < 1:
            raise ValueError(f"payload must have at least one element, got numel={numel}")
        if n_shards < 1:
            raise ValueError(f"n_shards must be >= 1, got {n_shards}")
        units = -(-numel // INT8_BLOCK) if codec == "int8" else numel
        return ShardPlan(codec, numel, tuple(k * units // n_shards for k in range(n_shards + 1)))

    @property
    def unit(self) -> int:
        return INT8_BLOCK if self.codec == "int8" else 1

    @property
    def units(self) -> int:
        return self.bounds[-1]

    @property
    def n_shards(self) -> int:
        return len(self.bounds) - 1

    def elem_range(self, shard: int) -> tuple[int, int]:
        """Element range ``[a, b)`` of ``shard`` within the unpadded payload."""
        a, b = self.bounds[shard], self.bounds[shard + 1]
        return min(a * self.unit, self.numel), min(b * self.unit, self.numel)

    def to_json(self) -> dict[str, object]:
        return {"codec": self.codec, "numel": self.numel, "bounds": list(self.bounds)}

    @staticmethod
    def from_json(obj: dict[str, object]) -> ShardPlan:
        bounds = obj["bounds"]
        numel = obj["numel"]
        if not isinstance(bounds, list) or not isinstance(numel, int):
            raise CorruptObjectError(f"malformed shard plan {obj!r}")
        return ShardPlan(str(obj["codec"]), numel, tuple(int(b) for b in bounds))


def _encode_units(x: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """Encode a flat fp32 slice that starts on a unit boundary."""
    if codec == "fp32":
        return {"x": x.contiguous()}
    if codec == "bf16":
        return {"x": x.to(torch.bfloat16)}
    rows = -(-x.numel() // INT8_BLOCK)
    padded = torch.zeros(rows * INT8_BLOCK, dtype=torch.float32)
    padded[: x.numel()] = x
    blocks = padded.view(rows, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1) / _INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return {"q": q, "s": scale.contiguous()}


def _decode_units(tensors: dict[str, torch.Tensor], codec: str, numel: int) -> torch.Tensor:
    """Inverse of :func:`_encode_units` (fp32, ``numel`` elements)."""
    if codec == "int8":
        return (tensors["q"].to(torch.float32) * tensors["s"][:, None]).reshape(-1)[:numel]
    return tensors["x"].to(torch.float32)[:numel]


def wire_roundtrip(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``decode(encode(x))`` for a flat fp32 slice starting on a unit boundary (no serialisation)."""
    if codec == "fp32":
        return x
    return _decode_units(_encode_units(x.contiguous(), codec), codec, x.numel())


def _buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bf16: same bytes as int16
    return memoryview(cast("Buffer", t.contiguous().numpy())).cast("B")


def _safetensors_blob(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Blob:
    """Serialise to the safetensors format (8-byte LE header length, JSON header, raw little-endian
    data) as buffers that point into the tensors, so a 256 MB payload is never copied in memory."""
    header: dict[str, object] = {"__metadata__": metadata}
    parts: Blob = []
    offset = 0
    for name in sorted(tensors):
        buf = _buffer(tensors[name])
        header[name] = {
            "dtype": _ST_NAMES[tensors[name].dtype],
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + buf.nbytes],
        }
        parts.append(buf)
        offset += buf.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header with spaces to 8-byte alignment
    return [memoryview(struct.pack("<Q", len(raw)) + raw), *parts]


def _crc(tensors: dict[str, torch.Tensor], a: int, b: int) -> int:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(_buffer(tensors[name][a:b]), crc)
    return crc


def _meta(meta: dict[str, str], plan: ShardPlan) -> dict[str, str]:
    return {"crf_diloco": WIRE_VERSION, "codec": plan.codec, "numel": str(plan.numel), **meta}


def encode_payload(flat: torch.Tensor, plan: ShardPlan, meta: dict[str, str]) -> Blob:
    """A participant's whole payload as safetensors bytes with one CRC per shard."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != plan.numel:
        raise ValueError(f"payload must be a flat fp32 tensor of {plan.numel} elements")
    tensors = _encode_units(flat, plan.codec)
    crcs = [_crc(tensors, plan.bounds[k], plan.bounds[k + 1]) for k in range(plan.n_shards)]
    return _safetensors_blob(tensors, {**_meta(meta, plan), "crc": json.dumps(crcs)})


@dataclass(frozen=True)
class Header:
    """Parsed safetensors header: absolute byte ranges of each tensor, and the metadata."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]
    metadata: dict[str, str]
    data_start: int


def _parse_header(blob: bytes | memoryview, key: str) -> Header | int:
    """Header from the first bytes of an object, or the number of bytes needed if ``blob`` is short."""
    if len(blob) < 8:
        raise CorruptObjectError(f"{key}: object shorter than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > 100_000_000:
        raise CorruptObjectError(f"{key}: implausible safetensors header length {n}")
    if len(blob) < 8 + n:
        return 8 + n
    try:
        raw = json.loads(bytes(blob[8 : 8 + n]))
    except ValueError as exc:
        raise CorruptObjectError(f"{key}: safetensors header is not JSON ({exc})") from exc
    metadata = raw.pop("__metadata__", None) or {}
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, info in raw.items():
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CorruptObjectError(f"{key}: tensor {name!r} has unexpected dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        tensors[name] = (dtype, tuple(info["shape"]), 8 + n + start, 8 + n + end)
    if metadata.get("crf_diloco") != WIRE_VERSION:
        raise CorruptObjectError(f"{key}: not a crf-diloco v{WIRE_VERSION} object (metadata {metadata!r})")
    return Header(tensors, metadata, 8 + n)


def read_header(store: ObjectStore, key: str) -> Header:
    """Read and parse an object's header with one (rarely two) ranged reads."""
    blob = store.get_range(key, 0, _HEADER_PROBE)
    parsed = _parse_header(blob, key)
    if isinstance(parsed, int):
        parsed = _parse_header(store.get_range(key, 0, parsed), key)
        assert isinstance(parsed, Header)
    return parsed


def _frombuffer(buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= s
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write into it
        return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def _expected_shapes(plan: ShardPlan, a: int, b: int) -> dict[str, tuple[int, ...]]:
    if plan.codec == "int8":
        return {"q": (b - a, INT8_BLOCK), "s": (b - a,)}
    return {"x": (b - a,)}


def _check_layout(header: Header, plan: ShardPlan, key: str, a: int, b: int) -> None:
    want = _expected_shapes(plan, a, b)
    got = {name: shape for name, (_, shape, _, _) in header.tensors.items()}
    meta = header.metadata
    if got != want or meta.get("codec") != plan.codec or meta.get("numel") != str(plan.numel):
        raise CorruptObjectError(
            f"{key}: layout {got} codec={meta.get('codec')} numel={meta.get('numel')} does not match "
            f"the round's plan {want} codec={plan.codec} numel={plan.numel}"
        )


def read_payload_shard(store: ObjectStore, key: str, header: Header, plan: ShardPlan, shard: int) -> torch.Tensor:
    """Range-read shard ``shard`` of a payload object, verify its CRC and decode it to fp32."""
    _check_layout(header, plan, key, 0, plan.units)
    try:
        crcs = json.loads(header.metadata["crc"])
        want_crc = int(crcs[shard])
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise CorruptObjectError(f"{key}: missing or malformed per-shard CRC list") from exc
    a, b = plan.bounds[shard], plan.bounds[shard + 1]
    parts: dict[str, torch.Tensor] = {}
    crc = 0
    for name in sorted(header.tensors):
        dtype, shape, start, _end = header.tensors[name]
        row_bytes = torch.empty((), dtype=dtype).element_size()
        for s in shape[1:]:
            row_bytes *= s
        buf = store.view(key, start + a * row_bytes, start + b * row_bytes)
        if len(buf) != (b - a) * row_bytes:
            raise CorruptObjectError(f"{key}: short read for {name} (got {len(buf)} of {(b - a) * row_bytes} bytes)")
        crc = zlib.crc32(buf, crc)
        parts[name] = _frombuffer(buf, dtype, (b - a, *shape[1:]))
    if crc != want_crc:
        raise CorruptObjectError(f"{key}: CRC-32 mismatch on shard {shard} (got {crc:#010x}, want {want_crc:#010x})")
    lo, hi = plan.elem_range(shard)
    return _decode_units(parts, plan.codec, hi - lo)


def encode_reduced(
    values: torch.Tensor, plan: ShardPlan, shard: int, meta: dict[str, str]
) -> tuple[Blob, torch.Tensor]:
    """Encode a reduced fp32 shard; also return its decoded values (what every reader will get)."""
    lo, hi = plan.elem_range(shard)
    if values.dtype != torch.float32 or values.numel() != hi - lo:
        raise ValueError(f"reduced shard {shard} must be fp32 with {hi - lo} elements")
    tensors = _encode_units(values, plan.codec)
    rows = plan.bounds[shard + 1] - plan.bounds[shard]
    crc = _crc(tensors, 0, rows)
    blob = _safetensors_blob(tensors, {**_meta(meta, plan), "shard": str(shard), "crc": json.dumps([crc])})
    return blob, _decode_units(tensors, plan.codec, hi - lo)


def decode_reduced(
    blob: bytes | memoryview, plan: ShardPlan, shard: int, key: str, token: str
) -> tuple[torch.Tensor, Header]:
    """Verify (layout, token, CRC) and decode a reduced shard object to fp32."""
    parsed = _parse_header(blob, key)
    if isinstance(parsed, int):
        raise CorruptObjectError(f"{key}: truncated object ({len(blob)} bytes, header needs {parsed})")
    a, b = plan.bounds[shard], plan.bounds[shard + 1]
    _check_layout(parsed, plan, key, a, b)
    if parsed.metadata.get("token") != token or parsed.metadata.get("shard") != str(shard):
        raise CorruptObjectError(f"{key}: belongs to another round or shard (metadata {parsed.metadata!r})")
    crc = 0
    parts: dict[str, torch.Tensor] = {}
    view = memoryview(blob)
    for name in sorted(parsed.tensors):
        dtype, shape, start, end = parsed.tensors[name]
        if end > len(blob):
            raise CorruptObjectError(f"{key}: truncated object")
        buf = view[start:end]
        crc = zlib.crc32(buf, crc)
        parts[name] = _frombuffer(buf, dtype, shape)
    try:
        want = int(json.loads(parsed.metadata["crc"])[0])
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise CorruptObjectError(f"{key}: missing or malformed CRC") from exc
    if crc != want:
        raise CorruptObjectError(f"{key}: CRC-32 mismatch (got {crc:#010x}, want {want:#010x})")
    lo, hi = plan.elem_range(shard)
    return _decode_units(parts, plan.codec, hi - lo), parsed
