"""Which sharded data parallelism the trainer runs under, checked once at construction.

* FSDP2 (accelerate's ``fsdp_version: 2``): supported and tested (2 ranks on gloo against one process). The
  chunked LM head scores inside the root module's forward, where FSDP2 gathers the head (``crf_core.channels.head``),
  and the EMA teacher is sharded like the policy (``crf_core.trainer.teacher``).
* FSDP1: refused. It flattens parameters into ``FlatParameter`` s, so ``lm_head.weight`` is not the head.
* DeepSpeed ZeRO-3: refused. It partitions every parameter to an empty tensor outside its own module's forward, and
  the chunked head never calls ``lm_head`` (it reads the weight, and re-reads it in its backward); TRL gathers it
  around its fused head (``maybe_gather_lm_head_ctx``). Not built here: accelerate 1.15 runs DeepSpeed only off CPU
  and this project has no accelerator to test it on. ZeRO-1/2 keep whole parameters and are not refused (untested).
* A PEFT policy's adapter EMA teacher under FSDP2: refused (it swaps the EMA tensors into the policy's parameters,
  which FSDP2 shards).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_sharding"]


def check_sharding(state: Any, *, adapter_ema_teacher: bool) -> None:
    """Raise ``ValueError`` for a parallelism the trainer does not support (see the module docstring).

    Args:
        state: the accelerator's state (``accelerator.state``): its ``fsdp_plugin`` / ``deepspeed_plugin``, if any.
        adapter_ema_teacher: whether the run keeps a PEFT adapter's EMA self-teacher.
    """
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None:
        version = getattr(fsdp, "fsdp_version", 1)
        if version != 2:
            raise ValueError(
                f"ComposerReplicationTrainer supports FSDP2, not FSDP{version}: its chunked LM head reads the head "
                "weight, which FSDP1 flattens; set fsdp_version: 2 in the accelerate config (fsdp_config)"
            )
        if adapter_ema_teacher:
            raise ValueError(
                "a PEFT policy's EMA self-teacher (the adapter's EMA swapped into the policy) cannot run under FSDP2, "
                "which shards the adapter; use sdpo_teacher='live', or DDP for a PEFT run"
            )
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if deepspeed is not None and getattr(deepspeed, "zero_stage", None) == 3:
        raise ValueError(
            "ComposerReplicationTrainer does not support DeepSpeed ZeRO-3: ZeRO-3 partitions lm_head.weight to an empty "
            "tensor outside the lm_head's own forward, and the chunked LM head reads the weight directly (untested "
            "here: no accelerator). Use FSDP2 (accelerate fsdp_version: 2), which is tested, or ZeRO stage 1/2"
        )
