"""First-error truncation of the SDPO channel (``sdpo_truncate_below``): the rule against a plain reference, and the
trainer's SDPO loss against an independent float64 computation of the truncated forward KL."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from crf_core.channels import SDPOConfig, first_error_mask


def _reference_mask(logprobs: list[list[float]], mask: list[list[float]], threshold: float) -> list[list[float]]:
    """Written from the rule's words: keep each row's tokens up to and including its first masked-in token whose
    teacher probability is below the threshold; nothing after it."""
    out = []
    for lps, ms in zip(logprobs, mask, strict=True):
        row, seen = [], False
        for lp, m in zip(lps, ms, strict=True):
            row.append(0.0 if seen else m)
            if m > 0 and math.exp(lp) < threshold:
                seen = True
        out.append(row)
    return out


def test_first_error_mask_matches_the_reference_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        b, c = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        logprobs = torch.log(torch.rand(b, c, generator=gen, dtype=torch.float64).clamp_min(1e-9))
        mask = (torch.rand(b, c, generator=gen) > 0.2).to(torch.float64)
        threshold = float(torch.rand((), generator=gen).clamp(0.01, 0.99))
        got = first_error_mask(logprobs, mask, threshold)
        assert got.dtype == mask.dtype
        assert got.tolist() == _reference_mask(logprobs.tolist(), mask.tolist(), threshold)


def test_first_error_mask_keeps_the_error_and_drops_what_follows() -> None:
    lp = torch.log(torch.tensor([[0.9, 0.8, 0.01, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9, 0.9], [0.01, 0.9, 0.9, 0.01, 0.9]]))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    got = first_error_mask(lp, mask, 0.1)
    # row 0: error at 2 kept, 3-4 dropped; row 1: no error; row 2: the masked-out first token is no error
    assert got.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]]


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((torch.zeros(2, 3), torch.ones(2, 3), 0.0), ValueError, r"probability in \(0, 1\)"),
        ((torch.zeros(2, 3), torch.ones(2, 3), 1.0), ValueError, r"probability in \(0, 1\)"),
        ((torch.zeros(2, 3), torch.ones(2, 3), True), ValueError, r"probability in \(0, 1\)"),
        ((torch.zeros(2, 3), torch.ones(2, 3), math.nan), ValueError, r"probability in \(0, 1\)"),
        ((torch.zeros(2, 3), torch.ones(3, 2), 0.1), ValueError, r"must both be \(B, C\)"),
        ((torch.zeros(6), torch.ones(6), 0.1), ValueError, r"must both be \(B, C\)"),
        ((torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), 0.1), TypeError, "floating-point"),
    ],
)
def test_first_error_mask_refuses_bad_input(args: tuple[Any, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        first_error_mask(*args)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5, math.inf, math.nan])
def test_config_refuses_a_threshold_outside_zero_one(value: float) -> None:
    with pytest.raises(ValueError, match="sdpo_truncate_below"):
        SDPOConfig(truncate_below=value)


# ----------------------------------------------------------------------------------------------- in the trainer
def _trainer(tiny_config: Callable[..., Any], tmp_path: Path, **overrides: Any) -> Any:
    pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
    from datasets import Dataset

    from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
    from crf_core.trainer import ComposerReplicationTrainer

    def all_fail(completions: list[str], **kwargs: Any) -> list[float]:
        kwargs["log_extra"]("feedback", [f"Test failed: got {i}; expected {i + 3}." for i in range(len(completions))])
        return [0.0] * len(completions)

    tokenizer = build_char_tokenizer()
    return ComposerReplicationTrainer(
        model=build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=5),
        reward_funcs=all_fail,
        # float32 (GRPOConfig defaults to bf16 autocast), so the float64 reference is the precision that decides
        args=tiny_config(tmp_path, sdpo_top_k=None, sdpo_alpha=0.0, max_completion_length=10, bf16=False, **overrides),
        train_dataset=Dataset.from_list([{"prompt": "def add(a, b):\n    return"}] * 8),
        processing_class=tokenizer,
    )


def _reference_loss(model: Any, batch: dict[str, Any], threshold: float | None) -> tuple[float, int]:
    """Forward KL(teacher ‖ student) per completion token, in float64, token-averaged over the first-error-truncated
    mask: the teacher is the initial policy (the EMA teacher before any step) on ``[reprompt ; completion]``, the
    student the policy on ``[prompt ; completion]``. Returns the loss and the number of tokens kept."""
    ref = copy.deepcopy(model).double().eval()
    prompt, completion = batch["prompt_ids"], batch["completion_ids"]
    c = completion.shape[1]
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(prompt.shape[0]):
            if float(batch["sdpo_mask"][i]) == 0:
                continue
            # the same left-padded rows and attention masks the trainer scores (TRL's layout)
            done = batch["completion_mask"][i]
            s_ids, s_mask = torch.cat([prompt[i], completion[i]]), torch.cat([batch["prompt_mask"][i], done])
            t_ids = torch.cat([batch["sdpo_teacher_prompt_ids"][i], completion[i]])
            t_mask = torch.cat([batch["sdpo_teacher_prompt_mask"][i], done])
            s = torch.log_softmax(ref(input_ids=s_ids[None], attention_mask=s_mask[None]).logits[0, -c - 1 : -1], -1)
            t = torch.log_softmax(ref(input_ids=t_ids[None], attention_mask=t_mask[None]).logits[0, -c - 1 : -1], -1)
            seen = False
            for j in range(c):
                if seen or batch["completion_mask"][i, j] == 0:
                    continue
                total += float((t[j].exp() * (t[j] - s[j])).sum())
                count += 1
                if threshold is not None and math.exp(float(t[j, completion[i, j]])) < threshold:
                    seen = True
    return total / count, count


def test_truncated_sdpo_loss_equals_the_float64_reference(tiny_config: Callable[..., Any], tmp_path: Path) -> None:
    threshold = 0.2
    trainer = _trainer(tiny_config, tmp_path, sdpo_truncate_below=threshold)
    trainer.model.train()
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([{"prompt": "def add(a, b):\n    return"}] * 4)
    got = float(trainer.sdpo_channel_loss(trainer.model, batch))
    want, kept = _reference_loss(trainer.model, batch, threshold)
    full, every = _reference_loss(trainer.model, batch, None)
    assert kept < every, "the batch must have tokens after a first error, or the test could not fail"
    assert got == pytest.approx(want, rel=1e-4)  # float32 KL of nearby distributions: ~1e-5 apart on some builds
    assert abs(want - full) > 1e-3 * abs(full)
    untruncated = _trainer(tiny_config, tmp_path / "plain")
    assert float(untruncated.sdpo_channel_loss(untruncated.model, batch)) == pytest.approx(full, rel=1e-4)
