"""Every channel on multi-turn batches: no loss, and exactly zero gradient, on tool-result tokens.

* GRPO: the trainer's chunked channel against TRL's own ``GRPOTrainer.compute_loss`` on a batch whose completions
  hold tool-result tokens (``tool_mask`` 0 inside the completion), every loss type TRL ships: loss values and every
  parameter gradient in float64 (TRL given a float64 scorer, as in ``test_grpo_parity``).
* SDPO: the student term, alone and riding along GRPO's pass, with a tool-masked batch.
* trace-replay DPO: a multi-turn pair (assistant call, tool result, assistant answer) rendered as a conversation.

"Exactly zero" is read where it is unambiguous: the decoder's last hidden state at row ``t`` feeds only the LM head's
prediction of token ``t + 1``, so its gradient is zero exactly when the loss ignores that prediction. A forward hook
on the final norm captures those states; rows predicting tool-result tokens must get a gradient of exactly 0.0, rows
predicting trained tokens a non-zero one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.pairs import collate_pairs
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
B, P, C = 4, 5, 12
#: (row, first, end) of each tool result inside the completions: tool_mask is 0 there
TOOL_SPANS = [(0, 3, 7), (1, 2, 4), (1, 8, 10), (2, 5, 9)]
PARITY: dict[str, tuple[float, float]] = {}  # loss type -> (max |Δ value|, max |Δ gradient|), for the report


def _zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def _common(tmp_path: Path, loss_type: str = "grpo") -> dict[str, Any]:
    return {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": B,
        "num_generations": 2,
        "max_completion_length": C,
        "loss_type": loss_type,
        "epsilon": 0.2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "bf16": False,
    }


def _batch(vocab: int, *, double: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    dtype = torch.float64 if double else torch.float32
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[3, 9:] = 0
    tool_mask = torch.ones(B, C, dtype=torch.long)
    for row, first, end in TOOL_SPANS:
        tool_mask[row, first:end] = 0
    return {
        "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (B, C), generator=g),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=dtype),
        "old_per_token_logps": -torch.rand(B, C, generator=g, dtype=dtype) * 6.0 - 1.0,
        "num_items_in_batch": (completion_mask * tool_mask).sum().to(dtype),
    }


def _float64_scores(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Reference completion log-probs and entropies in float64 from the full logits (no crf code)."""
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    logits = model.lm_head(out[:, -logits_to_keep - 1 : -1]).double()
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, input_ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    real = attention_mask[:, -logits_to_keep:] > 0
    zero = torch.zeros((), dtype=lp.dtype)
    return (
        torch.where(real, lp, zero),
        torch.where(real, entropy, zero) if kwargs.get("compute_entropy") else None,
        None,
    )


