"""crf's SDPO channel against TRL 1.16 ``SDPOTrainer``'s self-distillation loss, and a float64 reference.

TRL's loss is the trainer method ``SDPOTrainer._compute_self_distillation_loss`` (it dispatches on
``distillation_mode`` to ``trl.experimental.sdpo.loss_utils``, applies the clipped IS weight, then averages each
sequence's tokens and the sequences). The test calls it unbound on a minimal stand-in for the trainer (``args`` a
real TRL ``SDPOConfig``, an identity ``gather``, TRL's own metric logger), on the same student logits, teacher
logits, completion ids, masks and old log-probs that crf's :class:`~crf_core.channels.SDPOChannel` scores, for
each distillation mode crf supports (``full_logits``, ``topk_logits`` with and without the tail bucket) and
several alphas and IS clips. Values and gradients (wrt the student logits) must agree at float64 tolerance:

* crf's per-token term (``SDPOChannel.term``) reduced TRL's way equals TRL's loss;
* crf's own reduction (one token mean over the signalled tokens) equals TRL's per-token loss reduced that way.

Both are also checked against an independent plain-PyTorch float64 implementation of the generalised JSD on
random non-zero logits. Skipped when trl is older than 1.16 (no ``trl.experimental.sdpo``).
"""

from __future__ import annotations

import importlib.metadata
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from crf_core.channels import SDPOChannel, SDPOConfig, SDPOTargets
from crf_core.channels.head import token_mean

pytest.importorskip("trl", reason="trl is not installed (parity with TRL's SDPO loss)")
_TRL = importlib.metadata.version("trl")
if tuple(int(part) for part in _TRL.split(".")[:2]) < (1, 16):  # Python 3.10 resolves an older TRL
    pytest.skip(
        f"trl.experimental.sdpo (SDPOTrainer) is TRL 1.16's; this interpreter has trl {_TRL}",
        allow_module_level=True,
    )
sdpo_trainer = pytest.importorskip("trl.experimental.sdpo.sdpo_trainer", reason="TRL's SDPOTrainer")
loss_utils = pytest.importorskip("trl.experimental.sdpo.loss_utils", reason="TRL's SDPO loss functions")

B, C, V, K = 4, 7, 13, 5
LENGTHS = (7, 4, 5, 2)  # completion tokens per sample
SIGNAL = (1.0, 1.0, 0.0, 1.0)  # self_distillation_mask: sample 2 has no teacher signal
ATOL = 1e-12

# (distillation_mode, top_k, add_tail): the modes crf supports ('sampled_token' is refused by ComposerConfig)
MODES = [("full_logits", None, False), ("topk_logits", K, True), ("topk_logits", K, False)]
ALPHAS = [0.0, 0.3, 0.5, 1.0]
# (is_clip, with old log-probs): off, clipping some tokens off-policy, on-policy (TRL: no weight; crf: min(1, clip))
CLIPS = [(None, True), (1.5, True), (2.0, False)]


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, C, V, generator=g, dtype=torch.float64) * 2.0
    teacher = 0.5 * student + torch.randn(B, C, V, generator=g, dtype=torch.float64) * 1.5
    ids = torch.randint(0, V, (B, C), generator=g)
    mask = (torch.arange(C)[None, :] < torch.tensor(LENGTHS)[:, None]).to(torch.float64)
    lp = torch.log_softmax(student, -1).gather(-1, ids[..., None]).squeeze(-1)
    old = lp + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.6  # ratios on both sides of the clip
    return {"student": student, "teacher": teacher, "ids": ids, "mask": mask, "old": old}


def _trl_loss(
    batch: dict[str, torch.Tensor],
    student: torch.Tensor,
    mode: str,
    top_k: int | None,
    add_tail: bool,
    alpha: float,
    clip: float | None,
    with_old: bool,
    tmp_path: Any,
) -> torch.Tensor:
    """TRL's ``SDPOTrainer._compute_self_distillation_loss`` on a stand-in trainer."""
    args = sdpo_trainer.SDPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        distillation_mode=mode,
        distillation_topk=top_k,
        distillation_add_tail=add_tail,
        distillation_alpha=alpha,
        distillation_is_clip=clip,
    )
    stub = SimpleNamespace(
        args=args,
        _name="SDPO",
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(gather=lambda x: x),
    )
    stub._log_self_distillation_metric = lambda m, v: sdpo_trainer.SDPOTrainer._log_self_distillation_metric(stub, m, v)
    signal = torch.tensor(SIGNAL, dtype=torch.float64)
    logits = sdpo_trainer.DistillationLogits(
        completion_ids=batch["ids"],
        completion_mask=batch["mask"],
        loss_mask=batch["mask"] * signal[:, None],
        student_logits=student,
        teacher_logits=batch["teacher"],
    )
    inputs = {"old_per_token_logps": batch["old"]} if with_old else {}
    model = torch.nn.Linear(1, 1)  # only `.training` is read
    loss = sdpo_trainer.SDPOTrainer._compute_self_distillation_loss(stub, model, inputs, logits)
    assert stub._metrics["train"]["self_distillation/distillation_loss"], "TRL's own metric logger ran"
    return loss


