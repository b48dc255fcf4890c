"""Support-form row terms (``RowSupport``): a term read at a few ids and through the head's log-normaliser.

The chunked passes must give the values and gradients of the same term evaluated densely (``fn`` on the full
logits, plain autograd), in float64 to 1e-12, with the label log-probs and entropies alongside, half-active terms,
bias and temperature, in both chunked executions (``head_scores`` and ``chunked_weighted_sums``); plus
``head_logits_at`` against ``head_logits``, ``generalized_jsd_on_support`` against the top-k
``generalized_jsd_per_token``, and bad ids.
"""

from __future__ import annotations

import pytest
import torch

from crf_distill import (
    RowSupport,
    RowTerm,
    chunked_weighted_sums,
    generalized_jsd_on_support,
    generalized_jsd_per_token,
    head_logits,
    head_logits_at,
    head_scores,
    top_k_ids,
)

N, H, V, K = 23, 5, 19, 4


def _setup(gen, rand):  # type: ignore[no-untyped-def]
    hidden = rand(gen, N, H, scale=1.0, grad=True)
    weight = rand(gen, V, H, scale=1.0, grad=True)
    bias = rand(gen, V, scale=1.0, grad=True)
    labels = torch.randint(0, V, (N,), generator=gen)
    teacher = rand(gen, N, V)
    return hidden, weight, bias, labels, teacher


