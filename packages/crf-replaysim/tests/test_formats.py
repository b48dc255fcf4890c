"""TRL's preference formats in and out, the versioned schema, and the ``read_pairs`` contract crf-core relies on."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any

import pytest

from crf_replaysim import SCHEMA_VERSION, LoadedPair, example_pairs_path, load_pairs, read_pairs
from crf_replaysim.cli import main
from crf_replaysim.formats import FormatReader, detect_format, dj_record_to_trl, trl_row_to_dj_record
from crf_replaysim.normalize import DJNormalizer, normalize_jsonl
from crf_replaysim.records import DPOPair, RecordError, _dpo_pair_to_dj_record, validate_dj_record

STANDARD = {
    "prompt": "Fix the failing test in utils.py. ",
    "chosen": "I will open utils.py, read the failing assertion and patch the loop bound.",
    "rejected": "Delete the test so the suite passes again, nobody will notice.",
}
TOOL_CALL = {"type": "function", "function": {"name": "read_file", "arguments": {"path": "utils.py"}}}
CONVERSATIONAL = {
    "prompt": [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix utils.py."}],
    "chosen": [
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "def f(x): return x"},
        {"role": "assistant", "content": "The function is fine; the test expects the wrong value."},
    ],
    "rejected": [{"role": "assistant", "content": "Everything works, nothing to do here at all."}],
}


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_trl_standard_row_keeps_its_strings_and_gets_chat_lists():
    record = trl_row_to_dj_record(STANDARD, "trl-standard", source_id="p.jsonl:3")
    validate_dj_record(record)
    assert (record["prompt"], record["chosen"], record["rejected"]) == tuple(STANDARD.values())
    assert record["prompt_messages"] == [{"role": "user", "content": STANDARD["prompt"]}]
    assert record["chosen_messages"] == [{"role": "assistant", "content": STANDARD["chosen"]}]
    assert (record["trace_id"], record["turn"], record["meta"]) == ("p.jsonl:3", 1, {"source_format": "trl-standard"})
    assert dj_record_to_trl(record, "trl-standard") == {
        **STANDARD,
        "schema_version": SCHEMA_VERSION,
        "trace_id": "p.jsonl:3",
        "turn": 1,
    }


def test_trl_conversational_row_becomes_openai_chat_with_tool_calls():
    record = trl_row_to_dj_record(CONVERSATIONAL, "trl-conversational", source_id="row-0")
    validate_dj_record(record)
    (call,) = record["chosen_messages"][0]["tool_calls"]
    assert call == {
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "utils.py"}'},
        "id": "call_1",
    }
    assert record["chosen_messages"][1]["tool_call_id"] == "call_1"  # matched to the call it answers
    assert record["chosen"].startswith('read_file({"path": "utils.py"})')
    assert record["prompt"] == "system: You are a coding agent.\n\nuser: Fix utils.py."
    assert record["turn"] == 2
    row = dj_record_to_trl(record, "trl-conversational")
    assert row["prompt"] == CONVERSATIONAL["prompt"]
    assert row["rejected"] == CONVERSATIONAL["rejected"]


@pytest.mark.parametrize("fmt", ["trl-standard", "trl-conversational"])
def test_implicit_prompt_is_the_shared_prefix_as_trl_extracts_it(fmt):
    if fmt == "trl-standard":
        row = {"chosen": STANDARD["prompt"] + STANDARD["chosen"], "rejected": STANDARD["prompt"] + STANDARD["rejected"]}
    else:
        row = {k: CONVERSATIONAL["prompt"] + CONVERSATIONAL[k] for k in ("chosen", "rejected")}
    record = trl_row_to_dj_record(row, fmt, source_id="r")  # type: ignore[arg-type]
    assert record["meta"]["prompt_extracted"] is True
    trl = pytest.importorskip("trl")
    expected = trl.extract_prompt(row)
    if fmt == "trl-standard":
        assert (record["prompt"], record["chosen"], record["rejected"]) == (
            expected["prompt"],
            expected["chosen"],
            expected["rejected"],
        )
    else:
        assert record["prompt_messages"] == expected["prompt"]
        assert record["rejected_messages"] == expected["rejected"]


def test_extra_columns_go_to_meta_and_tools_are_kept():
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    row = {**CONVERSATIONAL, "tools": json.dumps(tools), "score_chosen": 8.5, "trace_id": "task-7", "turn": 9}
    record = trl_row_to_dj_record(row, "trl-conversational", source_id="r")
    assert record["meta"] == {"source_format": "trl-conversational", "score_chosen": 8.5, "tools": tools}
    assert (record["trace_id"], record["turn"]) == ("task-7", 9)
    assert json.loads(dj_record_to_trl(record, "trl-conversational")["tools"]) == tools


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"prompt": "p", "chosen": "c"}, "lacks"),
        ({"prompt": ["x"], "chosen": "c", "rejected": "r"}, "strings in prompt"),
        ({"prompt": "p", "chosen": "same", "rejected": ""}, "empty"),
        (
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "robot", "content": "a"}],
                "rejected": [],
            },
            "role",
        ),
        ({**STANDARD, "schema_version": "3.0"}, "newer"),
        ({**STANDARD, "tools": "{not json"}, "tools is a string but not JSON"),
    ],
)
def test_bad_trl_rows_are_refused_with_the_fix(row, match):
    with pytest.raises(RecordError, match=match):
        FormatReader().convert(row, "r")


def test_format_detection_and_one_format_per_input():
    record = _dpo_pair_to_dj_record(
        DPOPair(
            [{"role": "user", "content": "q"}],
            [{"role": "assistant", "content": "a"}],
            [{"role": "assistant", "content": "b"}],
            "t",
            1,
        )
    )
    assert [detect_format(r) for r in (record, STANDARD, CONVERSATIONAL)] == [
        "records",
        "trl-standard",
        "trl-conversational",
    ]
    reader = FormatReader()
    reader.convert(STANDARD, "a")
    with pytest.raises(RecordError, match="started as trl-standard"):
        reader.convert(CONVERSATIONAL, "b")
    with pytest.raises(RecordError, match="input format is 'records'"):
        FormatReader("records").convert(STANDARD, "a")
    with pytest.raises(RecordError, match="input format is 'trl'"):
        FormatReader("trl").convert(record, "a")


def test_dpo_pair_method_is_the_seed_function():
    pair = DPOPair([{"role": "user", "content": "q"}], [{"role": "assistant", "content": "a"}],
                   [{"role": "assistant", "content": "b"}], "t", 1, {"k": [1]})  # fmt: skip
    assert pair.to_dj_record() == _dpo_pair_to_dj_record(pair)


def test_normalizer_reads_trl_and_writes_trl_in_the_input_flavour(tmp_path):
    rows = [STANDARD, {**STANDARD, "prompt": "Another task entirely. "}, STANDARD]  # the third is a duplicate
    src = write(tmp_path / "std.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["normalize", str(src), "-o", str(out), "--output-format", "trl", "--quiet"]) == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in kept] == rows[:2]
    summary = normalize_jsonl(src, out, output_format="records")
    assert summary.input_format == "trl-standard"
    assert summary.dropped_per_op["document_deduplicator(pair)"] == 1
    conv = list(DJNormalizer(skip_dj=True, output_format="trl").normalize([CONVERSATIONAL]))
    assert conv[0]["chosen"][0]["tool_calls"][0]["function"]["arguments"] == '{"path": "utils.py"}'
    records = list(DJNormalizer(skip_dj=True, output_format="trl").normalize([json.loads(
        example_pairs_path().read_text().splitlines()[0])]))  # fmt: skip
    assert isinstance(records[0]["prompt"], list)  # records are chat lists: conversational


def test_schema_versions_same_major_read_other_majors_refused(tmp_path):
    first = json.loads(example_pairs_path().read_text().splitlines()[0])
    newer_minor = {**first, "schema_version": "1.7", "new_optional_field": {"x": 1}}
    rows = [first, newer_minor, {**first, "schema_version": "2.0"}, {**first, "schema_version": "0.9"}]
    items = list(read_pairs(write(tmp_path / "p.jsonl", rows)))
    assert [type(i).__name__ for i in items] == ["LoadedPair", "LoadedPair", "RecordError", "RecordError"]
    assert "upgrade crf-replaysim" in str(items[2])
    assert items[2].line == 3
    assert "older than this crf-replaysim reads" in str(items[3])
    with pytest.raises(RecordError, match="unknown keys"):
        validate_dj_record({**first, "new_optional_field": 1})  # not tolerated at the current minor


@pytest.mark.parametrize("fmt", ["records", "trl-standard", "trl-conversational"])
def test_contract_fixtures_ship_in_the_wheel_and_read_the_same(fmt):
    path = importlib.resources.files("crf_replaysim").joinpath("data").joinpath(example_pairs_path(fmt).name)
    assert path.is_file()
    pairs, errors = load_pairs(example_pairs_path(fmt))
    assert errors == []
    assert len(pairs) == 4
    assert all(isinstance(p, LoadedPair) and p.format == fmt for p in pairs)
    assert [p.line for p in pairs] == [1, 2, 3, 4]
    assert [p.chat for p in pairs] == [fmt != "trl-standard"] * 4
    records = [p.pair for p in load_pairs(example_pairs_path("records"))[0]]
    assert [(p.pair.trace_id, p.pair.turn, p.pair.chosen, p.pair.rejected) for p in pairs] == [
        (r.trace_id, r.turn, r.chosen, r.rejected) for r in records
    ]
    assert any(m.get("tool_calls") for r in records for m in r.chosen_messages + r.rejected_messages)
    rows = [json.loads(line) for line in example_pairs_path(fmt).read_text().splitlines()]
    assert {r["schema_version"] for r in rows} == {SCHEMA_VERSION}
    if fmt != "records":  # the TRL fixtures are exactly what the converter writes
        assert rows == [dj_record_to_trl(r.to_dj_record(), fmt) for r in records]  # type: ignore[arg-type]


def _tiny_tokenizer(tmp_path: Path) -> Any:
    """A byte-level BPE tokenizer trained offline on a few sentences, with a ChatML template."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([json.dumps(STANDARD), json.dumps(CONVERSATIONAL)] * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments }}){% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


@pytest.mark.parametrize("fmt", ["trl-standard", "trl-conversational"])
def test_trl_output_feeds_dpo_trainer_directly(tmp_path, fmt):
    """`--output-format trl` rows load with `datasets` and train a tiny model for one DPOTrainer step."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "trl.jsonl"
    assert main(["normalize", str(example_pairs_path()), "-o", str(out), "--skip-dj", "--quiet",
                 "--output-format", fmt]) == 0  # fmt: skip
    dataset = datasets.load_dataset("json", data_files=str(out), split="train")
    assert dataset.num_rows == 4
    tok = _tiny_tokenizer(tmp_path)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096,
    )  # fmt: skip
    model_dir = tmp_path / "tiny-model"  # saved to disk: DPOTrainer loads its reference copy from there
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2, report_to=[],
        max_length=256, save_strategy="no", logging_steps=1, use_cpu=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = trl.DPOTrainer(model=str(model_dir), args=args, train_dataset=dataset, processing_class=tok)
    result = trainer.train()
    assert result.global_step == 1
