"""``compose_loss``: the 3-channel Composer loss on a causal LM, for verification and ablations.

``total = lm_ce_weight·lm_ce + sdpo_weight·sdpo_jsd + dpo_weight·trace_replay_dpo``

This is a verification harness (seed failure mode 11): the first channel is plain next-token
cross-entropy (``lm_ce``), *not* GRPO's surrogate. Production GRPO training uses
``crf_core.trainer.ComposerReplicationTrainer`` (a TRL ``GRPOTrainer`` subclass) or the PRIME-RL adapter
``crf_primerl.composer_loss.loss_fn``. Use ``compose_loss`` for CPU smokes on real Hugging Face models,
unit tests of the composition, gradient-flow checks and channel ablations; log ``lm_ce`` as ``lm_ce``.

The loss math lives in ``crf_distill`` (one loss per module); this module only runs the model, aligns
positions and selects channels.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from crf_core._loss_inputs import get_float, get_ids, get_mask, logits_of
from crf_distill import (
    DPO_LOSS_TYPES,
    ChunkTerm,
    TAIDSchedule,
    aggregate,
    avg_sequence_logprob,
    chunked_fused_loss,
    chunked_token_logprobs,
    dpo_loss,
    entropy_opd_per_token,
    generalized_jsd_per_token,
    is_ratio_weight,
    sequence_logprob,
    simpo_loss,
    taid_linear_t,
    taid_target_logprobs,
    token_logprobs,
)

__all__ = ["DPO_VARIANTS", "SDPO_WRAPPERS", "LossComponents", "compose_loss"]

DPO_VARIANTS: tuple[str, ...] = (*DPO_LOSS_TYPES, "simpo")
SDPO_WRAPPERS: tuple[str | None, ...] = (None, "taid", "entropy_opd")
DPOVariant = Literal["sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sigmoid_norm", "simpo"]
SDPOWrapper = Literal["taid", "entropy_opd"]


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


def _weight(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite float, got {value!r}")
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0 (set it to 0.0 to switch the channel off), got {value}")
    return float(value)


def _unit(name: str, value: float) -> float:
    v = _weight(name, value)
    if v > 1:
        raise ValueError(f"`{name}` is an interpolation coefficient in [0, 1], got {value}")
    return v


class _Head:
    """Runs the model; unfused it yields ``(B, T, V)`` logits, fused (``chunk_size``) last hidden states."""

    def __init__(self, model: Any, chunk_size: int | None) -> None:
        self.model = model
        self.chunk_size = chunk_size
        if chunk_size is None:
            return
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"`chunk_size` must be a positive int or None, got {chunk_size!r}")
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, torch.nn.Linear) or not hasattr(model, "get_decoder"):
            raise ValueError(
                "chunk_size needs a Hugging Face causal LM with get_decoder() and a Linear lm_head; "
                "use chunk_size=None for other models"
            )
        config = getattr(model, "config", None)
        if getattr(config, "final_logit_softcapping", None) is not None or getattr(config, "logit_scale", None) not in (
            None,
            1.0,
        ):
            raise ValueError("chunk_size does not support logit soft-capping/scaling; use chunk_size=None")
        self.decoder = model.get_decoder()
        self.weight: torch.Tensor = head.weight
        self.bias: torch.Tensor | None = head.bias

    @property
    def fused(self) -> bool:
        return self.chunk_size is not None

    def states(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``(B, T, V)`` logits, or ``(B, T, H)`` last hidden states on the fused path."""
        if self.fused:
            out = self.decoder(input_ids=ids, attention_mask=attention_mask)
            hidden = getattr(out, "last_hidden_state", None)
            return out[0] if hidden is None else hidden
        return logits_of(self.model(input_ids=ids, attention_mask=attention_mask))

    def token_logprobs(self, states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Log-probs of ``labels`` ``(B, N)`` scored by ``states`` ``(B, N, X)``."""
        if not self.fused:
            return token_logprobs(states, labels, ignore_index=None)
        assert self.chunk_size is not None
        flat = chunked_token_logprobs(
            states.reshape(-1, states.shape[-1]),
            self.weight,
            labels.reshape(-1),
            bias=self.bias,
            chunk_size=self.chunk_size,
            ignore_index=None,
        )
        return flat.reshape(labels.shape)

    def project(self, states: torch.Tensor, is_logits: bool) -> torch.Tensor:
        """No-grad logits of ``states`` (identity when they already are logits)."""
        if is_logits:
            return states
        with torch.no_grad():
            z = states.float() @ self.weight.float().t()
            return z if self.bias is None else z + self.bias.float()


def _response_weights(inputs: Mapping[str, Any], ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """``(B, T-1)`` mask of the predicted tokens ``input_ids[:, 1:]`` that lm_ce trains on."""
    return get_mask(inputs, "response_mask", tuple(ids.shape), default=attention)[:, 1:]


def _taid_t(step: int | None, total: int | None, t_min: float, t_max: float, schedule: TAIDSchedule | None) -> float:
    if schedule is not None:
        if (schedule.t_start, schedule.t_end) != (t_min, t_max):
            raise ValueError(
                f"taid_schedule has t_start/t_end = ({schedule.t_start}, {schedule.t_end}) but taid_alpha_min/max = "
                f"({t_min}, {t_max}); build the schedule with the same bounds"
            )
        return schedule.t
    assert step is not None
    assert total is not None
    return taid_linear_t(step, total, t_min, t_max)


@dataclass(frozen=True)
class _SDPOSpec:
    """Everything the SDPO channel needs, aligned to the C completion positions (``(B, C, ...)``)."""

    weights: torch.Tensor  # (B, C) completion_mask · self_distillation_mask
    labels: torch.Tensor  # (B, C) completion token ids
    first: int  # student position scoring completion token 0 (= T - C - 1)
    teacher: torch.Tensor  # (B, C, X) teacher logits or hidden states (detached)
    teacher_is_logits: bool
    anchor: torch.Tensor | None  # (B, C, X) TAID anchor logits or hidden states (detached)
    anchor_is_logits: bool
    old: torch.Tensor | None  # (B, C) behaviour log-probs for is_clip


def _sdpo_spec(
    head: _Head,
    states: torch.Tensor,
    inputs: Mapping[str, Any],
    ids: torch.Tensor,
    *,
    taid_active: bool,
    is_clip: float | None,
) -> _SDPOSpec:
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
    weights = completion.to(torch.float32) * sample.to(torch.float32)[:, None]
    first = seq - c - 1
    labels = ids[:, seq - c :]

    if inputs.get("teacher_logits") is not None:
        teacher = get_float(inputs, "teacher_logits", (batch, c, "V"), why).detach()
        teacher_is_logits = True
    else:
        t_ids = get_ids(inputs, "teacher_input_ids", (batch, "T_teacher"), why)
        t_len = t_ids.shape[1]
        if t_len <= c or not torch.equal(t_ids[:, t_len - c :], labels):
            raise ValueError(
                "inputs['teacher_input_ids'] must end with the same C completion tokens as 'input_ids' "
                "(teacher prompt, then the student's completion); rebuild it as cat(teacher_prompt_ids, completion_ids)"
            )
        t_attn = get_mask(inputs, "teacher_attention_mask", tuple(t_ids.shape), default=torch.ones_like(t_ids))
        with torch.no_grad():
            teacher = head.states(t_ids, t_attn)[:, t_len - c - 1 : t_len - 1].detach()
        teacher_is_logits = not head.fused

    anchor: torch.Tensor | None = None
    anchor_is_logits = True
    if taid_active and inputs.get("student_init_logits") is not None:
        init = get_float(inputs, "student_init_logits", (batch, seq, "V"), "for TAID")
        anchor = init[:, first : seq - 1].detach()
    elif taid_active and inputs.get("student_init_input_ids") is not None:
        init_ids = get_ids(inputs, "student_init_input_ids", (batch, seq), "for TAID")
        warnings.warn(
            "TAID: inputs['student_init_input_ids'] is scored by the *live* model; that equals the step-0 "
            "student only before the first optimizer step. Pass precomputed inputs['student_init_logits'] "
            "(captured at step 0) or neither key (the paper's current detached student) instead.",
            UserWarning,
            stacklevel=4,
        )
        with torch.no_grad():
            anchor = head.states(init_ids, inputs.get("attention_mask"))[:, first : seq - 1].detach()
        anchor_is_logits = not head.fused

    old = None
    if is_clip is not None:
        if inputs.get("old_per_token_logps") is not None:
            old = get_float(inputs, "old_per_token_logps", (batch, c), "for sdpo_is_clip").detach()
        else:  # on-policy: the behaviour policy is the current one, the weight is 1
            with torch.no_grad():
                old = head.token_logprobs(states[:, first : seq - 1].detach(), labels)
    return _SDPOSpec(weights, labels, first, teacher, teacher_is_logits, anchor, anchor_is_logits, old)


def _sdpo_per_token(
    head: _Head,
    spec: _SDPOSpec,
    at: Callable[[torch.Tensor, Any], torch.Tensor],
    *,
    wrapper: str | None,
    alpha: float,
    top_k: int | None,
    is_clip: float | None,
    taid_t: float | None,
    h_max: float | None,
) -> Callable[[torch.Tensor, Any, Any], torch.Tensor]:
    """Per-token SDPO loss; ``at(x, rows)`` picks the rows of a ``(B, C, ...)`` tensor."""
    taid_active = wrapper == "taid" and taid_t is not None and taid_t < 1.0

    def per_token(s_logits: torch.Tensor, t_logits: Any, rows: Any) -> torch.Tensor:
        target = t_logits
        if taid_active:
            assert taid_t is not None
            anchor = None if spec.anchor is None else head.project(at(spec.anchor, rows), spec.anchor_is_logits)
            target = taid_target_logprobs(s_logits, t_logits, taid_t, anchor_logits=anchor)
        if wrapper == "entropy_opd":
            assert h_max is not None
            value = entropy_opd_per_token(s_logits, target, h_max=h_max, top_k=top_k)
        else:
            value = generalized_jsd_per_token(s_logits, target, alpha=alpha, top_k=top_k)
        if is_clip is not None and spec.old is not None:
            lp = token_logprobs(s_logits, at(spec.labels, rows), ignore_index=None)
            value = value * is_ratio_weight(lp, at(spec.old, rows), is_clip)
        return value

    return per_token


PerTokenFactory = Callable[
    [Callable[[torch.Tensor, Any], torch.Tensor]], Callable[[torch.Tensor, Any, Any], torch.Tensor]
]


def _unfused_channels(
    head: _Head,
    logits: torch.Tensor,
    ids: torch.Tensor,
    response: torch.Tensor,
    spec: _SDPOSpec | None,
    make_per_token: PerTokenFactory | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_ce and sdpo_jsd from materialised ``(B, T, V)`` logits."""
    lm_ce = -aggregate(head.token_logprobs(logits[:, :-1], ids[:, 1:]), response, "token_mean")
    if spec is None or make_per_token is None:
        return lm_ce, torch.zeros((), dtype=lm_ce.dtype, device=lm_ce.device)
    per_token = make_per_token(lambda x, rows: x)
    student = logits[:, spec.first : spec.first + spec.labels.shape[1]]
    return lm_ce, aggregate(per_token(student, spec.teacher, ...), spec.weights, "token_mean")


def _fused_channels(
    head: _Head,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    response: torch.Tensor,
    spec: _SDPOSpec | None,
    make_per_token: PerTokenFactory | None,
    lm_w: float,
    sdpo_w: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunked lm_head pass for both channels: (``lm_w·lm_ce + sdpo_w·sdpo`` with grad, lm_ce, sdpo)."""
    assert head.chunk_size is not None
    batch, seq = ids.shape
    per_seq = seq - 1  # flattened row r scores token (r // per_seq, r % per_seq + 1)
    tiny = torch.finfo(torch.float32).tiny
    labels = ids[:, 1:].reshape(-1)
    ce_w = response.to(torch.float32)
    terms = [
        ChunkTerm(
            lambda s, t, rows: -token_logprobs(s, labels[rows], ignore_index=None),
            (ce_w / ce_w.sum().clamp_min(tiny)).reshape(-1),
            lm_w,
            needs_teacher=False,
        )
    ]
    teacher_fn = None
    if spec is not None and make_per_token is not None:
        sdpo_spec = spec

        def at(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return x[rows // per_seq, rows % per_seq - sdpo_spec.first]

        def teacher_fn(rows: torch.Tensor) -> torch.Tensor:
            return head.project(at(sdpo_spec.teacher, rows), sdpo_spec.teacher_is_logits)

        sdpo_rows = torch.zeros(batch, per_seq, dtype=torch.float32, device=ids.device)
        sdpo_rows[:, spec.first :] = spec.weights / spec.weights.sum().clamp_min(tiny)
        terms.append(ChunkTerm(make_per_token(at), sdpo_rows.reshape(-1), sdpo_w, needs_teacher=True))
    total, values = chunked_fused_loss(
        hidden[:, :-1].reshape(batch * per_seq, hidden.shape[-1]),
        head.weight,
        terms,
        bias=head.bias,
        teacher_fn=teacher_fn,
        chunk_size=head.chunk_size,
    )
    sdpo = values[1] if len(values) > 1 else torch.zeros((), dtype=values[0].dtype, device=values[0].device)
    return total, values[0], sdpo


def _trace_replay_dpo(
    head: _Head,
    inputs: Mapping[str, Any],
    *,
    variant: str,
    beta: float,
    label_smoothing: float,
    simpo_beta: float,
    simpo_gamma: float,
) -> tuple[torch.Tensor, int]:
    why = "for the trace-replay DPO channel (active because 'dpo_chosen_input_ids' is present)"
    seq: dict[str, torch.Tensor] = {}
    lengths: dict[str, torch.Tensor] = {}
    pairs = None
    for side in ("chosen", "rejected"):
        ids = get_ids(inputs, f"dpo_{side}_input_ids", ("P", "T"), why)
        if pairs is None:
            pairs = ids.shape[0]
        elif ids.shape[0] != pairs:
            raise ValueError(f"inputs['dpo_rejected_input_ids'] must have P={pairs} rows like the chosen side")
        attn = get_mask(inputs, f"dpo_{side}_attention_mask", tuple(ids.shape), default=torch.ones_like(ids))
        resp = get_mask(inputs, f"dpo_{side}_response_mask", tuple(ids.shape), why=why)
        lp = head.token_logprobs(head.states(ids, attn)[:, :-1], ids[:, 1:])
        mask = resp[:, 1:]
        if variant == "simpo":
            seq[side] = avg_sequence_logprob(lp, mask)
        else:
            seq[side] = sequence_logprob(lp, mask)
            lengths[side] = mask.to(lp.dtype).sum(-1)
    assert pairs is not None
    if variant == "simpo":  # reference-free: dpo_*_ref_logprobs are ignored by design
        loss = simpo_loss(seq["chosen"], seq["rejected"], beta=simpo_beta, gamma=simpo_gamma)
        return loss, pairs
    ref_why = f"for dpo_variant={variant!r} (reference log-probs, summed over the response); SimPO needs none"
    ref_c = get_float(inputs, "dpo_chosen_ref_logprobs", (pairs,), ref_why)
    ref_r = get_float(inputs, "dpo_rejected_ref_logprobs", (pairs,), ref_why)
    loss = dpo_loss(
        seq["chosen"],
        seq["rejected"],
        ref_c.to(seq["chosen"].dtype),
        ref_r.to(seq["rejected"].dtype),
        beta=beta,
        loss_type=variant,  # type: ignore[arg-type]
        label_smoothing=label_smoothing,
        chosen_lengths=lengths["chosen"].clamp_min(1.0),
        rejected_lengths=lengths["rejected"].clamp_min(1.0),
    )
    return loss, pairs


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
        dpo_beta: DPO β. dpo_variant: TRL ``loss_type`` name (``sigmoid``, ``hinge``, ``ipo``, ``robust``,
            ``exo_pair``, ``nca_pair``, ``sigmoid_norm``) or ``"simpo"``.
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
        dpo_label_smoothing: ε for ``sigmoid`` (cDPO), ``robust`` and ``exo_pair``.
        taid_schedule: a :class:`crf_distill.TAIDSchedule` whose adaptive ``t`` is used instead of the linear
            one (the caller calls ``schedule.update(out.sdpo_jsd, step, total)`` once per optimizer step).
        chunk_size: run the lm_head fused and chunked over tokens (HF causal LMs with a Linear lm_head):
            lm_ce and sdpo_jsd share one pass (``crf_distill.chunked_fused_loss``), DPO uses
            ``chunked_token_logprobs``; peak memory holds one ``(chunk, V)`` block instead of ``(B, T, V)``
            logits. Gradients then flow through ``total`` only: ``lm_ce`` and ``sdpo_jsd`` are detached values.

    Raises:
        KeyError: a key a requested channel needs is missing (the message names it).
        ValueError/TypeError: bad shapes, dtypes or keyword combinations (the message names the fix).
    """
    lm_w = _weight("lm_ce_weight", lm_ce_weight)
    sdpo_w = _weight("sdpo_weight", sdpo_weight)
    dpo_w = _weight("dpo_weight", dpo_weight)
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
    t_min = _unit("taid_alpha_min", taid_alpha_min)
    t_max = _unit("taid_alpha_max", taid_alpha_max)
    if t_min > t_max:
        raise ValueError(f"`taid_alpha_min` ({t_min}) must not exceed `taid_alpha_max` ({t_max})")
    if sdpo_wrapper != "taid" and (taid_schedule_step is not None or taid_schedule is not None):
        raise ValueError("TAID schedule arguments were given but sdpo_wrapper is not 'taid'; set sdpo_wrapper='taid'")
    if sdpo_wrapper == "taid" and taid_schedule_step is None:
        raise ValueError(
            "sdpo_wrapper='taid' needs taid_schedule_step and taid_total_steps (the current and the total number "
            "of training steps) to place t on its schedule"
        )
    if entropy_opd_h_max is not None and sdpo_wrapper != "entropy_opd":
        raise ValueError("`entropy_opd_h_max` was given but sdpo_wrapper is not 'entropy_opd'; set it or drop h_max")
    if sdpo_wrapper == "entropy_opd" and entropy_opd_h_max is None:
        raise ValueError(
            "sdpo_wrapper='entropy_opd' needs `entropy_opd_h_max`, the teacher-entropy threshold in nats above "
            "which forward KL is added (a tunable; e.g. 1.0)"
        )
    alpha = _unit("sdpo_alpha", sdpo_alpha)

    if not isinstance(inputs, Mapping):
        raise TypeError(f"`inputs` must be a mapping of tensors, got {type(inputs).__name__}")
    ids = get_ids(inputs, "input_ids", ("B", "T"), "(the student sequences: prompt + completion)")
    if ids.shape[1] < 2:
        raise ValueError(
            f"inputs['input_ids'] must be (B, T) with T >= 2 to predict a next token, got T={ids.shape[1]}"
        )
    head = _Head(model, chunk_size)
    attention = get_mask(inputs, "attention_mask", tuple(ids.shape), default=torch.ones_like(ids))
    response = _response_weights(inputs, ids, attention)
    states = head.states(ids, attention)

    taid_t = None
    if sdpo_wrapper == "taid":
        taid_t = _taid_t(taid_schedule_step, taid_total_steps, t_min, t_max, taid_schedule)
    spec: _SDPOSpec | None = None
    make_per_token: PerTokenFactory | None = None
    if inputs.get("teacher_input_ids") is not None or inputs.get("teacher_logits") is not None:
        sdpo_spec = _sdpo_spec(
            head,
            states,
            inputs,
            ids,
            taid_active=taid_t is not None and taid_t < 1.0,
            is_clip=sdpo_is_clip,
        )
        spec = sdpo_spec

        def make_per_token(
            at: Callable[[torch.Tensor, Any], torch.Tensor],
        ) -> Callable[[torch.Tensor, Any, Any], torch.Tensor]:
            return _sdpo_per_token(
                head,
                sdpo_spec,
                at,
                wrapper=sdpo_wrapper,
                alpha=alpha,
                top_k=sdpo_top_k,
                is_clip=sdpo_is_clip,
                taid_t=taid_t,
                h_max=entropy_opd_h_max,
            )

    fused_total = None
    if head.fused:
        fused_total, lm_ce, sdpo = _fused_channels(head, states, ids, response, spec, make_per_token, lm_w, sdpo_w)
    else:
        lm_ce, sdpo = _unfused_channels(head, states, ids, response, spec, make_per_token)
    sdpo_tokens = 0 if spec is None else int((spec.weights != 0).sum())

    dpo, pairs = torch.zeros((), dtype=torch.float32, device=ids.device), 0
    if inputs.get("dpo_chosen_input_ids") is not None:
        dpo, pairs = _trace_replay_dpo(
            head,
            inputs,
            variant=dpo_variant,
            beta=dpo_beta,
            label_smoothing=dpo_label_smoothing,
            simpo_beta=simpo_beta,
            simpo_gamma=simpo_gamma,
        )

    if fused_total is None:
        total = lm_w * lm_ce + sdpo_w * sdpo + dpo_w * dpo
    else:  # lm_ce and sdpo_jsd are detached values; their gradient lives in fused_total
        total = fused_total + dpo_w * dpo
    return LossComponents(
        lm_ce=lm_ce,
        sdpo_jsd=sdpo,
        trace_replay_dpo=dpo,
        total=total,
        taid_t=taid_t,
        sdpo_tokens=sdpo_tokens,
        dpo_pairs=pairs,
    )
