"""Preference-pair formats: crf-replaysim's dj records and TRL's standard and conversational rows.

=====================  ==========================================================================
format                 one JSON object per line
=====================  ==========================================================================
``records``            the dj record of :mod:`crf_replaysim.records` (``schema_version``, flat
                       strings and chat lists side by side, provenance, ``meta``)
``trl-standard``       ``{"prompt": str, "chosen": str, "rejected": str}`` as TRL's ``DPOTrainer``
                       takes it (``prompt`` may be left out: TRL's implicit prompt, the longest
                       common prefix of ``chosen`` and ``rejected``)
``trl-conversational`` the same keys holding chat message lists (implicit prompt: the longest
                       common run of leading messages)
=====================  ==========================================================================

A TRL row becomes a dj record losslessly for training: the standard format keeps its strings as the
flat fields (and gets one-message chat lists: ``user`` prompt, ``assistant`` answers); the
conversational format keeps its lists (tool-call ``arguments`` given as objects are JSON-encoded, the
OpenAI form; missing tool-call ids are numbered) and gets the flat strings by
:func:`~crf_replaysim.messages.flatten_action`. Optional TRL columns ``trace_id``/``turn`` are used as
provenance, ``tools`` (list or JSON string) and every other column go into ``meta``, and a
``schema_version`` column is checked like a record's.

Written back as TRL (``trl-standard`` / ``trl-conversational``), a row has ``prompt``, ``chosen``,
``rejected``, ``schema_version``, ``trace_id``, ``turn`` and, when ``meta`` holds them, ``tools`` as a
JSON string (``DPOTrainer`` accepts both). ``meta`` itself stays in the records format only: its
free-form contents would break a column store's type inference. Content-part lists become their
text, so each message column has one type.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Literal, get_args

from crf_replaysim._checks import is_int
from crf_replaysim.jsonl import loads_bounded
from crf_replaysim.messages import MessageError, content_text, flatten_action, flatten_prompt, validate_messages
from crf_replaysim.records import (
    DJ_RECORD_KEYS,
    SCHEMA_VERSION,
    RecordError,
    check_schema_version,
    validate_dj_record,
)

__all__ = [
    "INPUT_FORMATS",
    "OUTPUT_FORMATS",
    "PAIR_FORMATS",
    "FormatReader",
    "PairFormat",
    "detect_format",
    "dj_record_to_trl",
    "trl_row_to_dj_record",
]

PairFormat = Literal["records", "trl-standard", "trl-conversational"]
PAIR_FORMATS: tuple[PairFormat, ...] = get_args(PairFormat)
INPUT_FORMATS: tuple[str, ...] = ("auto", "records", "trl")
"""``auto``: whatever the first good row is; ``trl``: either TRL flavour."""
OUTPUT_FORMATS: tuple[str, ...] = ("records", "trl", "trl-standard", "trl-conversational")
"""``trl``: the TRL flavour of the input (records, being chat lists, become ``trl-conversational``)."""

_TRL_KEYS = ("prompt", "chosen", "rejected")
_TRL_OWN = frozenset({*_TRL_KEYS, "schema_version", "trace_id", "turn", "tools", "meta"})
_RECORD_ONLY = frozenset(k for k in DJ_RECORD_KEYS if k.endswith("_messages"))


def detect_format(row: Any) -> PairFormat:
    """The format of one decoded row (raises ``RecordError`` naming what is missing)."""
    if not isinstance(row, dict):
        raise RecordError(f"a pair row is a JSON object, got {type(row).__name__}")
    keys = set(row)
    if keys & _RECORD_ONLY or ("schema_version" in keys and not {"chosen", "rejected"} <= keys):
        return "records"
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise RecordError(
            f"record lacks {missing}: it is neither a crf-replaysim record nor a TRL preference row. "
            "Fix: give it prompt/chosen/rejected (TRL) or write it with crf-replaysim"
        )
    chosen = row["chosen"]
    if isinstance(chosen, str):
        return "trl-standard"
    if isinstance(chosen, list):
        return "trl-conversational"
    raise RecordError(
        f"chosen is {type(chosen).__name__}; TRL's formats hold a string (standard) or a list of chat messages "
        "(conversational)"
    )


def _common_prefix(a: str | list[Any], b: str | list[Any]) -> int:
    """TRL's implicit-prompt split point: first differing position, a trailing space left to the answers."""
    n = min(len(a), len(b))
    idx = next((i for i in range(n) if a[i] != b[i]), n)
    if isinstance(a, str) and idx > 0 and idx < n and a[idx - 1] == " ":
        idx -= 1
    return idx


