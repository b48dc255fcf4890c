"""``compose_loss``: the 3-channel Composer loss on a causal LM, for verification and ablations.

``total = lm_ce_weight·lm_ce + sdpo_weight·sdpo_jsd + dpo_weight·trace_replay_dpo``

This is a verification harness (seed failure mode 11): the first channel is plain next-token
cross-entropy (``lm_ce``), *not* GRPO's surrogate. Production GRPO training uses
``crf_core.trainer.ComposerReplicationTrainer`` (a TRL ``GRPOTrainer`` subclass) or the PRIME-RL adapter
``crf_primerl.composer_loss.loss_fn``. Use ``compose_loss`` for CPU smokes on real Hugging Face models,
unit tests of the composition, gradient-flow checks and channel ablations; log ``lm_ce`` as ``lm_ce``.

A thin facade: it reads ``inputs`` once, then calls the channel objects of ``crf_core.channels`` (the same
ones ``ComposerReplicationTrainer`` uses); the loss math lives in ``crf_distill``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from crf_core._loss_inputs import get_float, get_ids, get_mask
from crf_core.channels import (
    DPO_VARIANTS,
    SDPO_WRAPPERS,
    ChunkPlan,
    DPOVariant,
    LMHead,
    PreferenceConfig,
    RowSource,
    SDPOChannel,
    SDPOConfig,
    SDPOWrapper,
    SequenceBatch,
    TraceReplayDPOChannel,
    hidden_source,
    lm_ce_term,
    logits_source,
    mean_weights,
)
from crf_core.channels._validate import check_unit, check_weight
from crf_core.channels.sdpo import completion_states, sdpo_targets
from crf_distill import RowTerm, TAIDSchedule

__all__ = ["DPO_VARIANTS", "SDPO_WRAPPERS", "LossComponents", "compose_loss"]


@dataclass(frozen=True)
class LossComponents:
    """Result of :func:`compose_loss`.

    Attributes:
        lm_ce: next-token cross-entropy (token mean over ``response_mask``); the verification stand-in for GRPO.
        sdpo_jsd: SDPO self-distillation divergence (generalised JSD, or its TAID / Entropy-OPD wrapper);
            0 when ``inputs`` has no SDPO keys or no sample carries a teacher signal.
        trace_replay_dpo: DPO-family (or SimPO) loss on the trace-replay pairs; 0 without DPO keys.
        total: ``lm_ce_weight·lm_ce + sdpo_weight·sdpo_jsd + dpo_weight·trace_replay_dpo``.
        taid_t: interpolation coefficient used by the TAID wrapper (``None`` otherwise).
        sdpo_tokens: number of tokens that carried SDPO signal. dpo_pairs: number of preference pairs.
    """

    lm_ce: torch.Tensor
    sdpo_jsd: torch.Tensor
    trace_replay_dpo: torch.Tensor
    total: torch.Tensor
    taid_t: float | None = None
    sdpo_tokens: int = 0
    dpo_pairs: int = 0

    def metrics(self) -> dict[str, float]:
        """Detached floats for logging (channel names kept as they are: ``lm_ce`` is not GRPO)."""
        out = {
            "lm_ce": float(self.lm_ce.detach()),
            "sdpo_jsd": float(self.sdpo_jsd.detach()),
            "trace_replay_dpo": float(self.trace_replay_dpo.detach()),
            "total": float(self.total.detach()),
        }
        if self.taid_t is not None:
            out["taid_t"] = self.taid_t
        return out


@dataclass(frozen=True)
class _SDPORows:
    """The SDPO term on the scored rows ``r = b·(T − 1) + t`` (row ``t`` predicts token ``t + 1``) and its weights."""

    term: RowTerm
    weights: torch.Tensor  # (N,) completion_mask · self_distillation_mask, 0 outside the completion


def _taid_anchor(head: LMHead, inputs: Mapping[str, Any], ids: torch.Tensor, c: int) -> RowSource | None:
    """TAID's anchor on the completion rows ``b·C + j``: given logits, the live model on the step-0 inputs, or None
    (the paper's current detached student)."""
    batch, seq = ids.shape
    if inputs.get("student_init_logits") is not None:
        init = get_float(inputs, "student_init_logits", (batch, seq, "V"), "for TAID")
        return logits_source(init[:, seq - c - 1 : seq - 1].reshape(batch * c, -1), lambda rows: rows)
    if inputs.get("student_init_input_ids") is None:
        return None
    init_ids = get_ids(inputs, "student_init_input_ids", (batch, seq), "for TAID")
    warnings.warn(
        "TAID: inputs['student_init_input_ids'] is scored by the *live* model; that equals the step-0 "
        "student only before the first optimizer step. Pass precomputed inputs['student_init_logits'] "
        "(captured at step 0) or neither key (the paper's current detached student) instead.",
        UserWarning,
        stacklevel=5,
    )
    with torch.no_grad():
        init_states = completion_states(head.states(init_ids, inputs.get("attention_mask")), c)
    return hidden_source(head, init_states.reshape(batch * c, -1), lambda rows: rows)


def _sdpo_rows(
    head: LMHead, channel: SDPOChannel, inputs: Mapping[str, Any], ids: torch.Tensor, taid_t: float | None
) -> _SDPORows:
    batch, seq = ids.shape
    why = "for the SDPO channel (it is active because 'teacher_input_ids' or 'teacher_logits' is present)"
    raw = inputs.get("completion_mask")
    if not isinstance(raw, torch.Tensor) or raw.dim() != 2:
        raise KeyError(f"inputs['completion_mask'] (B, C) is required {why}; got {type(raw).__name__}")
    completion = get_mask(inputs, "completion_mask", (batch, raw.shape[1]), why=why)
    c = completion.shape[1]
    if not 0 < c < seq:
        raise ValueError(
            f"inputs['completion_mask'] must be (B, C) with 0 < C < T={seq}: the completion is the last C tokens of "
            f"'input_ids' (and of 'teacher_input_ids'), got C={c}"
        )
    sample = get_mask(inputs, "self_distillation_mask", (batch,), default=torch.ones(batch, device=ids.device))
    tokens = completion.to(torch.float32) * sample.to(torch.float32)[:, None]  # (B, C)

    teacher_logits = t_ids = t_attn = None
    if inputs.get("teacher_logits") is not None:
        teacher_logits = get_float(inputs, "teacher_logits", (batch, c, "V"), why)
    else:
        t_ids = get_ids(inputs, "teacher_input_ids", (batch, "T_teacher"), why)
        t_attn = get_mask(inputs, "teacher_attention_mask", tuple(t_ids.shape), default=torch.ones_like(t_ids))
    old = None
    if channel.config.is_clip is not None and inputs.get("old_per_token_logps") is not None:
        old = get_float(inputs, "old_per_token_logps", (batch, c), "for sdpo_is_clip")
    targets = sdpo_targets(
        ids[:, seq - c :],
        sample > 0,
        teacher_logits=teacher_logits,
        teacher=lambda input_ids, mask: (head, head.states(input_ids, mask)),
        teacher_input_ids=t_ids,
        teacher_attention_mask=t_attn,
        old_logprobs=old,
        taid_t=taid_t,
        anchor=None if taid_t is None else _taid_anchor(head, inputs, ids, c),
        weights=tokens,
    )
    assert targets.weights is not None  # the token weights (no first-error truncation here: truncate_below unset)
    first = seq - c - 1  # row t = first + j scores completion token j
    weights = torch.zeros(batch, seq - 1, dtype=torch.float32, device=ids.device)
    weights[:, first:] = targets.weights
    rows = torch.arange(batch * (seq - 1), device=ids.device)
    term = channel.term_at(targets, targets.weights, rows // (seq - 1), rows % (seq - 1) - first)
    return _SDPORows(term, weights.reshape(-1))


def _pair_side(inputs: Mapping[str, Any], side: str, pairs: int | None) -> SequenceBatch:
    why = "for the trace-replay DPO channel (active because 'dpo_chosen_input_ids' is present)"
    ids = get_ids(inputs, f"dpo_{side}_input_ids", ("P", "T"), why)
    if pairs is not None and ids.shape[0] != pairs:
        raise ValueError(f"inputs['dpo_{side}_input_ids'] must have P={pairs} rows like the chosen side")
    attn = get_mask(inputs, f"dpo_{side}_attention_mask", tuple(ids.shape), default=torch.ones_like(ids))
    resp = get_mask(inputs, f"dpo_{side}_response_mask", tuple(ids.shape), why=why)
    return SequenceBatch(ids, attn, resp)


def _trace_replay_dpo(head: LMHead, inputs: Mapping[str, Any], config: PreferenceConfig) -> tuple[torch.Tensor, int]:
    channel = TraceReplayDPOChannel(config)
    chosen_batch = _pair_side(inputs, "chosen", None)
    pairs = chosen_batch.input_ids.shape[0]
    rejected_batch = _pair_side(inputs, "rejected", pairs)
    chosen = channel.sequence_logps(head, chosen_batch)
    rejected = channel.sequence_logps(head, rejected_batch)
    ref_c = ref_r = None
    if not config.reference_free:  # SimPO ignores the reference keys by design
        ref_why = (
            f"for dpo_variant={config.variant!r} (reference log-probs, summed over the response); SimPO needs none"
        )
        ref_c = get_float(inputs, "dpo_chosen_ref_logprobs", (pairs,), ref_why)
        ref_r = get_float(inputs, "dpo_rejected_ref_logprobs", (pairs,), ref_why)
    return channel.loss(chosen, rejected, ref_c, ref_r).loss, pairs


def compose_loss(
    model: Any,
    inputs: Mapping[str, Any],
    *,
    lm_ce_weight: float = 1.0,
    sdpo_weight: float = 1.0,
    dpo_weight: float = 1.0,
    dpo_beta: float = 0.1,
    dpo_variant: DPOVariant = "sigmoid",
    simpo_beta: float = 2.0,
    simpo_gamma: float = 1.0,
    sdpo_wrapper: SDPOWrapper | None = None,
    taid_schedule_step: int | None = None,
    taid_total_steps: int | None = None,
    taid_alpha_min: float = 0.4,
    taid_alpha_max: float = 1.0,
    entropy_opd_h_max: float | None = None,
    sdpo_alpha: float = 0.5,
    sdpo_top_k: int | None = None,
    sdpo_is_clip: float | None = None,
    dpo_label_smoothing: float = 0.0,
    taid_schedule: TAIDSchedule | None = None,
    chunk_size: int | None = None,
) -> LossComponents:
    """Compose ``lm_ce``, ``sdpo_jsd`` and ``trace_replay_dpo`` on a causal LM (verification harness).

    ``total = lm_ce_weight·lm_ce + sdpo_weight·sdpo_jsd + dpo_weight·trace_replay_dpo``. With every keyword at
    its default the result is bit for bit the plain 3-channel sum ``lm_ce + sdpo_jsd + trace_replay_dpo``.
    ``lm_ce`` is next-token cross-entropy, **not** GRPO (production: ``ComposerReplicationTrainer``).

    ``inputs`` keys (B samples, T tokens, C completion tokens, P preference pairs, V vocabulary):

    Always required
        * ``input_ids`` ``(B, T)`` long — prompt + completion (TRL layout: left-padded prompt, then the
          right-padded completion occupying the last C positions).
    Optional (lm_ce)
        * ``attention_mask`` ``(B, T)`` — default all ones.
        * ``response_mask`` ``(B, T)`` — 1 on tokens whose prediction is trained; default ``attention_mask``.
    SDPO channel (on when ``teacher_input_ids`` or ``teacher_logits`` is present; else ``sdpo_jsd = 0``)
        * ``completion_mask`` ``(B, C)`` — required: 1 on real completion tokens.
        * ``teacher_input_ids`` ``(B, T_t)`` — teacher prompt (reprompt with feedback) + the same C completion
          tokens; scored by ``model`` under ``no_grad`` (self-distillation). Optional ``teacher_attention_mask``.
        * ``teacher_logits`` ``(B, C, V)`` — alternative: precomputed teacher logits for the completion
          positions (e.g. an EMA teacher); wins over ``teacher_input_ids``.
        * ``self_distillation_mask`` ``(B,)`` — optional, 1 where the sample has a teacher signal.
        * ``old_per_token_logps`` ``(B, C)`` — optional behaviour log-probs for ``sdpo_is_clip`` (default:
          on-policy, i.e. the current detached log-probs, weight 1).
        * TAID only: ``student_init_logits`` ``(B, T, V)`` (preferred; the seed variant's step-0 anchor) or
          ``student_init_input_ids`` ``(B, T)`` (scored by the live model, with a warning: only right at step
          0). With neither, the anchor is the current detached student (the TAID paper).
    Trace-replay DPO channel (on when ``dpo_chosen_input_ids`` is present; else ``trace_replay_dpo = 0``)
        * ``dpo_chosen_input_ids``, ``dpo_rejected_input_ids`` ``(P, T_c)``, ``(P, T_r)`` — required.
        * ``dpo_chosen_response_mask``, ``dpo_rejected_response_mask`` — required, same shapes, 1 on
          response tokens. Optional ``dpo_chosen_attention_mask``, ``dpo_rejected_attention_mask``.
        * ``dpo_chosen_ref_logprobs``, ``dpo_rejected_ref_logprobs`` ``(P,)`` — summed reference log-probs;
          required for every DPO variant, **ignored** for ``dpo_variant="simpo"`` (reference-free).

    Keyword arguments (the seed's 13, then crf extensions):
        lm_ce_weight, sdpo_weight, dpo_weight: channel weights >= 0.
        dpo_beta: DPO β. dpo_variant: a TRL 1.16 ``loss_type`` name (any of ``crf_distill.DPO_LOSS_TYPES``:
            ``sigmoid``, ``hinge``, ``ipo``, ``robust``, ``exo_pair``, ``nca_pair``, ``sigmoid_norm``, ``bco_pair``,
            ``sppo_hard``, ``aot``, ``aot_unpaired``, ``apo_zero``, ``apo_down``, ``discopop``, ``sft``) or
            ``"simpo"``.
        simpo_beta, simpo_gamma: SimPO β and absolute margin γ (used only with ``dpo_variant="simpo"``).
        sdpo_wrapper: ``None`` (generalised JSD), ``"taid"`` (TAID target replaces the teacher inside the
            SDPO divergence; t = 1 is plain SDPO) or ``"entropy_opd"`` (reverse KL + forward KL where the
            teacher entropy exceeds ``entropy_opd_h_max``).
        taid_schedule_step, taid_total_steps: both or neither; TAID needs both (linear
            ``t = alpha_min + (alpha_max − alpha_min)·step/total``).
        taid_alpha_min, taid_alpha_max: TAID ``t_start``/``t_end`` (paper defaults 0.4 / 1.0).
        entropy_opd_h_max: teacher-entropy threshold in nats; required with ``sdpo_wrapper="entropy_opd"``.
        sdpo_alpha: JSD α (0 forward KL, 1 reverse KL; SDPO's 0.5). sdpo_top_k: student top-k support with
            tail bucket (None = full vocab). sdpo_is_clip: detached truncated IS weight cap.
        dpo_label_smoothing: ε for ``sigmoid`` (cDPO), ``robust``, ``exo_pair`` and SimPO.
        taid_schedule: a :class:`crf_distill.TAIDSchedule` whose adaptive ``t`` is used instead of the linear
            one (the caller calls ``schedule.update(out.sdpo_jsd, step, total)`` once per optimizer step).
        chunk_size: run the lm_head chunked over ``chunk_size`` tokens at a time (HF causal LMs with a plain
            linear lm_head; see ``crf_core.channels.head``): lm_ce and sdpo_jsd share one pass, DPO scores its
            response tokens the same way; peak memory holds one ``(chunk, V)`` block instead of ``(B, T, V)``
            logits, in the forward and in the backward. Every part of the result keeps its own gradient.

    Raises:
        KeyError: a key a requested channel needs is missing (the message names it).
        ValueError/TypeError: bad shapes, dtypes or keyword combinations (the message names the fix).
    """
    lm_w = check_weight("lm_ce_weight", lm_ce_weight)
    sdpo_w = check_weight("sdpo_weight", sdpo_weight)
    dpo_w = check_weight("dpo_weight", dpo_weight)
    if dpo_variant not in DPO_VARIANTS:
        raise ValueError(f"`dpo_variant` must be one of {DPO_VARIANTS}, got {dpo_variant!r}")
    if sdpo_wrapper not in SDPO_WRAPPERS:
        raise ValueError(f"`sdpo_wrapper` must be one of {SDPO_WRAPPERS}, got {sdpo_wrapper!r}")
    if (taid_schedule_step is None) != (taid_total_steps is None):
        missing = "taid_total_steps" if taid_total_steps is None else "taid_schedule_step"
        raise ValueError(
            f"TAID schedule is half-configured: `{missing}` is missing. Pass both taid_schedule_step and "
            "taid_total_steps (t = alpha_min + (alpha_max - alpha_min) * step / total), or neither."
        )
    sdpo_config = SDPOConfig(
        alpha=check_unit("sdpo_alpha", sdpo_alpha),
        top_k=sdpo_top_k,
        is_clip=sdpo_is_clip,
        wrapper=sdpo_wrapper,
        taid_alpha_min=taid_alpha_min,
        taid_alpha_max=taid_alpha_max,
        entropy_opd_h_max=entropy_opd_h_max,
    )
    if sdpo_wrapper != "taid" and (taid_schedule_step is not None or taid_schedule is not None):
        raise ValueError("TAID schedule arguments were given but sdpo_wrapper is not 'taid'; set sdpo_wrapper='taid'")
    if sdpo_wrapper == "taid" and taid_schedule_step is None:
        raise ValueError(
            "sdpo_wrapper='taid' needs taid_schedule_step and taid_total_steps (the current and the total number "
            "of training steps) to place t on its schedule"
        )
    sdpo_channel = SDPOChannel(sdpo_config)
    preference = PreferenceConfig(
        variant=dpo_variant,
        beta=dpo_beta,
        label_smoothing=dpo_label_smoothing,
        simpo_beta=simpo_beta,
        simpo_gamma=simpo_gamma,
    )

    if not isinstance(inputs, Mapping):
        raise TypeError(f"`inputs` must be a mapping of tensors, got {type(inputs).__name__}")
    ids = get_ids(inputs, "input_ids", ("B", "T"), "(the student sequences: prompt + completion)")
    if ids.shape[1] < 2:
        raise ValueError(
            f"inputs['input_ids'] must be (B, T) with T >= 2 to predict a next token, got T={ids.shape[1]}"
        )
    head = LMHead(model, ChunkPlan("off") if chunk_size is None else ChunkPlan("on", chunk_size=chunk_size))
    if chunk_size is not None and not head.separable:
        raise ValueError(f"chunk_size cannot be used with this model: {head.reason}; use chunk_size=None")
    attention = get_mask(inputs, "attention_mask", tuple(ids.shape), default=torch.ones_like(ids))
    response = get_mask(inputs, "response_mask", tuple(ids.shape), default=attention)[:, 1:]

    taid_t = None
    if sdpo_wrapper == "taid":
        taid_t = sdpo_config.taid_t(taid_schedule_step, taid_total_steps, taid_schedule)
    sdpo_rows = None
    if inputs.get("teacher_input_ids") is not None or inputs.get("teacher_logits") is not None:
        sdpo_rows = _sdpo_rows(head, sdpo_channel, inputs, ids, taid_t)

    states = head.states(ids, attention)
    rows = states.tensor[:, :-1].reshape(-1, states.tensor.shape[-1])
    labels, mask = ids[:, 1:].reshape(-1), response.reshape(-1)
    terms, weights, scales = [lm_ce_term(labels, mask)], [mean_weights(mask)], [lm_w]
    if sdpo_rows is not None:
        terms.append(sdpo_rows.term)
        weights.append(mean_weights(sdpo_rows.weights))
        scales.append(sdpo_w)
    fused, values = head.weighted_sums(rows, is_logits=states.is_logits, terms=terms, weights=weights, scales=scales)
    lm_ce = values[0]
    sdpo = values[1] if sdpo_rows is not None else torch.zeros((), dtype=lm_ce.dtype, device=lm_ce.device)
    sdpo_tokens = 0 if sdpo_rows is None else int((sdpo_rows.weights != 0).sum())

    dpo, pairs = torch.zeros((), dtype=torch.float32, device=ids.device), 0
    if inputs.get("dpo_chosen_input_ids") is not None:
        dpo, pairs = _trace_replay_dpo(head, inputs, preference)

    return LossComponents(
        lm_ce=lm_ce,
        sdpo_jsd=sdpo,
        trace_replay_dpo=dpo,
        total=fused + dpo_w * dpo,
        taid_t=taid_t,
        sdpo_tokens=sdpo_tokens,
        dpo_pairs=pairs,
    )
