"""crf_primerl.composer_loss: PRIME-RL's default DPPO + KL, the composer channels, and validation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import Tensor

from crf_primerl.composer_loss import LOSS_KWARGS, LossInputs, LossOutputs, loss_fn

UPSTREAM_METRICS = {
    "masked_mismatch_kl",
    "unmasked_mismatch_kl",
    "is_masked",
    "is_masked_low",
    "is_masked_high",
    "masked_advantage_positive",
    "masked_advantage_negative",
}


def reference_loss(
    lp: Tensor,
    lp_mu: Tensor,
    adv: Tensor,
    mask: Tensor,
    teacher: Tensor | None = None,
    weights: Tensor | None = None,
    *,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    teacher_tau: float = 0.0,
    teacher_weight: float = 0.0,
    teacher_mask_low: float = 0.2,
    ce_weight: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Independent plain-PyTorch transcription of the documented formula (not of the implementation).

    ℓ_t = w_t·[−keep_t·A'_t·r_t + kl_tau·m_t·(lp_t−lp_μ,t)² − teacher_weight·keepT_t·sg(lp_T,t−lp_t)·r_t
               − ce_weight·m_t·lp_t],   A' = adv_tau·A + teacher_tau·sg(lp_T − lp),
    keep = m ∧ ¬(A>0 ? p−p_μ > high : p−p_μ < −low),   keepT = m ∧ ¬(p−p_μ < −teacher_mask_low).
    """
    m = mask.to(lp.dtype)
    p, p_mu = lp.exp(), lp_mu.exp()
    ratio = (lp - lp_mu).exp()
    up_too_far = (p - p_mu) > dppo_mask_high
    down_too_far = (p - p_mu) < -dppo_mask_low
    dropped = (adv > 0) & up_too_far | (adv <= 0) & down_too_far
    keep = m * (~dropped).to(lp.dtype)
    a = adv_tau * adv
    if teacher is not None:
        a = a + teacher_tau * (teacher - lp).detach()
    per_token = -(keep * a * ratio) + kl_tau * m * (lp - lp_mu) ** 2
    if teacher is not None and teacher_weight > 0:
        keep_t = m * ((p - p_mu) >= -teacher_mask_low).to(lp.dtype)
        per_token = per_token - teacher_weight * keep_t * (teacher - lp).detach() * ratio
    if ce_weight > 0:
        per_token = per_token - ce_weight * m * lp
    if weights is not None:
        per_token = per_token * weights
    loss = per_token.sum()

    def mean_over(values: Tensor, where: Tensor) -> Tensor:
        n = int(where.sum())
        return values.detach()[where].double().sum() / n if n else torch.zeros((), dtype=torch.float64)

    k3 = (ratio - (lp - lp_mu) - 1).detach()
    drop = mask & dropped
    metrics = {
        "masked_mismatch_kl": mean_over(k3, drop),
        "unmasked_mismatch_kl": mean_over(k3, mask & ~dropped),
        "is_masked": mean_over(dropped, mask),
        "is_masked_low": mean_over((adv < 0) & down_too_far, mask),
        "is_masked_high": mean_over((adv > 0) & up_too_far, mask),
        "masked_advantage_positive": mean_over(adv > 0, drop),
        "masked_advantage_negative": mean_over(adv < 0, drop),
    }
    if teacher is not None:
        metrics["teacher_kl"] = mean_over(teacher - lp, mask)
    if teacher is not None and teacher_weight > 0:
        metrics["composer/teacher_is_masked"] = mean_over((p - p_mu) < -teacher_mask_low, mask)
    if ce_weight > 0:
        metrics["composer/nll"] = mean_over(-lp, mask)
    return loss, metrics


