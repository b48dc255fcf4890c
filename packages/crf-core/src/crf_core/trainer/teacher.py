"""The SDPO self-teacher: an exponential moving average of the policy (SDPO ``teacher_regularization='ema'``).

Source: lasgroup/SDPO ``dp_actor.py``. The teacher starts equal to the initial policy and moves toward it by
``rate`` after every optimizer step, ``θ_T ← (1 − r)·θ_T + r·θ_S``. Two forms, with the same weights:

* :class:`EmaTeacher`: a full frozen copy of the policy (a policy whose every weight trains).
* :class:`AdapterEmaTeacher`: for a PEFT policy, EMA copies of the *trainable* tensors only (the adapter, and any
  ``modules_to_save``). A frozen base weight never changes, so its EMA is itself
  (``(1 − r)·θ + r·θ = θ``): the teacher is the shared frozen base plus the EMA adapter, run by swapping the EMA
  tensors into the policy under no-grad and in eval mode (:meth:`AdapterEmaTeacher.applied`). Memory and
  checkpoints hold adapter-sized state.

Every rank holds its own teacher. It is taken before DDP wraps the policy, when the ranks' freshly initialised
weights (a PEFT adapter's, say) may still differ, so training starts by broadcasting rank 0's teacher
(``synchronise``); from then on the teachers stay identical because DDP keeps the policies identical.
Checkpointed with the Trainer (``crf_core.trainer.state``).

Under FSDP2 the full copy is sharded like the policy once the policy is (:meth:`EmaTeacher.shard`, TRL's
``prepare_fsdp``, as TRL's SDPOTrainer shards its teacher): every parameter is split on dim 0 over the same mesh,
so each rank's EMA step is a local ``lerp`` of its shard toward the policy's shard (no communication), its
checkpoint state is gathered to full tensors, and its forward gathers like the policy's. The adapter form
needs the unsharded trainable tensors and is refused under FSDP2.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, get_args

import torch
from torch import nn

from crf_core._checks import is_number

__all__ = ["SDPO_TEACHERS", "AdapterEmaTeacher", "EmaTeacher", "SDPOTeacher", "is_peft_model"]

SDPOTeacher = Literal["ema", "live"]
"""The self-teacher's weights: ``"ema"`` an exponential moving average of the policy, ``"live"`` the policy."""
SDPO_TEACHERS: tuple[SDPOTeacher, ...] = get_args(SDPOTeacher)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False when peft is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft ships with the [train] extra
        return False
    return isinstance(model, PeftModel)


def _check_rate(rate: float) -> float:
    if not is_number(rate) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"EMA rate must be a number in [0, 1], got {rate!r}")
    return float(rate)


