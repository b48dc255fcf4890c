"""``crf_core.trainer.tool_formats``: SmolLM2's tool-call format, without the model.

A stand-in tokenizer (the character tokenizer with SmolLM2's ChatML tokens ``<|im_start|>``/``<|im_end|>``, EOS
``<|im_end|>`` and SmolLM2's stock chat template) exercises the rendering, TRL's checks and parsing of fixed
strings, hostile ones included, and one ``ComposerReplicationTrainer`` step whose rollouts write SmolLM2-format calls
through TRL's own tool loop. The real SmolLM2-135M (its GGUF tokenizer and the model itself) is
``test_smollm2_tools.py``, run by ``nox -s smollm2_tools``.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from typing import Any

import pytest

pytest.importorskip("trl", reason="the tool-calling rollouts need the [train] extra (trl)")

import transformers
from packaging.version import Version

if Version(transformers.__version__) < Version("5.13.0.dev0"):
    pytest.skip("parsing tool calls with a response_template needs transformers >= 5.13", allow_module_level=True)

from datasets import Dataset
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
from crf_core.rewards import CodingEnvironment
from crf_core.trainer.tool_formats import (
    SMOLLM2_CHAT_TEMPLATE,
    SMOLLM2_RESPONSE_TEMPLATE,
    SMOLLM2_TOOL_CHAT_TEMPLATE,
    add_smollm2_tool_calling,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16

TOOLS = [CodingEnvironment.run_python, CodingEnvironment.run_tests, CodingEnvironment.submit]
RIGHT, WRONG = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"


def chatml_tokenizer() -> Any:
    """The character tokenizer with SmolLM2's turn tokens, EOS and stock chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
def tokenizer() -> Any:
    return add_smollm2_tool_calling(chatml_tokenizer())


PARSE_TAKES_TOOLS = "tools" in inspect.signature(parse_response).parameters
"""TRL >= 1.16 passes the tools to ``parse_response``; 1.14 (the lock's pick on Python 3.10) parses without them."""


def calls(*pairs: tuple[str, Any]) -> str:
    """A SmolLM2 turn calling ``(name, arguments)`` pairs, as the format writes it."""
    body = ",\n".join(json.dumps({"name": name, "arguments": arguments}) for name, arguments in pairs)
    return f"<tool_call>[\n{body}\n]</tool_call><|im_end|>"


def parse(tokenizer: Any, turn: str) -> dict[str, Any]:
    """``turn`` parsed as TRL's rollouts parse a generated turn (ids after the prompt, the prompt as prefix)."""
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "add"}], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    return parse_response(tokenizer, ids, prefix=prefix, **({"tools": TOOLS} if PARSE_TAKES_TOOLS else {}))


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "x"},
        ],
    ],
    ids=["user", "system", "turns"],
)
def test_without_tools_renders_as_the_stock_template(messages: list[dict[str, Any]]) -> None:
    stock = chatml_tokenizer()
    ours = add_smollm2_tool_calling(chatml_tokenizer())
    for generation in (False, True):
        expected = stock.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False) == expected


def test_tools_render_in_the_system_turn(tokenizer: Any) -> None:
    from transformers.utils import get_json_schema

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    system, user, generation = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou are an expert in composing functions.")
    assert json.loads(system.split("<tools>")[1].split("</tools>")[0]) == [get_json_schema(t) for t in TOOLS]
    assert system.endswith("... (more tool calls as required)\n]</tool_call>")
    assert user == "<|im_start|>user\nadd"
    assert generation == "<|im_start|>assistant\n"


