"""DPO pair records and their data-juicer row form (schema version ``SCHEMA_VERSION``).

A pair built by trace replay is a :class:`DPOPair`: the context before one assistant decision
(``prompt_messages``), the preferred action (``chosen_messages``) and the other one
(``rejected_messages``), all OpenAI chat lists, plus provenance (``trace_id``, ``turn`` = index of
the decided assistant message in the trace, so ``prompt_messages == trace.messages[:turn]``).

On disk (replay output, normaliser input and output, what ``crf-core`` reads) a pair is one JSON
object per line, the *dj record*, carrying both shapes side by side:

==================  ======================================================================
key                 value
==================  ======================================================================
schema_version      ``SCHEMA_VERSION``
prompt              flat string (role-tagged context) for text ops
chosen, rejected    flat strings for data-juicer text ops (filters point here)
prompt_messages     chat list
chosen_messages     chat list (at least one message)
rejected_messages   chat list (at least one message)
trace_id, turn      provenance
meta                free-form JSON object (teacher model, source line, ...)
==================  ======================================================================

The record is described by ``schema/dpo_pair.schema.json`` (shipped in the wheel, see
:func:`schema_path`). Mappers may rewrite the flat strings; a :class:`NormalizedDPOPair` keeps
them, so ``record -> NormalizedDPOPair -> record`` loses nothing.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

from crf_replaysim._checks import is_int
from crf_replaysim.jsonl import DEFAULT_MAX_DEPTH, LONE_SURROGATE
from crf_replaysim.messages import (
    MessageError,
    flatten_action,
    flatten_prompt,
    validate_messages,
    validate_tool_arguments,
)

__all__ = [
    "DJ_RECORD_KEYS",
    "SCHEMA_MAJOR",
    "SCHEMA_MINOR",
    "SCHEMA_VERSION",
    "DPOPair",
    "NormalizedDPOPair",
    "RecordError",
    "check_schema_version",
    "load_schema",
    "schema_path",
    "validate_dj_record",
]

SCHEMA_VERSION = "1.0"
"""Version of the record layout, ``"MAJOR.MINOR"``. Readers accept every ``1.x``: a major bump breaks
readers (refused with the fix), a minor bump only adds optional keys (tolerated from newer minors)."""
SCHEMA_MAJOR, SCHEMA_MINOR = (int(part) for part in SCHEMA_VERSION.split("."))

DJ_RECORD_KEYS: tuple[str, ...] = (
    "schema_version",
    "prompt",
    "chosen",
    "rejected",
    "prompt_messages",
    "chosen_messages",
    "rejected_messages",
    "trace_id",
    "turn",
    "meta",
)
_FLAT_KEYS = ("prompt", "chosen", "rejected")
_INTERNAL_PREFIX = "__dj__"  # data-juicer's own columns (__dj__stats__, __dj__hash); dropped on read


class RecordError(ValueError):
    """A DPO pair, dj record or preference row breaks its schema.

    ``line`` is the 1-based line of the file it came from (``None`` when it did not come from a file)
    and ``reason`` the message without the ``line N: `` prefix.
    """

    def __init__(self, reason: str, *, line: int | None = None) -> None:
        super().__init__(reason if line is None else f"line {line}: {reason}")
        self.reason = reason
        self.line = line


_FIELD_DEPTH = 2
"""Nesting level of a record's fields in its JSONL line (the line's object is level 1)."""


def _check_json(value: Any, where: str, depth: int = _FIELD_DEPTH) -> None:
    """Reject values that ``json.dumps`` would write but no reader gets back unchanged (iterative: any depth).

    ``depth``: the level ``value`` sits at in its line, so a pair that passes here is one ``read_pairs`` reads back.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, depth)]
    while stack:
        item, at, depth = stack.pop()
        if isinstance(item, str):
            if LONE_SURROGATE.search(item):
                raise RecordError(f"{at}: holds a lone surrogate, which UTF-8 cannot encode. Fix: repair the text")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise RecordError(f"{at}: {item!r} is not valid JSON. Fix: store finite numbers or strings")
        elif isinstance(item, (dict, list)):
            if depth > DEFAULT_MAX_DEPTH:
                raise RecordError(f"{at}: nested deeper than {DEFAULT_MAX_DEPTH} levels. Fix: flatten the data")
            if isinstance(item, dict):
                children = []
                for k, v in item.items():
                    if not isinstance(k, str):
                        raise RecordError(f"{at}: key {k!r} is not a string. Fix: use string keys (JSON objects)")
                    children.append((v, f"{at}.{k}", depth + 1))
            else:
                children = [(v, f"{at}[{i}]", depth + 1) for i, v in enumerate(item)]
            stack.extend(reversed(children))
        elif not isinstance(item, (int, bool)) and item is not None:
            raise RecordError(
                f"{at}: {type(item).__name__} does not survive a JSON round trip. "
                "Fix: use str/int/float/bool/None/list/dict"
            )


