"""Mixed precision: crf's scoring against TRL's real scorer under ``bf16=True``, and float32 pinned bit for bit.

Trainers over copies of one random Qwen2 (float32 weights, CPU): TRL's ``GRPOTrainer`` with ``bf16=True``,
untouched (its fused LM head, ``trl.kernels.ChunkedLogProbFunction``, under the accelerator's autocast), and
``ComposerReplicationTrainer`` with only the GRPO channel, its head chunked three tokens at a time or
materialised, with the bf16 head and with ``cast_lm_head_to_fp32=True``. Per-token log-probs, entropies, the loss
of ``compute_loss`` and every parameter gradient must agree to bf16-appropriate tolerances, and crf in plain
float32 (``bf16=False``) must *fail* the same tolerances, so the checks can see the precision regime.

The float32 pin replays the float32 path of crf's scorer as it was before autocast was honoured (decoder, then
``h Wᵀ`` in float32, ``logsumexp``, gather; per chunk of rows when chunked), op for op in plain PyTorch, and
requires ``torch.equal``; the loss must equal TRL's ``compute_loss`` fed those values exactly.
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
_TRL = importlib.metadata.version("trl")
if tuple(int(part) for part in _TRL.split(".")[:2]) < (1, 16):
    pytest.skip(
        f"crf's bf16 scoring follows TRL 1.16's fused LM head (bf16 product, float32 log-softmax); this interpreter "
        f"has trl {_TRL}, which scores bf16 another way (Python 3.10 resolves trl 1.14)",
        allow_module_level=True,
    )

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer  # noqa: E402
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm  # noqa: E402

B, P, C = 4, 5, 6
CHUNK = 3
# Measured on this batch: crf's bf16 log-probs, entropies and loss equal TRL's exactly (0.0), gradients to
# 2e-8 .. 6e-8 relative norm (float32 summation order); crf in float32 is 6e-4 .. 1e-3 away in log-probs,
# 4e-5 .. 3e-4 relative in the loss and 3e-3 .. 4e-3 in gradients. Tolerances sit between the two.
TOL_LOGP = 2e-5
TOL_LOSS = 5e-6
TOL_GRAD = 1e-5


def _zero_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def _args(output_dir: Path, *, bf16: bool, cast: bool) -> dict[str, Any]:
    return {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": B,
        "num_generations": 2,
        "max_completion_length": C,
        "loss_type": "grpo",
        "epsilon": 0.2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "bf16": bf16,
        "cast_lm_head_to_fp32": cast,
    }


@pytest.fixture(scope="module")
def model_and_data() -> tuple[Any, Any, Dataset]:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, architecture="qwen2", hidden_size=32, num_layers=2, num_heads=2, seed=3)
    return model, tokenizer, Dataset.from_list([{"prompt": "def f(x):"}] * 8)


@pytest.fixture(scope="module")
def trainer(
    model_and_data: tuple[Any, Any, Dataset], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., GRPOTrainer]:
    """``trainer(kind, bf16=..., cast=..., chunking=...)``: one cached trainer per setting (``kind`` 'trl' or 'crf')."""
    model, tokenizer, dataset = model_and_data
    cache: dict[tuple[Any, ...], GRPOTrainer] = {}

    def make(kind: str, *, bf16: bool, cast: bool, chunking: str = "on") -> GRPOTrainer:
        key = (kind, bf16, cast, chunking)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{kind}-{bf16}-{cast}-{chunking}")
            common = {"model": copy.deepcopy(model), "reward_funcs": _zero_reward, "train_dataset": dataset}
            if kind == "trl":
                built: GRPOTrainer = GRPOTrainer(
                    args=GRPOConfig(**_args(out, bf16=bf16, cast=cast)), processing_class=tokenizer, **common
                )
            else:
                config = ComposerConfig(
                    **_args(out, bf16=bf16, cast=cast), sdpo_weight=0.0, lm_head_chunking=chunking, chunk_size=CHUNK
                )
                built = ComposerReplicationTrainer(args=config, processing_class=tokenizer, **common)
            built.model.train()
            built.current_gradient_accumulation_steps = 1
            built.beta = 0.04  # KL on; the batch carries the reference log-probs
            cache[key] = built
        return cache[key]

    return make


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[0, 4:] = 0  # right padding
    completion_mask[2, 2:] = 0
    return {
        "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab, (B, C), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1]),
        "num_items_in_batch": completion_mask.sum(),
        # near the model's log-probs (about -4.6 on this vocabulary), so ratios sit around the clip range
        "old_per_token_logps": -torch.rand(B, C, generator=g) * 0.5 - 4.4,
        "ref_per_token_logps": -torch.rand(B, C, generator=g) * 0.5 - 4.4,
    }


def _ids(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    return ids, torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)


def _scores(trainer: GRPOTrainer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = _ids(batch)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, C, compute_entropy=True
        )
    assert entropies is not None
    return logps, entropies


def _loss_and_grads(trainer: GRPOTrainer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = trainer.compute_loss(trainer.model, dict(batch))
    return loss.detach(), list(torch.autograd.grad(loss, list(trainer.model.parameters())))


def _grad_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """``‖g − g_TRL‖ / ‖g_TRL‖`` over every parameter's gradient, concatenated."""
    diff = torch.cat([(a.double() - b.double()).flatten() for a, b in zip(got, want, strict=True)])
    return float(diff.norm() / torch.cat([b.double().flatten() for b in want]).norm())