def test_tool_calls_and_results_render_and_trl_accepts_the_template(tokenizer: Any) -> None:
    assert not supports_tool_calling(chatml_tokenizer())  # the stock template drops tool calls and results
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)
    conversation = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "run_tests", "arguments": {"code": WRONG}}},
                {"type": "function", "function": {"name": "submit", "arguments": json.dumps({"code": RIGHT})}},
            ],
        },
        {"role": "tool", "name": "run_tests", "content": "2 of 2 tests failed."},
    ]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    call = calls(("run_tests", {"code": WRONG}), ("submit", {"code": RIGHT}))
    assert text.endswith(
        "<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n" + call + "\n"
        "<|im_start|>user\n<tool_response>\n2 of 2 tests failed.\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------- parsing


def test_calls_parse_into_trl_tool_calls(tokenizer: Any) -> None:
    parsed = parse(tokenizer, "Testing first.\n" + calls(("run_tests", {"code": WRONG}), ("submit", {"code": RIGHT})))
    assert parsed == {
        "role": "assistant",
        "content": "Testing first.",
        "tool_calls": [
            {"type": "function", "function": {"name": "run_tests", "arguments": {"code": WRONG}}},
            {"type": "function", "function": {"name": "submit", "arguments": {"code": RIGHT}}},
        ],
    }
    assert parse(tokenizer, "Done.<|im_end|>") == {"role": "assistant", "content": "Done."}
    assert parse(tokenizer, "<tool_call>[]</tool_call><|im_end|>") == {"role": "assistant", "content": ""}


TEXT_ONLY = {
    "bad JSON": '<tool_call>[{"name": "submit", "arguments": {"code": }]</tool_call>',
    "a bare object": '<tool_call>{"name": "submit", "arguments": {"code": "x"}}</tool_call>',
    "an element that is a string": '<tool_call>["submit"]</tool_call>',
    "a name that is a number": '<tool_call>[{"name": 5, "arguments": {}}]</tool_call>',
    "an unclosed block": '<tool_call>[{"name": "submit", "arguments": {"code": "x"}}]',
    "deep nesting": "<tool_call>[" + "[" * 5000 + "]" * 5001 + "</tool_call>",
    "deep objects": '<tool_call>[{"name": "submit", "arguments": {"code": '
    + '{"a": ' * 2000
    + "1"
    + "}" * 2002
    + "]</tool_call>",
    "many open tags": "<tool_call>[{" * 3000,
}


@pytest.mark.parametrize("turn", list(TEXT_ONLY.values()), ids=list(TEXT_ONLY))
def test_malformed_calls_parse_as_text_without_raising(tokenizer: Any, turn: str) -> None:
    """What is not the format is the turn's text (TRL ends the rollout's turn there); nothing raises, quickly."""
    start = time.process_time()
    parsed = parse(tokenizer, turn + "<|im_end|>")
    assert time.process_time() - start < 5  # linear in the turn's length
    assert parsed == {"role": "assistant", "content": turn}


def test_deep_nesting_would_raise_recursion_error_without_the_bracket_bound() -> None:
    """Why ``MAX_CALL_BRACKETS``: transformers' JSON content parser recurses, and ``RecursionError`` escapes TRL's
    fallback (``ValueError``/``TypeError`` only)."""
    import copy

    from transformers.utils.chat_parsing.response_parser import parse_response as parse_text

    unbounded = copy.deepcopy(SMOLLM2_RESPONSE_TEMPLATE)
    unbounded["fields"]["tool_calls"]["open_pattern"] = r"<tool_call>(?P<name>)(?P<arguments>)"
    turn = "<tool_call>[" + "[" * 5000 + "]" * 5001 + "</tool_call><|im_end|>"
    with pytest.raises(RecursionError):
        parse_text(turn, unbounded, prefix="")
    assert parse_text(turn, SMOLLM2_RESPONSE_TEMPLATE, prefix="") == {"role": "assistant", "content": turn[:-10]}


def test_elements_missing_keys_parse_to_calls_trl_reports(tokenizer: Any) -> None:
    """No ``KeyError`` out of the parser: the name or arguments is ``""``, which TRL's loop answers as an error."""
    parsed = parse(tokenizer, '<tool_call>[{"arguments": {"code": "1"}}, {"name": "submit"}]</tool_call><|im_end|>')
    assert parsed["tool_calls"] == [
        {"type": "function", "function": {"name": "", "arguments": {"code": "1"}}},
        {"type": "function", "function": {"name": "submit", "arguments": ""}},
    ]


def test_add_smollm2_tool_calling_refuses_other_tokenizers() -> None:
    with pytest.raises(TypeError, match="Hugging Face tokenizer"):
        add_smollm2_tool_calling("SmolLM2")
    with pytest.raises(ValueError, match="SmolLM2-Instruct tokenizer"):
        add_smollm2_tool_calling(build_char_tokenizer(tool_calling=True))
    no_chatml = build_char_tokenizer()
    no_chatml.chat_template = SMOLLM2_CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"<\|im_start\|> is not a token"):
        add_smollm2_tool_calling(no_chatml)
    wrong_eos = chatml_tokenizer()
    wrong_eos.eos_token = "<eos>"
    with pytest.raises(ValueError, match="EOS token is '<eos>'"):
        add_smollm2_tool_calling(wrong_eos)
    tokenizer = add_smollm2_tool_calling(chatml_tokenizer())
    assert add_smollm2_tool_calling(tokenizer) is tokenizer  # again: harmless
    assert tokenizer.chat_template == SMOLLM2_TOOL_CHAT_TEMPLATE
    assert tokenizer.response_template == SMOLLM2_RESPONSE_TEMPLATE
    assert tokenizer.response_template is not SMOLLM2_RESPONSE_TEMPLATE


