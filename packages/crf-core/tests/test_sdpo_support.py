"""The SDPO term in support form: top-k, read at the student's ids, with the teacher's log-normaliser.

``SDPOChannel.term`` gives a top-k term (no wrapper) over a ``RowLogits`` teacher a ``RowSupport``; the chunked head
then never projects the teacher onto the full vocabulary. Checked in float64 against the same term scored densely
(values and gradients to 1e-12) for both teacher sources, with the IS weight on behaviour log-probs, without the
tail and on half the rows; through ``sdpo_targets`` and ``SDPOChannel.term_at`` (the rows both callers score); and
where there is no support form (wrappers, the full vocabulary, a plain callable).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from crf_core.channels import (
    LMHead,
    RowLogits,
    SDPOChannel,
    SDPOConfig,
    SDPOTargets,
    hidden_source,
    logits_source,
    sdpo_targets,
)
from crf_distill import RowTerm, head_scores

N = 14


@pytest.fixture
def head(make_tiny_causal_lm: Any) -> LMHead:
    return LMHead(make_tiny_causal_lm(vocab_size=41).double(), temperature=0.8)


def _teacher(head: LMHead, kind: str, gen: torch.Generator) -> RowLogits:
    index = torch.randperm(N, generator=gen)  # scored row -> teacher row
    if kind == "hidden":
        states = torch.randn(N, head.weight.shape[1], generator=gen, dtype=torch.float64)
        return hidden_source(head, states, lambda rows: index[rows])
    logits = torch.randn(N, head.weight.shape[0], generator=gen, dtype=torch.float64) * 2
    return logits_source(logits, lambda rows: index[rows])


@pytest.mark.parametrize("kind", ["hidden", "logits"])
@pytest.mark.parametrize(
    "config",
    [
        {"alpha": 0.5, "top_k": 5},
        {"alpha": 0.0, "top_k": 5, "add_tail": False},
        {"alpha": 1.0, "top_k": 41, "is_clip": 1.5},
        {"alpha": 0.3, "top_k": 3, "is_clip": 2.0},
    ],
)
@pytest.mark.parametrize("behaviour", [True, False])
def test_support_form_equals_the_dense_term(head: LMHead, kind: str, config: dict, behaviour: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    channel = SDPOChannel(SDPOConfig(**config))
    hidden = torch.randn(N, head.weight.shape[1], generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, head.weight.shape[0], (N,), generator=gen)
    old = torch.randn(N, generator=gen, dtype=torch.float64) - 3.0 if behaviour else None
    targets = SDPOTargets(_teacher(head, kind, gen), labels=labels, old_logprobs=old)
    active = torch.rand(N, generator=gen) > 0.3
    term = channel.term(targets, active)
    assert term.support is not None
    weight = head.weight
    got = head_scores(hidden, weight, labels, terms=[term], temperature=head.temperature, chunk_size=4)
    dense = RowTerm(term.fn, active=active)
    want = head_scores(hidden, weight, labels, terms=[dense], temperature=head.temperature, chunk_size=4)
    torch.testing.assert_close(got.values[0], want.values[0], rtol=0, atol=1e-12)
    assert float(got.values[0].detach().abs().sum()) > 0
    coeff = torch.linspace(0.5, 1.5, N, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((got.values[0] * coeff).sum() + got.logprobs.sum(), [hidden, weight]),
        torch.autograd.grad((want.values[0] * coeff).sum() + want.logprobs.sum(), [hidden, weight]),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["hidden", "logits"])
def test_row_logits_read_log_probs_at_ids(head: LMHead, kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    source = _teacher(head, kind, gen)
    rows = torch.tensor([0, 5, 9, 13])
    ids = torch.randint(0, head.weight.shape[0], (4, 6), generator=gen)
    want = torch.log_softmax(source(rows), dim=-1).gather(-1, ids)
    torch.testing.assert_close(source.logprobs_at(rows, ids), want, rtol=0, atol=1e-12)
    assert source.log_normaliser().shape == (N,)


def test_no_support_form_where_the_term_reads_the_full_vocabulary(head: LMHead) -> None:
    gen = torch.Generator().manual_seed(0)
    teacher = _teacher(head, "hidden", gen)
    active = torch.ones(N, dtype=torch.bool)
    full = SDPOChannel(SDPOConfig(top_k=None)).term(SDPOTargets(teacher), active)
    taid = SDPOChannel(SDPOConfig(top_k=5, wrapper="taid")).term(SDPOTargets(teacher, taid_t=0.5), active)
    opd = SDPOChannel(SDPOConfig(top_k=5, wrapper="entropy_opd", entropy_opd_h_max=1.0)).term(
        SDPOTargets(teacher), active
    )
    plain = SDPOChannel(SDPOConfig(top_k=5)).term(SDPOTargets(lambda rows: teacher(rows)), active)
    assert [t.support for t in (full, taid, opd, plain)] == [None, None, None, None]


@pytest.mark.parametrize("kind", ["forward", "logits"])
def test_sdpo_targets_keep_the_support_form_on_the_scored_rows(head: LMHead, kind: str) -> None:
    """What both callers build: ``sdpo_targets`` (a teacher forward or precomputed logits) re-indexed onto the scored
    rows by ``term_at`` keeps a ``RowLogits`` teacher, so the term keeps its support form there, equal to the dense
    term (values and gradients) with rows outside the completion and samples without a signal left out."""
    gen = torch.Generator().manual_seed(11)
    b, c, p, v = 3, 5, 4, head.weight.shape[0]
    completion = torch.randint(0, v, (b, c), generator=gen)
    signal = torch.tensor([True, False, True])
    weights = torch.ones(b, c, dtype=torch.float64) * signal[:, None]
    if kind == "logits":
        logits = torch.randn(b, c, v, generator=gen, dtype=torch.float64) * 2
        targets = sdpo_targets(completion, signal, teacher_logits=logits, weights=weights)
    else:
        prompt = torch.randint(0, v, (b, p), generator=gen)
        ids = torch.cat([prompt, completion], dim=1)
        targets = sdpo_targets(
            completion,
            signal,
            teacher=lambda i, m: (head, head.states(i, m)),
            teacher_input_ids=ids,
            teacher_attention_mask=torch.ones_like(ids),
            weights=weights,
        )
    assert isinstance(targets.teacher, RowLogits)
    sample = torch.arange(b).repeat_interleave(c + 1)  # each sample: one prompt row (position -1), then C tokens
    position = torch.arange(-1, c).repeat(b)
    term = SDPOChannel(SDPOConfig(top_k=6, alpha=0.3)).term_at(targets, weights, sample, position)
    assert term.support is not None
    n = sample.numel()
    hidden = torch.randn(n, head.weight.shape[1], generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=gen)
    got = head_scores(hidden, head.weight, labels, terms=[term], temperature=head.temperature, chunk_size=4)
    dense = RowTerm(term.fn, active=term.active)
    want = head_scores(hidden, head.weight, labels, terms=[dense], temperature=head.temperature, chunk_size=4)
    torch.testing.assert_close(got.values[0], want.values[0], rtol=0, atol=1e-12)
    assert bool((got.values[0][(position < 0) | ~signal[sample]] == 0).all())
    assert float(got.values[0].detach().abs().sum()) > 0
    (g_got,) = torch.autograd.grad(got.values[0].sum(), [hidden])
    (g_want,) = torch.autograd.grad(want.values[0].sum(), [hidden])
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-12)