@pytest.mark.parametrize("chunking", ["on", "off"])
@pytest.mark.parametrize("cast", [False, True], ids=["bf16-head", "cast_lm_head_to_fp32"])
def test_bf16_log_probs_and_entropies_equal_trl_scorer(
    trainer: Callable[..., GRPOTrainer], cast: bool, chunking: str
) -> None:
    trl = trainer("trl", bf16=True, cast=cast)
    batch = _batch(trl.model.config.vocab_size)
    real = batch["completion_mask"].bool()
    want_lp, want_ent = _scores(trl, batch)
    got_lp, got_ent = _scores(trainer("crf", bf16=True, cast=cast, chunking=chunking), batch)
    lp_err = float((got_lp - want_lp)[real].abs().max())
    ent_err = float((got_ent - want_ent)[real].abs().max())
    print(f"bf16 cast={cast} chunking={chunking}: log-prob error {lp_err:.3e}, entropy error {ent_err:.3e}")
    assert lp_err <= TOL_LOGP
    assert ent_err <= TOL_LOGP
    assert bool((got_lp[~real] == 0).all())
    # crf in plain float32 cannot pass the same check: the tolerance sees the precision regime
    fp32_lp, _ = _scores(trainer("crf", bf16=False, cast=cast, chunking=chunking), batch)
    assert float((fp32_lp - want_lp)[real].abs().max()) > 10 * TOL_LOGP


@pytest.mark.parametrize("chunking", ["on", "off"])
@pytest.mark.parametrize("cast", [False, True], ids=["bf16-head", "cast_lm_head_to_fp32"])
def test_bf16_loss_and_gradients_equal_trl_compute_loss(
    trainer: Callable[..., GRPOTrainer], cast: bool, chunking: str
) -> None:
    trl = trainer("trl", bf16=True, cast=cast)
    batch = _batch(trl.model.config.vocab_size)
    want, want_grads = _loss_and_grads(trl, batch)
    got, got_grads = _loss_and_grads(trainer("crf", bf16=True, cast=cast, chunking=chunking), batch)
    loss_err = abs(float(got) - float(want)) / abs(float(want))
    grad_err = _grad_error(got_grads, want_grads)
    print(
        f"bf16 cast={cast} chunking={chunking}: loss {float(want):.6f}, relative error {loss_err:.3e}, "
        f"gradient relative error {grad_err:.3e}"
    )
    assert any(bool((g != 0).any()) for g in want_grads)
    assert loss_err <= TOL_LOSS
    assert grad_err <= TOL_GRAD
    fp32, fp32_grads = _loss_and_grads(trainer("crf", bf16=False, cast=cast, chunking=chunking), batch)
    assert abs(float(fp32) - float(want)) / abs(float(want)) > TOL_LOSS
    assert _grad_error(fp32_grads, want_grads) > TOL_GRAD


def _float32_replay(model: Any, ids: torch.Tensor, mask: torch.Tensor, chunk: int | None) -> tuple[torch.Tensor, ...]:
    """crf's float32 scorer as it was, op for op: decoder states of the real completion tokens, per chunk of rows
    ``z = h.float() @ W.float().t()``, ``lse = logsumexp(z)``, ``z[y] − lse`` and ``lse − p·z``."""
    start = ids.shape[1] - C
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    real = mask[:, start:] > 0
    rows, labels = hidden[:, start - 1 : -1][real], ids[:, start:][real]
    weight = model.get_output_embeddings().weight
    step = rows.shape[0] if chunk is None else chunk
    logps, entropies = [], []
    for i in range(0, rows.shape[0], step):
        z = rows[i : i + step].to(torch.float32) @ weight.to(torch.float32).t()
        lse = torch.logsumexp(z, dim=-1)
        logps.append(z.gather(-1, labels[i : i + step].unsqueeze(-1)).squeeze(-1) - lse)
        p = torch.exp(z - lse.unsqueeze(-1))
        entropies.append(lse - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).reshape(-1))
    spread = [torch.zeros(real.shape).masked_scatter(real, torch.cat(x)) for x in (logps, entropies)]
    return spread[0], spread[1]


@pytest.mark.parametrize("chunking", ["on", "off"])
def test_float32_stays_bit_identical(
    trainer: Callable[..., GRPOTrainer], chunking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = trainer("crf", bf16=False, cast=False, chunking=chunking)
    batch = _batch(ours.model.config.vocab_size)
    ids, mask = _ids(batch)
    with torch.no_grad():
        want_lp, want_ent = _float32_replay(ours.model, ids, mask, CHUNK if chunking == "on" else None)
    got_lp, got_ent = _scores(ours, batch)
    assert torch.equal(got_lp, want_lp)
    assert torch.equal(got_ent, want_ent)
    # the loss is TRL's math on those values, bit for bit
    trl = trainer("trl", bf16=False, cast=False)
    monkeypatch.setattr(
        trl,
        "_get_per_token_logps_and_entropies",
        lambda model, i, m, k, **kw: (*_float32_replay(model, i, m, CHUNK if chunking == "on" else None), None),
    )
    assert torch.equal(
        ours.compute_loss(ours.model, dict(batch)).detach(), trl.compute_loss(trl.model, dict(batch)).detach()
    )
    # and the pin is sensitive: the bf16 regime is not bit-identical to it
    bf16_lp, _ = _scores(trainer("crf", bf16=True, cast=False, chunking=chunking), batch)
    assert not torch.equal(bf16_lp, want_lp)
