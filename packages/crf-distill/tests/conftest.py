"""Independent float64 references for the crf-distill losses, written from the papers' formulas.

Nothing here imports crf_distill: every reference works in probability space with explicit softmax,
sigmoid and sums, whereas the package works in log space. Tests reach these through the ``ref`` fixture
(pytest runs with ``--import-mode=importlib``, so test modules cannot import each other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
import torch


def softmax(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.log(1.0 / (1.0 + torch.exp(-x)))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    p = softmax(logits)
    return torch.log(torch.take_along_dim(p, labels.unsqueeze(-1), dim=-1).squeeze(-1))


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.double()
    return (values * m).sum() / m.sum()


def seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.double()
    rows = [(values[i] * m[i]).sum() / m[i].sum() for i in range(values.shape[0]) if m[i].sum() > 0]
    return torch.stack(rows).mean()


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) for probability vectors (p > 0 everywhere in the tests)."""
    return (p * (torch.log(p) - torch.log(q))).sum(-1)


def support(
    s_logits: torch.Tensor, t_logits: torch.Tensor, top_k: int | None, add_tail: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    ps, pt = softmax(s_logits), softmax(t_logits.detach())
    if top_k is None:
        return ps, pt
    idx = torch.argsort(s_logits.detach(), dim=-1, descending=True)[..., :top_k]
    ps_k = torch.take_along_dim(ps, idx, dim=-1)
    pt_k = torch.take_along_dim(pt, idx, dim=-1)
    if add_tail:
        ps_k = torch.cat([ps_k, 1.0 - ps_k.sum(-1, keepdim=True)], dim=-1)
        pt_k = torch.cat([pt_k, 1.0 - pt_k.sum(-1, keepdim=True)], dim=-1)
        return ps_k, pt_k
    return ps_k / ps_k.sum(-1, keepdim=True), pt_k / pt_k.sum(-1, keepdim=True)


def gjsd(
    s_logits: torch.Tensor, t_logits: torch.Tensor, alpha: float, top_k: int | None = None, add_tail: bool = True
) -> torch.Tensor:
    ps, pt = support(s_logits, t_logits, top_k, add_tail)
    if alpha == 0.0:
        return kl(pt, ps)
    if alpha == 1.0:
        return kl(ps, pt)
    mix = (1.0 - alpha) * ps + alpha * pt
    return alpha * kl(pt, mix) + (1.0 - alpha) * kl(ps, mix)


def entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log(p)).sum(-1)