def check_schema_version(value: Any) -> bool:
    """Raise ``RecordError`` unless ``value`` is a ``schema_version`` this package reads (``1.x``).

    Returns True when it is a newer minor version than ``SCHEMA_VERSION`` (its extra keys are optional
    additions, tolerated by readers).
    """
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) != 2 or not all(p.isdigit() and p.isascii() for p in parts):
        raise RecordError(
            f"schema_version is {value!r}, expected 'MAJOR.MINOR' such as {SCHEMA_VERSION!r}. "
            "Fix: write records with crf-replaysim (replay or normalize)"
        )
    major, minor = int(parts[0]), int(parts[1])
    if major > SCHEMA_MAJOR:
        raise RecordError(
            f"schema_version is {value!r}, newer than this crf-replaysim reads ({SCHEMA_MAJOR}.x). "
            "Fix: upgrade crf-replaysim (pip install -U crf-replaysim)"
        )
    if major < SCHEMA_MAJOR:
        raise RecordError(
            f"schema_version is {value!r}, older than this crf-replaysim reads ({SCHEMA_MAJOR}.x). "
            "Fix: regenerate the pairs with this version (crf-replaysim replay) or install the matching crf-replaysim"
        )
    return minor > SCHEMA_MINOR


def _check_fields(field_of: Callable[[str], Any], *, flat: bool, decoded: bool = False) -> None:
    """Check a pair's fields, read through ``field_of(name)`` (``getattr`` on a pair, ``[]`` on a dj record).

    ``flat``: also require the flat strings ``prompt``/``chosen``/``rejected`` (normalised pairs, dj records).
    ``decoded``: the values come from :func:`crf_replaysim.jsonl.iter_json_lines`, which already refused
    everything ``_check_json`` looks for (non-finite numbers, lone surrogates, deep nesting; JSON has no
    other types), so that walk is skipped.
    """
    check_schema_version(field_of("schema_version"))
    if flat:
        for key in _FLAT_KEYS:
            value = field_of(key)
            if not isinstance(value, str):
                raise RecordError(
                    f"{key} is {type(value).__name__}, text ops need a flat string. "
                    f"Fix: keep chat lists in {key}_messages and the flattened text in {key}"
                )
    trace_id, turn, meta = (field_of(k) for k in ("trace_id", "turn", "meta"))
    for name in ("prompt_messages", "chosen_messages", "rejected_messages"):
        messages = field_of(name)
        try:
            validate_messages(messages, name, min_items=1)
            if name == "chosen_messages":
                validate_tool_arguments(messages, name)
        except MessageError as err:
            raise RecordError(str(err)) from None
        if not decoded:
            _check_json(messages, name)
    if not isinstance(trace_id, str) or not trace_id:
        raise RecordError(f"trace_id is {trace_id!r}. Fix: give every pair the non-empty id of its source trace")
    if not is_int(turn) or turn < 0:
        raise RecordError(f"turn is {turn!r}. Fix: use the index (int >= 0) of the decided message in its trace")
    if not isinstance(meta, dict):
        raise RecordError(f"meta is {type(meta).__name__}. Fix: use a dict (JSON object)")
    if not decoded:
        _check_json(meta, "meta")