def _reference_for(sample: dict[str, Tensor], **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """`reference_loss` on the fields of a ``make_sample`` sample (teacher and weights when it has them)."""
    return reference_loss(
        sample["trainer_logprobs"],
        sample["inference_logprobs"],
        sample["advantages"],
        sample["loss_mask"],
        sample.get("teacher_logprobs"),
        sample.get("loss_weights"),
        **kwargs,
    )


def _inputs(sample: dict[str, Tensor]) -> LossInputs:
    return LossInputs(**sample)


def _grad(loss: Tensor, leaf: Tensor) -> Tensor:
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def _token(lp_theta: float, lp_mu: float, adv: float) -> dict[str, Tensor]:
    """A sample whose last token has the given log-probs and advantage, after a masked prompt token."""
    return {
        "trainer_logprobs": torch.tensor([-1.0, lp_theta], dtype=torch.float64, requires_grad=True),
        "inference_logprobs": torch.tensor([-1.0, lp_mu], dtype=torch.float64),
        "advantages": torch.tensor([adv, adv], dtype=torch.float64),
        "loss_mask": torch.tensor([False, True]),
    }


# --- the seed's tests -------------------------------------------------------------------------


def test_returns_finite_scalar(make_sample: Any) -> None:
    sample = make_sample(seq=300, dtype=torch.float32)
    out = loss_fn(_inputs(sample))
    assert isinstance(out, LossOutputs)
    assert out.loss.dim() == 0
    assert torch.isfinite(out.loss)
    assert out.loss.requires_grad
    assert set(out.metrics) == UPSTREAM_METRICS
    assert all(v.dim() == 0 and torch.isfinite(v) and not v.requires_grad for v in out.metrics.values())
    grad = _grad(out.loss, sample["trainer_logprobs"])
    assert torch.isfinite(grad).all()
    assert grad[sample["loss_mask"]].abs().sum() > 0
    assert torch.all(grad[~sample["loss_mask"]] == 0)  # prompt tokens get no gradient


def _assert_dropped_outlier(p: float, p_old: float, adv: float, metrics: dict[str, float]) -> None:
    """Dropped from the policy gradient, the token still pays the KL: loss kl_tau·log_r², gradient 2·kl_tau·log_r."""
    kl_tau = 1e-3
    sample = _token(math.log(p), math.log(p_old), adv=adv)
    out = loss_fn(_inputs(sample), kl_tau=kl_tau)
    log_r = math.log(p / p_old)
    assert out.loss.item() == pytest.approx(kl_tau * log_r**2, rel=1e-12)
    assert _grad(out.loss, sample["trainer_logprobs"])[1].item() == pytest.approx(2 * kl_tau * log_r, rel=1e-12)
    assert {name: out.metrics[name].item() for name in metrics} == metrics


def _assert_kept_in_band(p: float, p_old: float, adv: float, kl_tau: float) -> None:
    """Kept: loss −A·r + kl_tau·log_r², gradient w.r.t. lp −A·r + 2·kl_tau·log_r, nothing masked."""
    sample = _token(math.log(p), math.log(p_old), adv=adv)
    kept = loss_fn(_inputs(sample), kl_tau=kl_tau)
    r = p / p_old
    assert kept.loss.item() == pytest.approx(-adv * r + kl_tau * math.log(r) ** 2, rel=1e-12)
    grad = _grad(kept.loss, sample["trainer_logprobs"])[1].item()
    assert grad == pytest.approx(-adv * r + 2 * kl_tau * math.log(r), rel=1e-12)
    assert kept.metrics["is_masked"].item() == 0.0


def test_dppo_mask_high_drops_positive_advantage_outliers() -> None:
    # p rose 0.30 → 0.60 (Δp = +0.3 > 0.2) with A > 0: dropped; 0.30 → 0.45 (Δp = 0.15) stays.
    _assert_dropped_outlier(0.6, 0.3, 1.5, {"is_masked_high": 1.0, "is_masked_low": 0.0})
    _assert_kept_in_band(0.45, 0.3, 1.5, kl_tau=1e-3)


def test_dppo_mask_low_drops_negative_advantage_outliers() -> None:
    # p fell 0.70 → 0.40 (Δp = −0.3 < −0.2) with A < 0: dropped; 0.70 → 0.60 (Δp = −0.1) stays.
    _assert_dropped_outlier(0.4, 0.7, -2.0, {"is_masked_low": 1.0, "masked_advantage_negative": 1.0})
    _assert_kept_in_band(0.6, 0.7, -2.0, kl_tau=0.0)


def test_dppo_mask_sign_conditioned_on_advantage() -> None:
    # A > 0 with a large probability *drop*: PRIME-RL only checks the upper bound there → kept.
    pos = _token(math.log(0.1), math.log(0.9), adv=1.0)
    out = loss_fn(_inputs(pos), kl_tau=0.0)
    assert out.metrics["is_masked"].item() == 0.0
    assert out.loss.item() == pytest.approx(-1.0 * 0.1 / 0.9, rel=1e-12)
    # A < 0 with a large probability *rise*: only the lower bound applies → kept.
    neg = _token(math.log(0.9), math.log(0.1), adv=-1.0)
    assert loss_fn(_inputs(neg), kl_tau=0.0).metrics["is_masked"].item() == 0.0
    # A == 0 falls in the "low" branch, like upstream: a drop beyond the bound is masked.
    zero = _token(math.log(0.1), math.log(0.9), adv=0.0)
    assert loss_fn(_inputs(zero)).metrics["is_masked"].item() == 1.0


def test_dppo_bounds_can_be_disabled(make_sample: Any) -> None:
    sample = make_sample(seq=400, spread=0.6, seed=3)
    masked = loss_fn(_inputs(sample))
    assert masked.metrics["is_masked"].item() > 0.2  # the default bounds bind on these inputs
    wide = loss_fn(_inputs(sample), dppo_mask_low=1e6, dppo_mask_high=1e6)
    assert wide.metrics["is_masked"].item() == 0.0
    lp, lp_mu, adv, m = (sample[k] for k in ("trainer_logprobs", "inference_logprobs", "advantages", "loss_mask"))
    m = m.double()
    no_mask = (-(m * adv * (lp - lp_mu).exp()) + 1e-3 * m * (lp - lp_mu) ** 2).sum()
    torch.testing.assert_close(wide.loss, no_mask, rtol=1e-12, atol=1e-12)
    inf = loss_fn(_inputs(sample), dppo_mask_low=math.inf, dppo_mask_high=math.inf)
    torch.testing.assert_close(inf.loss, wide.loss, rtol=0, atol=0)


def test_advantages_shape_validates_seq_accepted(make_sample: Any) -> None:
    """PRIME-RL's per-sample contract: every field ``(seq,)`` in, a 0-d per-sample sum out, the gradient
    ``(seq,)`` on ``trainer_logprobs`` only, equal to the formula reference for the same sample."""
    sample = make_sample(seq=64)
    for name in ("trainer_logprobs", "inference_logprobs", "advantages", "loss_mask"):
        assert sample[name].shape == (64,), name
    out = loss_fn(_inputs(sample))
    assert out.loss.shape == ()
    assert out.loss.dtype == sample["trainer_logprobs"].dtype
    want, want_metrics = _reference_for(sample)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    grad = _grad(out.loss, sample["trainer_logprobs"])
    assert grad.shape == (64,)
    torch.testing.assert_close(grad, _grad(_reference_for(sample)[0], sample["trainer_logprobs"]))
    assert set(out.metrics) == set(want_metrics)
    for name, value in out.metrics.items():
        assert value.shape == (), name


def test_advantages_shape_validates_bt_rejected(make_sample: Any) -> None:
    sample = make_sample(seq=64)
    sample["advantages"] = sample["advantages"].reshape(4, 16)
    with pytest.raises(ValueError, match=r"expected \(seq,\) shape, got \(B, T\) = \(4, 16\) for advantages") as err:
        loss_fn(_inputs(sample))
    message = str(err.value)
    assert "once per sample" in message
    assert "batch.advantages[b]" in message
    # All fields batched, as a TRL-style runner would pass them: the first one is named.
    batched = {k: v.detach().reshape(4, 16) for k, v in make_sample(seq=64).items()}
    with pytest.raises(ValueError, match=r"got \(B, T\) = \(4, 16\) for trainer_logprobs"):
        loss_fn(_inputs(batched))


def test_parity_with_prime_rl_default_loss_fn(prime_rl_loss: Any, make_sample: Any) -> None:
    """PRIME-RL's own ``default_loss_fn``, reached through its real ``CustomLossConfig`` loader, equals ours."""
    from prime_rl.configs.trainer import CustomLossConfig, DefaultLossConfig

    upstream = prime_rl_loss
    fields = {f.name for f in dataclasses.fields(upstream.LossInputs)}
    teacher_field = "teacher_logprobs" if "teacher_logprobs" in fields else "ref_logprobs"
    has_teacher_tau = "teacher_tau" in DefaultLossConfig.model_fields
    setup = getattr(upstream, "setup_rl_loss_fn", None) or upstream.setup_loss_fn
    configs: list[dict[str, float]] = [
        {},
        {"dppo_mask_low": 0.05, "dppo_mask_high": 0.3, "adv_tau": 0.7, "kl_tau": 0.02},
        {"dppo_mask_low": 1e6, "dppo_mask_high": 1e6},
        {"dppo_mask_low": 0.0, "dppo_mask_high": 0.0},
    ]
    if has_teacher_tau:
        configs.append({"teacher_tau": 0.5, "kl_tau": 0.01})
    checked = 0
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        for i, config in enumerate(configs):
            for teacher in (False, True):
                if config.get("teacher_tau") and not teacher:
                    continue
                with_weights = "loss_weights" in fields
                sample = make_sample(seq=513, dtype=dtype, seed=10 * i + teacher, teacher=teacher, weights=with_weights)
                theirs_in = {k: v for k, v in sample.items() if k != "teacher_logprobs"}
                theirs_in[teacher_field] = sample.get("teacher_logprobs")
                theirs_fn = setup(DefaultLossConfig(**config))
                ours_fn = setup(CustomLossConfig(import_path="crf_primerl.composer_loss.loss_fn", kwargs=config))
                theirs = theirs_fn(upstream.LossInputs(**theirs_in))
                ours = ours_fn(upstream.LossInputs(**theirs_in))
                torch.testing.assert_close(ours.loss, theirs.loss, rtol=tol, atol=tol)
                lp = sample["trainer_logprobs"]
                torch.testing.assert_close(_grad(ours.loss, lp), _grad(theirs.loss, lp), rtol=tol, atol=tol)
                assert set(theirs.metrics) <= set(ours.metrics)
                for key, value in theirs.metrics.items():
                    torch.testing.assert_close(ours.metrics[key], value.detach(), rtol=tol, atol=tol)
                checked += 1
    assert checked >= 16


# --- parity with the independent reference ---------------------------------------------------

SHADOW_CONFIGS: list[dict[str, Any]] = [
    {},
    {"dppo_mask_low": 0.05, "dppo_mask_high": 0.35, "adv_tau": 0.5, "kl_tau": 0.05},
    {"teacher": True},
    {"teacher": True, "teacher_tau": 0.7},
    {"teacher": True, "teacher_weight": 0.8, "teacher_mask_low": 0.1},
    {"ce_weight": 0.3},
    {"weights": True},
    {"teacher": True, "weights": True, "teacher_tau": 0.2, "teacher_weight": 1.5, "ce_weight": 0.1, "kl_tau": 0.01},
]


@pytest.mark.parametrize(
    "config", SHADOW_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "defaults"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_shadow_parity_with_formula_reference(config: dict[str, Any], seed: int, make_sample: Any) -> None:
    kwargs = {k: v for k, v in config.items() if k not in ("teacher", "weights")}
    sample = make_sample(seq=777, seed=seed, teacher=config.get("teacher", False), weights=config.get("weights", False))
    ours = loss_fn(_inputs(sample), **kwargs)
    ref_loss, ref_metrics = _reference_for(sample, **kwargs)
    assert ref_loss.abs() > 1e-3  # random inputs, never a trivial zero
    torch.testing.assert_close(ours.loss, ref_loss, rtol=1e-12, atol=1e-12)
    lp = sample["trainer_logprobs"]
    torch.testing.assert_close(_grad(ours.loss, lp), _grad(ref_loss, lp), rtol=1e-12, atol=1e-12)
    assert set(ours.metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        got = ours.metrics[key]  # fractions of bool masks come out in the default dtype, as upstream
        tol = 1e-12 if got.dtype == torch.float64 else 1e-6
        torch.testing.assert_close(got, value.to(got.dtype), rtol=tol, atol=tol, msg=key)


def test_float32_matches_float64_reference(make_sample: Any) -> None:
    kwargs: dict[str, Any] = {"teacher_weight": 0.5, "ce_weight": 0.2}
    sample32 = make_sample(seq=2048, dtype=torch.float32, teacher=True, seed=5)
    sample64 = make_sample(seq=2048, dtype=torch.float64, teacher=True, seed=5)
    ours = loss_fn(_inputs(sample32), **kwargs)
    ref, _ = _reference_for(sample64, **kwargs)
    # measured on seeds 0-4: relative loss error <= 1.2e-7, gradient error <= 9e-6 where gradients reach ~40
    torch.testing.assert_close(ours.loss.double(), ref, rtol=1e-6, atol=0.0)
    grad32 = _grad(ours.loss, sample32["trainer_logprobs"])
    assert grad32.dtype == torch.float32
    torch.testing.assert_close(grad32.double(), _grad(ref, sample64["trainer_logprobs"]), rtol=1e-5, atol=1e-4)


def test_defaults_ignore_teacher_in_loss_but_report_teacher_kl(make_sample: Any) -> None:
    sample = make_sample(seq=200, teacher=True)
    with_teacher = loss_fn(_inputs(sample))
    without = loss_fn(_inputs({k: v for k, v in sample.items() if k != "teacher_logprobs"}))
    assert torch.equal(with_teacher.loss, without.loss)
    m = sample["loss_mask"]
    expected_kl = (sample["teacher_logprobs"] - sample["trainer_logprobs"].detach())[m].mean()
    torch.testing.assert_close(with_teacher.metrics["teacher_kl"], expected_kl)


def test_ref_logprobs_generation_is_the_same_signal(make_sample: Any) -> None:
    sample = make_sample(seq=200, teacher=True)
    old = loss_fn(_inputs(sample), teacher_weight=0.4, teacher_tau=0.3)
    renamed = dict(sample, ref_logprobs=sample["teacher_logprobs"])
    del renamed["teacher_logprobs"]
    new = loss_fn(_inputs(renamed), teacher_weight=0.4, teacher_tau=0.3)
    assert torch.equal(old.loss, new.loss)


def test_loss_weights_scale_and_zero_weights_remove_tokens(make_sample: Any) -> None:
    sample = make_sample(seq=128, seed=2)
    base = loss_fn(_inputs(sample), ce_weight=0.1)
    per_token = []
    for t in range(128):
        onehot = torch.zeros(128, dtype=torch.float64)
        onehot[t] = 1.0
        per_token.append(loss_fn(_inputs(dict(sample, loss_weights=onehot)), ce_weight=0.1).loss.detach())
    torch.testing.assert_close(torch.stack(per_token).sum(), base.loss.detach(), rtol=1e-12, atol=1e-12)
    doubled = loss_fn(_inputs(dict(sample, loss_weights=torch.full((128,), 2.0, dtype=torch.float64))), ce_weight=0.1)
    torch.testing.assert_close(doubled.loss, 2 * base.loss, rtol=1e-12, atol=1e-12)
    prompt = ~sample["loss_mask"]
    assert torch.all(torch.stack(per_token)[prompt] == 0)


def test_teacher_distillation_gradient_pulls_toward_teacher() -> None:
    # Teacher likes the token more than the student (lp_T > lp_θ): a descent step must raise lp_θ.
    sample = _token(math.log(0.3), math.log(0.3), adv=0.0)
    sample["teacher_logprobs"] = torch.tensor([-1.0, math.log(0.6)], dtype=torch.float64)
    out = loss_fn(_inputs(sample), adv_tau=0.0, kl_tau=0.0, teacher_weight=1.0)
    grad = _grad(out.loss, sample["trainer_logprobs"])[1].item()
    assert grad == pytest.approx(-math.log(0.6 / 0.3), rel=1e-12)  # −(lp_T − lp_θ)·r with r = 1
    # A token whose probability fell beyond teacher_mask_low is outside the channel's trust region.
    fallen = _token(math.log(0.2), math.log(0.6), adv=0.0)
    fallen["teacher_logprobs"] = torch.tensor([-1.0, math.log(0.9)], dtype=torch.float64)
    dropped = loss_fn(_inputs(fallen), adv_tau=0.0, kl_tau=0.0, teacher_weight=1.0)
    assert dropped.loss.item() == 0.0
    assert dropped.metrics["composer/teacher_is_masked"].item() == 1.0


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["trainer_logprobs", "inference_logprobs", "advantages", "loss_mask"])
def test_mismatched_lengths_rejected(field: str, make_sample: Any) -> None:
    sample = make_sample(seq=50)
    sample[field] = sample[field].detach()[:-3]
    expected = 47 if field == "trainer_logprobs" else 50
    with pytest.raises(ValueError, match=rf"must have the length of trainer_logprobs \({expected}\)"):
        loss_fn(_inputs(sample))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_non_bool_loss_mask_rejected(dtype: torch.dtype, make_sample: Any) -> None:
    sample = make_sample(seq=30)
    sample["loss_mask"] = sample["loss_mask"].to(dtype)
    with pytest.raises(ValueError, match=r"loss_mask must be a bool tensor .* loss_mask\.bool\(\)"):
        loss_fn(_inputs(sample))


@pytest.mark.parametrize(
    "field", ["trainer_logprobs", "inference_logprobs", "advantages", "teacher_logprobs", "loss_weights"]
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_rejected(field: str, bad: float, make_sample: Any) -> None:
    sample = make_sample(seq=30, teacher=True, weights=True)
    poisoned = sample[field].detach().clone()
    poisoned[20] = bad
    sample[field] = poisoned
    with pytest.raises(ValueError, match=rf"{field} has 1 NaN/inf entries out of 30"):
        loss_fn(_inputs(sample))


@pytest.mark.parametrize("name", sorted(LOSS_KWARGS))
@pytest.mark.parametrize("value", [-0.1, -1e-9, math.nan])
def test_negative_or_nan_kwargs_rejected(name: str, value: float, make_sample: Any) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be >= 0"):
        loss_fn(_inputs(make_sample(seq=10, teacher=True)), **{name: value})


def test_negative_dppo_bound_error_points_at_disabling() -> None:
    with pytest.raises(ValueError, match="pass 1e6 for both bounds"):
        loss_fn(_inputs(_token(-1.0, -1.0, 1.0)), dppo_mask_high=-0.2)


@pytest.mark.parametrize("value", [True, "0.2", None])
def test_non_numeric_kwargs_rejected(value: Any) -> None:
    with pytest.raises(TypeError, match="kl_tau must be a float"):
        loss_fn(_inputs(_token(-1.0, -1.0, 1.0)), kl_tau=value)


def test_unknown_kwarg_rejected_with_suggestion() -> None:
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) 'dppo_mask_hi' \(did you mean 'dppo_mask_high'\?\)"):
        loss_fn(_inputs(_token(-1.0, -1.0, 1.0)), dppo_mask_hi=0.3)


@pytest.mark.parametrize("shape", [(), (2, 3, 4)])
def test_non_1d_shapes_rejected(shape: tuple[int, ...]) -> None:
    sample = _token(-1.0, -1.0, 1.0)
    sample["advantages"] = torch.ones(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"expected \(seq,\) shape for advantages, got shape"):
        loss_fn(_inputs(sample))


def test_scalar_advantage_error_shows_broadcast() -> None:
    sample = _token(-1.0, -1.0, 1.0)
    sample["advantages"] = torch.tensor(1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"advantages\.expand\(seq\)"):
        loss_fn(_inputs(sample))


def test_integer_advantages_rejected() -> None:
    sample = _token(-1.0, -1.0, 1.0)
    sample["advantages"] = torch.tensor([1, 1])
    with pytest.raises(ValueError, match=r"advantages must be a floating-point tensor, got torch\.int64"):
        loss_fn(_inputs(sample))


def test_negative_loss_weights_rejected(make_sample: Any) -> None:
    sample = make_sample(seq=20, weights=True)
    sample["loss_weights"][3] = -0.5
    with pytest.raises(ValueError, match=r"loss_weights must be >= 0 .* got min -0\.5"):
        loss_fn(_inputs(sample))


def test_both_teacher_fields_rejected(make_sample: Any) -> None:
    sample = make_sample(seq=20, teacher=True)
    sample["ref_logprobs"] = sample["teacher_logprobs"]
    with pytest.raises(ValueError, match="both teacher_logprobs and ref_logprobs are set"):
        loss_fn(_inputs(sample))


@pytest.mark.parametrize("name", ["teacher_tau", "teacher_weight"])
def test_teacher_channel_without_teacher_rejected(name: str, make_sample: Any) -> None:
    with pytest.raises(ValueError, match=r"need teacher log-probs.*configure a teacher"):
        loss_fn(_inputs(make_sample(seq=20)), **{name: 0.5})


def test_device_mismatch_rejected() -> None:
    sample = _token(-1.0, -1.0, 1.0)
    sample["inference_logprobs"] = torch.empty(2, dtype=torch.float64, device="meta")
    with pytest.raises(
        ValueError, match=r"must be on trainer_logprobs' device \(cpu\); got \{'inference_logprobs': 'meta'\}"
    ):
        loss_fn(_inputs(sample))


def test_non_tensor_field_rejected() -> None:
    sample: dict[str, Any] = _token(-1.0, -1.0, 1.0)
    sample["advantages"] = [1.0, 1.0]
    with pytest.raises(TypeError, match=r"advantages must be a torch\.Tensor of shape"):
        loss_fn(_inputs(sample))


def test_mapping_inputs_rejected_with_fix() -> None:
    with pytest.raises(TypeError, match=r"inputs of type dict lacks .*LossInputs\("):
        loss_fn(_token(-1.0, -1.0, 1.0))


def _upstream_inputs(upstream: Any, sample: dict[str, Tensor]) -> Any:
    """PRIME-RL's own ``LossInputs`` for ``sample``, under whichever teacher field name it uses."""
    fields = {f.name for f in dataclasses.fields(upstream.LossInputs)}
    teacher_field = "teacher_logprobs" if "teacher_logprobs" in fields else "ref_logprobs"
    kwargs: dict[str, Tensor | None] = {k: v for k, v in sample.items() if k in fields}
    kwargs[teacher_field] = sample.get("teacher_logprobs")
    return upstream.LossInputs(**kwargs)


def test_teacher_channel_matches_prime_rl_ref_kl_loss_fn(prime_rl_loss: Any, make_sample: Any) -> None:
    """With ``adv_tau=0`` and ``teacher_weight=1`` our loss is PRIME-RL's on-policy-distillation component."""
    if not hasattr(prime_rl_loss, "ref_kl_loss_fn"):
        pytest.skip("this prime-rl generation predates ref_kl_loss_fn (added by the algorithm abstraction, 0be5ac4)")
    sample = make_sample(seq=513, teacher=True, weights=True, seed=7)
    upstream_inputs = _upstream_inputs(prime_rl_loss, sample)
    theirs = prime_rl_loss.ref_kl_loss_fn(upstream_inputs)
    ours = loss_fn(upstream_inputs, adv_tau=0.0, kl_tau=1e-3, teacher_weight=1.0, teacher_mask_low=0.2)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-12)
    lp = sample["trainer_logprobs"]
    torch.testing.assert_close(_grad(ours.loss, lp), _grad(theirs.loss, lp), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.metrics["composer/teacher_is_masked"], theirs.metrics["ref_kl/is_masked"])


def test_ce_channel_matches_prime_rl_nll_loss_fn(prime_rl_loss: Any, make_sample: Any) -> None:
    """With only ``ce_weight=1`` on, our loss is PRIME-RL's masked NLL (``ce_loss_fn``, formerly ``sft_loss_fn``)."""
    upstream_nll: Any = getattr(prime_rl_loss, "ce_loss_fn", None) or prime_rl_loss.sft_loss_fn
    sample = make_sample(seq=513, seed=8)
    upstream_inputs = _upstream_inputs(prime_rl_loss, sample)
    theirs = upstream_nll(upstream_inputs)
    ours = loss_fn(upstream_inputs, adv_tau=0.0, kl_tau=0.0, ce_weight=1.0)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-12)
    lp = sample["trainer_logprobs"]
    torch.testing.assert_close(_grad(ours.loss, lp), _grad(theirs.loss, lp), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.metrics["composer/nll"], theirs.metrics["nll"].detach())


