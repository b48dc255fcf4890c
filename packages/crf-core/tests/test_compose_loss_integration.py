"""compose_loss on real (tiny) Hugging Face causal LMs: composition, channel semantics, TAID anchors, errors.

The lm_ce channel is next-token cross-entropy, not GRPO (seed failure mode 11): these tests assert gradient
flow and exact composition, never a GRPO property.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from typing import Any

import pytest
import torch

from crf_core import LossComponents, compose_loss
from crf_distill import (
    dpo_loss,
    entropy_opd_loss,
    generalized_jsd,
    sequence_logprob,
    simpo_loss,
    taid_target_logprobs,
    token_logprobs,
)

VOCAB, B, T, C, T_TEACHER, P = 96, 3, 10, 4, 12, 2

SEED_DEFAULTS: dict[str, Any] = {
    "lm_ce_weight": 1.0,
    "sdpo_weight": 1.0,
    "dpo_weight": 1.0,
    "dpo_beta": 0.1,
    "dpo_variant": "sigmoid",
    "simpo_beta": 2.0,
    "simpo_gamma": 1.0,
    "sdpo_wrapper": None,
    "taid_schedule_step": None,
    "taid_total_steps": None,
    "taid_alpha_min": 0.4,
    "taid_alpha_max": 1.0,
    "entropy_opd_h_max": None,
}


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[2, :2] = 0  # left-padded prompt
    completion = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    attention[:, T - C :] = completion
    teacher_prompt = torch.randint(0, VOCAB, (B, T_TEACHER - C), generator=g)
    chosen = torch.randint(0, VOCAB, (P, 8), generator=g)
    rejected = torch.randint(0, VOCAB, (P, 9), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "teacher_input_ids": torch.cat([teacher_prompt, ids[:, T - C :]], dim=1),
        "self_distillation_mask": torch.tensor([1, 1, 0]),
        "dpo_chosen_input_ids": chosen,
        "dpo_rejected_input_ids": rejected,
        "dpo_chosen_response_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 0]]),
        "dpo_rejected_response_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0, 0]]),
        "dpo_chosen_ref_logprobs": torch.tensor([-22.0, -25.0]),
        "dpo_rejected_ref_logprobs": torch.tensor([-27.0, -12.0]),
    }


def completion_logits(model: Any, ids: torch.Tensor, attention: torch.Tensor | None = None) -> torch.Tensor:
    """Logits that score the last C tokens of ``ids``."""
    logits = model(input_ids=ids, attention_mask=attention).logits
    return logits[:, ids.shape[1] - C - 1 : ids.shape[1] - 1]


def sdpo_weights(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["completion_mask"].float() * inputs["self_distillation_mask"].float()[:, None]


def legacy_channels(model: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-wave-13 3-channel composition in plain PyTorch (no crf_distill): token-mean CE, full-vocabulary
    JSD(α=0.5) with the explicit mixture, sigmoid DPO on summed response log-probs."""
    ids, attention = inputs["input_ids"], inputs["attention_mask"]
    logits = model(input_ids=ids, attention_mask=attention).logits
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    lp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    m = attention[:, 1:].double()
    lm_ce = -((lp * m).sum() / m.sum())
    with torch.no_grad():
        teacher = completion_logits(model, inputs["teacher_input_ids"]).double()
    p = torch.softmax(logits[:, T - C - 1 : T - 1].double(), dim=-1)
    q = torch.softmax(teacher, dim=-1)
    mix = 0.5 * p + 0.5 * q
    jsd = 0.5 * (q * (q.log() - mix.log())).sum(-1) + 0.5 * (p * (p.log() - mix.log())).sum(-1)
    w = sdpo_weights(inputs).double()
    sdpo = (jsd * w).sum() / w.sum()
    seq = {}
    for side in ("chosen", "rejected"):
        x = inputs[f"dpo_{side}_input_ids"]
        side_logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].double(), dim=-1)
        side_lp = side_logp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
        seq[side] = (side_lp * inputs[f"dpo_{side}_response_mask"][:, 1:].double()).sum(-1)
    margin = (seq["chosen"] - inputs["dpo_chosen_ref_logprobs"]) - (
        seq["rejected"] - inputs["dpo_rejected_ref_logprobs"]
    )
    dpo = -torch.nn.functional.logsigmoid(0.1 * margin).mean()
    return lm_ce, sdpo, dpo