@dataclass(frozen=True)
class DPOPair:
    """One preference pair from trace replay (chat lists + provenance). Validated on construction."""

    prompt_messages: list[dict[str, Any]]
    chosen_messages: list[dict[str, Any]]
    rejected_messages: list[dict[str, Any]]
    trace_id: str
    turn: int
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: str = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_fields(partial(getattr, self), flat=False)

    def to_dj_record(self) -> dict[str, Any]:
        """The dj record of this pair: flat ``prompt``/``chosen``/``rejected`` next to deep copies of the lists.

        ``chosen = flatten_action(chosen_messages)`` (text, then ``name(arguments)`` per tool call),
        ``prompt = flatten_prompt(prompt_messages)`` (``"role: text"`` blocks); keys in ``DJ_RECORD_KEYS`` order.
        """
        return {
            "schema_version": self.schema_version,
            "prompt": flatten_prompt(self.prompt_messages),
            "chosen": flatten_action(self.chosen_messages),
            "rejected": flatten_action(self.rejected_messages),
            "prompt_messages": copy.deepcopy(self.prompt_messages),
            "chosen_messages": copy.deepcopy(self.chosen_messages),
            "rejected_messages": copy.deepcopy(self.rejected_messages),
            "trace_id": self.trace_id,
            "turn": self.turn,
            "meta": copy.deepcopy(self.meta),
        }

    def swapped(self) -> DPOPair:
        """The same pair with chosen and rejected exchanged."""
        return DPOPair(
            prompt_messages=self.prompt_messages,
            chosen_messages=self.rejected_messages,
            rejected_messages=self.chosen_messages,
            trace_id=self.trace_id,
            turn=self.turn,
            meta=self.meta,
            schema_version=self.schema_version,
        )


@dataclass(frozen=True)
class NormalizedDPOPair:
    """A pair after normalisation: the chat lists, the (possibly rewritten) flat strings, provenance."""

    prompt: str
    chosen: str
    rejected: str
    prompt_messages: list[dict[str, Any]]
    chosen_messages: list[dict[str, Any]]
    rejected_messages: list[dict[str, Any]]
    trace_id: str
    turn: int
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: str = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_fields(partial(getattr, self), flat=True)

    def to_dj_record(self) -> dict[str, Any]:
        """The dj record of this pair (deep copies; keys in ``DJ_RECORD_KEYS`` order)."""
        return {key: copy.deepcopy(getattr(self, key)) for key in DJ_RECORD_KEYS}

    @classmethod
    def from_dj_record(cls, record: dict[str, Any]) -> NormalizedDPOPair:
        """Inverse of :meth:`to_dj_record`: validates ``record`` (:func:`validate_dj_record`) and copies every
        field (keys of a newer minor version and ``__dj__`` columns are dropped)."""
        validate_dj_record(record)
        return cls(**{key: copy.deepcopy(record[key]) for key in DJ_RECORD_KEYS})


def _dpo_pair_to_dj_record(pair: DPOPair) -> dict[str, Any]:
    """Row for data-juicer: the seed's name for :meth:`DPOPair.to_dj_record` (kept for the seed's callers;
    not in ``__all__``: new code calls the method)."""
    if not isinstance(pair, DPOPair):
        raise TypeError(f"expected a DPOPair, got {type(pair).__name__}. Fix: build one with DPOPair(...)")
    return pair.to_dj_record()


def validate_dj_record(record: Any, *, decoded: bool = False) -> None:
    """Raise ``RecordError`` unless ``record`` is a dj record of a schema version this package reads (1.x).

    Same rules as ``schema/dpo_pair.schema.json``, without needing ``jsonschema`` at run time.
    Keys starting with ``__dj__`` (data-juicer's stats/hash columns) are tolerated, and so are the
    keys a newer minor version added. ``decoded=True``: ``record`` was read by
    :func:`crf_replaysim.jsonl.iter_json_lines` (its JSON-safety checks are not repeated).
    """
    if not isinstance(record, dict):
        raise RecordError(f"a dj record is a dict (JSON object), got {type(record).__name__}")
    missing = [k for k in DJ_RECORD_KEYS if k not in record]
    if missing:
        raise RecordError(
            f"record lacks {missing}. Fix: build records with DPOPair.to_dj_record (crf-replaysim replay writes them)"
        )
    newer = check_schema_version(record["schema_version"])
    unknown = sorted(k for k in record if k not in DJ_RECORD_KEYS and not str(k).startswith(_INTERNAL_PREFIX))
    if unknown and not newer:
        raise RecordError(f"record has unknown keys {unknown}. Fix: move extra information into 'meta'")
    _check_fields(record.__getitem__, flat=True, decoded=decoded)


def schema_path() -> Path:
    """Path of the shipped JSON Schema of a dj record (``crf_replaysim/schema/dpo_pair.schema.json``)."""
    return Path(str(resources.files("crf_replaysim").joinpath("schema").joinpath("dpo_pair.schema.json")))


def load_schema() -> dict[str, Any]:
    """The shipped JSON Schema as a dict."""
    schema: dict[str, Any] = json.loads(schema_path().read_text(encoding="utf-8"))
    return schema
