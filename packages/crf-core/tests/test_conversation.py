"""The pieces multi-turn rollouts are built from: the character tokenizer's tool-calling format, conversations
rendered with their assistant turns marked, multi-turn trace-replay pairs, SDPO's environment feedback and
demonstrations, and the warm start. No sandbox needed."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

pytest.importorskip("trl", reason="the trainer needs the [train] extra (trl)")

import torch
from trl.chat_template_utils import (
    is_chat_template_prefix_preserving,
    parse_response,
    qwen2_5_chat_template,
    qwen3_chat_template,
    supports_tool_calling,
)

from crf_core.messages import action_text, message_text
from crf_core.trainer import ComposerConfig
from crf_core.trainer.conversation import check_messages, normalise_messages, render_conversation
from crf_core.trainer.episodes import environment_feedback
from crf_core.trainer.pairs import collate_pairs, tokenize_pairs
from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.trainer.warm_start import warm_start_on_episodes

USER = [{"role": "user", "content": "Write add."}]


def tool_turn(name: str, arguments: Any, content: str | None = "") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}],
    }


EPISODE = [
    tool_turn("run_tests", '{"code": "a - b"}', "draft"),
    {"role": "tool", "tool_call_id": "c1", "content": "1 of 1 tests failed."},
    {"role": "assistant", "content": "a + b"},
]


def scored_text(tokenizer: Any, ids: Any, mask: Any) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])


# ---------------------------------------------------------------------------------------- the tiny tool format
def test_tool_calling_char_tokenizer_passes_trls_checks() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)
    assert not supports_tool_calling(build_char_tokenizer())  # the plain template stays as it was


def test_tool_calls_round_trip_through_trls_parser() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    prefix = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = (
        'let me test<call>{"name": "run_tests", "arguments": {"code": "def add(a, b):\\n    return a + b"}}</call><eos>'
    )
    parsed = parse_response(tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"], prefix=prefix)
    assert parsed["content"] == "let me test"
    assert parsed["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "run_tests", "arguments": {"code": "def add(a, b):\n    return a + b"}},
        }
    ]
    broken = tokenizer('<call>{"name": "run_tests", "argu</call><eos>', add_special_tokens=False)["input_ids"]
    assert "tool_calls" not in parse_response(tokenizer, broken, prefix=prefix)  # malformed: read as text


def test_tool_template_renders_every_role() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, *USER, *normalise_messages(EPISODE)], tokenize=False
    )
    assert text == (
        '@S:S\n@U:Write add.\n@A:draft<call>{"name": "run_tests", "arguments": {"code": "a - b"}}</call><eos>'
        "@T:1 of 1 tests failed.\n@A:a + b<eos>"
    )


def test_char_tokenizer_refuses_bad_tool_calling_flags() -> None:
    with pytest.raises(TypeError, match="tool_calling"):
        build_char_tokenizer(tool_calling="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="characters of the tool format"):
        build_char_tokenizer("abc", tool_calling=True)


# ---------------------------------------------------------------------------------------- render_conversation
def test_assistant_turns_are_trained_and_tool_results_are_not() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    rendered = render_conversation(tokenizer, USER, EPISODE)
    assert len(rendered.trained) == len(rendered.input_ids)
    assert tokenizer.decode(rendered.input_ids[: rendered.context_tokens]) == "@U:Write add.\n"
    assert scored_text(tokenizer, rendered.input_ids, rendered.trained) == (
        'draft<call>{"name": "run_tests", "arguments": {"code": "a - b"}}</call><eos>a + b<eos>'
    )


def test_a_real_models_template_works_too() -> None:
    """Qwen2.5's template (TRL ships it): the end-of-turn marker is trained, the newline after it and the tool's
    `<tool_response>` turn are not."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = qwen2_5_chat_template
    rendered = render_conversation(
        tokenizer, USER, EPISODE, tools=[{"type": "function", "function": {"name": "run_tests"}}]
    )
    assert scored_text(tokenizer, rendered.input_ids, rendered.trained) == (
        'draft\n<tool_call>\n{"name": "run_tests", "arguments": {"code": "a - b"}}\n</tool_call><|im_end|>'
        "a + b<|im_end|>"
    )