def params_with_grad(model: Any, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True))


# --------------------------------------------------------------------------- seed-named tests


def test_defaults_bit_exact_with_legacy_kwargs(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    plain = compose_loss(tiny_causal_lm, inputs)
    explicit = compose_loss(tiny_causal_lm, inputs, **SEED_DEFAULTS)
    assert len(SEED_DEFAULTS) == 13
    for name in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"):
        assert torch.equal(getattr(plain, name), getattr(explicit, name)), name
    assert torch.equal(plain.total, plain.lm_ce + plain.sdpo_jsd + plain.trace_replay_dpo)
    # the legacy composition, recomputed independently in float64: equal up to float32 rounding
    lm_ce, sdpo, dpo = legacy_channels(tiny_causal_lm, inputs)
    for got, want in ((plain.lm_ce, lm_ce), (plain.sdpo_jsd, sdpo), (plain.trace_replay_dpo, dpo)):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7), (got, want)
    assert torch.allclose(plain.total.double(), lm_ce + sdpo + dpo, rtol=1e-5, atol=1e-7)
    assert all(x.item() > 0 for x in (lm_ce, sdpo, dpo))


def test_simpo_does_not_require_ref_logprobs(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    no_ref = {k: v for k, v in inputs.items() if "ref_logprobs" not in k}
    out = compose_loss(tiny_causal_lm, no_ref, dpo_variant="simpo", simpo_beta=2.5, simpo_gamma=0.5)
    # supplying the reference keys changes nothing: SimPO ignores them
    with_ref = compose_loss(tiny_causal_lm, inputs, dpo_variant="simpo", simpo_beta=2.5, simpo_gamma=0.5)
    assert torch.equal(out.trace_replay_dpo, with_ref.trace_replay_dpo)
    avg = {}
    for side in ("chosen", "rejected"):
        x, m = inputs[f"dpo_{side}_input_ids"], inputs[f"dpo_{side}_response_mask"][:, 1:].float()
        lp = token_logprobs(tiny_causal_lm(input_ids=x).logits[:, :-1], x[:, 1:])
        avg[side] = (lp * m).sum(-1) / m.sum(-1)
    assert torch.allclose(out.trace_replay_dpo, simpo_loss(avg["chosen"], avg["rejected"], beta=2.5, gamma=0.5))
    with pytest.raises(KeyError, match="dpo_chosen_ref_logprobs"):
        compose_loss(tiny_causal_lm, no_ref)


def test_taid_alpha_one_recovers_sdpo(tiny_causal_lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import crf_core.channels.sdpo as sdpo_module

    targets: list[float] = []
    original = sdpo_module.taid_target_logprobs

    def spy(student: torch.Tensor, teacher: torch.Tensor, t: float, **kwargs: Any) -> torch.Tensor:
        targets.append(t)
        return original(student, teacher, t, **kwargs)

    monkeypatch.setattr(sdpo_module, "taid_target_logprobs", spy)
    inputs = make_inputs()
    plain = compose_loss(tiny_causal_lm, inputs)
    assert not targets
    # pure teacher target: t = 1 at every step, init logits (present here) are ignored
    inputs["student_init_logits"] = torch.randn(B, T, VOCAB)
    for step in (0, 5, 10):
        taid = compose_loss(
            tiny_causal_lm,
            inputs,
            sdpo_wrapper="taid",
            taid_schedule_step=step,
            taid_total_steps=10,
            taid_alpha_min=1.0,
            taid_alpha_max=1.0,
        )
        assert taid.taid_t == 1.0
        assert targets  # the TAID target was built, not bypassed
        assert set(targets) == {1.0}
        targets.clear()
        assert torch.allclose(taid.sdpo_jsd, plain.sdpo_jsd, rtol=1e-6, atol=1e-9)
        ga = params_with_grad(tiny_causal_lm, taid.sdpo_jsd)
        gb = params_with_grad(tiny_causal_lm, plain.sdpo_jsd)
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(ga, gb, strict=True) if a is not None)
    below_one = compose_loss(tiny_causal_lm, inputs, sdpo_wrapper="taid", taid_schedule_step=0, taid_total_steps=10)
    assert not torch.allclose(below_one.sdpo_jsd, plain.sdpo_jsd)


def test_taid_requires_schedule_step(tiny_causal_lm: Any) -> None:
    with pytest.raises(ValueError, match="`taid_schedule_step` is missing"):
        compose_loss(tiny_causal_lm, make_inputs(), sdpo_wrapper="taid", taid_total_steps=100)
    with pytest.raises(ValueError, match="taid_schedule_step and taid_total_steps"):
        compose_loss(tiny_causal_lm, make_inputs(), sdpo_wrapper="taid")


def test_taid_requires_total_steps(tiny_causal_lm: Any) -> None:
    with pytest.raises(ValueError, match="`taid_total_steps` is missing"):
        compose_loss(tiny_causal_lm, make_inputs(), sdpo_wrapper="taid", taid_schedule_step=3)


def test_taid_accepts_precomputed_student_init_logits(make_tiny_causal_lm: Any) -> None:
    model = make_tiny_causal_lm(seed=0)
    init_model = make_tiny_causal_lm(seed=1)  # stands in for the step-0 snapshot of a drifted run
    inputs = make_inputs()
    with torch.no_grad():
        init_logits = init_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    inputs["student_init_logits"] = init_logits
    kwargs = {"sdpo_wrapper": "taid", "taid_schedule_step": 2, "taid_total_steps": 10}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the precomputed path never warns
        out = compose_loss(model, inputs, **kwargs)
    t = 0.4 + 0.6 * 2 / 10
    assert out.taid_t == pytest.approx(t)
    student = completion_logits(model, inputs["input_ids"], inputs["attention_mask"])
    with torch.no_grad():
        teacher = completion_logits(model, inputs["teacher_input_ids"])
    target = taid_target_logprobs(student, teacher, t, anchor_logits=init_logits[:, T - C - 1 : T - 1])
    expected = generalized_jsd(student, target, sdpo_weights(inputs), alpha=0.5)
    assert torch.allclose(out.sdpo_jsd, expected, atol=1e-7)
    without_anchor = compose_loss(model, {k: v for k, v in inputs.items() if k != "student_init_logits"}, **kwargs)
    assert not torch.allclose(out.sdpo_jsd, without_anchor.sdpo_jsd)


# --------------------------------------------------------------------------- further contract tests


def test_taid_student_init_input_ids_uses_live_model_and_warns(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    kwargs = {"sdpo_wrapper": "taid", "taid_schedule_step": 0, "taid_total_steps": 10}
    with pytest.warns(UserWarning, match="only before the first optimizer step"):
        out = compose_loss(tiny_causal_lm, {**inputs, "student_init_input_ids": inputs["input_ids"]}, **kwargs)
    # at step 0 the live model *is* the init model, so this equals the precomputed-logits path
    with torch.no_grad():
        init_logits = tiny_causal_lm(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    precomputed = compose_loss(tiny_causal_lm, {**inputs, "student_init_logits": init_logits}, **kwargs)
    assert torch.allclose(out.sdpo_jsd, precomputed.sdpo_jsd, atol=1e-7)


def test_taid_without_anchor_is_the_paper_current_student(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    out = compose_loss(tiny_causal_lm, inputs, sdpo_wrapper="taid", taid_schedule_step=5, taid_total_steps=10)
    student = completion_logits(tiny_causal_lm, inputs["input_ids"], inputs["attention_mask"])
    with torch.no_grad():
        teacher = completion_logits(tiny_causal_lm, inputs["teacher_input_ids"])
    target = taid_target_logprobs(student, teacher, 0.7)
    assert torch.allclose(out.sdpo_jsd, generalized_jsd(student, target, sdpo_weights(inputs)), atol=1e-7)


def test_gradients_flow_through_every_channel(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    out = compose_loss(tiny_causal_lm, inputs)
    assert isinstance(out, LossComponents)
    for name in ("lm_ce", "sdpo_jsd", "trace_replay_dpo"):
        grads = params_with_grad(tiny_causal_lm, getattr(out, name))
        assert any(g is not None and bool((g != 0).any()) for g in grads), name
        assert all(g is None or bool(torch.isfinite(g).all()) for g in grads), name


def test_channel_weights_and_absent_channels(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    out = compose_loss(tiny_causal_lm, inputs, lm_ce_weight=0.5, sdpo_weight=3.0, dpo_weight=0.0)
    assert torch.allclose(out.total, 0.5 * out.lm_ce + 3.0 * out.sdpo_jsd)
    only_lm = compose_loss(tiny_causal_lm, {"input_ids": inputs["input_ids"]})
    assert only_lm.sdpo_jsd.item() == 0.0
    assert only_lm.trace_replay_dpo.item() == 0.0
    assert torch.equal(only_lm.total, only_lm.lm_ce)
    no_signal = compose_loss(tiny_causal_lm, {**inputs, "self_distillation_mask": torch.zeros(B)})
    assert no_signal.sdpo_jsd.item() == 0.0
    assert no_signal.sdpo_tokens == 0


def test_lm_ce_equals_hugging_face_causal_lm_loss(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    hf = tiny_causal_lm(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels).loss
    out = compose_loss(tiny_causal_lm, inputs)
    assert torch.allclose(out.lm_ce, hf, atol=1e-6)


@pytest.mark.parametrize("variant", ["sigmoid", "hinge", "ipo", "robust", "bco_pair", "aot", "discopop", "sft"])
def test_dpo_variants_match_crf_distill(tiny_causal_lm: Any, variant: str) -> None:
    inputs = make_inputs()
    out = compose_loss(tiny_causal_lm, inputs, dpo_variant=variant, dpo_beta=0.2, dpo_label_smoothing=0.1)  # type: ignore[arg-type]
    seq, lengths = {}, {}
    for side in ("chosen", "rejected"):
        x, m = inputs[f"dpo_{side}_input_ids"], inputs[f"dpo_{side}_response_mask"][:, 1:]
        seq[side] = sequence_logprob(token_logprobs(tiny_causal_lm(input_ids=x).logits[:, :-1], x[:, 1:]), m)
        lengths[side] = m.sum(-1).float()
    expected = dpo_loss(
        seq["chosen"],
        seq["rejected"],
        inputs["dpo_chosen_ref_logprobs"],
        inputs["dpo_rejected_ref_logprobs"],
        beta=0.2,
        loss_type=variant,  # type: ignore[arg-type]
        label_smoothing=0.1,
        chosen_lengths=lengths["chosen"],
        rejected_lengths=lengths["rejected"],
    )
    assert torch.allclose(out.trace_replay_dpo, expected, atol=1e-6)


def test_entropy_opd_wrapper(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    out = compose_loss(tiny_causal_lm, inputs, sdpo_wrapper="entropy_opd", entropy_opd_h_max=4.0)
    student = completion_logits(tiny_causal_lm, inputs["input_ids"], inputs["attention_mask"])
    with torch.no_grad():
        teacher = completion_logits(tiny_causal_lm, inputs["teacher_input_ids"])
    assert torch.allclose(out.sdpo_jsd, entropy_opd_loss(student, teacher, sdpo_weights(inputs), h_max=4.0), atol=1e-7)
    with pytest.raises(ValueError, match="entropy_opd_h_max"):
        compose_loss(tiny_causal_lm, inputs, sdpo_wrapper="entropy_opd")


def test_precomputed_teacher_logits_equal_teacher_forward(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    with torch.no_grad():
        teacher = completion_logits(tiny_causal_lm, inputs["teacher_input_ids"])
    by_ids = compose_loss(tiny_causal_lm, inputs, sdpo_top_k=7, sdpo_alpha=1.0)
    by_logits = compose_loss(
        tiny_causal_lm,
        {k: v for k, v in inputs.items() if k != "teacher_input_ids"} | {"teacher_logits": teacher},
        sdpo_top_k=7,
        sdpo_alpha=1.0,
    )
    assert torch.allclose(by_ids.sdpo_jsd, by_logits.sdpo_jsd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"sdpo_wrapper": "taid", "taid_schedule_step": 3, "taid_total_steps": 10},
        {"sdpo_wrapper": "entropy_opd", "entropy_opd_h_max": 4.0, "sdpo_top_k": 9},
        {"dpo_variant": "simpo", "sdpo_is_clip": 1.5, "sdpo_top_k": 5},
    ],
)
def test_chunked_fused_path_matches_unfused(tiny_causal_lm: Any, kwargs: dict[str, Any]) -> None:
    inputs = make_inputs()
    if kwargs.get("sdpo_is_clip"):
        inputs["old_per_token_logps"] = -torch.rand(B, C) * 6
    unfused = compose_loss(tiny_causal_lm, inputs, **kwargs)
    fused = compose_loss(tiny_causal_lm, inputs, chunk_size=5, **kwargs)
    for name in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"):
        assert torch.allclose(getattr(fused, name), getattr(unfused, name), atol=1e-6), name
    for a, b in zip(
        params_with_grad(tiny_causal_lm, fused.total), params_with_grad(tiny_causal_lm, unfused.total), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6)


def test_taid_schedule_object_drives_t(tiny_causal_lm: Any) -> None:
    from crf_distill import TAIDSchedule

    schedule = TAIDSchedule(t_start=0.4, t_end=1.0, alpha=0.5)
    inputs = make_inputs()
    model = copy.deepcopy(tiny_causal_lm)
    seen = []
    for step in range(3):
        out = compose_loss(
            model, inputs, sdpo_wrapper="taid", taid_schedule_step=step, taid_total_steps=100, taid_schedule=schedule
        )
        seen.append(out.taid_t)
        schedule.update(out.sdpo_jsd * (3 - step), step, 100)  # a falling loss pushes t up adaptively
    assert seen[0] == seen[1] == 0.4  # the first update only records the loss (TAID Alg. 1)
    assert seen[2] > 0.4 + 0.6 * 2 / 100 + 0.1  # well above the linear floor: the adaptive step acted
    with pytest.raises(ValueError, match="same bounds"):
        compose_loss(
            model,
            inputs,
            sdpo_wrapper="taid",
            taid_schedule_step=0,
            taid_total_steps=9,
            taid_alpha_min=0.2,
            taid_schedule=schedule,
        )


def test_errors_name_the_key_shape_and_fix(tiny_causal_lm: Any) -> None:
    inputs = make_inputs()
    m = tiny_causal_lm
    with pytest.raises(KeyError, match="input_ids"):
        compose_loss(m, {})
    with pytest.raises(TypeError, match=r"inputs\['input_ids'\] must hold integer token ids"):
        compose_loss(m, {"input_ids": inputs["input_ids"].float()})
    with pytest.raises(KeyError, match="completion_mask"):
        compose_loss(m, {k: v for k, v in inputs.items() if k != "completion_mask"})
    with pytest.raises(ValueError, match=r"inputs\['attention_mask'\] must have shape"):
        compose_loss(m, {**inputs, "attention_mask": inputs["attention_mask"][:, 1:]})
    with pytest.raises(ValueError, match="must end with the same C completion tokens"):
        compose_loss(m, {**inputs, "teacher_input_ids": inputs["teacher_input_ids"].flip(1)})
    with pytest.raises(ValueError, match=r"dpo_chosen_ref_logprobs'\] must have shape \(2,\)"):
        compose_loss(m, {**inputs, "dpo_chosen_ref_logprobs": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"student_init_logits'\] must have shape \(3, 10, 'V'\)"):
        compose_loss(
            m,
            {**inputs, "student_init_logits": torch.zeros(B, C, VOCAB)},
            sdpo_wrapper="taid",
            taid_schedule_step=0,
            taid_total_steps=4,
        )
    with pytest.raises(ValueError, match="sdpo_wrapper is not 'entropy_opd'"):
        compose_loss(m, inputs, entropy_opd_h_max=1.0)
    with pytest.raises(ValueError, match="sdpo_wrapper is not 'taid'"):
        compose_loss(m, inputs, taid_schedule_step=1, taid_total_steps=2)
    with pytest.raises(ValueError, match="dpo_variant"):
        compose_loss(m, inputs, dpo_variant="kto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sdpo_weight"):
        compose_loss(m, inputs, sdpo_weight=-1.0)
    with pytest.raises(ValueError, match="must not exceed"):
        compose_loss(m, inputs, taid_alpha_min=0.9, taid_alpha_max=0.5)


def test_docstring_lists_every_inputs_key() -> None:
    doc = inspect.getdoc(compose_loss) or ""
    source = inspect.getsource(inspect.getmodule(compose_loss))  # type: ignore[arg-type]
    used = set(re.findall(r"\(inputs, \"([a-z_]+)\"", source))
    used |= set(re.findall(r"inputs(?:\.get\(|\[)\"([a-z_]+)\"", source))
    used |= {
        f"dpo_{side}_{suffix}"
        for side in ("chosen", "rejected")
        for suffix in ("input_ids", "attention_mask", "response_mask")
    }
    assert {"input_ids", "completion_mask", "teacher_input_ids", "student_init_logits"} <= used
    missing = sorted(k for k in used if k not in doc)
    assert not missing, missing


@pytest.mark.parametrize("anchor_key", ["student_init_logits", "student_init_input_ids"])
def test_chunked_taid_anchors_match_unfused(tiny_causal_lm: Any, anchor_key: str) -> None:
    inputs = make_inputs()
    if anchor_key == "student_init_logits":
        inputs[anchor_key] = torch.randn(B, T, VOCAB, generator=torch.Generator().manual_seed(3))
    else:
        inputs[anchor_key] = inputs["input_ids"]
    kwargs = {"sdpo_wrapper": "taid", "taid_schedule_step": 1, "taid_total_steps": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        unfused = compose_loss(tiny_causal_lm, inputs, **kwargs)
        fused = compose_loss(tiny_causal_lm, inputs, chunk_size=4, **kwargs)
    assert torch.allclose(fused.sdpo_jsd, unfused.sdpo_jsd, atol=1e-6)
    assert torch.allclose(fused.total, unfused.total, atol=1e-6)
    # every part keeps its own gradient on the chunked path, equal to the unchunked one
    for name in ("lm_ce", "sdpo_jsd", "trace_replay_dpo"):
        part, ref = getattr(fused, name), getattr(unfused, name)
        assert part.requires_grad, name
        for a, b in zip(params_with_grad(tiny_causal_lm, part), params_with_grad(tiny_causal_lm, ref), strict=True):
            assert (a is None) == (b is None)
            assert a is None or torch.allclose(a, b, atol=1e-6), name


def test_chunked_path_rejects_models_it_cannot_fuse(tiny_causal_lm: Any) -> None:
    class Wrapped(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs: Any) -> Any:
            return self.inner(**kwargs)

    inputs = make_inputs()
    out = compose_loss(Wrapped(tiny_causal_lm), inputs)  # any module returning logits works unfused
    assert torch.equal(out.total, compose_loss(tiny_causal_lm, inputs).total)
    with pytest.raises(ValueError, match="chunk_size=None"):
        compose_loss(Wrapped(tiny_causal_lm), inputs, chunk_size=8)
    with pytest.raises(ValueError, match="chunk_size"):
        compose_loss(tiny_causal_lm, inputs, chunk_size=0)


def _other_architecture(name: str) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":  # tied input/output embeddings, learned positions
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_hugging_face_architectures(arch: str) -> None:
    """Each channel, value and parameter gradients, against the independent float64 composition on GPT-2 (tied
    embeddings) and Qwen2; then the chunked top-k path against the unfused one, channel by channel."""
    model = _other_architecture(arch)
    inputs = make_inputs()
    plain = compose_loss(model, inputs)
    names = ("lm_ce", "sdpo_jsd", "trace_replay_dpo")
    for name, want in zip(names, legacy_channels(model, inputs), strict=True):
        got = getattr(plain, name)
        assert want.item() > 0, name
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        for a, b in zip(params_with_grad(model, got), params_with_grad(model, want), strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    out = compose_loss(model, inputs, sdpo_top_k=10)
    fused = compose_loss(model, inputs, sdpo_top_k=10, chunk_size=7)
    for name in (*names, "total"):
        a_value, b_value = getattr(fused, name), getattr(out, name)
        assert torch.isfinite(b_value), name
        torch.testing.assert_close(a_value, b_value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for a, b in zip(params_with_grad(model, a_value), params_with_grad(model, b_value), strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