@contextmanager
def final_states(model: Any) -> Iterator[list[torch.Tensor]]:
    """The decoder's last hidden states ``(B, T, H)`` of every forward that builds a graph, in order."""
    captured: list[torch.Tensor] = []

    def hook(module: Any, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            captured.append(output)

    handle = model.model.norm.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def _tool_rows(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, P + C)`` boolean rows of the final states predicting a tool-result token / a trained token."""
    completion_mask, tool_mask = batch["completion_mask"], batch["tool_mask"]
    tool = torch.zeros(B, P + C, dtype=torch.bool)
    trained = torch.zeros(B, P + C, dtype=torch.bool)
    tool[:, P - 1 : P - 1 + C] = (completion_mask * (1 - tool_mask)) > 0
    trained[:, P - 1 : P - 1 + C] = (completion_mask * tool_mask) > 0
    return tool, trained


def _check_rows(grad: torch.Tensor, tool: torch.Tensor, trained: torch.Tensor) -> None:
    assert grad.shape[:2] == tool.shape
    assert int(tool.sum()) == sum(end - first for _, first, end in TOOL_SPANS)
    assert bool((grad[tool] == 0).all()), "a tool-result token received a gradient"
    assert bool((grad[trained].abs().sum(-1) > 0).any()), "no trained token received a gradient"


def _grpo_pair(tmp_path: Path, loss_type: str) -> tuple[GRPOTrainer, ComposerReplicationTrainer]:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=3).double()
    dataset = Dataset.from_list([{"prompt": "def f(x):"}] * 8)
    trl = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=_zero_reward,
        args=GRPOConfig(**_common(tmp_path / "trl", loss_type)),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    ours = ComposerReplicationTrainer(
        model=copy.deepcopy(model),
        reward_funcs=_zero_reward,
        args=ComposerConfig(
            **_common(tmp_path / "crf", loss_type), sdpo_weight=0.0, lm_head_chunking="on", chunk_size=5
        ),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    for trainer in (trl, ours):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
    return trl, ours


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_chunked_grpo_honours_tool_mask_like_trl(
    tmp_path: Path, loss_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    trl, ours = _grpo_pair(tmp_path, loss_type)
    monkeypatch.setattr(trl, "_get_per_token_logps_and_entropies", _float64_scores)
    batch = _batch(trl.model.config.vocab_size)
    tool, trained = _tool_rows(batch)
    with final_states(trl.model) as trl_states:
        want = trl.compute_loss(trl.model, dict(batch))
    with final_states(ours.model) as our_states:
        got = ours.compute_loss(ours.model, dict(batch))
    assert got.dtype == want.dtype == torch.float64
    assert len(trl_states) == len(our_states) == 1  # one graph-building policy pass each
    trl_params, our_params = list(trl.model.parameters()), list(ours.model.parameters())
    *g_want, h_want = torch.autograd.grad(want, [*trl_params, trl_states[0]])
    *g_got, h_got = torch.autograd.grad(got, [*our_params, our_states[0]])
    value_error = abs(got.item() - want.item())
    grad_error = max(float((a - b).abs().max()) for a, b in zip(g_got, g_want, strict=True))
    PARITY[loss_type] = (value_error, grad_error)
    print(f"\n[tool_mask parity] {loss_type}: max |Δ loss| {value_error:.3e}, max |Δ grad| {grad_error:.3e}")
    assert torch.allclose(got.detach(), want.detach(), rtol=1e-10, atol=1e-12), (float(got), float(want))
    assert any(bool((g != 0).any()) for g in g_want)
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-12)
    _check_rows(h_want, tool, trained)  # TRL itself trains nothing there ...
    _check_rows(h_got, tool, trained)  # ... and neither does the chunked channel


def test_tool_mask_changes_the_grpo_loss(tmp_path: Path) -> None:
    """Control: the mask is read (without it the tool-result tokens would be trained)."""
    _, ours = _grpo_pair(tmp_path, "dapo")
    batch = _batch(ours.model.config.vocab_size)
    unmasked = {k: v for k, v in batch.items() if k != "tool_mask"}
    unmasked["num_items_in_batch"] = batch["completion_mask"].sum().double()
    with torch.no_grad():
        assert float(ours.compute_loss(ours.model, dict(batch))) != float(ours.compute_loss(ours.model, unmasked))


def _sdpo_trainer(tmp_path: Path, grpo_weight: float) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=5).double()
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=_zero_reward,
        args=ComposerConfig(
            **_common(tmp_path, "dapo"),
            grpo_weight=grpo_weight,
            sdpo_weight=1.0,
            sdpo_top_k=8,
            sdpo_teacher="live",
            lm_head_chunking="on",
            chunk_size=5,
        ),
        train_dataset=Dataset.from_list([{"prompt": "def f(x):"}] * 8),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.mark.parametrize("grpo_weight", [0.0, 1.0], ids=["sdpo-alone", "sdpo-with-grpo"])
def test_sdpo_never_trains_on_tool_results(tmp_path: Path, grpo_weight: float) -> None:
    trainer = _sdpo_trainer(tmp_path, grpo_weight)
    batch = _batch(trainer.model.config.vocab_size)
    g = torch.Generator().manual_seed(2)
    batch["sdpo_teacher_prompt_ids"] = torch.randint(4, trainer.model.config.vocab_size, (B, P + 3), generator=g)
    batch["sdpo_teacher_prompt_mask"] = torch.ones(B, P + 3, dtype=torch.long)
    batch["sdpo_mask"] = torch.ones(B, dtype=torch.float64)
    tool, trained = _tool_rows(batch)
    with final_states(trainer.model) as states:
        sdpo = trainer.sdpo_channel_loss(trainer.model, dict(batch))
    assert sdpo is not None
    assert len(states) == 1
    (grad,) = torch.autograd.grad(sdpo, [states[0]])
    _check_rows(grad, tool, trained)
    with final_states(trainer.model) as states:
        composed = trainer.compute_loss(trainer.model, dict(batch))
    assert len(states) == 1  # with GRPO on, the SDPO student rides along GRPO's pass: both channels' gradient
    (grad,) = torch.autograd.grad(composed, [states[0]])
    _check_rows(grad, tool, trained)


def test_sdpo_loss_is_zero_when_every_token_is_a_tool_result(tmp_path: Path) -> None:
    """A completion made only of tool results gives SDPO nothing to distil."""
    trainer = _sdpo_trainer(tmp_path, 0.0)
    batch = _batch(trainer.model.config.vocab_size)
    batch["sdpo_teacher_prompt_ids"] = batch["prompt_ids"].flip(1)
    batch["sdpo_teacher_prompt_mask"] = torch.ones(B, P, dtype=torch.long)
    batch["sdpo_mask"] = torch.ones(B, dtype=torch.float64)
    all_tool = dict(batch, tool_mask=torch.zeros(B, C, dtype=torch.long))
    with torch.no_grad():
        assert trainer.sdpo_channel_loss(trainer.model, all_tool) == 0.0


MULTI_TURN = {
    "prompt": "@U:add\n@A:",
    "chosen": "",
    "rejected": "",
    "prompt_messages": [{"role": "user", "content": "Write add."}],
    "chosen_messages": [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": '{"code": "a - b"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1 of 1 tests failed: returned -1; expected 3"},
        {"role": "assistant", "content": "a + b"},
    ],
    "rejected_messages": [{"role": "assistant", "content": "a * b"}],
}


def test_trace_replay_dpo_scores_assistant_turns_only(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=7).double()
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=_zero_reward,
        args=ComposerConfig(
            **_common(tmp_path),
            sdpo_weight=0.0,
            trace_replay_dpo_weight=1.0,
            trace_replay_batch_size=1,
            trace_replay_max_length=256,
            dpo_variant="simpo",
        ),
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 8),
        processing_class=tokenizer,
        trace_replay_pairs=[dict(MULTI_TURN, chosen="x", rejected="y")],
    )
    trainer.model.train()
    pair = trainer._pairs[0]
    assert pair.chosen_mask is not None
    chosen_text = tokenizer.decode(pair.chosen_ids)
    scored = tokenizer.decode([t for t, m in zip(pair.chosen_ids, pair.chosen_mask, strict=True) if m])
    assert "@T:1 of 1 tests failed" in chosen_text  # the conversation is intact ...
    assert scored == '<call>{"name": "run_tests", "arguments": {"code": "a - b"}}</call><eos>a + b<eos>'  # ... scored
    batch = collate_pairs(trainer._pairs, trainer._pad_id())
    with final_states(trainer.model) as states:
        loss = trainer.trace_replay_channel_loss(trainer.model, [0])
    assert len(states) == 1
    (grad,) = torch.autograd.grad(loss, [states[0]])
    response = batch.response_mask.bool()
    predicts_scored = torch.zeros_like(response)
    predicts_scored[:, :-1] = response[:, 1:]
    inside = torch.zeros_like(response)  # rows predicting tokens of the responses, scored or not
    for row in range(2):
        n_prompt = len(pair.prompt_ids)
        n_total = n_prompt + len(pair.chosen_ids if row == 0 else pair.rejected_ids)
        inside[row, n_prompt - 1 : n_total - 1] = True
    unscored = inside & ~predicts_scored
    assert bool(unscored[0].any())  # the tool result and the headers
    assert bool((grad[unscored] == 0).all()), "a tool-result token of a DPO pair received a gradient"
    assert bool((grad[predicts_scored].abs().sum(-1) > 0).all())
