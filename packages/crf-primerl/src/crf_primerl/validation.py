"""Input and keyword validation for the per-sample PRIME-RL loss contract.

PRIME-RL calls a custom loss once per packed sample with 1-D ``(seq,)`` tensors. Everything here
runs on every call, so the structural checks are pure Python and the value checks (finite inputs,
non-negative weights) cost one device synchronisation in total.
"""

from __future__ import annotations

import math
from typing import NamedTuple, TypeGuard

import torch
from torch import Tensor

_REQUIRED_FIELDS = ("trainer_logprobs", "inference_logprobs", "advantages", "loss_mask")
_TEACHER_FIELDS = ("teacher_logprobs", "ref_logprobs")

_SLICE_HINT = (
    "PRIME-RL calls loss_fn once per sample with 1-D (seq,) tensors, not on a batched (B, T) tensor. "
    "From your own batched loop, slice each sample before the call:\n"
    "    for b in range(B):\n"
    "        out = loss_fn(LossInputs(trainer_logprobs=batch.trainer_logprobs[b],\n"
    "                                 inference_logprobs=batch.inference_logprobs[b],\n"
    "                                 advantages=batch.advantages[b], loss_mask=batch.loss_mask[b],\n"
    "                                 teacher_logprobs=None if batch.teacher_logprobs is None\n"
    "                                 else batch.teacher_logprobs[b]), **kwargs)"
)


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool`` (finiteness is the caller's to check)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Sample(NamedTuple):
    """One validated sample: every tensor is 1-D with the same length and device.

    ``teacher_logprobs`` holds whichever teacher field the caller's generation uses
    (``teacher_logprobs`` before PRIME-RL's algorithm abstraction, ``ref_logprobs`` after it).
    """

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    teacher_logprobs: Tensor | None
    loss_weights: Tensor | None


def read_sample(inputs: object) -> Sample:
    """Read PRIME-RL ``LossInputs`` (either generation, or ours) and check shapes, dtypes and values.

    Raises:
        TypeError: ``inputs`` lacks a required field, or a field is not a tensor.
        ValueError: a tensor is not 1-D, lengths or devices differ, ``loss_mask`` is not bool,
            a float tensor holds NaN/inf, ``loss_weights`` has a negative entry, or both
            ``teacher_logprobs`` and ``ref_logprobs`` are given.
    """
    missing = [name for name in _REQUIRED_FIELDS if not hasattr(inputs, name)]
    if missing:
        raise TypeError(
            f"inputs of type {type(inputs).__name__} lacks {missing}; pass PRIME-RL's LossInputs or "
            "crf_primerl.composer_loss.LossInputs(trainer_logprobs=..., inference_logprobs=..., "
            "advantages=..., loss_mask=...)"
        )
    teacher_fields = [name for name in _TEACHER_FIELDS if getattr(inputs, name, None) is not None]
    if len(teacher_fields) > 1:
        raise ValueError(
            "both teacher_logprobs and ref_logprobs are set; they are the same signal under PRIME-RL's "
            "old and new names: set only one"
        )
    teacher_name = teacher_fields[0] if teacher_fields else ""
    raw: dict[str, object] = {name: getattr(inputs, name) for name in _REQUIRED_FIELDS}
    if teacher_name:
        raw[teacher_name] = getattr(inputs, teacher_name)
    weights = getattr(inputs, "loss_weights", None)
    if weights is not None:
        raw["loss_weights"] = weights
    named = _as_tensors(raw)
    _check_structure(named)
    _check_values(named)
    return Sample(
        trainer_logprobs=named["trainer_logprobs"],
        inference_logprobs=named["inference_logprobs"],
        advantages=named["advantages"],
        loss_mask=named["loss_mask"],
        teacher_logprobs=named.get(teacher_name),
        loss_weights=named.get("loss_weights"),
    )


def _as_tensors(raw: dict[str, object]) -> dict[str, Tensor]:
    named: dict[str, Tensor] = {}
    for name, value in raw.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (seq,), got {type(value).__name__}")
        named[name] = value
    return named


def _check_structure(named: dict[str, Tensor]) -> None:
    for name, tensor in named.items():
        if tensor.dim() == 2:
            b, t = tensor.shape
            raise ValueError(f"expected (seq,) shape, got (B, T) = ({b}, {t}) for {name}. {_SLICE_HINT}")
        if tensor.dim() != 1:
            hint = (
                " (a per-sample scalar advantage must be broadcast: advantages.expand(seq))"
                if name == "advantages"
                else ""
            )
            raise ValueError(f"expected (seq,) shape for {name}, got shape {tuple(tensor.shape)}{hint}. {_SLICE_HINT}")
    seq = named["trainer_logprobs"].shape[0]
    wrong_len = {name: tensor.shape[0] for name, tensor in named.items() if tensor.shape[0] != seq}
    if wrong_len:
        raise ValueError(
            f"all per-sample tensors must have the length of trainer_logprobs ({seq}); got {wrong_len}. "
            "They must span the same packed prompt+completion tokens of one sample."
        )
    device = named["trainer_logprobs"].device
    off_device = {name: str(tensor.device) for name, tensor in named.items() if tensor.device != device}
    if off_device:
        raise ValueError(f"all tensors must be on trainer_logprobs' device ({device}); got {off_device}")
    if named["loss_mask"].dtype != torch.bool:
        raise ValueError(
            f"loss_mask must be a bool tensor (True on trainable tokens), got {named['loss_mask'].dtype}; "
            "convert it with loss_mask.bool() or loss_mask != 0"
        )
    for name, tensor in named.items():
        if name != "loss_mask" and not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}; cast it with .float()")