def _check_state(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """``state`` must have exactly ``own``'s names, shapes and dtypes."""
    if set(state) != set(own):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"EMA teacher state does not match the policy: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, value in state.items():
        if value.shape != own[name].shape:
            raise ValueError(
                f"EMA teacher tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(own[name].shape)}"
            )
        if value.dtype != own[name].dtype:
            raise ValueError(f"EMA teacher tensor {name!r} has dtype {value.dtype}, expected {own[name].dtype}")


def _is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _broadcast(tensors: Iterator[torch.Tensor] | list[torch.Tensor], src: int) -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_world_size() < 2:
        return
    for tensor in tensors:
        torch.distributed.broadcast(tensor, src=src)


class EmaTeacher:
    """A frozen full copy of the policy updated as ``θ_T ← (1 − r)·θ_T + r·θ_S`` (SDPO ``teacher_regularization='ema'``).

    The copy (``module``) starts equal to ``model`` (the initial policy) and is never seen by the optimizer.
    """

    kind = "full"

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = _check_rate(rate)
        self.module = copy.deepcopy(model)
        # Instance-level `forward` overrides (TRL 1.16's fused LM head, accelerate hooks) close over the
        # *original* module, so the copy would silently run the live weights: restore the class forward.
        for sub in self.module.modules():
            sub.__dict__.pop("forward", None)
        self.module.requires_grad_(False)
        self.module.eval()
        self.sharded = False

    @property
    def nbytes(self) -> int:
        """Bytes of the teacher's parameters (a tied parameter once): the memory it adds to the run."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def shard(self, accelerator: Any) -> None:
        """Shard the copy like an FSDP2 policy (TRL's ``prepare_fsdp`` with the accelerator's FSDP2 plugin); call it
        on every rank after the policy is sharded and after :meth:`synchronise`."""
        if self.sharded:
            return
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if plugin is None or plugin.fsdp_version != 2:
            raise ValueError("EmaTeacher.shard needs an accelerator with an FSDP2 plugin (fsdp_version=2)")
        from trl.models import prepare_fsdp

        prepared: Any = prepare_fsdp(self.module, accelerator)
        self.module = prepared
        self.sharded = True

    @contextmanager
    def applied(self, policy: nn.Module) -> Iterator[nn.Module]:
        """The model that computes teacher outputs: the copy itself (``policy`` is not touched)."""
        del policy
        yield self.module

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The teacher's parameters and buffers as full tensors (for checkpoints). Sharded, this gathers them: a
        collective every rank must join."""
        self._reshard()
        return {
            k: (v.full_tensor() if _is_dtensor(v) else v).detach().clone() for k, v in self.module.state_dict().items()
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; every tensor must match the teacher's names, shapes and dtypes."""
        own = self.module.state_dict()
        _check_state(own, state)
        if not self.sharded:
            self.module.load_state_dict(dict(state))
            return
        from torch.distributed.tensor import distribute_tensor

        self._reshard()
        for name, value in state.items():
            target = own[name]
            if _is_dtensor(target):
                value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements)
            target.copy_(value)

    @torch.no_grad()
    def synchronise(self, src: int = 0) -> None:
        """Make every rank's copy equal to rank ``src``'s (no-op outside ``torch.distributed``, and once sharded:
        the shards come from copies that were synchronised first)."""
        if not self.sharded:
            _broadcast(list(self.module.state_dict().values()), src)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the teacher toward ``model``'s current weights by ``rate`` (no-op when rate is 0). Sharded, each rank
        moves its shard toward the policy's shard of the same parameter."""
        if self.rate == 0.0:
            return
        self._reshard()
        student = dict(model.named_parameters())
        for name, param in self.module.named_parameters():
            source = student.get(name)
            if source is None:
                raise KeyError(f"the policy has no parameter {name!r}; the EMA teacher must mirror the policy")
            if _is_dtensor(param) != _is_dtensor(source):
                raise ValueError(
                    f"the EMA teacher's {name!r} and the policy's are not sharded alike (one is an FSDP2 DTensor); "
                    "shard the teacher with EmaTeacher.shard once the policy is sharded"
                )
            own, theirs = _local(param), _local(source.detach())
            if own.shape != theirs.shape:
                raise ValueError(
                    f"the EMA teacher's shard of {name!r} is {tuple(own.shape)}, the policy's {tuple(theirs.shape)}; "
                    "both must be sharded over the same mesh"
                )
            own.lerp_(theirs.to(own.dtype), self.rate)

    def _reshard(self) -> None:
        """Sharded: put every FSDP2 unit of the copy back to its sharded parameters (a forward that keeps them
        gathered would otherwise hide the shards the EMA step and the checkpoint read)."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


class AdapterEmaTeacher:
    """The EMA self-teacher of a PEFT policy: EMA copies of its trainable tensors over the shared frozen base.

    ``tensors[name]`` (same names, shapes and dtypes as ``policy.named_parameters()``' trainable entries) starts
    equal to the policy's and moves as ``θ_T ← (1 − r)·θ_T + r·θ_S``. Teacher outputs are the policy's with
    these tensors swapped in (:meth:`applied`), which equals a full copy of the policy under the same EMA
    (the frozen base's EMA is the base itself).
    """

    kind = "adapter"

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = _check_rate(rate)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the PEFT policy has no trainable parameters, so its EMA teacher would never move")
        head = _head_tensors(model)
        if any(p is h for _, p in trainable for h in head):
            raise ValueError(
                "the PEFT policy's plain nn.Linear lm_head is trainable, which the adapter EMA teacher cannot "
                "share; freeze it, or train it through peft (modules_to_save=['lm_head'])"
            )
        self.tensors: dict[str, torch.Tensor] = {n: p.detach().clone() for n, p in trainable}

    @property
    def nbytes(self) -> int:
        """Bytes of the EMA tensors: the memory the teacher adds to the run (the base is shared)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _params(self, policy: nn.Module) -> dict[str, nn.Parameter]:
        params = dict(policy.named_parameters())
        missing = sorted(set(self.tensors) - set(params))
        if missing:
            raise KeyError(f"the policy has no parameters {missing[:5]}; the EMA teacher must mirror the policy")
        return {name: params[name] for name in self.tensors}

    @contextmanager
    def applied(self, policy: nn.Module) -> Iterator[nn.Module]:
        """``policy`` with the EMA tensors in place of its trainable ones, in eval mode, under no-grad.

        The swap exchanges storage (``param.data``), so it copies nothing; on exit the policy's own tensors and
        every module's train/eval mode are back. Use it only where no autograd graph of the policy is alive.
        """
        params = self._params(policy)
        modes = [(m, m.training) for m in policy.modules()]
        own: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for name, param in params.items():
                    ema = self.tensors[name]
                    if ema.device != param.device:
                        ema = self.tensors[name] = ema.to(param.device)
                    own[name] = param.data
                    param.data = ema
                policy.eval()
                yield policy
        finally:
            for name, data in own.items():
                params[name].data = data
            for module, training in modes:
                module.training = training

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA tensors (for checkpoints), keyed by the policy's parameter names."""
        return {k: v.detach().clone() for k, v in self.tensors.items()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; every tensor must match the teacher's names, shapes and dtypes."""
        _check_state(self.tensors, state)
        for name, value in state.items():
            self.tensors[name].copy_(value)

    @torch.no_grad()
    def synchronise(self, src: int = 0) -> None:
        """Make every rank's EMA tensors equal to rank ``src``'s (no-op outside ``torch.distributed``)."""
        _broadcast(list(self.tensors.values()), src)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the EMA tensors toward ``model``'s trainable weights by ``rate`` (no-op when rate is 0)."""
        if self.rate == 0.0:
            return
        for name, param in self._params(model).items():
            ema = self.tensors[name]
            ema.lerp_(param.detach().to(device=ema.device, dtype=ema.dtype), self.rate)


def _head_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The weight (and bias) of the plain linear head the chunked scorer projects teacher states with, if any."""
    from crf_core.channels import LMHead

    head = LMHead(model)
    if not head.separable:
        return []
    return [head.weight] if head.bias is None else [head.weight, head.bias]
