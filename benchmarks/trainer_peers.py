"""The trainers that `trainer_memory.py` and `trainer_overhead.py` put side by side, built one way for both.

Kinds (`KINDS`), each paired with the peer its ratio is taken against (`PEER`):

* ``trl``: TRL's ``GRPOTrainer``;
* ``crf-grpo``: ``ComposerReplicationTrainer`` with the GRPO channel only (peer ``trl``);
* ``crf-all``: every channel, GRPO + SDPO (EMA self-teacher) + trace-replay DPO (peer ``trl``);
* ``trl-sdpo``: ``trl.experimental.sdpo.SDPOTrainer``, half policy gradient and half distillation on the
  student's top-`SDPO_TOP_K` tokens plus a tail bucket, EMA teacher (the setting of the TRL comparison in the
  issue "Coming from TRL"); feedback through its ``privileged_context`` column;
* ``crf-sdpo``: crf's GRPO + SDPO at the same setting (``distillation_*`` names, as a TRL user writes them;
  feedback through the reward's ``log_extra``) (peer ``trl-sdpo``).

Every kind gets the same model, data, reward and GRPO settings (``common``).
"""

from __future__ import annotations

import os
from typing import Any

KINDS = ("trl", "crf-grpo", "crf-all", "trl-sdpo", "crf-sdpo")
PEER = {"crf-grpo": "trl", "crf-all": "trl", "crf-sdpo": "trl-sdpo"}
PROMPTS = [
    "def add(a, b):\n    return",
    "def sub(a, b):\n    return",
    "def neg(x):\n    return",
    "def sq(x):\n    return",
]
PAIRS = [{"prompt": p, "chosen": " a + b", "rejected": " a - b"} for p in PROMPTS]
FEEDBACK = "the answer has even length"
SDPO_TOP_K = 100
SDPO = {
    "distillation_weight": 0.5,
    "distillation_mode": "topk_logits",
    "distillation_topk": SDPO_TOP_K,
    "distillation_add_tail": True,
    "teacher_model_kind": "ema",
    "include_environment_feedback": True,  # TRL's SDPOTrainer then reads `privileged_context`; crf's default
}
"""The SDPO setting both SDPO kinds run, in TRL `SDPOConfig`'s names (crf's `ComposerConfig` accepts them)."""


def feedback_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Cheap deterministic reward (1 for an odd-length completion) that reports feedback on the failures through
    crf's ``log_extra``, so SDPO has a teacher signal on every step."""
    if "log_extra" in kwargs:
        kwargs["log_extra"]("feedback", [None if len(c) % 2 else FEEDBACK for c in completions])
    return [float(len(c) % 2) for c in completions]


def dataset(repeats: int) -> Any:
    """The prompts ``repeats`` times; the ``privileged_context`` column is TRL SDPOTrainer's feedback source."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p, "privileged_context": FEEDBACK} for p in PROMPTS] * repeats)


def build(kind: str, model: Any, tokenizer: Any, train: Any, common: dict[str, Any]) -> Any:
    """A trainer of ``kind`` (one of `KINDS`) on ``model`` with the shared settings ``common``."""
    kwargs = {"model": model, "reward_funcs": feedback_reward, "train_dataset": train, "processing_class": tokenizer}
    if kind == "trl":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    if kind == "trl-sdpo":
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        # SDPOTrainer builds its EMA teacher by loading the student again from `config._name_or_path`
        folder = os.path.join(common["output_dir"], "student")
        model.save_pretrained(folder)
        model.config._name_or_path = folder
        return SDPOTrainer(args=SDPOConfig(**common, **SDPO), **kwargs)
    if kind not in KINDS:
        raise ValueError(f"unknown trainer kind {kind!r}; choose one of {', '.join(KINDS)}")
    from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

    if kind == "crf-sdpo":
        config = ComposerConfig(**common, **SDPO)
    else:
        every = kind == "crf-all"
        config = ComposerConfig(
            **common, sdpo_weight=1.0 if every else 0.0, trace_replay_dpo_weight=1.0 if every else 0.0
        )
    return ComposerReplicationTrainer(args=config, trace_replay_pairs=PAIRS if kind == "crf-all" else None, **kwargs)
