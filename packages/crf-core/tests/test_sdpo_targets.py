"""``sdpo_targets``: the one home of SDPO's inputs (teacher forward, completion offset, row mapping, old log-probs),
used by ``compose_loss`` and ``ComposerReplicationTrainer`` alike; ``SDPOChannel.term_at`` on other row layouts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from crf_core.channels import LMHead, SDPOChannel, SDPOConfig, first_error_mask, sdpo_targets
from crf_distill import generalized_jsd_per_token

VOCAB, B, P, C = 96, 3, 5, 4


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    completion = torch.randint(0, VOCAB, (B, C), generator=g)
    prompt = torch.randint(0, VOCAB, (B, P), generator=g)
    mask = torch.ones(B, P + C, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded teacher prompt
    return {"completion": completion, "teacher_ids": torch.cat([prompt, completion], dim=1), "teacher_mask": mask}


def test_teacher_runs_on_signalled_samples_and_rows_map_to_the_completion(tiny_causal_lm: Any) -> None:
    batch = _batch()
    head = LMHead(tiny_causal_lm)
    seen: list[torch.Tensor] = []

    def teacher(ids: torch.Tensor, mask: torch.Tensor) -> Any:
        seen.append(ids)
        return head, head.states(ids, mask)

    signal = torch.tensor([True, False, True])
    old = torch.randn(B, C)
    targets = sdpo_targets(
        batch["completion"],
        signal,
        teacher=teacher,
        teacher_input_ids=batch["teacher_ids"],
        teacher_attention_mask=batch["teacher_mask"],
        old_logprobs=old,
    )
    assert len(seen) == 1
    assert torch.equal(seen[0], batch["teacher_ids"][signal])  # the unsignalled sample is never scored
    with torch.no_grad():
        full = tiny_causal_lm(input_ids=batch["teacher_ids"], attention_mask=batch["teacher_mask"]).logits
    want = full[:, P - 1 : P - 1 + C]  # position P - 1 + j predicts completion token j
    for b in (0, 2):
        rows = torch.arange(b * C, (b + 1) * C)
        torch.testing.assert_close(targets.teacher(rows), want[b], rtol=1e-5, atol=1e-6)
    assert targets.labels is not None
    assert torch.equal(targets.labels, batch["completion"].reshape(-1))
    assert targets.old_logprobs is not None
    assert torch.equal(targets.old_logprobs, old.reshape(-1))


def test_precomputed_teacher_logits_need_no_forward() -> None:
    batch = _batch()
    logits = torch.randn(B, C, VOCAB)
    targets = sdpo_targets(batch["completion"], torch.ones(B, dtype=torch.bool), teacher_logits=logits)
    assert torch.equal(targets.teacher(torch.tensor([5, 0])), logits.reshape(B * C, VOCAB)[[5, 0]])


def test_first_error_truncation_lives_in_the_builder(tiny_causal_lm: Any) -> None:
    """``truncate_below`` zeroes the token weights after each signalled row's first error, from the teacher's own
    log-probs of the completion tokens: the same with precomputed logits and with the teacher forward."""
    batch = _batch()
    head = LMHead(tiny_causal_lm)
    signal = torch.tensor([True, False, True])
    weights = torch.ones(B, C) * signal[:, None]
    weights[0, 1] = 0.0  # a tool-result token stays out
    with torch.no_grad():
        full = tiny_causal_lm(input_ids=batch["teacher_ids"], attention_mask=batch["teacher_mask"]).logits
    logits = full[:, P - 1 : P - 1 + C]
    logprobs = torch.log_softmax(logits.double(), -1).gather(-1, batch["completion"][..., None])[..., 0]
    probs = logprobs.exp().flatten().sort().values
    k = int((probs[1:] / probs[:-1])[3:-3].argmax()) + 3  # a wide gap mid-way: float32 and float64 agree on sides
    threshold = float((probs[k] * probs[k + 1]).sqrt())  # some rows have an error before their end
    want = first_error_mask(logprobs, weights.double(), threshold).float()
    assert not torch.equal(want, weights), "the threshold must truncate something, or the test could not fail"
    precomputed = sdpo_targets(
        batch["completion"], signal, teacher_logits=logits, weights=weights, truncate_below=threshold
    )
    forward = sdpo_targets(
        batch["completion"],
        signal,
        teacher=lambda ids, mask: (head, head.states(ids, mask)),
        teacher_input_ids=batch["teacher_ids"],
        teacher_attention_mask=batch["teacher_mask"],
        weights=weights,
        truncate_below=threshold,
    )
    assert precomputed.weights is not None
    assert forward.weights is not None
    assert torch.equal(precomputed.weights, want)
    assert torch.equal(forward.weights, want)
    assert torch.equal(weights[0], torch.tensor([1.0, 0.0, 1.0, 1.0]))  # the caller's weights are not modified
    plain = sdpo_targets(batch["completion"], signal, teacher_logits=logits, weights=weights)
    assert plain.weights is weights
    with pytest.raises(ValueError, match="needs the \\(B, C\\) token weights"):
        sdpo_targets(batch["completion"], signal, teacher_logits=logits, truncate_below=threshold)


def test_no_signal_runs_no_teacher() -> None:
    batch = _batch()

    def teacher(ids: torch.Tensor, mask: torch.Tensor) -> Any:
        raise AssertionError("the teacher must not run without a signal")

    targets = sdpo_targets(
        batch["completion"],
        torch.zeros(B, dtype=torch.bool),
        teacher=teacher,
        teacher_input_ids=batch["teacher_ids"],
        teacher_attention_mask=batch["teacher_mask"],
    )
    with pytest.raises(RuntimeError, match="no sample has a teacher signal"):
        targets.teacher(torch.tensor([0]))


def test_teacher_ids_must_end_with_the_completion() -> None:
    batch = _batch()
    bad = batch["teacher_ids"].clone()
    bad[0, -1] = (bad[0, -1] + 1) % VOCAB
    with pytest.raises(ValueError, match="must end with the same C completion tokens"):
        sdpo_targets(
            batch["completion"],
            torch.ones(B, dtype=torch.bool),
            teacher=lambda ids, mask: pytest.fail("not reached"),
            teacher_input_ids=bad,
            teacher_attention_mask=batch["teacher_mask"],
        )


def test_term_at_reads_the_same_rows_from_any_scored_layout() -> None:
    """compose_loss scores every next-token row (negative positions are prompt rows), the trainer the real
    completion tokens: the same (sample, position) gives the same value, inactive rows are never evaluated."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(B, C, VOCAB, generator=g)
    student = torch.randn(B, C, VOCAB, generator=g)
    weights = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    channel = SDPOChannel(SDPOConfig())
    targets = sdpo_targets(torch.zeros(B, C, dtype=torch.long), weights.sum(-1) > 0, teacher_logits=teacher)
    sample = torch.tensor([0, 0, 2, 1, 0, 2])
    position = torch.tensor([3, -1, 2, 1, 2, 0])
    term = channel.term_at(targets, weights, sample, position)
    assert term.active is not None
    assert term.active.tolist() == [True, False, True, False, False, True]
    rows = term.active.nonzero(as_tuple=True)[0]
    got = term.fn(student[sample[rows], position[rows]], rows)
    want = generalized_jsd_per_token(student[sample[rows], position[rows]], teacher[sample[rows], position[rows]])
    torch.testing.assert_close(got, want)


def test_taid_settings_live_in_the_sdpo_config() -> None:
    config = SDPOConfig(wrapper="taid", taid_alpha_min=0.2, taid_alpha_max=0.8, taid_adaptive=False)
    schedule = config.taid_schedule()
    assert schedule is not None
    assert (schedule.t_start, schedule.t_end, schedule.disable_adaptive) == (0.2, 0.8, True)
    assert config.taid_t(5, 10) == pytest.approx(0.5)
    assert config.taid_t(None, None, schedule) == schedule.t
    assert SDPOConfig().taid_schedule() is None
    with pytest.raises(ValueError, match="must not exceed"):
        SDPOConfig(taid_alpha_min=0.9, taid_alpha_max=0.5)
    with pytest.raises(ValueError, match="same bounds"):
        SDPOConfig(wrapper="taid").taid_t(None, None, schedule)