def _jsd_term(teacher: torch.Tensor, active: torch.Tensor | None, add_tail: bool) -> RowTerm:
    """A top-K generalised JSD to fixed teacher logits, densely and in support form."""
    teacher_lp = torch.log_softmax(teacher, dim=-1)

    def dense(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return generalized_jsd_per_token(z, teacher[rows], alpha=0.3, top_k=K, add_tail=add_tail)

    def at(values: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        student = values - lse.unsqueeze(-1)
        return generalized_jsd_on_support(student, teacher_lp[rows].gather(-1, ids), alpha=0.3, add_tail=add_tail)

    return RowTerm(dense, active=active, support=RowSupport(lambda z, rows: top_k_ids(z, K), at))


def _loss(lp: torch.Tensor, ent: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Non-linear and batch-coupled, so every row's upstream gradient differs."""
    ratio = torch.exp(lp - lp.detach().mean())
    return -(ratio.clamp(0.8, 1.2) * 0.7).mean() + 0.3 * ent.var() + (value * torch.linspace(0.5, 2.0, N)).sum()


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("half_active", [True, False])
def test_support_form_equals_the_dense_term(gen, rand, chunk_size, temperature, add_tail, half_active) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, bias, labels, teacher = _setup(gen, rand)
    active = torch.rand(N, generator=gen) > 0.4 if half_active else None
    term = _jsd_term(teacher, active, add_tail)
    params = [hidden, weight, bias]
    kwargs = {"bias": bias, "entropy": True, "temperature": temperature}
    got = head_scores(hidden, weight, labels, terms=[term], chunk_size=chunk_size, **kwargs)
    want = head_scores(hidden, weight, labels, terms=[RowTerm(term.fn, active=active)], **kwargs)  # dense
    assert got.entropy is not None
    assert want.entropy is not None
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.values[0], want.values[0], rtol=0, atol=1e-12)
    if active is not None:
        assert bool((got.values[0][~active] == 0).all())
    g_got = torch.autograd.grad(_loss(got.logprobs, got.entropy, got.values[0]), params)
    g_want = torch.autograd.grad(_loss(want.logprobs, want.entropy, want.values[0]), params)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_only_the_support_term_flows_back(gen, rand, chunk_size) -> None:  # type: ignore[no-untyped-def]
    """Its own value alone (no label log-prob or entropy gradient), and terms reading only the ids or only lse."""
    hidden, weight, bias, labels, teacher = _setup(gen, rand)
    jsd = _jsd_term(teacher, None, True)
    only_values = RowTerm(
        lambda z, rows: z.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) ** 2,
        support=RowSupport(lambda z, rows: labels[rows].unsqueeze(-1), lambda v, lse, i, rows: v[:, 0] ** 2),
    )
    only_lse = RowTerm(
        lambda z, rows: torch.logsumexp(z, dim=-1).sin(),
        support=RowSupport(lambda z, rows: labels[rows].unsqueeze(-1), lambda v, lse, i, rows: lse.sin()),
    )
    terms = [jsd, only_values, only_lse]
    got = head_scores(hidden, weight, labels, bias=bias, terms=terms, chunk_size=chunk_size)
    want = head_scores(hidden, weight, labels, bias=bias, terms=[RowTerm(t.fn) for t in terms])
    for k in range(len(terms)):
        torch.testing.assert_close(got.values[k], want.values[k], rtol=0, atol=1e-12)
        g_got = torch.autograd.grad(got.values[k].sum(), [hidden, weight, bias], retain_graph=True)
        g_want = torch.autograd.grad(want.values[k].sum(), [hidden, weight, bias], retain_graph=True)
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_support_ids_are_chosen_once_per_row(gen, rand) -> None:  # type: ignore[no-untyped-def]
    """The chunked backward reuses the forward's ids: ``ids`` runs once per chunk of active rows."""
    hidden, weight, bias, labels, teacher = _setup(gen, rand)
    calls: list[int] = []
    base = _jsd_term(teacher, None, True)
    assert base.support is not None
    support = base.support

    def counted(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        calls.append(int(rows.numel()))
        return support.ids(z, rows)

    term = RowTerm(base.fn, support=RowSupport(counted, support.fn))
    out = head_scores(hidden, weight, labels, bias=bias, terms=[term], chunk_size=5)
    (out.values[0].sum() + out.logprobs.sum()).backward()
    assert calls == [5, 5, 5, 5, 3]


def test_head_logits_at_reads_the_head_at_ids(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, bias, _, _ = _setup(gen, rand)
    ids = torch.randint(0, V, (N, K), generator=gen)
    want = head_logits(hidden, weight, bias, 0.7).gather(-1, ids)
    got = head_logits_at(hidden, weight, ids, bias, 0.7)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # float32 and the bf16 regime (a half projection dtype rounds the logits to it, as head_logits does)
    h32, w32, b32 = hidden.detach().float(), weight.detach().float(), bias.detach().float()
    torch.testing.assert_close(head_logits_at(h32, w32, ids, b32), head_logits(h32, w32, b32).gather(-1, ids))
    half = head_logits_at(h32, w32, ids, b32, precision=torch.bfloat16)
    assert half.dtype == torch.float32
    assert torch.equal(half, half.bfloat16().float())  # rounded to bf16 by the product
    full = head_logits(h32, w32, b32, precision=torch.bfloat16).gather(-1, ids)
    torch.testing.assert_close(half, full, rtol=8e-3, atol=1e-2)  # one bf16 ulp at most


def test_generalized_jsd_on_support_is_the_top_k_divergence(gen, rand) -> None:  # type: ignore[no-untyped-def]
    student = rand(gen, 3, 6, V, grad=True)
    teacher = rand(gen, 3, 6, V)
    ids = top_k_ids(student, K)
    s = torch.log_softmax(student, dim=-1).gather(-1, ids)
    t = torch.log_softmax(teacher, dim=-1).gather(-1, ids)
    for alpha in (0.0, 0.5, 1.0):
        for tail in (True, False):
            want = generalized_jsd_per_token(student, teacher, alpha=alpha, top_k=K, add_tail=tail)
            got = generalized_jsd_on_support(s, t, alpha=alpha, add_tail=tail)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_bad_support_inputs_name_the_problem(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden, weight, _, labels, _ = _setup(gen, rand)
    with pytest.raises(ValueError, match="top_k"):
        top_k_ids(hidden, V + 1)
    with pytest.raises(ValueError, match="student's shape"):
        generalized_jsd_on_support(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(n=23, k\) torch.long"):
        head_logits_at(hidden, weight, torch.zeros(N, K, dtype=torch.int32))
    bad = RowTerm(
        lambda z, rows: z.sum(-1),
        support=RowSupport(lambda z, rows: torch.zeros(3, 2, dtype=torch.long), lambda *a: a[1]),
    )
    with pytest.raises(ValueError, match="support ids"):
        head_scores(hidden, weight, labels, terms=[bad], chunk_size=4)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("half_active", [True, False])
def test_weighted_sums_use_the_support_form(gen, rand, chunk_size, half_active) -> None:  # type: ignore[no-untyped-def]
    """The other chunked execution: ``chunked_weighted_sums`` evaluates the support form (``fn`` is never called)
    and gives the dense term's total, values and gradients, through the total and through a value alone."""
    hidden, weight, bias, labels, teacher = _setup(gen, rand)
    active = torch.rand(N, generator=gen) > 0.4 if half_active else None
    base = _jsd_term(teacher, active, True)
    assert base.support is not None

    def refused(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the chunked execution called fn instead of the support form")

    term = RowTerm(refused, active=active, support=base.support)
    ce = RowTerm(lambda z, rows: -torch.log_softmax(z, dim=-1).gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1))
    coeff = [torch.linspace(0.5, 1.5, N, dtype=torch.float64), torch.full((N,), 1.0 / N, dtype=torch.float64)]
    kwargs = {"bias": bias, "temperature": 0.7}
    total, values = chunked_weighted_sums(
        hidden, weight, [term, ce], coeff, [0.3, 1.0], chunk_size=chunk_size, **kwargs
    )
    dense = head_scores(hidden, weight, labels, terms=[RowTerm(base.fn, active=active), ce], **kwargs)
    want_values = [(v * c).sum() for v, c in zip(dense.values, coeff, strict=True)]
    want_total = 0.3 * want_values[0] + want_values[1]
    torch.testing.assert_close(total, want_total, rtol=0, atol=1e-12)
    for got, want in zip(values, want_values, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    params = [hidden, weight, bias]
    for got, want in ((total, want_total), (values[0], want_values[0])):
        g_got = torch.autograd.grad(got, params, retain_graph=True)
        g_want = torch.autograd.grad(want, params, retain_graph=True)
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
