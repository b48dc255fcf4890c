"""SDPO channel pieces: response-token logits of a causal LM, the EMA self-teacher, and the loss.

Source: SDPO (Hübotter et al., arXiv 2601.20802), lasgroup/SDPO ``dp_actor.py`` (teacher forward,
EMA) and ``core_algos.py::compute_self_distillation_loss``. The student is the policy on
``[prompt ; response]``; the teacher is the same model (or its EMA copy) under no-grad on
``[teacher_prompt ; response]``, both at the sampling temperature. The loss is crf-distill's
``generalized_jsd`` on the response tokens of samples with a teacher signal, token-mean.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from crf_distill import generalized_jsd

__all__ = ["EmaTeacher", "response_logits", "sdpo_loss"]


def response_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logits that score each response token, divided by ``temperature``.

    Runs ``model`` on ``[prompt ; response]`` (prompts left-padded, responses right-padded) with
    position ids counted over real tokens only, so the same response gets the same positions under
    differently padded prompts. Position ``t`` of the result scores ``response_ids[:, t]``.

    Args:
        prompt_ids, prompt_mask: ``(B, P)``. response_ids, response_mask: ``(B, C)``.
        temperature: > 0.

    Returns:
        ``(B, C, V)`` float logits (with grad if the caller allows it).
    """
    for name, t in (("prompt_ids", prompt_ids), ("prompt_mask", prompt_mask)):
        if t.dim() != 2:
            raise ValueError(f"{name} must be (B, P), got shape {tuple(t.shape)}")
    if response_ids.dim() != 2 or response_ids.shape != response_mask.shape:
        raise ValueError(
            f"response_ids and response_mask must both be (B, C); got {tuple(response_ids.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(
            f"prompt (B, P) = {tuple(prompt_ids.shape)}/{tuple(prompt_mask.shape)} does not match "
            f"response (B, C) = {tuple(response_ids.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    num = response_ids.shape[1]
    kwargs = {"logits_to_keep": num + 1} if _accepts_logits_to_keep(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs).logits
    return logits[:, -num - 1 : -1, :] / temperature


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (HF causal LMs do: the LM head then only runs
    on the last positions, not on the prompt)."""
    target: Any = model
    if hasattr(target, "get_base_model"):  # PEFT wrapper
        target = target.get_base_model()
    try:
        return "logits_to_keep" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


def sdpo_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    *,
    alpha: float,
    top_k: int | None,
    add_tail: bool,
    is_clip: float | None,
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPO loss: token-mean generalised JSD over response tokens of samples with a teacher signal.

    ``L = Σ_{b,t} m_bt·s_b·w_bt·gJSD_α(S_bt, sg(T_bt)) / Σ_{b,t} m_bt·s_b`` with ``m`` the response mask,
    ``s`` the per-sample SDPO mask, ``w`` the detached truncated IS weight ``min(π_θ/π_old, is_clip)``
    (1 when ``old_logprobs`` is None, i.e. on-policy, where ``π_old = sg(π_θ)``).

    Args:
        student_logits, teacher_logits: ``(B, C, V)`` from :func:`response_logits`.
        response_ids, response_mask: ``(B, C)`` sampled tokens and 1/0 mask.
        sample_mask: ``(B,)`` 1 where the sample has a teacher signal.
        alpha, top_k, add_tail, is_clip: see ``crf_distill.generalized_jsd``.
        old_logprobs: ``(B, C)`` behaviour-policy log-probs of ``response_ids`` (temperature-scaled), or None.

    Returns:
        0-d tensor (0 when no sample has a signal).
    """
    use_clip = is_clip is not None and old_logprobs is not None
    return generalized_jsd(
        student_logits,
        teacher_logits.detach(),
        response_mask,
        alpha=alpha,
        top_k=top_k,
        add_tail=add_tail,
        is_clip=is_clip if use_clip else None,
        labels=response_ids if use_clip else None,
        old_logprobs=old_logprobs if use_clip else None,
        sample_mask=sample_mask,
    )


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