def _openai_messages(messages: Any, where: str, counter: list[int]) -> list[dict[str, Any]]:
    """Chat messages in HF/TRL form -> OpenAI form: object arguments JSON-encoded, missing call ids numbered,
    tool results without ``tool_call_id`` matched to the oldest unanswered call."""
    if not isinstance(messages, list):
        raise RecordError(f"{where} is {type(messages).__name__}, expected a list of chat messages")
    out: list[dict[str, Any]] = []
    unanswered: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RecordError(f"{where}[{i}] is {type(message).__name__}, expected a chat message object")
        message = copy.deepcopy(message)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                if isinstance(call, dict):
                    call = dict(call)
                    if not call.get("id"):
                        counter[0] += 1
                        call["id"] = f"call_{counter[0]}"
                    call.setdefault("type", "function")
                    fn = call.get("function")
                    if isinstance(fn, dict) and isinstance(fn.get("arguments"), (dict, list)):
                        call["function"] = {**fn, "arguments": json.dumps(fn["arguments"], ensure_ascii=False)}
                    unanswered.append(str(call["id"]))
                fixed.append(call)
            message["tool_calls"] = fixed
        if message.get("role") == "tool":
            if message.get("tool_call_id"):
                if message["tool_call_id"] in unanswered:
                    unanswered.remove(message["tool_call_id"])
            elif unanswered:
                message["tool_call_id"] = unanswered.pop(0)
        out.append(message)
    return out


