"""Wire format (version 2): authenticated safetensors objects; fp32/bf16/int8/int4/top-k codecs of a flat payload.

A payload is the flat fp32 concatenation ``x`` of all tensors of a round (``numel`` elements). It is cut into
*units* (one element for ``fp32``/``bf16``, one block for ``int8`` (:data:`INT8_BLOCK`), ``int4`` and ``topk``) and
the units into one contiguous shard per participant (`ShardPlan`).

Codecs (tensor names inside the object):

* ``fp32``: ``x`` (F32, ``[numel]``).
* ``bf16``: ``x`` (BF16, ``[numel]``), round-to-nearest-even of ``x``.
* ``int8``: row-wise absmax quantisation of ``x`` zero-padded to ``[rows, INT8_BLOCK]``:
  ``s_i = max_j |x_ij| / 127`` (F32, ``[rows]``), ``q_ij = round(x_ij / s_i)`` (I8), decoded as ``q_ij · s_i``.
  Like torchft's row-wise quantised allreduce (one fp32 scale per row), except that rows are fixed-size blocks of the
  flattened payload instead of the tensors' own rows.
* ``int4:<B>`` (``int4`` = ``int4:64``): block-wise absmax quantisation to ``[-7, 7]`` of ``x`` zero-padded to
  ``[rows, B]``: ``s_i = max_j |x_ij| / 7`` (F32, ``[rows]``) and ``q`` (U8, ``[rows, B/2]``), two values per byte:
  element ``2j`` in the low nibble, ``2j+1`` in the high one, each stored as ``q + 8`` (``1..15``). Decoded as
  ``q_ij · s_i``; error ``<= s_i / 2``. ``0.5 + 4/B`` bytes per element (``0.141×`` fp32 at ``B = 64``).
* ``topk:<k>/<B>`` (``topk`` = ``topk:41/4096``, 1 % of each block): per block of ``B`` elements the ``k`` largest
  magnitudes (ties: the lower offset), as ``i`` (I16 offsets in the block, strictly ascending, ``[rows, k]``), ``q``
  (I8, ``[rows, k]``: absmax int8 of the kept values) and ``s`` (F32, ``[rows]``); everything else decodes to 0.
  ``3k + 4`` bytes per block: ``127 / 16384 = 0.00775×`` fp32 by default.

The unit of ``int8``/``int4``/``topk`` is one block, so every shard decodes alone. ``int4`` and ``topk`` payloads are
validated when decoded (finite non-negative scales, values and offsets in range and ascending, zero padding): a
replica holding the secret that sends anything else gets `CorruptObjectError`, never a silent wrong value.

Every object is a valid safetensors file whose JSON header starts with ``{"__metadata__":{"mac":"<64 hex>"``. The
metadata also holds ``crf_diloco`` (this version), ``kind`` (``payload``, ``reduced`` or ``state``), a random
``nonce``, ``tag_alg`` and ``tags``: one content tag per item (per shard of a payload, one for the other kinds) over
the item's bytes of every tensor in name order, so one range-read shard is verified without reading the rest.
``mac`` is `Authenticator.mac_hex` over the key and the header with the mac digits zeroed, so the header is checked
before it is parsed. Nothing is ever unpickled; every malformed object raises `CorruptObjectError` naming its key.
"""

from __future__ import annotations

import functools
import itertools
import json
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from crf_diloco._checks import is_int
from crf_diloco.auth import MAC_HEX, Authenticator, default_tag_alg
from crf_diloco.errors import CorruptObjectError
from crf_diloco.strictjson import parse_json_object

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from crf_diloco.store import ObjectStore

__all__ = [
    "CODECS",
    "INT4_BLOCK",
    "INT8_BLOCK",
    "READ_CHUNK",
    "READ_MIN",
    "READ_WINDOW",
    "TOPK_BLOCK",
    "TOPK_K",
    "WIRE_VERSION",
    "Blob",
    "Codec",
    "Header",
    "Prefetch",
    "RunAll",
    "Scratch",
    "ShardPlan",
    "check_payload_header",
    "decode_object",
    "decode_payload_blob",
    "encode_object",
    "encode_payload",
    "encode_reduced",
    "feedback_roundtrip",
    "header_probe",
    "parse_codec",
    "payload_data_start",
    "prefetch_payload_shard",
    "read_header",
    "read_objects",
    "read_payload_shard",
    "read_reduced",
    "run_all",
    "tensor_bytes",
    "wire_roundtrip",
]

WIRE_VERSION = "2"
CODECS = ("fp32", "bf16", "int8", "int4", "topk")
INT8_BLOCK = 512
#: default int4 block (one fp32 scale per 64 values: 36 bytes per 64 elements, 0.141x fp32) and its allowed range
INT4_BLOCK = 64
INT4_BLOCK_RANGE = (8, 4096)
#: default top-k: 41 of every 4096 values (1 %), int16 offsets + int8 values + one fp32 scale per block:
#: 41 * 3 + 4 = 127 bytes per 16384 fp32 bytes, 0.00775x fp32
TOPK_K = 41
TOPK_BLOCK = 4096
TOPK_BLOCK_RANGE = (64, 32768)
_INT8_MAX = 127.0
_INT4_MAX = 7.0
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_MAC_PREFIX = b'{"__metadata__":{"mac":"'
_MAX_HEADER = 1 << 20
HEADER_PROBE = 4096