def _trl_per_token(
    batch: dict[str, torch.Tensor],
    student: torch.Tensor,
    mode: str,
    top_k: int | None,
    add_tail: bool,
    alpha: float,
    clip: float | None,
    with_old: bool,
) -> torch.Tensor:
    """TRL's per-token loss (its loss_utils functions and IS clipping), ``(B, C)``."""
    if mode == "topk_logits":
        per = loss_utils.compute_topk_self_distillation_loss(
            student, batch["teacher"], distillation_topk=top_k, distillation_alpha=alpha, distillation_add_tail=add_tail
        )
    else:
        per = loss_utils.compute_full_logit_self_distillation_loss(student, batch["teacher"], distillation_alpha=alpha)
    if clip is not None and with_old:
        lp = loss_utils.selective_log_softmax(student, batch["ids"])
        per = loss_utils.apply_importance_sampling_clipping(per, lp, batch["old"], clip)
    return per


def _crf_per_token(
    batch: dict[str, torch.Tensor],
    student: torch.Tensor,
    top_k: int | None,
    add_tail: bool,
    alpha: float,
    clip: float | None,
    with_old: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """crf's SDPO channel term on the signalled completion tokens: ``(B, C)`` (0 elsewhere) and the token mask."""
    channel = SDPOChannel(SDPOConfig(alpha=alpha, top_k=top_k, add_tail=add_tail, is_clip=clip))
    signal = torch.tensor(SIGNAL, dtype=torch.float64)
    weights = (batch["mask"] * signal[:, None]).reshape(-1)
    teacher = batch["teacher"].reshape(B * C, V)
    targets = SDPOTargets(
        teacher=lambda rows: teacher[rows],
        labels=batch["ids"].reshape(-1),
        old_logprobs=batch["old"].reshape(-1) if with_old else None,
    )
    active = weights > 0
    term = channel.term(targets, active)
    rows = active.nonzero(as_tuple=True)[0]
    values = term.fn(student.reshape(B * C, V)[rows], rows)
    per = torch.zeros(B * C, dtype=values.dtype).index_put((rows,), values)
    return per.reshape(B, C), weights.reshape(B, C)


def _trl_reduction(per: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """TRL's: each sequence's token mean, then the mean over every sequence of the batch."""
    return ((per * weights).sum(-1) / weights.sum(-1).clamp(min=1.0)).mean()


def _reference_per_token(
    batch: dict[str, torch.Tensor],
    student: torch.Tensor,
    top_k: int | None,
    add_tail: bool,
    alpha: float,
    clip: float | None,
    with_old: bool,
) -> torch.Tensor:
    """Independent float64 generalised JSD on probabilities (no TRL, no crf)."""
    s = torch.log_softmax(student, -1)
    t = torch.log_softmax(batch["teacher"], -1)
    token_lp = s.gather(-1, batch["ids"][..., None]).squeeze(-1)
    if top_k is not None:
        idx = student.argsort(-1, descending=True)[..., :top_k]
        s, t = s.gather(-1, idx), t.gather(-1, idx)
        if add_tail:
            s = torch.cat([s, torch.log1p(-s.exp().sum(-1, keepdim=True))], -1)
            t = torch.cat([t, torch.log1p(-t.exp().sum(-1, keepdim=True))], -1)
        else:
            s = s - s.exp().sum(-1, keepdim=True).log()
            t = t - t.exp().sum(-1, keepdim=True).log()
    p, q = s.exp(), t.exp()
    if alpha == 0.0:
        per = (q * (t - s)).sum(-1)  # KL(teacher ‖ student)
    elif alpha == 1.0:
        per = (p * (s - t)).sum(-1)  # KL(student ‖ teacher)
    else:
        log_m = ((1 - alpha) * p + alpha * q).log()
        per = alpha * (q * (t - log_m)).sum(-1) + (1 - alpha) * (p * (s - log_m)).sum(-1)
    if clip is not None:
        ratio = (token_lp - batch["old"]).exp() if with_old else torch.ones_like(token_lp)
        per = per * ratio.detach().clamp(max=clip)
    return per


def _value_and_grad(fn: Any, student: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = student.clone().requires_grad_(True)
    value = fn(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


CASES = [(m, k, tail, a, clip, old) for (m, k, tail) in MODES for a in ALPHAS for (clip, old) in CLIPS]


def _id(case: tuple[Any, ...]) -> str:
    mode, _, tail, alpha, clip, old = case
    return f"{mode}{'-tail' if tail else ''}-a{alpha}-clip{clip}{'-old' if old else ''}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_crf_channel_matches_trl_sdpo_trainer_loss(case: tuple[Any, ...], tmp_path: Any) -> None:
    mode, top_k, add_tail, alpha, clip, with_old = case
    batch = _batch()

    def trl(x: torch.Tensor) -> torch.Tensor:
        return _trl_loss(batch, x, mode, top_k, add_tail, alpha, clip, with_old, tmp_path)

    def crf(x: torch.Tensor) -> torch.Tensor:
        return _trl_reduction(*_crf_per_token(batch, x, top_k, add_tail, alpha, clip, with_old))

    trl_value, trl_grad = _value_and_grad(trl, batch["student"])
    crf_value, crf_grad = _value_and_grad(crf, batch["student"])
    assert trl_value.abs() > 1e-3, "a non-trivial loss"
    assert trl_grad.abs().max() > 1e-4, "a non-trivial gradient"
    torch.testing.assert_close(crf_value, trl_value, atol=ATOL, rtol=0)
    torch.testing.assert_close(crf_grad, trl_grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_crf_reduction_of_trl_per_token_loss(case: tuple[Any, ...]) -> None:
    """crf's loss (token mean over signalled tokens) is TRL's per-token SDPO loss under that reduction."""
    _, top_k, add_tail, alpha, clip, with_old = case
    mode = case[0]
    batch = _batch(1)
    weights = _crf_per_token(batch, batch["student"], top_k, add_tail, alpha, clip, with_old)[1]
    on_policy_weight = 1.0 if clip is None or with_old else min(1.0, clip)  # TRL skips the weight without old lps

    def trl(x: torch.Tensor) -> torch.Tensor:
        per = _trl_per_token(batch, x, mode, top_k, add_tail, alpha, clip, with_old) * on_policy_weight
        return (per * weights).sum() / weights.sum()

    def crf(x: torch.Tensor) -> torch.Tensor:
        per, w = _crf_per_token(batch, x, top_k, add_tail, alpha, clip, with_old)
        return token_mean(per.reshape(-1), w.reshape(-1))

    trl_value, trl_grad = _value_and_grad(trl, batch["student"])
    crf_value, crf_grad = _value_and_grad(crf, batch["student"])
    torch.testing.assert_close(crf_value, trl_value, atol=ATOL, rtol=0)
    torch.testing.assert_close(crf_grad, trl_grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_crf_and_trl_match_a_float64_reference(case: tuple[Any, ...], tmp_path: Any) -> None:
    mode, top_k, add_tail, alpha, clip, with_old = case
    batch = _batch(2)
    signal = torch.tensor(SIGNAL, dtype=torch.float64)
    weights = batch["mask"] * signal[:, None]

    def reference(x: torch.Tensor) -> torch.Tensor:
        return _trl_reduction(_reference_per_token(batch, x, top_k, add_tail, alpha, clip, with_old), weights)

    def crf(x: torch.Tensor) -> torch.Tensor:
        return _trl_reduction(*_crf_per_token(batch, x, top_k, add_tail, alpha, clip, with_old))

    def trl(x: torch.Tensor) -> torch.Tensor:
        return _trl_loss(batch, x, mode, top_k, add_tail, alpha, clip, with_old, tmp_path)

    ref_value, ref_grad = _value_and_grad(reference, batch["student"])
    crf_value, crf_grad = _value_and_grad(crf, batch["student"])
    torch.testing.assert_close(crf_value, ref_value, atol=1e-10, rtol=0)
    torch.testing.assert_close(crf_grad, ref_grad, atol=1e-10, rtol=0)
    # on-policy TRL applies no weight, crf and the reference min(1, clip): the same (1) for every clip here
    trl_value, trl_grad = _value_and_grad(trl, batch["student"])
    torch.testing.assert_close(trl_value, ref_value, atol=1e-10, rtol=0)
    torch.testing.assert_close(trl_grad, ref_grad, atol=1e-10, rtol=0)
