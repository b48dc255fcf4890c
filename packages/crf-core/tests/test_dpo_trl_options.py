"""TRL 1.16 DPOConfig names and loss-type lists on ComposerConfig and the trace-replay DPO channel."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from crf_core.channels.trace_replay_dpo import PreferenceConfig, SequenceLogps, TraceReplayDPOChannel
from crf_distill import DPO_LOSS_TYPES, dpo_loss


def _pairs(seed: int = 3) -> tuple[SequenceLogps, SequenceLogps, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    chosen = SequenceLogps(-torch.rand(4, generator=g, dtype=torch.float64) * 9, torch.tensor([3.0, 4.0, 2.0, 6.0]))
    rejected = SequenceLogps(-torch.rand(4, generator=g, dtype=torch.float64) * 9, torch.tensor([5.0, 1.0, 2.0, 3.0]))
    return chosen, rejected, -torch.rand(4, generator=g, dtype=torch.float64) * 9, -torch.rand(4, generator=g) * 9


@pytest.mark.parametrize("variant", DPO_LOSS_TYPES)
def test_channel_runs_every_trl_loss_type(variant: str) -> None:
    c, r, rc, rr = _pairs()
    got = TraceReplayDPOChannel(
        PreferenceConfig(variant=variant, beta=0.2, label_smoothing=1e-3, discopop_tau=0.5)
    ).loss(c, r, rc, rr)
    want = dpo_loss(
        c.total, r.total, rc, rr.double(), beta=0.2, loss_type=variant, label_smoothing=1e-3, discopop_tau=0.5,  # type: ignore[arg-type]
        chosen_lengths=c.length, rejected_lengths=r.length,
    )  # fmt: skip
    assert torch.allclose(got.loss, want, atol=1e-12)


@pytest.mark.parametrize("variant", [("sigmoid", "sft"), ["sigmoid", "sft"], "sigmoid, sft"])
def test_channel_combines_a_list_with_weights(variant: Any) -> None:
    c, r, rc, rr = _pairs()
    cfg = PreferenceConfig(variant=variant, loss_weights=(1.0, 0.25), discopop_tau=0.1)
    assert cfg.variant == ("sigmoid", "sft")
    got = TraceReplayDPOChannel(cfg).loss(c, r, rc, rr).loss
    ch = TraceReplayDPOChannel
    one = ch(PreferenceConfig(variant="sigmoid")).loss(c, r, rc, rr).loss
    sft = ch(PreferenceConfig(variant="sft")).loss(c, r, rc, rr).loss
    assert torch.allclose(got, one + 0.25 * sft, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": ("sigmoid", "hinge"), "loss_weights": (1.0,)}, "1 entries but dpo_variant names 2"),
        ({"variant": ("sigmoid", "simpo")}, "cannot be combined"),
        ({"variant": ("sigmoid", "kto")}, "dpo_variant must be one of"),
        ({"variant": ()}, "at least one"),
        ({"variant": "simpo", "loss_weights": (1.0,)}, "not to dpo_variant='simpo'"),
        ({"variant": ("sigmoid", "hinge"), "loss_weights": (1.0, float("inf"))}, r"dpo_loss_weights\[1\]"),
        ({"variant": "discopop", "discopop_tau": 0.0}, "dpo_discopop_tau"),
    ],
)
def test_preference_config_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PreferenceConfig(**kwargs)


trl = pytest.importorskip("trl", reason="ComposerConfig needs the [train] extra (trl)")


def _config(tmp_path: Any, **kwargs: Any) -> Any:
    from crf_core.trainer import ComposerConfig

    return ComposerConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_trl_names_are_aliases(tmp_path: Any) -> None:
    cfg = _config(
        tmp_path, dpo_variant="sigmoid,bco_pair,discopop", label_smoothing=0.1, loss_weights=[1.0, 0.5, 2.0],
        discopop_tau=0.2,
    )  # fmt: skip
    assert (cfg.dpo_label_smoothing, cfg.dpo_loss_weights, cfg.dpo_discopop_tau) == (0.1, [1.0, 0.5, 2.0], 0.2)
    pref = cfg.preference_config()
    assert (pref.variant, pref.loss_weights, pref.discopop_tau) == (
        ("sigmoid", "bco_pair", "discopop"),
        (1, 0.5, 2),
        0.2,
    )
    # the same value under both names is fine
    assert _config(tmp_path, label_smoothing=0.2, dpo_label_smoothing=0.2).dpo_label_smoothing == 0.2


def test_colliding_trl_names_keep_their_grpo_meaning(tmp_path: Any) -> None:
    from trl import GRPOConfig

    cfg = _config(tmp_path, beta=0.04, loss_type="dapo")
    assert (cfg.beta, cfg.loss_type, cfg.dpo_beta, cfg.dpo_variant) == (0.04, "dapo", 0.1, "sigmoid")
    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert {"beta", "loss_type"} <= grpo_fields  # why they are not aliased
    assert not {"label_smoothing", "loss_weights", "discopop_tau"} & grpo_fields  # why these are


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"label_smoothing": 0.1, "dpo_label_smoothing": 0.2}, "alias of `dpo_label_smoothing`.*set only one"),
        ({"discopop_tau": 0.3, "dpo_discopop_tau": 0.2}, "alias of `dpo_discopop_tau`"),
        ({"dpo_variant": "sigmoid,hinge", "loss_weights": [1.0]}, "1 entries but dpo_variant names 2"),
        ({"label_smoothing": 0.7}, "dpo_label_smoothing"),
        ({"ld_alpha": 0.5}, "ld_alpha.*sigmoid_norm"),
        ({"f_divergence_type": "js_divergence"}, "only 'reverse_kl'"),
        ({"use_weighting": True}, "use_weighting=False"),
        ({"dpo_variant": "sigmoid,kto"}, "dpo_variant must be one of"),
    ],
)
def test_trl_option_errors(tmp_path: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **kwargs)