#: An encoded object as a list of buffers (header first); never joined on local disks.
Blob = list[memoryview]


@dataclass(frozen=True)
class Codec:
    """A parsed wire codec: ``kind`` (``fp32``, ``bf16``, ``int8``, ``int4``, ``topk``), its unit ``block`` (elements per
    unit) and, for ``topk``, ``k`` (values kept per block). ``name`` is the canonical string used on the wire."""

    kind: str
    block: int = 1
    k: int = 0

    @property
    def name(self) -> str:
        if self.kind == "int4":
            return f"int4:{self.block}"
        if self.kind == "topk":
            return f"topk:{self.k}/{self.block}"
        return self.kind

    @property
    def error_feedback(self) -> bool:
        """Whether rounds of this codec keep a per-replica residual (the sub-int8 codecs do)."""
        return self.kind in ("int4", "topk")

    def bytes_per_block(self) -> int:
        """Wire bytes of one unit (payload data only, headers excluded)."""
        if self.kind == "int4":
            return self.block // 2 + 4
        if self.kind == "topk":
            return self.k * 3 + 4
        if self.kind == "int8":
            return INT8_BLOCK + 4
        return 4 if self.kind == "fp32" else 2

    def ratio(self) -> float:
        """Payload bytes of this codec / fp32 bytes (headers excluded)."""
        return self.bytes_per_block() / (4 * self.block)


