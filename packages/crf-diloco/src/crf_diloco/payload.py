"""The tensors of one round as a flat fp32 payload: validation, flattening, write-back, finiteness."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crf_diloco.wire import Scratch, parse_codec

__all__ = [
    "SUPPORTED_DTYPES",
    "as_tensor_list",
    "codec_of",
    "count_nonfinite",
    "dtype_runs",
    "flatten",
    "nonfinite_as_dtypes",
    "write_back",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def as_tensor_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as a non-empty list of fp32/fp16/bf16 tensors with at least one element in all."""
    tensor_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not tensor_list:
        raise ValueError("allreduce needs at least one tensor")
    for i, t in enumerate(tensor_list):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"tensors[{i}] has dtype {t.dtype}; ObjectStoreAllReduce reduces float32, float16 and "
                "bfloat16 tensors (cast others first)"
            )
    if sum(t.numel() for t in tensor_list) == 0:
        raise ValueError("allreduce needs at least one element across its tensors")
    return tensor_list


def codec_of(compression: str | None) -> str:
    """The canonical wire codec of a ``compression`` argument (``None`` → ``"fp32"``; ``"int4"`` → ``"int4:64"``;
    ``"topk"`` → ``"topk:41/4096"``); `ValueError` naming the fix for anything else."""
    if compression is None:
        return "fp32"
    if compression == "fp32":
        raise ValueError("compression must be None (fp32 on the wire), 'bf16', 'int8', 'int4[:<block>]' or "
                         "'topk[:<k>/<block>]', got 'fp32': pass None")  # fmt: skip
    try:
        return parse_codec(compression).name
    except ValueError as exc:
        raise ValueError(
            f"compression must be None, 'bf16', 'int8', 'int4[:<block>]' or 'topk[:<k>/<block>]': {exc}"
        ) from None


def flatten(tensors: list[torch.Tensor], scratch: Scratch) -> torch.Tensor:
    """The round's flat fp32 payload: a view of the input for one contiguous fp32 CPU tensor, else a copy into a
    reused staging buffer."""
    only = tensors[0]
    if len(tensors) == 1 and only.dtype == torch.float32 and only.is_contiguous() and only.device.type == "cpu":
        return only.detach().view(-1)
    total = sum(t.numel() for t in tensors)
    flat = scratch.get("payload", 4 * total).view(torch.float32)
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset : offset + n].view(t.shape).copy_(t.detach())
        offset += n
    return flat


def write_back(tensors: list[torch.Tensor], result: torch.Tensor) -> None:
    """Copy the flat fp32 ``result`` into ``tensors`` in order, casting to their dtype and device."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            src = result[offset : offset + n]
            if t.is_contiguous():
                t.view(-1).copy_(src)
            else:
                t.copy_(src.view(t.shape))
            offset += n


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/±inf values of ``x``: one summing pass when there are none (a non-finite element makes the sum
    non-finite), an exact count otherwise (the sum of finite values can also overflow)."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return 0
    return int((~torch.isfinite(x)).sum())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_runs(tensors: list[torch.Tensor]) -> tuple[tuple[str, int], ...]:
    """The tensors' dtypes as runs ``(dtype, count)`` over the flat payload; ``()`` when all are float32."""
    runs: list[tuple[str, int]] = []
    for t in tensors:
        name, n = _dtype_name(t.dtype), t.numel()
        if not n:
            continue
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + n)
        else:
            runs.append((name, n))
    return () if all(name == "float32" for name, _ in runs) else tuple(runs)


def nonfinite_as_dtypes(values: torch.Tensor, start: int, runs: tuple[tuple[str, int], ...]) -> dict[str, int]:
    """For the fp32 ``values`` at payload offset ``start``: how many are NaN/inf once cast to the dtype of the tensor
    they go back to (``runs`` from `dtype_runs`), by dtype. A float16 sum of 60000 + 60000 is finite in fp32 and
    ``inf`` in float16, so the check must run in the payload's own dtype."""
    bad: dict[str, int] = {}
    offset, end = 0, start + values.numel()
    for name, n in runs or (("float32", end),):
        lo, hi = max(offset, start), min(offset + n, end)
        offset += n
        if lo >= hi:
            continue
        chunk = values[lo - start : hi - start]
        count = count_nonfinite(chunk if name == "float32" else chunk.to(getattr(torch, name)))
        if count:
            bad[name] = bad.get(name, 0) + count
    return bad