def test_huge_finite_inputs_are_not_mistaken_for_inf() -> None:
    # The fast finiteness check sums the inputs; a float32 overflow there must not raise.
    big = -3.0e38
    sample = {
        "trainer_logprobs": torch.tensor([big, -0.5], requires_grad=True),
        "inference_logprobs": torch.tensor([big, -0.6]),
        "advantages": torch.tensor([1.0, 1.0]),
        "loss_mask": torch.tensor([False, True]),
    }
    out = loss_fn(_inputs(sample))
    r = math.exp(0.1)
    assert out.loss.item() == pytest.approx(-r + 1e-3 * 0.1**2, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(make_sample: Any) -> None:
    kwargs = {"teacher_weight": 0.5, "teacher_tau": 0.1, "ce_weight": 0.2}
    cpu = make_sample(seq=4096, dtype=torch.float32, teacher=True, weights=True, seed=11)
    cuda = {k: v.detach().cuda().requires_grad_(v.requires_grad) for k, v in cpu.items()}
    on_cpu, on_cuda = loss_fn(_inputs(cpu), **kwargs), loss_fn(_inputs(cuda), **kwargs)
    torch.testing.assert_close(on_cuda.loss.cpu(), on_cpu.loss, rtol=1e-5, atol=1e-4)
    grad_cuda = _grad(on_cuda.loss, cuda["trainer_logprobs"]).cpu()
    torch.testing.assert_close(grad_cuda, _grad(on_cpu.loss, cpu["trainer_logprobs"]), rtol=1e-5, atol=1e-6)
    for key, value in on_cpu.metrics.items():
        torch.testing.assert_close(on_cuda.metrics[key].cpu(), value, rtol=1e-5, atol=1e-6, msg=key)


def test_all_zero_filler_teacher_is_refused_when_a_teacher_channel_is_on(make_sample: Any) -> None:
    """PRIME-RL (from 0be5ac4) fills ref_logprobs with 0.0 for samples without a reference in a mixed micro-batch:
    a teacher channel there would silently do nothing, so it is an error that says so."""
    sample = make_sample(seq=100, seed=4)
    filler = torch.zeros(100, dtype=torch.float64)
    filler[:5] = -1.0  # prompt positions do not count: only the loss mask decides
    sample["ref_logprobs"] = filler
    for knobs in ({"teacher_weight": 1.0}, {"teacher_tau": 0.5}):
        with pytest.raises(ValueError, match=r"0\.0 on every loss-mask token.*filler.*type = \"opd\""):
            loss_fn(_inputs(sample), **knobs)
    # With the teacher channels off the filler is harmless: the loss is the plain one.
    plain = loss_fn(_inputs({k: v for k, v in sample.items() if k != "ref_logprobs"}))
    torch.testing.assert_close(loss_fn(_inputs(sample)).loss, plain.loss, rtol=0, atol=0)
    # A sample with no loss-mask token at all has nothing for the teacher to do: not an error.
    empty = dict(sample, loss_mask=torch.zeros(100, dtype=torch.bool))
    assert loss_fn(_inputs(empty), teacher_weight=1.0).loss.item() == 0.0
    # A real teacher on the same sample moves the loss.
    sample["ref_logprobs"] = make_sample(seq=100, seed=4, teacher=True)["teacher_logprobs"]
    assert not torch.equal(loss_fn(_inputs(sample), teacher_weight=1.0).loss, plain.loss)


def test_missing_teacher_error_says_what_works_at_prime_rl_head(make_sample: Any) -> None:
    """A GRPO run at prime-rl HEAD never carries ref_logprobs into the rl loss: the error names prime-rl's opd."""
    with pytest.raises(ValueError, match=r"is None.*only the 'opd'/'opsd' algorithms fill ref_logprobs"):
        loss_fn(_inputs(make_sample(seq=20)), teacher_weight=0.5)
