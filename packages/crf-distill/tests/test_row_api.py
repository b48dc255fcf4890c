"""One chunked API: ``RowTerm`` with ``head_scores`` / ``chunked_weighted_sums``; the per-token entry points of
``crf_distill.chunked`` are adapters over it, bit for bit."""

from __future__ import annotations

import importlib

import torch

import crf_distill
from crf_distill import (
    ChunkTerm,
    RowTerm,
    chunked_fused_loss,
    chunked_token_logprobs,
    chunked_weighted_sums,
    generalized_jsd_per_token,
    head_scores,
    token_logprobs,
)

N, H, V = 17, 5, 11


def test_chunked_fused_loss_is_chunked_weighted_sums_of_row_terms(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden = rand(gen, N, H, scale=1.0, grad=True)
    weight = rand(gen, V, H, scale=1.0, grad=True)
    teacher = rand(gen, N, V, scale=1.0)
    labels = torch.randint(0, V, (N,), generator=gen)
    w = torch.rand(N, generator=gen, dtype=hidden.dtype)
    w[::3] = 0

    def jsd(s: torch.Tensor, t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        assert t is not None
        return generalized_jsd_per_token(s, t, alpha=0.3)

    def ce(s: torch.Tensor, t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        assert t is None  # a term that does not need the teacher never computes it
        return -token_logprobs(s, labels[rows])

    terms = [ChunkTerm(jsd, w, 2.0), ChunkTerm(ce, w, 0.5, needs_teacher=False)]
    total, values = chunked_fused_loss(hidden, weight, terms, teacher_logits=teacher, chunk_size=4)
    source = teacher.detach().__getitem__
    rows = [t.row_term(source) for t in terms]
    assert all(isinstance(r, RowTerm) for r in rows)
    total_b, values_b = chunked_weighted_sums(hidden, weight, rows, [w, w], [2.0, 0.5], chunk_size=4)
    assert torch.equal(total, total_b)
    for a, b in zip(values, values_b, strict=True):
        assert torch.equal(a, b)
    ga = torch.autograd.grad(total, (hidden, weight))
    gb = torch.autograd.grad(total_b, (hidden, weight))
    for a, b in zip(ga, gb, strict=True):
        assert torch.equal(a, b)


def test_chunked_token_logprobs_is_head_scores(gen, rand) -> None:  # type: ignore[no-untyped-def]
    hidden = rand(gen, N, H, scale=1.0, grad=True)
    weight = rand(gen, V, H, scale=1.0, grad=True)
    labels = torch.randint(0, V, (N,), generator=gen)
    got = chunked_token_logprobs(hidden, weight, labels, chunk_size=3, ignore_index=None)
    want = head_scores(hidden, weight, labels, chunk_size=3).logprobs
    assert torch.equal(got, want)


def test_one_name_for_a_row_source() -> None:
    chunked = importlib.import_module("crf_distill.chunked")
    assert chunked.RowSource is crf_distill.RowSource
    assert not hasattr(chunked, "TeacherFn")