def dpo(lw, ll, rw, rl, beta, loss_type, eps=0.0, len_w=None, len_l=None, tau=0.05):  # type: ignore[no-untyped-def]
    rho_w, rho_l = lw - rw, ll - rl
    if loss_type in ("ipo", "sigmoid_norm"):
        rho_w, rho_l = rho_w / len_w, rho_l / len_l
    d = rho_w - rho_l
    if loss_type == "sigmoid":
        out = -(1 - eps) * log_sigmoid(beta * d) - eps * log_sigmoid(-beta * d)
    elif loss_type == "hinge":
        out = torch.clamp(1 - beta * d, min=0)
    elif loss_type == "ipo":
        out = (d - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        out = (-(1 - eps) * log_sigmoid(beta * d) + eps * log_sigmoid(-beta * d)) / (1 - 2 * eps)
    elif loss_type == "exo_pair":
        sp, sn = sigmoid(beta * d), sigmoid(-beta * d)
        out = sp * (torch.log(sp) - torch.log(torch.tensor(1 - eps, dtype=d.dtype))) + sn * (
            torch.log(sn) - torch.log(torch.tensor(eps, dtype=d.dtype))
        )
    elif loss_type == "nca_pair":
        out = -log_sigmoid(beta * rho_w) - 0.5 * log_sigmoid(-beta * rho_w) - 0.5 * log_sigmoid(-beta * rho_l)
    elif loss_type == "sigmoid_norm":
        out = -log_sigmoid(beta * d)
    elif loss_type == "bco_pair":
        out = -log_sigmoid(beta * rho_w) - log_sigmoid(-beta * rho_l)
    elif loss_type == "sppo_hard":
        out = (rho_w - 1 / (2 * beta)) ** 2 + (rho_l + 1 / (2 * beta)) ** 2
    elif loss_type in ("aot", "aot_unpaired"):
        # ascending ranks matched across the batch (optimal transport of the two 1-D distributions)
        a, b = (lw - ll, rw - rl) if loss_type == "aot" else (rho_w, rho_l)
        a = torch.stack([a[i] for i in torch.argsort(a.detach())])
        b = torch.stack([b[i] for i in torch.argsort(b.detach())])
        out = -(1 - eps) * log_sigmoid(beta * (a - b)) - eps * log_sigmoid(-beta * (a - b))
    elif loss_type == "apo_zero":
        out = (1 - sigmoid(beta * rho_w)) + sigmoid(beta * rho_l)
    elif loss_type == "apo_down":
        out = sigmoid(beta * rho_w) + (1 - sigmoid(beta * d))
    elif loss_type == "discopop":
        m = sigmoid(beta * d / tau)
        out = (1 - m) * -log_sigmoid(beta * d) + m * torch.exp(-beta * d)
    elif loss_type == "sft":
        return -lw.sum() / len_w.sum()
    else:
        raise AssertionError(loss_type)
    return out.mean()


def simpo(avg_w, avg_l, beta, gamma, eps=0.0, loss_type="sigmoid"):  # type: ignore[no-untyped-def]
    z = beta * (avg_w - avg_l) - gamma
    if loss_type == "hinge":
        return torch.clamp(1 - z, min=0).mean()
    return (-(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)).mean()


def taid_target(s_logits, t_logits, t, anchor=None, interpolation="logit"):  # type: ignore[no-untyped-def]
    a = (s_logits if anchor is None else anchor).detach()
    if interpolation == "logit":
        return softmax((1 - t) * a + t * t_logits.detach())
    return (1 - t) * softmax(a) + t * softmax(t_logits.detach())


def taid(s_logits, t_logits, t, anchor=None, interpolation="logit", objective="cross_entropy"):  # type: ignore[no-untyped-def]
    p = taid_target(s_logits, t_logits, t, anchor, interpolation)
    q = softmax(s_logits)
    if objective == "kl":
        return kl(p, q)
    return -(p * torch.log(q)).sum(-1)


def eopd(s_logits, t_logits, h_max, gate="hard", sharpness=5.0, lam=1.0, combine="add", top_k=None, add_tail=True):  # type: ignore[no-untyped-def]
    ps, pt = support(s_logits, t_logits, top_k, add_tail)
    h = entropy(pt)
    if gate == "hard":
        g = (h > h_max).double()
    elif gate == "sigmoid":
        g = sigmoid(sharpness * (h - h_max))
    else:
        g = torch.clamp(h / h_max, 0, 1)
    if combine == "add":
        return kl(ps, pt) + lam * g * kl(pt, ps)
    return (1 - g) * kl(ps, pt) + g * kl(pt, ps)


def taid_schedule_trace(losses, steps, total, t_start=0.4, t_end=1.0, alpha=5e-4, beta=0.99):  # type: ignore[no-untyped-def]
    """TAID Alg. 1 transcribed from the paper: returns t after each update."""
    import math

    t, prev, m, out = t_start, None, 0.0, []
    for loss, step in zip(losses, steps, strict=True):
        if prev is None:
            prev = loss
            out.append(t)
            continue
        rel = (prev - loss) / (prev + 1e-15)
        m = beta * m + (1 - beta) * rel
        dt = alpha * (1 / (1 + math.exp(-m))) * (1 - t)
        t = min(t_end, max(t_start + (t_end - t_start) * step / total, t + dt))
        prev = loss
        out.append(t)
    return out


@pytest.fixture
def ref() -> SimpleNamespace:
    """Namespace of the float64 reference implementations above."""
    return SimpleNamespace(
        softmax=softmax,
        log_sigmoid=log_sigmoid,
        token_logprobs=token_logprobs,
        token_mean=token_mean,
        seq_mean=seq_mean,
        kl=kl,
        support=support,
        gjsd=gjsd,
        entropy=entropy,
        dpo=dpo,
        simpo=simpo,
        taid_target=taid_target,
        taid=taid,
        eopd=eopd,
        taid_schedule_trace=taid_schedule_trace,
    )


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator; every test draws fresh random (never all-zero) inputs from it."""
    return torch.Generator().manual_seed(1234)


def randn(gen: torch.Generator, *shape: int, scale: float = 2.0, grad: bool = False) -> torch.Tensor:
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(grad)
    return x


@pytest.fixture
def rand() -> object:
    """``rand(gen, *shape, scale=2.0, grad=False)`` float64 normal tensor."""
    return randn


LogitBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture
def logit_batch(gen: torch.Generator) -> Callable[..., LogitBatch]:
    """``logit_batch(B, T, V, drop=0.3)`` -> student logits (requires grad), teacher logits ``(B, T, V)`` and a
    float mask ``(B, T)`` that drops about ``drop`` of the tokens (``mask[0, 0]`` always kept); drawn from ``gen``."""

    def draw(b: int, t: int, v: int, *, drop: float = 0.3) -> LogitBatch:
        student = randn(gen, b, t, v, grad=True)
        teacher = randn(gen, b, t, v)
        mask = (torch.rand(b, t, generator=gen) > drop).double()
        mask[0, 0] = 1.0
        return student, teacher, mask

    return draw


def assert_value_and_grads(
    got: torch.Tensor, want: torch.Tensor, wrt: Sequence[torch.Tensor], *, atol: float = 1e-10
) -> None:
    """``got`` (the package's 0-d loss) equals the float64 reference ``want`` in value and in its gradient
    with respect to every tensor of ``wrt``."""
    assert got.dim() == 0
    assert torch.allclose(got, want, atol=atol), (got.item(), want.item())
    g_got = torch.autograd.grad(got, list(wrt))
    g_want = torch.autograd.grad(want, list(wrt))
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.allclose(a, b, atol=atol)


@pytest.fixture
def check_against_ref() -> Callable[..., None]:
    """``check_against_ref(got, want, wrt, atol=1e-10)``: value and gradients of a loss equal its reference."""
    return assert_value_and_grads