def _check_values(named: dict[str, Tensor]) -> None:
    floats = [tensor.detach() for name, tensor in named.items() if name != "loss_mask"]
    # NaN/inf anywhere makes the elementwise sum non-finite: one reduction, one synchronisation per call.
    total = floats[0]
    for tensor in floats[1:]:
        total = total + tensor
    bad = ~torch.isfinite(total).all()
    weights = named.get("loss_weights")
    if weights is not None:
        bad = bad | (weights.detach() < 0).any()
    if bool(bad):
        _diagnose_values(named)


def _diagnose_values(named: dict[str, Tensor]) -> None:
    """Slow path: name the offending tensor (or return when the sum merely overflowed)."""
    for name, tensor in named.items():
        if name == "loss_mask":
            continue
        n_bad = int((~torch.isfinite(tensor.detach())).sum())
        if n_bad:
            raise ValueError(
                f"{name} has {n_bad} NaN/inf entries out of {tensor.numel()}; every position of the packed sample "
                "must be finite (PRIME-RL pads position 0 with log(1/V), never NaN): find where they come from "
                "(an fp16 overflow, a -inf log-prob from a zero-probability token) and fix them upstream"
            )
    weights = named.get("loss_weights")
    if weights is not None and bool((weights < 0).any()):
        raise ValueError(
            f"loss_weights must be >= 0 (a weight scales its token's loss; 0 removes it); got min {float(weights.min())}"
        )


def check_bounds(**values: float) -> None:
    """Check that every keyword is a real number ``>= 0`` (PRIME-RL's ``Field(ge=0)``); ``inf`` is allowed.

    Raises:
        TypeError: a value is not an ``int``/``float`` (``bool`` is refused).
        ValueError: a value is negative or NaN.
    """
    for name, value in values.items():
        if not is_number(value):
            raise TypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})")
        if math.isnan(value) or value < 0:
            hint = " To disable the DPPO mask pass 1e6 for both bounds." if name.startswith("dppo_mask") else ""
            raise ValueError(f"{name} must be >= 0 (as PRIME-RL's loss config requires), got {value}.{hint}")


_TEACHER_CANNOT_ARRIVE = (
    "At prime-rl 0be5ac4 and later (HEAD 559b447) only the 'opd'/'opsd' algorithms fill ref_logprobs, and "
    "prime-rl routes them to its own ref_kl loss component, not to [trainer.loss]: for teacher distillation "
    'there, use prime-rl\'s own [orchestrator.algo] type = "opd" and set teacher_tau = teacher_weight = 0. '
    "crf-primerl's teacher channels need the generation that passes teacher_logprobs to the loss (prime-rl up "
    "to 46653c1, with a teacher model configured)."
)


def check_teacher_arrives(sample: Sample) -> None:
    """Refuse a teacher channel where no teacher log-probs arrive: ``None``, or PRIME-RL's all-zero filler.

    From 0be5ac4 on PRIME-RL packs a sample without a reference next to ones with a reference with
    ``ref_logprobs = 0.0`` on every token; a teacher that is 0 on every loss-mask token of a sample that has
    loss-mask tokens is that filler. Costs one device synchronisation (only when a teacher channel is on).

    Raises:
        ValueError: saying why the teacher log-probs cannot arrive and what to use instead.
    """
    teacher, mask = sample.teacher_logprobs, sample.loss_mask
    if teacher is None:
        raise ValueError(
            "teacher_tau/teacher_weight > 0 need teacher log-probs, but inputs.teacher_logprobs/ref_logprobs is "
            "None (configure a teacher model where your prime-rl passes them to the loss, or set both to 0). "
            + _TEACHER_CANNOT_ARRIVE
        )
    if bool(mask.any() & ~((teacher != 0) & mask).any()):
        raise ValueError(
            "teacher_tau/teacher_weight > 0, but this sample's ref_logprobs are 0.0 on every loss-mask token: "
            "prime-rl's filler for a sample without a reference (a GRPO sample packed with OPD ones), so the "
            "teacher channel has no teacher here and would silently do nothing. " + _TEACHER_CANNOT_ARRIVE
        )
