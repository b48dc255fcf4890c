"""Every DPO ``loss_type`` (and a weighted list) against TRL 1.16's own ``DPOTrainer._compute_loss``.

TRL's loss lives inside a trainer method that runs the model forward. The test calls the unbound method on a
minimal stand-in for the trainer whose "model" returns chosen per-token log-probs we control (zero outside the
completion, as TRL's fused head yields), with precomputed reference log-probs, so TRL's loss is a function of
the same four sequence log-probs crf's ``dpo_loss`` receives. Values and gradients (wrt the per-token
log-probs) must agree at float64 tolerance. Skipped when trl is not importable or older than 1.16.
"""

from __future__ import annotations

import importlib.metadata
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from crf_distill import DPO_LOSS_TYPES, dpo_loss

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer", reason="trl is not installed (parity with TRL's DPO loss)")
_TRL = importlib.metadata.version("trl")
if tuple(int(part) for part in _TRL.split(".")[:2]) < (1, 16):  # Python 3.10 resolves an older TRL
    pytest.skip(
        f"the stand-in trainer follows TRL 1.16's DPOTrainer._compute_loss; this interpreter has trl {_TRL}",
        allow_module_level=True,
    )

P, T = 5, 9  # pairs, sequence length (first column is prompt)
BETA = 0.3
ATOL = 1e-12


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):  # type: ignore[no-untyped-def]
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)

    gather = gather_for_metrics


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token policy log-probs ``(2P, T-1)`` (leaf with grad), completion mask ``(2P, T)`` and the two refs."""
    mask = torch.zeros(2 * P, T, dtype=torch.long)
    for i in range(2 * P):
        start = int(torch.randint(1, 4, (1,), generator=gen))
        stop = int(torch.randint(start + 1, T + 1, (1,), generator=gen))
        mask[i, start:stop] = 1
    per_token = (-torch.rand(2 * P, T - 1, generator=gen, dtype=torch.float64) * 3.0).requires_grad_(True)
    ref_w = -torch.rand(P, generator=gen, dtype=torch.float64) * 12.0
    ref_l = -torch.rand(P, generator=gen, dtype=torch.float64) * 12.0
    return per_token, mask, ref_w, ref_l


def _trl_loss(per_token, mask, ref_w, ref_l, loss_types, loss_weights, eps, tau):  # type: ignore[no-untyped-def]
    shift = mask[:, 1:].to(per_token.dtype)
    logps = per_token * shift  # zero outside the completion, as TRL's fused head returns
    outputs = SimpleNamespace(
        log_probs=logps,
        entropy=torch.zeros_like(logps),
        mean_logits=torch.zeros_like(logps),
        is_top1=torch.zeros_like(logps, dtype=torch.bool),
    )
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=list(loss_types),
        loss_weights=list(loss_weights),
        beta=BETA,
        label_smoothing=eps,
        use_weighting=False,
        args=SimpleNamespace(discopop_tau=tau),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(2 * P, T, dtype=torch.long),
        "attention_mask": torch.ones(2 * P, T, dtype=torch.long),
        "completion_mask": mask,
        "ref_chosen_logps": ref_w,
        "ref_rejected_logps": ref_l,
    }
    # TRL builds exo_pair's ε as torch.tensor(label_smoothing), i.e. in the default dtype; with float32 its log ε
    # and log(1−ε) are float32-rounded (value off by ~4e-8, gradient by ~1e-9). Run TRL in float64 throughout.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return trl_dpo.DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, False)
    finally:
        torch.set_default_dtype(default)


def _crf_loss(per_token, mask, ref_w, ref_l, loss_types, loss_weights, eps, tau):  # type: ignore[no-untyped-def]
    shift = mask[:, 1:].to(per_token.dtype)
    seq = (per_token * shift).sum(1)
    lengths = shift.sum(1)
    return dpo_loss(
        seq[:P],
        seq[P:],
        ref_w,
        ref_l,
        beta=BETA,
        loss_type=loss_types,
        loss_weights=loss_weights,
        label_smoothing=eps,
        discopop_tau=tau,
        chosen_lengths=lengths[:P],
        rejected_lengths=lengths[P:],
    )


# (loss_type, label_smoothing): ε where TRL 1.16 reads it; TRL 1.16's sigmoid ignores ε (crf's ε > 0 is cDPO)
CASES = [(t, {"exo_pair": 1e-3, "robust": 0.2, "aot": 0.2, "aot_unpaired": 0.2}.get(t, 0.0)) for t in DPO_LOSS_TYPES]
CASES += [("aot", 0.0), ("aot_unpaired", 0.0), ("robust", 0.0)]

# max |crf − TRL| over the seeds, per case: (value, gradient); printed with -s for the parity note
PARITY: dict[str, tuple[float, float]] = {}


def _compare(gen_seed: int, loss_types, loss_weights, eps, tau=0.05) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(gen_seed)
    per_token, mask, ref_w, ref_l = _batch(gen)
    want = _trl_loss(per_token, mask, ref_w, ref_l, loss_types, loss_weights, eps, tau)
    (g_want,) = torch.autograd.grad(want, [per_token])
    got = _crf_loss(per_token, mask, ref_w, ref_l, loss_types, loss_weights, eps, tau)
    (g_got,) = torch.autograd.grad(got, [per_token])
    assert got.dtype == want.dtype == torch.float64
    assert float(g_want.abs().max()) > 0.0  # the comparison is not vacuous
    dv, dg = abs(float((got - want).detach())), float((g_got - g_want).abs().max())
    assert torch.allclose(got, want, atol=ATOL, rtol=0.0), (loss_types, got.item(), want.item())
    assert torch.allclose(g_got, g_want, atol=ATOL, rtol=0.0), (loss_types, dg)
    return dv, dg


def test_every_loss_type_has_a_parity_case() -> None:
    assert {c[0] for c in CASES} == set(DPO_LOSS_TYPES)


@pytest.mark.parametrize(("loss_type", "eps"), CASES, ids=[f"{t}-{e}" for t, e in CASES])
def test_matches_trl_per_type(loss_type: str, eps: float) -> None:
    worst = (0.0, 0.0)
    for seed in range(5):
        dv, dg = _compare(seed, [loss_type], [1.0], eps)
        worst = (max(worst[0], dv), max(worst[1], dg))
    PARITY[f"{loss_type}-{eps}"] = worst
    print(f"PARITY {loss_type} eps={eps}: value {worst[0]:.3e} grad {worst[1]:.3e}")


@pytest.mark.parametrize("tau", [0.05, 0.5, 2.0])
def test_discopop_tau_matches_trl(tau: float) -> None:
    for seed in range(3):
        _compare(seed, ["discopop"], [1.0], 0.0, tau=tau)


def test_weighted_list_matches_trl() -> None:
    types = ["sigmoid", "bco_pair", "sft", "apo_zero", "aot"]
    weights = [0.8, 0.2, 1.0, 0.5, -0.3]
    worst = (0.0, 0.0)
    for seed in range(5):
        dv, dg = _compare(seed, types, weights, 0.0)
        worst = (max(worst[0], dv), max(worst[1], dg))
    print(f"PARITY list {types} {weights}: value {worst[0]:.3e} grad {worst[1]:.3e}")
