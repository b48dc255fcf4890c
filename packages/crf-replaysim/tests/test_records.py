"""DPO pair records: the shipped JSON Schema, round trips, and the two shapes (flat strings + chat lists)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import crf_replaysim
from crf_replaysim.messages import action_key, flatten_action, flatten_prompt
from crf_replaysim.records import (
    DJ_RECORD_KEYS,
    SCHEMA_VERSION,
    DPOPair,
    NormalizedDPOPair,
    RecordError,
    _dpo_pair_to_dj_record,
    load_schema,
    schema_path,
    validate_dj_record,
)

VALIDATOR = jsonschema.Draft202012Validator(load_schema())


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def sample_pair() -> DPOPair:
    return DPOPair(
        prompt_messages=[
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "the test."}]},
            {"role": "assistant", "content": None, "tool_calls": [call("c1", "run_command", {"command": "pytest -q"})]},
            {"role": "tool", "tool_call_id": "c1", "content": "1 failed"},
        ],
        chosen_messages=[
            {
                "role": "assistant",
                "content": "Reading the code first.",
                "tool_calls": [call("t1", "read_file", {"path": "src/a.py"})],
            }
        ],
        rejected_messages=[{"role": "assistant", "content": "Done — the tests pass. ✅"}],
        trace_id="fix-001",
        turn=4,
        meta={"teacher_model": "org/teacher", "scores": [0.5, 1]},
    )


def test_schema_ships_inside_the_package_and_is_a_valid_schema():
    path = schema_path()
    assert path.is_file()
    assert path.parent.parent == Path(crf_replaysim.__file__).parent
    jsonschema.Draft202012Validator.check_schema(load_schema())
    version = load_schema()["properties"]["schema_version"]
    assert version == {"type": "string", "pattern": rf"^{SCHEMA_VERSION.split('.')[0]}\.[0-9]+$"}
    assert re.fullmatch(version["pattern"].strip("^$"), SCHEMA_VERSION)
    assert set(load_schema()["required"]) == set(DJ_RECORD_KEYS)


def test_dj_record_has_both_shapes_and_validates_against_schema():
    record = _dpo_pair_to_dj_record(sample_pair())
    assert list(record) == list(DJ_RECORD_KEYS)
    VALIDATOR.validate(record)
    validate_dj_record(record)
    for side in ("chosen", "rejected", "prompt"):
        assert isinstance(record[side], str)
        assert isinstance(record[f"{side}_messages"], list)
        assert all(isinstance(m, dict) for m in record[f"{side}_messages"])


def test_flat_strings_render_text_and_tool_calls():
    record = _dpo_pair_to_dj_record(sample_pair())
    assert record["chosen"] == 'Reading the code first.\nread_file({"path": "src/a.py"})'
    assert record["rejected"] == "Done — the tests pass. ✅"
    assert record["prompt"] == (
        "system: You are a coding agent.\n\nuser: Fix the test.\n\n"
        'assistant: run_command({"command": "pytest -q"})\n\ntool: 1 failed'
    )
    two = [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert flatten_action(two) == "a\n\nb"
    assert flatten_prompt(two) == "assistant: a\n\nassistant: b"


def test_dj_record_does_not_share_lists_with_the_pair():
    pair = sample_pair()
    record = _dpo_pair_to_dj_record(pair)
    record["chosen_messages"][0]["content"] = "changed"
    record["meta"]["scores"].append(2)
    assert pair.chosen_messages[0]["content"] == "Reading the code first."
    assert pair.meta["scores"] == [0.5, 1]


def test_round_trip_through_json_loses_nothing():
    record = _dpo_pair_to_dj_record(sample_pair())
    line = json.dumps(record, ensure_ascii=False)
    normalized = NormalizedDPOPair.from_dj_record(json.loads(line))
    assert isinstance(normalized, NormalizedDPOPair)
    assert normalized.to_dj_record() == record
    assert json.dumps(normalized.to_dj_record(), ensure_ascii=False) == line


def test_round_trip_keeps_rewritten_flat_strings():
    """Mappers rewrite the flat strings; the normalized pair keeps the rewritten text and the chat lists."""
    record = _dpo_pair_to_dj_record(sample_pair())
    record["rejected"] = "Done - the tests pass."
    normalized = NormalizedDPOPair.from_dj_record(copy.deepcopy(record))
    assert normalized.rejected == "Done - the tests pass."
    assert normalized.rejected_messages == sample_pair().rejected_messages
    assert normalized.to_dj_record() == record


def test_data_juicer_internal_columns_are_tolerated_and_dropped():
    record = _dpo_pair_to_dj_record(sample_pair())
    with_stats = {**record, "__dj__stats__": {"text_len": 12}, "__dj__hash": "abc"}
    VALIDATOR.validate(with_stats)
    assert NormalizedDPOPair.from_dj_record(with_stats).to_dj_record() == record


def test_swapped_exchanges_sides_only():
    pair = sample_pair()
    swapped = pair.swapped()
    assert swapped.chosen_messages == pair.rejected_messages
    assert swapped.rejected_messages == pair.chosen_messages
    assert (swapped.prompt_messages, swapped.trace_id, swapped.turn, swapped.meta) == (
        pair.prompt_messages,
        pair.trace_id,
        pair.turn,
        pair.meta,
    )


def _mutations():
    """(name, mutate(record), error fragment): each makes the record invalid for both validators."""

    def setter(key, value):
        def mutate(r):
            r[key] = value

        return mutate

    def msg(side, i, **changes):
        def mutate(r):
            m = r[f"{side}_messages"][i]
            for k, v in changes.items():
                if v is KeyError:
                    m.pop(k, None)
                else:
                    m[k] = v

        return mutate

    return [
        ("missing key", lambda r: r.pop("turn"), "lacks"),
        ("unknown key", setter("score", 1.0), "unknown keys"),
        ("chosen as chat list", setter("chosen", [{"role": "assistant", "content": "x"}]), "flat string"),
        ("rejected as None", setter("rejected", None), "flat string"),
        ("messages as string", setter("chosen_messages", "hello"), "list of chat messages"),
        ("empty chosen_messages", setter("chosen_messages", []), "at least 1"),
        ("empty prompt_messages", setter("prompt_messages", []), "at least 1"),
        ("bad role", msg("prompt", 0, role="bot"), "'role'"),
        ("user without content", msg("prompt", 0, content=KeyError), "no 'content'"),
        ("user content null", msg("prompt", 0, content=None), "'content' is null"),
        ("empty assistant", msg("rejected", 0, content=""), "empty"),
        ("tool without id", msg("prompt", 3, tool_call_id=KeyError), "tool_call_id"),
        ("user with tool_calls", msg("prompt", 0, tool_calls=[]), "tool_calls"),
        (
            "arguments as object",
            msg("chosen", 0, tool_calls=[{"id": "t", "type": "function", "function": {"name": "f", "arguments": {}}}]),
            "JSON-encoded string",
        ),
        (
            "tool call without id",
            msg("chosen", 0, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{}"}}]),
            "'id'",
        ),
        ("content part without type", msg("prompt", 1, content=[{"text": "x"}]), "'type'"),
        ("negative turn", setter("turn", -1), "turn is -1"),
        ("boolean turn", setter("turn", True), "turn is True"),
        ("empty trace_id", setter("trace_id", ""), "trace_id"),
        ("meta as list", setter("meta", []), "meta is list"),
        ("old schema version", setter("schema_version", "0.9"), "schema_version"),
    ]


@pytest.mark.parametrize(("name", "mutate", "fragment"), _mutations(), ids=[m[0] for m in _mutations()])
def test_python_validator_and_json_schema_reject_the_same_records(name, mutate, fragment):
    record = _dpo_pair_to_dj_record(sample_pair())
    mutate(record)
    assert not VALIDATOR.is_valid(record), f"schema accepted: {name}"
    with pytest.raises(RecordError, match=r"Fix:|lacks|unknown") as info:
        validate_dj_record(record)
    assert fragment in str(info.value)


def test_constructors_validate():
    with pytest.raises(RecordError, match="chosen_messages"):
        DPOPair([{"role": "user", "content": "x"}], "not a list", [{"role": "assistant", "content": "y"}], "t", 1)  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="flat string"):
        NormalizedDPOPair("p", ["c"], "r", *[[{"role": "user", "content": "x"}]] * 3, "t", 1)  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="not valid JSON"):
        DPOPair(*[[{"role": "assistant", "content": "x"}]] * 3, "t", 1, meta={"loss": float("nan")})
    with pytest.raises(RecordError, match=r"meta\.span: tuple does not survive a JSON round trip"):
        DPOPair(*[[{"role": "assistant", "content": "x"}]] * 3, "t", 1, meta={"span": (1, 2)})
    with pytest.raises(RecordError, match=r"rejected_messages\[0\]\.name: set does not survive"):
        DPOPair(
            *[[{"role": "assistant", "content": "x"}]] * 2, [{"role": "assistant", "content": "x", "name": {1}}], "t", 1
        )
    with pytest.raises(TypeError, match="expected a DPOPair"):
        _dpo_pair_to_dj_record({"chosen": "x"})  # type: ignore[arg-type]


def test_action_key_ignores_ids_and_argument_key_order():
    a = {"role": "assistant", "content": " Look. ", "tool_calls": [call("x", "read_file", {"path": "a", "n": 1})]}
    b = {
        "role": "assistant",
        "content": "Look.",
        "tool_calls": [
            {"id": "y", "type": "function", "function": {"name": "read_file", "arguments": '{"n": 1, "path": "a"}'}}
        ],
    }
    assert action_key(a) == action_key(b)
    assert action_key(a) != action_key({**b, "content": "Looking."})
    assert action_key(a) != action_key({**b, "tool_calls": [call("y", "read_file", {"path": "b", "n": 1})]})


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
messages = st.lists(
    st.one_of(
        st.builds(lambda t: {"role": "user", "content": t}, text),
        st.builds(lambda t: {"role": "assistant", "content": t + "."}, text),
        st.builds(
            lambda name, arg: {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("c", name or "f", {"arg": arg})],
            },
            st.text("abcdef_", max_size=8),
            text,
        ),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(prompt=messages, chosen=messages, rejected=messages, turn=st.integers(0, 10_000), trace_id=text.filter(bool))
def test_random_pairs_round_trip_and_match_the_schema(prompt, chosen, rejected, turn, trace_id):
    record = _dpo_pair_to_dj_record(DPOPair(prompt, chosen, rejected, trace_id, turn, {"k": trace_id}))
    VALIDATOR.validate(record)
    line = json.dumps(record, ensure_ascii=False)
    assert NormalizedDPOPair.from_dj_record(json.loads(line)).to_dj_record() == record