# --------------------------------------------------------------------------- TRL's tool loop

#: Each rollout's assistant turns: a draft tested, fixed and submitted; hostile calls TRL and the environment contain.
SCRIPTS = [
    [calls(("run_tests", {"code": WRONG})), calls(("submit", {"code": RIGHT})), "Done.<|im_end|>"],
    [
        calls(("rm_rf", {"path": "/"}), ("", {"code": "1"}), ("run_python", {"source": "1"}), ("submit", [RIGHT])),
        "<tool_call>[" + "[" * 300 + "</tool_call><|im_end|>",  # past the bracket bound: text,
    ],
]


class ScriptedSampler:
    """Stands in for ``GRPOTrainer._generate_single_turn`` (sampling only): each rollout's next assistant turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.started = tokenizer, 0

    def __call__(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
        out = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids).split("<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n", 1)[1]
            if "<tool_response>" not in text:
                script = SCRIPTS[self.started % len(SCRIPTS)]
                self.started += 1
                step = 0
            else:
                script = next(s for s in SCRIPTS if text.startswith(s[0]))
                step = text.count("<tool_response>") // len(parse(self.tokenizer, script[0])["tool_calls"])
            out.append(self.tokenizer(script[step], add_special_tokens=False)["input_ids"])
        return out, None


@pytest.mark.usefixtures("bwrap")
def test_trl_tool_loop_runs_smollm2_calls_in_the_environment(tokenizer: Any, tmp_path: Any) -> None:
    from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer

    trainer = ComposerReplicationTrainer(
        model=build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=8192),
        args=ComposerConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=1500,
            max_tool_calling_iterations=3,
            max_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            bf16=False,
            seed=0,
            sdpo_top_k=8,
        ),
        train_dataset=Dataset.from_list(
            [{"prompt": [{"role": "user", "content": "add"}], "tests": ["assert add(1, 2) == 3"]}] * 2
        ),
        processing_class=tokenizer,
        environment_factory=CodingEnvironment.factory(
            timeout_s=5.0, memory_mb=256, max_result_chars=300, strip_strings=tuple(tokenizer.all_special_tokens)
        ),
    )
    trainer._generate_single_turn = ScriptedSampler(tokenizer)  # type: ignore[method-assign]
    batches: list[dict[str, Any]] = []
    generate = trainer._generate_and_score_completions

    def capture(inputs: Any) -> dict[str, Any]:
        batches.append(generate(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = capture  # type: ignore[method-assign]
    result = trainer.train()
    assert trainer.state.global_step == 1
    assert math.isfinite(result.training_loss)
    fixed, hostile = (env.episode for env in trainer.environments)
    assert [(c.tool, c.refused) for c in fixed.calls] == [("run_tests", None), ("submit", None)]
    assert fixed.calls[0].result.startswith("1 of 1 tests failed.")
    assert fixed.reward == 1.0
    assert hostile.calls == ()  # every hostile call failed before reaching a tool
    (logged,) = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert logged["tools/call_frequency"] == pytest.approx(6 / 2)  # 2 + 4 calls over 2 rollouts
    assert logged["tools/failure_frequency"] == pytest.approx(4 / 6)  # TRL counted the 4 hostile ones as failures
    (batch,) = batches
    completion_mask, tool_mask = batch["completion_mask"], batch["tool_mask"]
    for row, marker in ((0, "1 of 1 tests failed."), (1, "Tool rm_rf not found.")):
        results = tokenizer.decode(batch["completion_ids"][row][(completion_mask[row] * (1 - tool_mask[row])) > 0])
        trained = tokenizer.decode(batch["completion_ids"][row][(completion_mask[row] * tool_mask[row]) > 0])
        assert marker in results
        assert marker not in trained
        assert "<tool_response>" not in trained
        assert trained.startswith("<tool_call>[\n")