@functools.lru_cache(maxsize=64)
def parse_codec(name: str) -> Codec:
    """The `Codec` of a compression string: ``fp32``, ``bf16``, ``int8``, ``int4`` (= ``int4:64``), ``int4:<block>``,
    ``topk`` (= ``topk:41/4096``, 1 % of each block) or ``topk:<k>/<block>``. `ValueError` naming the fix otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"codec must be a string such as 'int4' or 'topk:41/4096', got {name!r}")
    if name in ("fp32", "bf16"):
        return Codec(name)
    if name == "int8":
        return Codec("int8", INT8_BLOCK)
    kind, sep, args = name.partition(":")
    if kind == "int4":
        block = _codec_int(name, args, INT4_BLOCK) if sep else INT4_BLOCK
        if not INT4_BLOCK_RANGE[0] <= block <= INT4_BLOCK_RANGE[1] or block % 2:
            raise ValueError(
                f"codec {name!r}: the int4 block size must be even and in [{INT4_BLOCK_RANGE[0]}, "
                f"{INT4_BLOCK_RANGE[1]}] (two values per byte, one fp32 scale per block), got {block}; "
                f"use e.g. 'int4:{INT4_BLOCK}'"
            )
        return Codec("int4", block)
    if kind == "topk":
        k, block = TOPK_K, TOPK_BLOCK
        if sep:
            k_text, slash, block_text = args.partition("/")
            if not slash:
                raise ValueError(
                    f"codec {name!r}: write top-k as 'topk:<k>/<block>', e.g. 'topk:{TOPK_K}/{TOPK_BLOCK}'"
                )
            k, block = _codec_int(name, k_text, TOPK_K), _codec_int(name, block_text, TOPK_BLOCK)
        if not TOPK_BLOCK_RANGE[0] <= block <= TOPK_BLOCK_RANGE[1]:
            raise ValueError(
                f"codec {name!r}: the top-k block size must be in [{TOPK_BLOCK_RANGE[0]}, {TOPK_BLOCK_RANGE[1]}] "
                f"(indices are int16 offsets within a block), got {block}; use e.g. 'topk:{TOPK_K}/{TOPK_BLOCK}'"
            )
        if not 1 <= k <= block // 4:
            raise ValueError(
                f"codec {name!r}: k (values kept per block of {block}) must be in [1, {block // 4}] (block / 4: "
                f"denser than that, 'int4' or 'int8' is smaller on the wire), got {k}; e.g. 1 % is "
                f"'topk:{max(1, -(-block // 100))}/{block}'"
            )
        return Codec("topk", block, k)
    raise ValueError(f"codec must be one of {CODECS} (optionally 'int4:<block>' or 'topk:<k>/<block>'), got {name!r}")


def _codec_int(name: str, text: str, example: int) -> int:
    if not text.isdigit() or not text.isascii() or (len(text) > 1 and text[0] == "0") or len(text) > 6:
        raise ValueError(f"codec {name!r}: {text!r} is not a plain positive integer (e.g. {example})")
    return int(text)


@dataclass(frozen=True)
class ShardPlan:
    """How a payload of ``numel`` elements is cut into ``len(bounds) - 1`` shards of units."""

    codec: str
    numel: int
    bounds: tuple[int, ...]

    @staticmethod
    def build(numel: int, codec: str, n_shards: int) -> ShardPlan:
        spec = parse_codec(codec)
        if spec.name != codec:
            raise ValueError(f"codec {codec!r} is not canonical: pass {spec.name!r}")
        if numel < 1:
            raise ValueError(f"payload must have at least one element, got numel={numel}")
        if n_shards < 1:
            raise ValueError(f"n_shards must be >= 1, got {n_shards}")
        units = -(-numel // spec.block)
        return ShardPlan(codec, numel, tuple(k * units // n_shards for k in range(n_shards + 1)))

    @property
    def spec(self) -> Codec:
        return parse_codec(self.codec)

    @property
    def unit(self) -> int:
        return self.spec.block

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

    def shapes(self, a: int, b: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Tensor names, dtypes and shapes of units ``[a, b)`` under this codec."""
        spec = self.spec
        if spec.kind == "int8":
            return {"q": (torch.int8, (b - a, INT8_BLOCK)), "s": (torch.float32, (b - a,))}
        if spec.kind == "int4":
            return {"q": (torch.uint8, (b - a, spec.block // 2)), "s": (torch.float32, (b - a,))}
        if spec.kind == "topk":
            return {"i": (torch.int16, (b - a, spec.k)), "q": (torch.int8, (b - a, spec.k)),
                    "s": (torch.float32, (b - a,))}  # fmt: skip
        return {"x": (torch.float32 if self.codec == "fp32" else torch.bfloat16, (b - a,))}


# -- codecs -------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` zero-padded to whole blocks, as ``[rows, block]`` (a copy)."""
    rows = -(-x.numel() // block)
    padded = torch.zeros(rows * block, dtype=torch.float32)
    padded[: x.numel()] = x
    return padded.view(rows, block)


def _absmax_quantise(values: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise absmax quantisation of ``[rows, n]`` fp32 values: ``(q, s)`` with ``q`` in ``[-qmax, qmax]`` (fp32)."""
    scale = values.abs().amax(dim=1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(values / safe[:, None]).clamp_(-qmax, qmax)
    return q, scale.contiguous()


def _encode_units(x: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """Encode a flat fp32 slice that starts on a unit boundary."""
    if codec == "fp32":
        return {"x": x.contiguous()}
    if codec == "bf16":
        return {"x": x.to(torch.bfloat16)}
    spec = parse_codec(codec)
    blocks = _blocks(x, spec.block)
    if spec.kind == "int8":
        q, scale = _absmax_quantise(blocks, _INT8_MAX)
        return {"q": q.to(torch.int8), "s": scale}
    if spec.kind == "int4":
        q, scale = _absmax_quantise(blocks, _INT4_MAX)
        nib = (q + 8).to(torch.uint8).view(blocks.shape[0], -1, 2)  # 1..15; nibble 0 (-8) is never written
        return {"q": (nib[:, :, 0] | (nib[:, :, 1] << 4)).contiguous(), "s": scale}
    # topk: the k largest magnitudes per block (ties: the lower index), indices ascending, int8 absmax values
    mag = blocks.abs()
    tail = blocks.numel() - x.numel()
    if tail:
        mag.view(-1)[x.numel() :] = -1.0  # padding is chosen only when the block has fewer than k real elements
    mag.nan_to_num_(nan=float("inf"))
    # exactly k per row, deterministic: all magnitudes above the k-th largest, then the lowest offsets equal to it
    kth = torch.topk(mag, spec.k, dim=1).values[:, -1:]
    keep = mag >= kth
    crowded = (keep.sum(dim=1) > spec.k).nonzero()[:, 0]  # rows where values tie at the k-th: pick the lowest offsets
    if crowded.numel():
        m, t = mag[crowded], kth[crowded]
        above, tied = m > t, m == t
        keep[crowded] = above | (tied & (tied.cumsum(dim=1) <= spec.k - above.sum(dim=1, keepdim=True)))
    idx = keep.nonzero()[:, 1].view(-1, spec.k)  # row-major: ascending offsets in each row
    q, scale = _absmax_quantise(torch.gather(blocks, 1, idx), _INT8_MAX)
    return {"i": idx.to(torch.int16), "q": q.to(torch.int8), "s": scale}


def _check_scales(s: torch.Tensor, key: str) -> None:
    if s.numel() and not bool((torch.isfinite(s) & (s >= 0)).all()):
        raise CorruptObjectError(f"{key}: a block scale is negative, NaN or inf (forged or corrupt scales)")


def _decode_units(tensors: dict[str, torch.Tensor], codec: str, numel: int, key: str = "<memory>") -> torch.Tensor:
    """Inverse of :func:`_encode_units`: ``numel`` values (fp32, or the raw bf16 values; both add exactly).

    For ``int4``/``topk`` the content is validated (finite non-negative scales, nibbles in ``[-7, 7]``, indices
    strictly ascending inside the block, int8 values in ``[-127, 127]``, nothing non-zero in the padding):
    `CorruptObjectError` naming ``key`` otherwise. Such an object can only come from a replica holding the secret."""
    if codec in ("fp32", "bf16"):
        return tensors["x"][:numel]
    spec = parse_codec(codec)
    if spec.kind == "int8":
        return (tensors["q"].to(torch.float32) * tensors["s"][:, None]).reshape(-1)[:numel]
    s = tensors["s"]
    _check_scales(s, key)
    rows = s.shape[0]
    if spec.kind == "int4":
        packed = tensors["q"].to(torch.int16)
        q = torch.stack([(packed & 15) - 8, (packed >> 4) - 8], dim=2).view(rows, spec.block)
        if bool((q == -8).any()):
            raise CorruptObjectError(f"{key}: an int4 value is -8 (nibble 0), outside the codec's [-7, 7]")
        out = (q.to(torch.float32) * s[:, None]).reshape(-1)
    else:
        idx, qv = tensors["i"].to(torch.int64), tensors["q"]
        if bool(((idx < 0) | (idx >= spec.block)).any()) or bool((idx[:, 1:] <= idx[:, :-1]).any()):
            raise CorruptObjectError(
                f"{key}: top-k indices must be strictly ascending offsets in [0, {spec.block}) within each block"
            )
        if bool((qv == -128).any()):
            raise CorruptObjectError(f"{key}: a top-k value is -128, outside the codec's [-127, 127]")
        dense = torch.zeros(rows, spec.block, dtype=torch.float32)
        dense.scatter_(1, idx, qv.to(torch.float32) * s[:, None])
        out = dense.view(-1)
    if out.numel() > numel and bool((out[numel:] != 0).any()):
        raise CorruptObjectError(f"{key}: non-zero values in the padding after the payload's {numel} elements")
    return out[:numel]


def wire_roundtrip(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``decode(encode(x))`` for a flat fp32 slice starting on a unit boundary (no serialisation)."""
    if codec == "fp32":
        return x
    return _decode_units(_encode_units(x.contiguous(), codec), codec, x.numel())


def feedback_roundtrip(x: torch.Tensor, residual: torch.Tensor | None, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of error feedback: ``(decoded, new_residual)`` with ``decoded = decode(encode(x + residual))`` and
    ``new_residual = (x + residual) - decoded`` (fp32; ``residual=None`` is zero). Summed over rounds, decoded
    outputs plus the last residual equal the inputs (up to fp32 rounding of the two additions)."""
    c = x if residual is None else x + residual
    decoded = wire_roundtrip(c, codec)
    return decoded, c - decoded


# -- buffers ------------------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor (a view when contiguous)."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(cast("Buffer", flat.numpy())).cast("B")


def _frombuffer(buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= s
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: never written through
        return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


class Scratch:
    """Reusable byte buffers, one per name, grown on demand (warm pages make the next round cheaper)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, nbytes: int) -> torch.Tensor:
        """A writable ``uint8`` tensor of ``nbytes`` bytes (8-byte aligned)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 8), dtype=torch.uint8)
            self._buffers[name] = buf
        return buf[:nbytes]

    def clear(self) -> None:
        self._buffers.clear()


# -- sealing ------------------------------------------------------------------------------------------
def encode_object(
    key: str,
    auth: Authenticator,
    kind: str,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    items: Sequence[tuple[int, int]] | None = None,
    data_start: int | None = None,
) -> Blob:
    """Seal ``tensors`` (CPU, any safetensors dtype) as the object at ``key``.

    ``items``: unit ranges ``[a, b)`` (rows of each tensor) that get their own content tag, in order; ``None`` for
    one tag over everything. ``data_start``: pad the header with spaces so that the tensor data start at this byte
    (a multiple of 8; ignored if the header needs more), so a reader can fetch data beside the header in one round
    trip. The data are not copied: the returned buffers point into ``tensors``.
    """
    names = sorted(tensors)
    buffers = [tensor_bytes(tensors[n]) for n in names]
    nonce = auth.new_nonce()
    if items is None:
        tags = [auth.tag(key, nonce, 0, buffers)]
    else:
        row_bytes = [b.nbytes // max(tensors[n].shape[0], 1) for n, b in zip(names, buffers, strict=True)]
        tags = [
            auth.tag(key, nonce, i, [buf[a * rb : b * rb] for buf, rb in zip(buffers, row_bytes, strict=True)])
            for i, (a, b) in enumerate(items)
        ]
    metadata = {"mac": "0" * MAC_HEX, "crf_diloco": WIRE_VERSION, "kind": kind, "nonce": nonce, "tag_alg": default_tag_alg(),
                "tags": json.dumps(tags), **meta}  # fmt: skip
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, buf in zip(names, buffers, strict=True):
        t = tensors[name]
        header[name] = {
            "dtype": _ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + buf.nbytes],
        }
        offset += buf.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header with spaces to 8-byte alignment
    if data_start is not None and 8 + len(raw) < data_start and data_start % 8 == 0:
        raw += b" " * (data_start - 8 - len(raw))
    assert raw.startswith(_MAC_PREFIX)
    mac = auth.mac_hex("object", key, raw).encode()
    raw = _MAC_PREFIX + mac + raw[len(_MAC_PREFIX) + MAC_HEX :]
    return [memoryview(struct.pack("<Q", len(raw)) + raw), *buffers]


@dataclass(frozen=True)
class Header:
    """An authenticated, parsed object header: absolute byte ranges of each tensor, and the metadata.

    ``head`` holds the first bytes already read (the header, and all of a small object).
    """

    key: str
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]
    metadata: dict[str, str]
    data_start: int
    size: int
    head: bytes

    def meta(self, name: str) -> str:
        value = self.metadata.get(name)
        if value is None:
            raise CorruptObjectError(f"{self.key}: metadata has no {name!r}")
        return value

    def tags(self, count: int) -> list[str]:
        try:
            tags = json.loads(self.meta("tags"))
        except (ValueError, RecursionError):
            tags = None
        if not isinstance(tags, list) or len(tags) != count or not all(isinstance(t, str) for t in tags):
            raise CorruptObjectError(f"{self.key}: metadata 'tags' must be a list of {count} tags")
        return tags

    def expect(self, kind: str, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], **meta: str) -> None:
        """Raise `CorruptObjectError` unless the object is of ``kind`` with exactly these tensors and metadata."""
        got = {name: (dtype, shape) for name, (dtype, shape, _, _) in self.tensors.items()}
        wrong = {k: self.metadata.get(k) for k, v in meta.items() if self.metadata.get(k) != v}
        if self.metadata.get("kind") != kind or got != shapes or wrong:
            raise CorruptObjectError(
                f"{self.key}: a {self.metadata.get('kind')!r} object with tensors {got} and metadata {wrong} does not "
                f"match the round's {kind} {shapes} {meta}"
            )


def _parse_header(blob: bytes, key: str, auth: Authenticator) -> Header | int:
    """Header from the first bytes of an object, or the number of bytes needed when ``blob`` is too short."""
    if len(blob) < 8:
        raise CorruptObjectError(f"{key}: object of {len(blob)} bytes is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if not len(_MAC_PREFIX) + MAC_HEX <= n <= _MAX_HEADER:
        raise CorruptObjectError(f"{key}: implausible safetensors header length {n}")
    if len(blob) < 8 + n:
        return 8 + n
    raw = blob[8 : 8 + n]
    if not raw.startswith(_MAC_PREFIX):
        raise CorruptObjectError(f"{key}: header does not start with the crf-diloco MAC")
    mac = raw[len(_MAC_PREFIX) : len(_MAC_PREFIX) + MAC_HEX]
    auth.check_mac("object", key, mac, _MAC_PREFIX + b"0" * MAC_HEX + raw[len(_MAC_PREFIX) + MAC_HEX :])
    obj = parse_json_object(raw, key)
    metadata = obj.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptObjectError(f"{key}: safetensors metadata must be an object of strings")
    if metadata.get("crf_diloco") != WIRE_VERSION:
        raise CorruptObjectError(f"{key}: not a crf-diloco wire v{WIRE_VERSION} object")
    entries = []
    for name, info in obj.items():
        entries.append((name, *_parse_entry(name, info, key)))
    entries.sort(key=lambda e: e[3])
    offset = 0
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, dtype, shape, start, end in entries:
        if start != offset:
            raise CorruptObjectError(f"{key}: tensor {name!r} data does not follow the previous one (gap or overlap)")
        tensors[name] = (dtype, shape, 8 + n + start, 8 + n + end)
        offset = end
    return Header(key, tensors, metadata, 8 + n, 8 + n + offset, bytes(blob))


def _parse_entry(name: str, info: Any, key: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    bad = CorruptObjectError(f"{key}: malformed entry for tensor {name!r}: {info!r:.200}")
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad
    dtype = ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    shape, offsets = info["shape"], info["data_offsets"]
    ints = [*shape, *offsets] if isinstance(shape, list) and isinstance(offsets, list) else None
    if dtype is None or ints is None or len(offsets) != 2 or len(shape) > 8:
        raise bad
    if not all(is_int(v) and 0 <= v < 1 << 50 for v in ints):
        raise bad
    count = 1
    for s in shape:
        count *= s
    start, end = offsets
    if end - start != count * torch.empty((), dtype=dtype).element_size():
        raise CorruptObjectError(f"{key}: tensor {name!r} spans {end - start} bytes, its shape {shape} needs another")
    return dtype, tuple(shape), start, end


def header_probe(n_items: int) -> int:
    """Bytes to read for the header of an object with ``n_items`` content tags (it rarely needs more)."""
    return 640 + 48 * n_items


def read_header(store: ObjectStore, key: str, auth: Authenticator, probe: int = HEADER_PROBE) -> Header:
    """Read, authenticate and parse an object's header with one (rarely two) ranged reads of ``probe`` bytes."""
    blob = store.get_range(key, 0, probe)
    parsed = _parse_header(blob, key, auth)
    if isinstance(parsed, int):
        if len(blob) < probe:
            raise CorruptObjectError(f"{key}: truncated object ({len(blob)} bytes, its header needs {parsed})")
        parsed = _parse_header(store.get_range(key, 0, parsed), key, auth)
        if isinstance(parsed, int):
            raise CorruptObjectError(f"{key}: truncated object (its header needs {parsed} bytes)")
    return parsed


def _read_range(store: ObjectStore, header: Header, start: int, dest: torch.Tensor) -> memoryview:
    """Bytes ``[start, start + len(dest))`` of the object into ``dest`` (a uint8 tensor); short reads are corrupt."""
    view = memoryview(cast("Buffer", dest.numpy())).cast("B") if dest.numel() else memoryview(bytearray())
    known = max(0, min(len(header.head) - start, view.nbytes))  # bytes the header read already brought
    view[:known] = header.head[start : start + known]
    got = known
    if known < view.nbytes:
        got += store.read_into(header.key, start + known, view[known:])
    if got != view.nbytes:
        raise CorruptObjectError(f"{header.key}: truncated object (read {got} of {view.nbytes} bytes at {start})")
    return view


#: runs reads at once and returns their results in order (e.g. `crf_diloco.rounds.peer.Peer.concurrently`)
RunAll = Callable[[Sequence[Callable[[], Any]]], list[Any]]


def run_all(calls: Sequence[Callable[[], Any]], run: RunAll | None) -> list[Any]:
    """``calls``' results in order: at once with ``run`` (when there are several), else one after the other."""
    return run(calls) if run is not None and len(calls) > 1 else [call() for call in calls]


#: the most bytes one ranged read of a whole object asks for (`read_objects`); S3 serves 8-16 MB ranges at a
#: connection's full speed, and a link with a per-connection cap fills with several at once
READ_CHUNK = 8 << 20
#: ranged reads of `read_objects` in flight at once (and the most a lying header can make it send in vain)
READ_WINDOW = 16
#: the least bytes a ranged read of `read_objects` asks for when it spreads the bytes over `READ_WINDOW` reads
READ_MIN = 1 << 20


def read_objects(
    store: ObjectStore,
    headers: Sequence[Header],
    run: RunAll | None = None,
    chunk: int = READ_CHUNK,
    window: int = READ_WINDOW,
) -> list[bytes]:
    """The whole objects that ``headers`` (from `read_header`) head, in order, for `decode_object`.

    The bytes after each header's ``head`` come in ranged reads of at most ``chunk`` bytes, ``window`` at a time
    across all the objects (at once with ``run``): ``n`` objects of ``B`` bytes cost ``ceil(n B / (chunk window))``
    round trips over a network, not ``n``. With ``run``, fewer bytes than fill a window are spread over it (reads of
    at least `READ_MIN`), so they use several connections too (a connection often carries less than a link). A
    header whose object holds fewer bytes than it claims fails at its first short read (`CorruptObjectError`,
    truncated) with at most one window sent and the bytes read so far held: a claim is never allocated up front.
    Bytes after an object's end are not read."""
    if not is_int(chunk) or chunk < 1 or not is_int(window) or window < 1:
        raise ValueError(f"chunk and window must be positive ints, got {chunk!r} and {window!r}")
    if run is not None:  # one after the other, more reads would only cost more round trips
        rest = sum(max(0, h.size - len(h.head)) for h in headers)
        chunk = min(chunk, max(READ_MIN, -(-rest // window)))
    pieces: list[list[bytes]] = [[h.head[: h.size]] for h in headers]
    reads = (  # lazily: a claim's count of reads is never built either
        (i, start, min(start + chunk, h.size))
        for i, h in enumerate(headers)
        for start in range(min(len(h.head), h.size), h.size, chunk)
    )
    while batch := list(itertools.islice(reads, window)):
        got = run_all([partial(store.get_range, headers[i].key, a, b) for i, a, b in batch], run)
        for (i, a, b), data in zip(batch, got, strict=True):
            if len(data) != b - a:
                raise CorruptObjectError(
                    f"{headers[i].key}: truncated object (read {len(data)} of {b - a} bytes at {a})"
                )
            pieces[i].append(data)
    return [b"".join(p) for p in pieces]


def _row_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    row = torch.empty((), dtype=dtype).element_size()
    for s in shape[1:]:
        row *= s
    return row


@dataclass(frozen=True)
class Prefetch:
    """Bytes of one payload shard read where this version's writer puts them, before the header was known: the
    absolute start of each tensor's rows and the tensors they were read into. Adopted only if the header, once
    read and authenticated, puts every tensor there, and only after the shard's content tag verifies."""

    starts: dict[str, int]
    parts: dict[str, torch.Tensor]
    views: dict[str, memoryview]


def _dest(name: str, nbytes: int, scratch: Scratch, into: dict[str, torch.Tensor] | None) -> torch.Tensor:
    dest = into[name].view(torch.uint8).reshape(-1) if into is not None and name in into else None
    return dest if dest is not None else scratch.get(name, nbytes)


def _read_item(
    store: ObjectStore,
    header: Header,
    auth: Authenticator,
    units: tuple[int, int],
    item: tuple[int, int],
    scratch: Scratch,
    into: dict[str, torch.Tensor] | None = None,
    *,
    prefetched: Prefetch | None = None,
    run: RunAll | None = None,
) -> dict[str, torch.Tensor]:
    """Read units ``[a, b)`` of every tensor (into ``into[name]``'s bytes if given, else scratch; the tensors' ranges
    at once with ``run``) and verify that they are item ``index`` of ``count`` (``item = (index, count)``) under the
    object's content tags. ``prefetched`` bytes are used instead of reading when the header puts them there."""
    a, b = units
    index, count = item
    names = sorted(header.tensors)
    starts = {n: header.tensors[n][2] + a * _row_bytes(header.tensors[n][0], header.tensors[n][1]) for n in names}
    if prefetched is not None and prefetched.starts == starts:
        views, parts = [prefetched.views[n] for n in names], prefetched.parts
    else:
        parts = {}
        calls = []
        for name in names:
            dtype, shape, _, _ = header.tensors[name]
            dest = _dest(name, (b - a) * _row_bytes(dtype, shape), scratch, into)
            calls.append(partial(_read_range, store, header, starts[name], dest))
            parts[name] = dest.view(dtype).view((b - a, *shape[1:]))
        views = run_all(calls, run)
    want = header.tags(count)[index]
    auth.check_tag(header.key, header.meta("nonce"), index, views, want, header.meta("tag_alg"), f"item {index}")
    return parts


# -- payloads and reduced shards ----------------------------------------------------------------------
def encode_payload(key: str, auth: Authenticator, flat: torch.Tensor, plan: ShardPlan, meta: dict[str, str]) -> Blob:
    """A participant's whole payload, with one content tag per shard of ``plan``."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != plan.numel:
        raise ValueError(f"payload must be a flat fp32 tensor of {plan.numel} elements")
    items = [(plan.bounds[k], plan.bounds[k + 1]) for k in range(plan.n_shards)]
    meta = {"codec": plan.codec, "numel": str(plan.numel), **meta}
    tensors = _encode_units(flat, plan.codec)
    return encode_object(key, auth, "payload", tensors, meta, items, data_start=payload_data_start(plan))


def decode_payload_blob(blob: Blob, plan: ShardPlan, key: str) -> torch.Tensor:
    """What every reader decodes from a payload `encode_payload` made (its tensors are read back from ``blob``, not
    re-encoded): ``plan.numel`` values, fp32 (bf16 for that codec). For fp32 a view of the encoded bytes.
    `CorruptObjectError` naming ``key`` if its content breaks the codec's rules."""
    shapes = plan.shapes(0, plan.units)
    names = sorted(shapes)
    if len(blob) != 1 + len(names):
        raise ValueError(f"{key}: a payload blob of {len(blob)} buffers, {plan.codec} needs {1 + len(names)}")
    tensors = {name: _frombuffer(buf, *shapes[name]) for name, buf in zip(names, blob[1:], strict=True)}
    return _decode_units(tensors, plan.codec, plan.numel, key)


def payload_data_start(plan: ShardPlan) -> int:
    """Where the tensor data of a payload of ``plan`` start: its header is padded to the header probe's size, so a
    reader can fetch a shard's bytes beside the header (`prefetch_payload_shard`) in the same round trip."""
    return -(-header_probe(plan.n_shards) // 8) * 8


def prefetch_payload_shard(
    store: ObjectStore,
    key: str,
    plan: ShardPlan,
    shard: int,
    scratch: Scratch,
    out: torch.Tensor | None = None,
) -> tuple[list[Callable[[], bool]], Prefetch]:
    """Reads of shard ``shard`` of the payload at ``key`` where `encode_payload` puts it, not knowing the header yet:
    one call per tensor (each True once its bytes were read; False while the object is absent or shorter), to run
    beside the header's read, and the `Prefetch` they fill. Nothing is trusted here: `read_payload_shard` adopts
    the bytes only if every call returned True, the authenticated header puts the shard there and its content tag
    verifies."""
    a, b = plan.bounds[shard], plan.bounds[shard + 1]
    into = {"x": out} if out is not None and plan.codec == "fp32" else None
    shapes = plan.shapes(0, plan.units)
    offset = payload_data_start(plan)
    starts, parts, views = {}, {}, {}
    calls: list[Callable[[], bool]] = []
    for name in sorted(shapes):
        dtype, shape = shapes[name]
        row = _row_bytes(dtype, shape)
        starts[name] = offset + a * row
        dest = _dest(name, (b - a) * row, scratch, into)
        parts[name] = dest.view(dtype).view((b - a, *shape[1:]))
        views[name] = memoryview(cast("Buffer", dest.numpy())).cast("B") if dest.numel() else memoryview(bytearray())
        calls.append(partial(_read_into_or_absent, store, key, starts[name], views[name]))
        offset += plan.units * row
    return calls, Prefetch(starts, parts, views)


def _read_into_or_absent(store: ObjectStore, key: str, start: int, view: memoryview) -> bool:
    """Fill ``view`` from byte ``start`` of ``key``: False if the object is absent or too short."""
    try:
        return store.read_into(key, start, view) == view.nbytes
    except FileNotFoundError:
        return False


def read_payload_shard(
    store: ObjectStore,
    header: Header,
    auth: Authenticator,
    plan: ShardPlan,
    shard: int,
    scratch: Scratch,
    out: torch.Tensor | None = None,
    *,
    prefetched: Prefetch | None = None,
    run: RunAll | None = None,
) -> torch.Tensor:
    """Range-read shard ``shard`` of a payload (whose header was checked against ``plan``), verify its tag and
    decode it: the shard's values (fp32, or bf16 for that codec), valid until ``scratch`` is reused. With the fp32
    codec and a contiguous fp32 ``out``, the bytes are read straight into ``out`` (garbage there if this raises).
    ``prefetched`` (`prefetch_payload_shard`, same ``scratch`` and ``out``) saves the read when the header puts the
    shard where it was read; ``run`` reads the ranges of several tensors at once."""
    a, b = plan.bounds[shard], plan.bounds[shard + 1]
    into = {"x": out} if out is not None and plan.codec == "fp32" else None
    parts = _read_item(store, header, auth, (a, b), (shard, plan.n_shards), scratch, into, prefetched=prefetched,
                       run=run)  # fmt: skip
    lo, hi = plan.elem_range(shard)
    return _decode_units(parts, plan.codec, hi - lo, header.key)


def check_payload_header(header: Header, plan: ShardPlan, **meta: str) -> None:
    """Raise `CorruptObjectError` unless ``header`` is a payload of exactly ``plan``'s layout and ``meta``."""
    header.expect("payload", plan.shapes(0, plan.units), codec=plan.codec, numel=str(plan.numel), **meta)


def encode_reduced(
    key: str, auth: Authenticator, values: torch.Tensor, plan: ShardPlan, shard: int, meta: dict[str, str]
) -> tuple[Blob, torch.Tensor]:
    """Encode a reduced fp32 shard; also return its decoded values (what every reader will get)."""
    lo, hi = plan.elem_range(shard)
    if values.dtype != torch.float32 or values.numel() != hi - lo:
        raise ValueError(f"reduced shard {shard} must be fp32 with {hi - lo} elements")
    tensors = _encode_units(values, plan.codec)
    meta = {"codec": plan.codec, "numel": str(plan.numel), "shard": str(shard), **meta}
    blob = encode_object(key, auth, "reduced", tensors, meta)
    return blob, _decode_units(tensors, plan.codec, hi - lo, key)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        count *= s
    return count


def read_reduced(
    store: ObjectStore,
    key: str,
    auth: Authenticator,
    plan: ShardPlan,
    shard: int,
    out: torch.Tensor,
    scratch: Scratch,
    **meta: str,
) -> None:
    """Read a reduced shard object, check it (layout, ``meta``, tag) and write its fp32 values into ``out``.

    For the fp32 codec the bytes land in ``out`` directly (one copy); ``out`` holds garbage if this raises. Over a
    network the object comes in one ranged read (header and data), on a local disk the data are read straight into
    ``out`` after the header.
    """
    a, b = plan.bounds[shard], plan.bounds[shard + 1]
    probe = header_probe(len(plan.bounds))
    if store.remote:
        probe += sum(_nbytes(dtype, shape) for dtype, shape in plan.shapes(a, b).values())
    header = read_header(store, key, auth, probe)
    header.expect("reduced", plan.shapes(a, b), codec=plan.codec, numel=str(plan.numel), shard=str(shard), **meta)
    lo, hi = plan.elem_range(shard)
    if out.dtype != torch.float32 or out.numel() != hi - lo or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of {hi - lo} elements")
    into = {"x": out} if plan.codec == "fp32" else None
    parts = _read_item(store, header, auth, (0, b - a), (0, 1), scratch, into)
    if into is None:
        out.copy_(_decode_units(parts, plan.codec, hi - lo, key))


def decode_object(blob: bytes, key: str, auth: Authenticator, kind: str) -> tuple[Header, dict[str, torch.Tensor]]:
    """Authenticate and decode a whole object held in memory; tensors are copies (writable)."""
    parsed = _parse_header(blob, key, auth)
    if isinstance(parsed, int) or parsed.size != len(blob):
        raise CorruptObjectError(f"{key}: object of {len(blob)} bytes is truncated or has trailing bytes")
    if parsed.metadata.get("kind") != kind:
        raise CorruptObjectError(f"{key}: a {parsed.metadata.get('kind')!r} object where a {kind!r} one belongs")
    views = [memoryview(blob)[s:e] for _, (_, _, s, e) in sorted(parsed.tensors.items())]
    want = parsed.tags(1)[0]
    auth.check_tag(key, parsed.meta("nonce"), 0, views, want, parsed.meta("tag_alg"), "content")
    tensors = {
        name: _frombuffer(view, dtype, shape).clone()
        for view, (name, (dtype, shape, _, _)) in zip(views, sorted(parsed.tensors.items()), strict=True)
    }
    return parsed, tensors
