"""The SDPO self-teacher: an exponential moving average of the policy (SDPO ``teacher_regularization='ema'``).

Source: lasgroup/SDPO ``dp_actor.py``. The copy starts equal to the initial policy and moves toward it by
``rate`` after every optimizer step, ``θ_T ← (1 − r)·θ_T + r·θ_S``. Every rank holds its own copy. The copy is
taken before DDP wraps the policy, when the ranks' freshly initialised weights (a PEFT adapter's, say) may still
differ, so training starts by broadcasting rank 0's teacher (:meth:`EmaTeacher.synchronise`); from then on the
copies stay identical because DDP keeps the policies identical. Checkpointed with the Trainer
(``crf_core.trainer.state``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["EmaTeacher"]


class EmaTeacher:
    """A frozen copy of the policy updated as ``θ_T ← (1 − r)·θ_T + r·θ_S`` (SDPO ``teacher_regularization='ema'``).

    The copy starts equal to ``model`` (the initial policy) and is never seen by the optimizer.
    """

    def __init__(self, model: nn.Module, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"EMA rate must be in [0, 1], got {rate}")
        self.rate = float(rate)
        self.module = copy.deepcopy(model)
        # Instance-level `forward` overrides (TRL 1.16's fused LM head, accelerate hooks) close over the
        # *original* module, so the copy would silently run the live weights: restore the class forward.
        for sub in self.module.modules():
            sub.__dict__.pop("forward", None)
        self.module.requires_grad_(False)
        self.module.eval()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The teacher's parameters and buffers (for checkpoints)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; every tensor must match the teacher's names, shapes and dtypes."""
        own = self.module.state_dict()
        if set(state) != set(own):
            missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise ValueError(
                f"EMA teacher state does not match the policy: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, value in state.items():
            if value.shape != own[name].shape:
                raise ValueError(
                    f"EMA teacher tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(own[name].shape)}"
                )
        self.module.load_state_dict(state)

    @torch.no_grad()
    def synchronise(self, src: int = 0) -> None:
        """Make every rank's copy equal to rank ``src``'s (no-op outside ``torch.distributed``)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        if torch.distributed.get_world_size() < 2:
            return
        for tensor in self.module.state_dict().values():
            torch.distributed.broadcast(tensor, src=src)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the teacher toward ``model``'s current weights by ``rate`` (no-op when rate is 0)."""
        if self.rate == 0.0:
            return
        student = dict(model.named_parameters())
        for name, param in self.module.named_parameters():
            source = student.get(name)
            if source is None:
                raise KeyError(f"the policy has no parameter {name!r}; the EMA teacher must mirror the policy")
            param.lerp_(source.detach().to(param.dtype), self.rate)
