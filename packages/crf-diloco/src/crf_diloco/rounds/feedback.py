"""Error feedback of the ``int4``/``topk`` codecs: stream names and the residual a round leaves if it commits."""

from __future__ import annotations

from typing import Any

import torch

from crf_diloco.layout import validate_name
from crf_diloco.payload import count_nonfinite
from crf_diloco.records import PayloadSpec
from crf_diloco.rounds.round import RoundFailure
from crf_diloco.wire import parse_codec

__all__ = ["parse_stream_key", "residual_of", "stream_key"]


def stream_key(spec: PayloadSpec) -> str:
    """The error-feedback stream of a payload: ``codec|op|numel|name``."""
    return f"{spec.codec}|{spec.op}|{spec.numel}|{spec.name or ''}"


def parse_stream_key(key: Any) -> int:
    """The element count of a stream key made by `stream_key`; `ValueError` if it is not one."""
    parts = key.split("|") if isinstance(key, str) else []
    try:
        ok = len(parts) == 4 and parse_codec(parts[0]).name == parts[0] and parse_codec(parts[0]).error_feedback
        ok = ok and parts[1] in ("avg", "sum") and parts[2].isdigit() and int(parts[2]) >= 1
        if ok and parts[3]:
            validate_name(parts[3], "name")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{key!r} is not an error-feedback stream 'codec|op|numel|name' of an int4/topk codec")
    return int(parts[2])


def residual_of(flat: torch.Tensor, sent: torch.Tensor, rank: int) -> torch.Tensor:
    """What the codec loses of ``flat`` (the contribution plus the old residual) when it ``sent`` what readers
    decode: the residual a round leaves if it commits. `RoundFailure` if it is not finite."""
    residual = flat - sent
    if count_nonfinite(residual):
        raise RoundFailure(f"rank {rank}: the error-feedback residual is not finite (its values overflow fp32)")
    return residual
