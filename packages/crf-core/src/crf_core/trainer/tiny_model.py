"""Offline tiny policies: a fixed character vocabulary and a small causal LM built from a config.

Used by the tests, the main job (``examples/composer_main.py``) and the benchmark, so none of them
needs a model download. Every character of ``DEFAULT_ALPHABET`` is one token; unknown characters
map to ``<unk>``. The model is a randomly initialised Llama or Qwen2 decoder sized by the caller.

``build_char_tokenizer(tool_calling=True)`` gives the tokenizer a tool-calling chat format that TRL's multi-turn
machinery (``GRPOTrainer(tools=..., environment_factory=...)``) accepts: :data:`TOOL_CHAT_TEMPLATE` renders every
role and tool call, is prefix-preserving, and :data:`TOOL_RESPONSE_TEMPLATE` parses the policy's tool calls back::

    @S:<system>\\n@U:<user>\\n@A:<text><call>{"name": "run_tests", "arguments": {"code": "..."}}</call><eos>@T:<result>\\n@A:
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_ALPHABET",
    "PLAIN_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TOOL_CHAT_TEMPLATE",
    "TOOL_RESPONSE_TEMPLATE",
    "build_char_tokenizer",
    "build_tiny_causal_lm",
]

#: Printable ASCII (letters, digits, punctuation, space) plus newline and tab.
DEFAULT_ALPHABET: str = string.ascii_letters + string.digits + string.punctuation + " \n\t"

#: Special tokens, in id order: padding, beginning/end of sequence, unknown character.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")

#: Chat template of the character tokenizer: the message contents back to back, no role markers and no
#: generation prompt, so a one-user-message conversation renders exactly as its plain-text prompt.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

#: Tool-calling chat template of the character tokenizer (``build_char_tokenizer(tool_calling=True)``). Each message
#: starts with a two-letter role marker (``@S:`` system, ``@U:`` user, ``@A:`` assistant, ``@T:`` tool); an assistant
#: turn is its text, then one ``<call>{"name": ..., "arguments": {...}}</call>`` per tool call, then ``<eos>``; other
#: turns end with a newline. With tools, a first line ``@tools:name,name`` lists them. The generation prompt is
#: ``@A:``. Arguments given as a JSON string (OpenAI's format) are rendered as that string.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '@tools:' }}"
    "{%- for tool in tools -%}{{ (tool['function']['name'] if tool['function'] is defined else tool['name']) }}"
    "{%- if not loop.last -%}{{ ',' }}{%- endif -%}{%- endfor -%}{{ '\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '@A:' }}{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{ '<call>' }}{{ {'name': fn['name'], 'arguments': fn['arguments']} | tojson }}{{ '</call>' }}"
    "{%- endfor -%}"
    "{{ eos_token }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '@T:' }}{{ message['content'] }}{{ '\\n' }}"
    "{%- elif message['role'] == 'system' -%}"
    "{{ '@S:' }}{{ message['content'] }}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '@U:' }}{{ message['content'] }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '@A:' }}{%- endif -%}"
)

#: transformers' ``response_template`` for :data:`TOOL_CHAT_TEMPLATE`: text up to ``<eos>`` is the content, each
#: ``<call>…</call>`` a tool call (JSON). A call that is not valid JSON makes TRL read the whole turn as text.
TOOL_RESPONSE_TEMPLATE: dict[str, object] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "@A:",
    "fields": {
        "tool_calls": {
            "open": "<call>",
            "close": "</call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, tool_calling: bool = False) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer that maps each character of ``alphabet`` to one token.

    Ids: ``SPECIAL_TOKENS`` first (``<pad>`` = 0), then ``alphabet`` in order. Decoding joins
    tokens without separators, so ``decode(encode(s)) == s`` for strings over the alphabet. The chat
    template is :data:`PLAIN_CHAT_TEMPLATE`, or with ``tool_calling`` :data:`TOOL_CHAT_TEMPLATE` and the
    ``response_template`` :data:`TOOL_RESPONSE_TEMPLATE` (TRL's tool-calling rollouts need both; transformers >= 5.13).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError("alphabet must be a non-empty string of characters; pass e.g. DEFAULT_ALPHABET")
    if len(set(alphabet)) != len(alphabet):
        raise ValueError("alphabet has repeated characters; pass each character once")
    if not isinstance(tool_calling, bool):
        raise TypeError(f"tool_calling must be a bool, got {type(tool_calling).__name__}")
    if tool_calling and not set('@:<>{}[]"/,\n').issubset(alphabet):
        raise ValueError(
            'tool_calling=True needs the characters of the tool format (@ : < > { } [ ] " / , newline) '
            "in the alphabet; use DEFAULT_ALPHABET"
        )
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE if tool_calling else PLAIN_CHAT_TEMPLATE
    if tool_calling:
        import copy

        tokenizer.response_template = copy.deepcopy(TOOL_RESPONSE_TEMPLATE)
    return tokenizer


def build_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    *,
    architecture: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 512,
    seed: int = 0,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
) -> PreTrainedModel:
    """Build a randomly initialised decoder-only LM whose vocabulary matches ``tokenizer``.

    ``architecture`` is ``"llama"`` or ``"qwen2"``. Weights are drawn under ``torch.manual_seed(seed)``
    so two calls with the same arguments give identical models. ``vocab_size`` (default ``len(tokenizer)``)
    may be larger than the tokenizer, to reproduce a real vocabulary's memory (Qwen's 151,936); ids past the
    tokenizer decode to nothing.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if architecture not in ("llama", "qwen2"):
        raise ValueError(f"architecture={architecture!r} is not supported; use 'llama' or 'qwen2'")
    for name, value in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    vocab = len(tokenizer) if vocab_size is None else vocab_size
    if not isinstance(vocab, int) or vocab < len(tokenizer):
        raise ValueError(f"vocab_size must be an int >= len(tokenizer)={len(tokenizer)}, got {vocab_size!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    config_cls = LlamaConfig if architecture == "llama" else Qwen2Config
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