def _hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat lists for a TRL column: content parts joined into their text (one type per column)."""
    out = []
    for message in messages:
        message = copy.deepcopy(message)
        if isinstance(message.get("content"), list):
            message["content"] = content_text(message["content"])
        out.append(message)
    return out


def trl_row_to_dj_record(row: Mapping[str, Any], fmt: PairFormat, *, source_id: str) -> dict[str, Any]:
    """The dj record of a TRL row of format ``fmt``; ``source_id`` names the row when it has no ``trace_id``.

    Raises ``RecordError`` naming the problem and the fix.
    """
    if "schema_version" in row:
        check_schema_version(row["schema_version"])
    implicit = "prompt" not in row
    chosen, rejected = row["chosen"], row["rejected"]
    meta: dict[str, Any] = {"source_format": fmt}
    if isinstance(row.get("meta"), dict):
        meta.update(copy.deepcopy(row["meta"]))
    meta.update({k: copy.deepcopy(v) for k, v in row.items() if k not in _TRL_OWN})
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = loads_bounded(tools)
        except ValueError as err:
            raise RecordError(
                f"tools is a string but not JSON, or not usable ({err}). Fix: give tools as a list or a JSON array"
            ) from None
    if tools is not None:
        meta["tools"] = tools
    if implicit:
        meta["prompt_extracted"] = True
    if fmt == "trl-standard":
        if not isinstance(rejected, str) or not (implicit or isinstance(row["prompt"], str)):
            raise RecordError(
                "TRL standard rows hold strings in prompt, chosen and rejected. Fix: make all three strings, "
                "or all three chat lists (conversational)"
            )
        if implicit:
            cut = _common_prefix(chosen, rejected)
            prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
        else:
            prompt = row["prompt"]
        if not chosen.strip() or not rejected.strip():
            raise RecordError("chosen or rejected is empty (nothing left after the prompt). Fix: drop the row")
        prompt_messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        chosen_messages: list[dict[str, Any]] = [{"role": "assistant", "content": chosen}]
        rejected_messages: list[dict[str, Any]] = [{"role": "assistant", "content": rejected}]
        flat = (prompt, chosen, rejected)
    else:
        counter = [0]
        if implicit:
            if not isinstance(rejected, list):
                raise RecordError("rejected is not a list of chat messages like chosen. Fix: make both chat lists")
            cut = _common_prefix(chosen, rejected)
            prompt_messages = _openai_messages(chosen[:cut], "prompt", counter)
            chosen_messages = _openai_messages(chosen[cut:], "chosen", counter)
            rejected_messages = _openai_messages(rejected[cut:], "rejected", counter)
        else:
            prompt_messages = _openai_messages(row["prompt"], "prompt", counter)
            chosen_messages = _openai_messages(chosen, "chosen", counter)
            rejected_messages = _openai_messages(rejected, "rejected", counter)
        for name, messages in (
            ("prompt", prompt_messages),
            ("chosen", chosen_messages),
            ("rejected", rejected_messages),
        ):
            try:
                validate_messages(messages, name, min_items=1)
            except MessageError as err:
                raise RecordError(str(err)) from None
        flat = (flatten_prompt(prompt_messages), flatten_action(chosen_messages), flatten_action(rejected_messages))
    trace_id = row.get("trace_id")
    turn = row.get("turn")
    record = {
        "schema_version": SCHEMA_VERSION,
        "prompt": flat[0],
        "chosen": flat[1],
        "rejected": flat[2],
        "prompt_messages": prompt_messages,
        "chosen_messages": chosen_messages,
        "rejected_messages": rejected_messages,
        "trace_id": trace_id if isinstance(trace_id, str) and trace_id else source_id,
        "turn": turn if is_int(turn) and turn >= 0 else len(prompt_messages),
        "meta": meta,
    }
    validate_dj_record(record)
    return record


def dj_record_to_trl(record: Mapping[str, Any], fmt: PairFormat) -> dict[str, Any]:
    """A TRL row (``fmt``: ``trl-standard`` or ``trl-conversational``) of a valid dj record."""
    if fmt == "trl-standard":
        row: dict[str, Any] = {"prompt": record["prompt"], "chosen": record["chosen"], "rejected": record["rejected"]}
    elif fmt == "trl-conversational":
        row = {key: _hf_messages(record[f"{key}_messages"]) for key in _TRL_KEYS}
    else:
        raise ValueError(f"fmt must be 'trl-standard' or 'trl-conversational', got {fmt!r}")
    row.update(schema_version=record["schema_version"], trace_id=record["trace_id"], turn=record["turn"])
    tools = record["meta"].get("tools") if isinstance(record.get("meta"), dict) else None
    if tools:
        row["tools"] = json.dumps(tools, ensure_ascii=False)
    return row


class FormatReader:
    """Turns rows of one source into dj records, holding the source to one format.

    ``input_format``: ``auto`` (the first good row decides), ``records``, or ``trl`` (either TRL flavour,
    decided by the first good row). A row of another format raises ``RecordError`` saying so.
    ``convert(row, source_id)`` returns the validated dj record (records pass through as the same dict).
    """

    def __init__(self, input_format: str = "auto") -> None:
        if input_format not in INPUT_FORMATS:
            raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
        self.input_format = input_format
        self.format: PairFormat | None = None
        self._first: str | None = None

    def convert(self, row: Any, source_id: str, *, decoded: bool = False) -> dict[str, Any]:
        """The validated dj record of ``row`` (``decoded``: it came from ``iter_json_lines``, see
        :func:`~crf_replaysim.records.validate_dj_record`)."""
        fmt = detect_format(row)
        allowed = {"records": ("records",), "trl": ("trl-standard", "trl-conversational")}.get(self.input_format)
        if allowed is not None and fmt not in allowed:
            raise RecordError(
                f"row is {fmt}, but the input format is {self.input_format!r}. "
                "Fix: pass input_format='auto' (CLI --input-format auto) or convert the row"
            )
        if self.format is not None and fmt != self.format:
            raise RecordError(
                f"row is {fmt}, but this input started as {self.format} ({self._first}); one input holds one "
                "format. Fix: split the file by format"
            )
        if fmt == "records":
            validate_dj_record(row, decoded=decoded)
            record: dict[str, Any] = row
        else:
            record = trl_row_to_dj_record(row, fmt, source_id=source_id)
        if self.format is None:
            self.format, self._first = fmt, source_id
        return record
