"""Typed pair records across the package boundary: crf-replaysim's ``LoadedPair`` goes straight into the trainer's
tokenisation as a ``PairRecord`` (no dict round-trip, no second validation of what crf-replaysim checked)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers", reason="the tokenizer needs the [train] extra")
pytest.importorskip("crf_replaysim", reason="pair files are read by crf-replaysim ([train] extra)")

import crf_replaysim as replaysim
from crf_core._testing.tiny_model import build_char_tokenizer
from crf_core.trainer.pair_files import read_pair_file
from crf_core.trainer.pairs import PairRecord, check_pair_records, tokenize_pairs


@pytest.mark.parametrize("fmt", ["records", "trl-standard", "trl-conversational"])
def test_loaded_pairs_tokenise_without_a_dict(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded, bad = replaysim.load_pairs(replaysim.example_pairs_path(fmt))
    assert not bad

    def no_mapping(record: Any, index: int = 0) -> PairRecord:
        raise AssertionError("a LoadedPair must not be re-parsed as a mapping")

    monkeypatch.setattr(PairRecord, "from_mapping", staticmethod(no_mapping))
    records = check_pair_records(loaded)
    assert all(type(r) is PairRecord for r in records)
    assert [r.chosen for r in records] == [item.pair.chosen for item in loaded]
    assert all((r.prompt_messages is None) == (fmt == "trl-standard") for r in records)
    from_file = read_pair_file(replaysim.example_pairs_path(fmt))
    assert from_file == records
    tokenizer = build_char_tokenizer()
    assert tokenize_pairs(records, tokenizer, 64) == tokenize_pairs(from_file, tokenizer, 64)


def test_mappings_are_checked_once_and_read_like_records() -> None:
    record = PairRecord.from_mapping({"prompt": "p", "chosen": "a", "rejected": "b", "ref_chosen_logps": -3})
    assert record.ref_chosen_logps == -3.0
    assert isinstance(record.ref_chosen_logps, float)
    assert record["chosen"] == "a"
    assert "prompt_messages" not in record
    with pytest.raises(KeyError):
        record["prompt_messages"]
    with pytest.raises(ValueError, match="needs a string 'chosen'"):
        check_pair_records([{"prompt": "p", "chosen": 3, "rejected": "b"}])
    with pytest.raises(ValueError, match="pair record 1: 'ref_rejected_logps' must be a finite number"):
        check_pair_records([record, {"prompt": "p", "chosen": "a", "rejected": "b", "ref_rejected_logps": "x"}])
    with pytest.raises(ValueError, match="no trace-replay pairs"):
        check_pair_records([])
