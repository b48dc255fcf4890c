"""The trainer reads trace-replay pair files through crf-replaysim's schema-checked reader.

The contract fixtures crf-replaysim ships in its wheel (the same four pairs as its records, TRL standard rows
and TRL conversational rows) are read by both packages' tests; here the trainer tokenises them, skips bad lines
with their line numbers (or fails with ``trace_replay_strict``) and refuses a newer major schema version.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")
pytest.importorskip("crf_replaysim", reason="pair files are read by crf-replaysim ([train] extra)")

from datasets import Dataset

import crf_replaysim as replaysim
from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.pair_files import read_pair_file

FORMATS = ["records", "trl-standard", "trl-conversational"]


def _reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def _trainer(tmp_path: Path, path: Path, **overrides: Any) -> ComposerReplicationTrainer:
    tokenizer = build_char_tokenizer()
    args = ComposerConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        sdpo_weight=0.0,
        trace_replay_dpo_weight=1.0,
        trace_replay_path=str(path),
        trace_replay_max_length=64,
        **overrides,
    )
    return ComposerReplicationTrainer(
        model=build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2),
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_shared_fixture_is_read_in_every_format(fmt: str) -> None:
    path = replaysim.example_pairs_path(fmt)
    records = read_pair_file(path)
    assert len(records) == 4
    reference = read_pair_file(replaysim.example_pairs_path("records"))
    for got, want in zip(records, reference, strict=True):
        assert got["chosen"] == want["chosen"]
        assert got["rejected"] == want["rejected"]
    # a TRL standard row is trained as written; chat pairs keep their messages for the chat template
    assert all(("prompt_messages" in r) == (fmt != "trl-standard") for r in records)


def test_trainer_trains_on_the_shared_fixture(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, replaysim.example_pairs_path("trl-conversational"))
    assert len(trainer._pairs) == 4
    trainer.model.train()
    loss = trainer.trace_replay_channel_loss(trainer.model, indices=[0, 1])
    assert loss.requires_grad
    assert float(loss.detach()) > 0
    # one real step with the trainer's own optimizer: the parameters move and the pairs' loss goes down
    torch.manual_seed(0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    optimizer = trainer.create_optimizer()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    moved = [n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert moved, "no parameter changed"
    after = trainer.trace_replay_channel_loss(trainer.model, indices=[0, 1])
    # measured: 0.6931472 -> 0.6930614 at the default learning rate (all 12 tensors move), ~1400x float32's
    # resolution at 0.69, and deterministic (the tiny model and the pairs are fixed)
    assert float(after.detach()) < float(loss.detach()) - 1e-5


def test_bad_lines_are_skipped_by_number_or_fail_when_strict(tmp_path: Path, caplog: Any) -> None:
    good = replaysim.example_pairs_path("records").read_text(encoding="utf-8").splitlines()
    newer = json.loads(good[0]) | {"schema_version": "2.0"}
    path = tmp_path / "pairs.jsonl"
    lines = [good[0], "{not json", json.dumps(newer), good[1], '{"prompt": "p", "chosen": 3}', good[2]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="crf_core.trainer.pair_files"):
        trainer = _trainer(tmp_path, path)
    assert len(trainer._pairs) == 3
    message = caplog.text
    assert "skipped 3 bad line(s)" in message
    for number in ("line 2", "line 3", "line 5"):
        assert number in message
    assert "upgrade crf-replaysim" in message
    with pytest.raises(replaysim.RecordError, match="line 2"):
        _trainer(tmp_path, path, trace_replay_strict=True)


def test_precomputed_references_travel_in_meta(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in replaysim.example_pairs_path("records").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["meta"] = {**row.get("meta", {}), "ref_chosen_logps": -10.0 - i, "ref_rejected_logps": -12.0}
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    trainer = _trainer(tmp_path, path)
    assert trainer.trace_replay_reference == "precomputed"
    assert trainer._pair_ref is not None
    assert trainer._pair_ref[0].tolist() == [-10.0, -11.0, -12.0, -13.0]
