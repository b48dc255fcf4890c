"""Strict, linear-time reading of the record the sandboxed harness writes (``crf_core.rewards._harness``).

Everything in the record may be forged by the candidate, so it is read as hostile text: exactly
the expected lines and keys, bounded sizes, JSON numbers refused (ints travel as hex strings,
floats as their repr, both length-checked before conversion), nesting at most ``MAX_DEPTH`` deep,
and no set or dict whose elements pile onto one hash value (a crafted collision set would make
building it quadratic). Any deviation raises ``MalformedRecord``, which the reward scores as 0.
Decoded values are plain builtins (or ``NotData``), so no object the candidate made takes part in
a comparison.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Union

__all__ = [
    "HarnessRecord",
    "MalformedRecord",
    "NotData",
    "Raised",
    "Returned",
    "bounded_repr",
    "decode_value",
    "parse_record",
]

MAX_DEPTH = 66  # the harness stops at 64 levels below the top; a little slack for its own wrapping
MAX_INT_HEX_DIGITS = 65_536  # 262,144 bits (math.factorial(20000) fits)
MAX_NUMBER_TEXT = 64
MAX_DECIMAL_TEXT = 4_300  # as many digits as Python converts between int and str by default
MAX_HASH_MULTIPLICITY = 8
_HEX = re.compile(rf"-?[0-9a-f]{{1,{MAX_INT_HEX_DIGITS}}}")
_SCALAR_TAGS = {"N": 1, "b": 2, "i": 2, "f": 2, "c": 3, "s": 2, "y": 2, "q": 3, "D": 2, "?": 2}
_CONTAINERS = {"l": list, "t": tuple, "S": set, "F": frozenset}


class MalformedRecord(ValueError):
    """The sandbox's record is missing, truncated or not in the harness's format."""


@dataclass(frozen=True, eq=False)
class NotData:
    """A value the candidate returned that is not plain data (its type name); it equals nothing but itself."""

    type_name: str

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


@dataclass(frozen=True)
class Raised:
    """An exception raised in the sandbox: its type name, message and the candidate's traceback (all bounded)."""

    type: str
    message: str
    traceback: str

    def describe(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


@dataclass(frozen=True)
class Returned:
    """The decoded value a probe evaluated to."""

    value: object


Result = Union[Returned, Raised]  # noqa: UP007 (runtime alias on Python 3.10)


@dataclass(frozen=True)
class HarnessRecord:
    """What the harness reported: the load failure, if any, else one result per probe."""

    load_error: Raised | None
    results: tuple[Result, ...]


def _reject_constant(name: str) -> object:
    raise MalformedRecord(f"JSON constant {name} in the record")


def _small_int(text: str) -> int:
    if len(text) > 12:
        raise MalformedRecord("oversized JSON number in the record")
    return int(text)


def _reject_float(text: str) -> float:
    raise MalformedRecord("JSON float in the record")


def _load(line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line, parse_int=_small_int, parse_float=_reject_float, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        raise MalformedRecord(f"unreadable record line: {type(exc).__name__}") from None
    if not isinstance(obj, dict) or len(obj) != 1:
        raise MalformedRecord("a record line must be an object with one key")
    return obj


def _raised(obj: Any) -> Raised:
    if not (
        isinstance(obj, dict)
        and set(obj) == {"type", "message", "traceback"}
        and all(isinstance(v, str) for v in obj.values())
    ):
        raise MalformedRecord("malformed exception report")
    return Raised(obj["type"], obj["message"], obj["traceback"])


def parse_record(text: str, probes: int) -> HarnessRecord:
    """Read the harness record from the program's stdout; ``probes`` is how many results it must hold.

    Raises:
        MalformedRecord: anything but exactly ``load``, ``probes`` results (when loaded) and ``end``.
    """
    if not text.endswith("\n"):
        raise MalformedRecord("the record is missing or truncated")
    lines = text[:-1].split("\n")
    head = _load(lines[0])
    if "load" not in head:
        raise MalformedRecord("the record does not start with the load line")
    load_error = None if head["load"] is None else _raised(head["load"])
    expected = 0 if load_error is not None else probes
    if len(lines) != expected + 2:
        raise MalformedRecord(f"the record has {len(lines) - 2} results, expected {expected}")
    if _load(lines[-1]) != {"end": expected}:
        raise MalformedRecord("the record does not end with the end line")
    results: list[Result] = []
    for line in lines[1:-1]:
        obj = _load(line)
        if "value" in obj:
            results.append(Returned(decode_value(obj["value"])))
        elif "raised" in obj:
            results.append(_raised(obj["raised"]))
        else:
            raise MalformedRecord("a result line is neither a value nor an exception")
    return HarnessRecord(load_error, tuple(results))


def decode_value(node: Any, depth: int = 0) -> object:
    """The plain value of one tagged encoding (see ``crf_core.rewards._harness``); raises ``MalformedRecord``."""
    if depth > MAX_DEPTH:
        raise MalformedRecord("value nested too deeply")
    if not (isinstance(node, list) and node and isinstance(node[0], str)):
        raise MalformedRecord("a value must be a tagged list")
    tag = node[0]
    if tag in _CONTAINERS:
        if len(node) != 2 or not isinstance(node[1], list):
            raise MalformedRecord(f"malformed {tag!r} value")
        items = [_decode_item(item, depth + 1) for item in node[1]]
        kind = _CONTAINERS[tag]
        if kind is set or kind is frozenset:
            return kind(_hashable(items))
        return kind(items)
    if tag == "d":
        if len(node) != 2 or not isinstance(node[1], list):
            raise MalformedRecord("malformed dict value")
        pairs = []
        for pair in node[1]:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise MalformedRecord("malformed dict item")
            pairs.append((decode_value(pair[0], depth + 1), decode_value(pair[1], depth + 1)))
        keys = _hashable(k for k, _ in pairs)
        return dict(zip(keys, (v for _, v in pairs), strict=True))
    if _SCALAR_TAGS.get(tag) != len(node):
        raise MalformedRecord(f"malformed value with tag {tag!r}")
    return _scalar(tag, node[1:])


def _decode_item(node: Any, depth: int) -> object:
    """``decode_value`` with a fast path for the commonest elements (short ints and strings)."""
    if type(node) is list and len(node) == 2:
        tag, arg = node
        if type(arg) is str:
            if tag == "s":
                return arg
            if tag == "i" and len(arg) <= 16 and _HEX.fullmatch(arg):
                return int(arg, 16)
    return decode_value(node, depth)


def _scalar(tag: str, args: list[Any]) -> object:
    if tag == "N":
        return None
    if tag == "b":
        if not isinstance(args[0], bool):
            raise MalformedRecord("malformed bool")
        return args[0]
    if not all(isinstance(a, str) for a in args):
        raise MalformedRecord(f"malformed value with tag {tag!r}")
    if tag == "s":
        return args[0]
    if tag == "?":
        return NotData(args[0][:100])
    if tag == "i":
        return _int(args[0])
    if tag == "q":
        numerator, denominator = _int(args[0]), _int(args[1])
        if denominator <= 0:
            raise MalformedRecord("malformed Fraction")
        return Fraction(numerator, denominator)
    if tag == "y":
        try:
            return bytes.fromhex(args[0])
        except ValueError:
            raise MalformedRecord("malformed bytes") from None
    if any(len(a) > (MAX_DECIMAL_TEXT if tag == "D" else MAX_NUMBER_TEXT) for a in args):
        raise MalformedRecord("oversized number")
    try:
        if tag == "f":
            return float(args[0])
        if tag == "c":
            return complex(float(args[0]), float(args[1]))
        return Decimal(args[0])  # "D"
    except (ValueError, InvalidOperation):
        raise MalformedRecord(f"malformed number with tag {tag!r}") from None


def _int(text: str) -> int:
    if not _HEX.fullmatch(text):
        raise MalformedRecord("malformed int")
    return int(text, 16)


def _hashable(items: Iterable[object]) -> list[object]:
    """``items`` as a list, checked to be hashable and free of crafted hash collisions."""
    out = list(items)
    try:
        counts = Counter(hash(item) for item in out)
    except TypeError:
        raise MalformedRecord("unhashable element in a set or dict key") from None
    if counts and max(counts.values()) > MAX_HASH_MULTIPLICITY:
        raise MalformedRecord("set or dict elements crafted to collide in one hash value")
    return out


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset, _REPR.maxdict = 4, 12, 12, 12, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 100, 100, 100


def bounded_repr(value: object, limit: int = 200) -> str:
    """A repr of a decoded value for messages: bounded in work and length (``reprlib``), never raises."""
    try:
        text = _REPR.repr(value)
    except Exception:  # e.g. an int too long for str()
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