def test_a_template_that_is_not_prefix_preserving_is_refused() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = qwen3_chat_template  # drops earlier turns' reasoning once a later user turn follows
    response = [
        {"role": "assistant", "content": "<think>x</think>a"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "b"},
    ]
    with pytest.raises(ValueError, match="not prefix-preserving"):
        render_conversation(tokenizer, USER, response)


@pytest.mark.parametrize(
    ("context", "response", "match"),
    [
        ([], EPISODE, "context must be a list of at least 1"),
        (USER, [{"role": "tool", "tool_call_id": "c", "content": "x"}], "no assistant message"),
        (USER, [{"role": "robot", "content": "x"}], "role 'robot'"),
        (USER, [{"role": "user", "content": "x", "tool_calls": []}], "only an assistant message"),
        (USER, [tool_turn("run", 3)], "arguments must be a dict or a JSON string"),
        (USER, [{"role": "assistant", "content": 5}], "content is int"),
    ],
)
def test_render_conversation_refuses_bad_messages(context: Any, response: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_conversation(build_char_tokenizer(tool_calling=True), context, response)


def test_render_conversation_needs_a_chat_template() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    tokenizer.chat_template = None
    with pytest.raises(TypeError, match="no chat template"):
        render_conversation(tokenizer, USER, EPISODE)


def test_normalise_messages_decodes_json_arguments_only() -> None:
    out = normalise_messages([tool_turn("a", '{"x": 1}'), tool_turn("b", "not json"), tool_turn("c", "[1]")])
    assert [m["tool_calls"][0]["function"]["arguments"] for m in out] == [{"x": 1}, "not json", "[1]"]
    check_messages(out, "out")


# ---------------------------------------------------------------------------------------- multi-turn pairs
def _record(**overrides: Any) -> dict[str, Any]:
    record = {
        "prompt": "user: Write add.",
        "chosen": "draft\nrun_tests(...)",
        "rejected": "a * b",
        "prompt_messages": USER,
        "chosen_messages": EPISODE,
        "rejected_messages": [{"role": "assistant", "content": "a * b"}],
    }
    return {**record, **overrides}


def test_chat_pairs_share_the_context_and_score_assistant_turns() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    (pair,) = tokenize_pairs([_record()], tokenizer, 512, render="auto")
    assert tokenizer.decode(pair.prompt_ids) == "@U:Write add.\n"
    assert pair.chosen_mask is not None
    assert pair.rejected_mask is not None
    assert scored_text(tokenizer, pair.rejected_ids, pair.rejected_mask) == "a * b<eos>"
    batch = collate_pairs([pair], tokenizer.pad_token_id)
    chosen_scored = batch.input_ids[0][batch.response_mask[0] > 0]
    assert "@T:" not in tokenizer.decode(chosen_scored)
    assert tokenizer.decode(chosen_scored).endswith("a + b<eos>")


def test_flat_rendering_is_unchanged() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    (pair,) = tokenize_pairs([_record()], tokenizer, 512, render="flat")
    assert pair.chosen_mask is None
    assert tokenizer.decode(pair.chosen_ids) == "draft\nrun_tests(...)<eos>"
    (plain,) = tokenize_pairs([_record()], build_char_tokenizer(), 512, render="auto")  # plain template: flat
    assert plain.chosen_mask is None


def test_chat_rendering_needs_the_message_lists() -> None:
    record = _record()
    del record["chosen_messages"]
    with pytest.raises(ValueError, match="trace_replay_render='chat' needs"):
        tokenize_pairs([record], build_char_tokenizer(tool_calling=True), 512, render="chat")
    (pair,) = tokenize_pairs([record], build_char_tokenizer(tool_calling=True), 512, render="auto")
    assert pair.chosen_mask is None


def test_auto_falls_back_to_flat_for_a_record_the_template_cannot_render(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = qwen3_chat_template  # renders tool calls, but drops earlier turns' reasoning
    reasoning = [*USER, {"role": "assistant", "content": "<think>x</think>a"}, {"role": "user", "content": "more"}]
    record = _record(prompt_messages=reasoning)
    with caplog.at_level(logging.WARNING):
        (pair,) = tokenize_pairs([record], tokenizer, 512, render="auto")
    assert pair.chosen_mask is None
    assert "train as flat text" in caplog.text
    with pytest.raises(ValueError, match=r"pair record 0: .*not prefix-preserving"):
        tokenize_pairs([record], tokenizer, 512, render="chat")


def test_a_pair_cut_to_no_assistant_token_is_refused() -> None:
    with pytest.raises(ValueError, match="no chosen assistant token fits in trace_replay_max_length=3"):
        tokenize_pairs([_record()], build_char_tokenizer(tool_calling=True), 3, render="chat")


def test_trace_replay_render_is_validated(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="trace_replay_render must be one of"):
        ComposerConfig(output_dir=str(tmp_path), trace_replay_render="xml", report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="render must be one of"):
        tokenize_pairs([_record()], build_char_tokenizer(), 64, render="xml")


# ---------------------------------------------------------------------------------------- SDPO's inputs
class _Env:
    def __init__(self, feedback: Any) -> None:
        self._feedback = feedback

    @property
    def feedback(self) -> Any:
        return self._feedback


class _MethodEnv:
    def feedback(self) -> str:
        return "x"


def test_environment_feedback() -> None:
    assert environment_feedback(None, 2) is None
    assert environment_feedback([object(), object()], 2) is None  # no environment reports feedback
    assert environment_feedback([_Env("failed"), _Env(None), object()], 3) == ["failed", None, None]
    with pytest.raises(ValueError, match="2 environments for 3 rollouts"):
        environment_feedback([_Env("a"), _Env("b")], 3)
    with pytest.raises(TypeError, match="make it a property"):
        environment_feedback([_MethodEnv()], 1)
    with pytest.raises(TypeError, match="must be a str or None"):
        environment_feedback([_Env(3)], 1)


def test_action_text_of_a_tool_calling_rollout() -> None:
    assert action_text(EPISODE) == 'draft\nrun_tests({"code": "a - b"})\na + b'
    single = [{"role": "assistant", "content": "a + b"}]
    assert action_text(single) == message_text(single)  # without tools: unchanged
    assert action_text("plain") == "plain"
    dict_args = [tool_turn("submit", {"code": "x"}, None)]
    assert action_text(dict_args) == 'submit({"code": "x"})'


# ---------------------------------------------------------------------------------------- the warm start
def test_warm_start_trains_the_assistant_turns() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=1).eval()
    report = warm_start_on_episodes(model, tokenizer, [(USER, EPISODE)], steps=30, learning_rate=1e-2, batch_size=1)
    assert report.steps == 30
    assert report.last_loss < report.first_loss
    assert not model.training  # the mode it came in with
    rendered = render_conversation(tokenizer, USER, EPISODE)
    ids = torch.tensor([rendered.input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    trained = torch.tensor(rendered.trained[1:], dtype=torch.bool)
    assert float(nll[trained].mean()) < float(nll[~trained].mean())  # it learnt what it was taught, not the rest


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"episodes": []}, "non-empty"),
        ({"steps": 0}, "steps"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"episodes": [(USER,)]}, "episode 0 must be"),
        ({"episodes": [(USER, [{"role": "tool", "tool_call_id": "c", "content": "x"}])]}, "episode 0: the response"),
    ],
)
def test_warm_start_refuses_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    arguments: dict[str, Any] = {"episodes": [(USER, EPISODE)], "steps": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        warm_start_on_episodes(model, tokenizer, **arguments)


def test_json_arguments_in_records_are_rendered_as_objects() -> None:
    tokenizer = build_char_tokenizer(tool_calling=True)
    rendered = render_conversation(tokenizer, USER, [tool_turn("run_tests", json.dumps({"code": "x"}))])
    assert '"arguments": {"code": "x"}' in tokenizer.decode(rendered.input_ids)
