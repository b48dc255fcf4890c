"""The operators a unit test applies to a returned value, run on the trainer side on decoded data with bounded work.

``crf_core.rewards.asserts`` compiles an assertion such as ``abs((P - E) / E) < tol`` or
``sorted(P)[0] == E`` into a tree of these functions; only ``P``, the value under test, comes from
the sandbox (as plain data, ``crf_core.rewards.record``). Every comparison, arithmetic operation and
conversion the test applies runs here, on builtin types whose methods the candidate cannot touch.

The data is hostile, so each operation bounds its work before it starts: ints of at most
``MAX_INT_BITS`` bits, powers whose result stays below that, sequences repeated to at most
``MAX_ITEMS`` items, no ``%`` formatting of strings, sets and dict keys checked against crafted hash
collisions. A refused operation raises ``Refused`` (a ``TypeError``), and the check fails.
"""

from __future__ import annotations

import cmath
import math
import operator
from collections import defaultdict
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

from crf_core._checks import is_int

__all__ = ["BINARY", "CALLS", "MAX_INT_BITS", "MAX_ITEMS", "METHODS", "UNARY", "Refused", "call_method"]

MAX_INT_BITS = 1 << 18  # 262,144 bits: fact(20000) fits
MAX_ITEMS = 10_000_000
MAX_POW_EXPONENT = 1 << 16
MAX_COLLISIONS = 8
_NUMBERS = (int, float, complex, Fraction, Decimal)
_SEQUENCES = (str, bytes, list, tuple)


class Refused(TypeError):
    """An operation on returned data that the trainer will not run (unbounded work or an unsupported type)."""


def _number(x: Any) -> Any:
    if isinstance(x, bool) or not isinstance(x, _NUMBERS):
        if isinstance(x, bool):
            return int(x)
        raise Refused(f"not a number: {type(x).__name__}")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise Refused("int too large")
    return x


def _numeric(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def run(a: Any, b: Any) -> Any:
        return fn(_number(a), _number(b))

    return run


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, _SEQUENCES) and type(a) is type(b):
        return operator.add(a, b)
    return _number(a) + _number(b)


def _mul(a: Any, b: Any) -> Any:
    for seq, times in ((a, b), (b, a)):
        if isinstance(seq, _SEQUENCES) and is_int(times):
            if len(seq) * max(times, 0) > MAX_ITEMS:
                raise Refused("repeated sequence too long")
            return seq * times
    a, b = _number(a), _number(b)
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
        raise Refused("product too large")
    return a * b


def _pow(a: Any, b: Any) -> Any:
    a, b = _number(a), _number(b)
    if isinstance(b, int) and isinstance(a, (int, Fraction)):
        size = abs(a.numerator).bit_length() + (a.denominator.bit_length() if isinstance(a, Fraction) else 0)
        if abs(b) > MAX_POW_EXPONENT or size * abs(b) > MAX_INT_BITS:
            raise Refused("power too large")
    elif (isinstance(a, Decimal) or isinstance(b, Decimal)) and not (isinstance(b, int) and abs(b) <= MAX_POW_EXPONENT):
        raise Refused("Decimal power with a large or fractional exponent")
    return a**b


BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": _add, "-": _numeric(operator.sub), "*": _mul, "/": _numeric(operator.truediv),
    "//": _numeric(operator.floordiv), "%": _numeric(operator.mod), "**": _pow,
}  # fmt: skip


def _negate(x: Any) -> Any:
    return -_number(x)


UNARY: dict[str, Callable[[Any], Any]] = {
    "-": _negate, "+": lambda x: +_number(x), "not": operator.not_, "~": lambda x: ~int(_number(x)),
}  # fmt: skip


def _hashed(items: Any) -> list[Any]:
    """``items`` as a list, refused when more than ``MAX_COLLISIONS`` unequal items share one hash (crafted)."""
    out = list(items)
    buckets: defaultdict[int, list[Any]] = defaultdict(list)
    for item in out:
        distinct = buckets[hash(item)]
        if not any(item == seen for seen in distinct):
            if len(distinct) >= MAX_COLLISIONS:
                raise Refused("set elements crafted to collide in one hash value")
            distinct.append(item)
    return out


def _round(x: Any, digits: Any = None) -> Any:
    if digits is None:
        return round(_number(x))
    if not is_int(digits) or abs(digits) > 1000:
        raise Refused("round() digits must be a small int")
    return round(_number(x), digits)


def _sum(items: Any, start: Any = 0) -> Any:
    total = _number(start)
    for item in items:
        total = _add(total, _number(item))
    return total


def _isclose(a: Any, b: Any, rel_tol: Any = 1e-9, abs_tol: Any = 0.0) -> bool:
    a, b = _number(a), _number(b)
    if isinstance(a, complex) or isinstance(b, complex):
        return cmath.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)


def _text(x: Any) -> str:
    return str(x)


def _sorted(items: Any, reverse: Any = False) -> list[Any]:
    return sorted(list(items), reverse=bool(reverse))


def _unary_number(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda x: fn(_number(x))


# name as written in the test -> (function, keyword arguments it accepts)
CALLS: dict[str, tuple[Callable[..., Any], frozenset[str]]] = {
    "abs": (lambda x: abs(_number(x)), frozenset()),
    "round": (_round, frozenset()),
    "len": (len, frozenset()),
    "str": (_text, frozenset()),
    "repr": (repr, frozenset()),
    "int": (lambda x=0: int(x) if isinstance(x, str) else int(_number(x)), frozenset()),
    "float": (lambda x=0.0: float(x) if isinstance(x, str) else float(_number(x)), frozenset()),
    "bool": (bool, frozenset()),
    "sorted": (_sorted, frozenset({"reverse"})),
    "list": (lambda x=(): list(x), frozenset()),
    "tuple": (lambda x=(): tuple(x), frozenset()),
    "set": (lambda x=(): set(_hashed(x)), frozenset()),
    "frozenset": (lambda x=(): frozenset(_hashed(x)), frozenset()),
    "sum": (_sum, frozenset()),
    "min": (min, frozenset()),
    "max": (max, frozenset()),
    "all": (all, frozenset()),
    "any": (any, frozenset()),
    "math.fabs": (_unary_number(math.fabs), frozenset()),
    "math.floor": (_unary_number(math.floor), frozenset()),
    "math.ceil": (_unary_number(math.ceil), frozenset()),
    "math.trunc": (_unary_number(math.trunc), frozenset()),
    "math.sqrt": (_unary_number(math.sqrt), frozenset()),
    "math.isnan": (_unary_number(math.isnan), frozenset()),
    "math.isinf": (_unary_number(math.isinf), frozenset()),
    "math.isfinite": (_unary_number(math.isfinite), frozenset()),
    "isclose": (_isclose, frozenset({"rel_tol", "abs_tol"})),
    "math.isclose": (_isclose, frozenset({"rel_tol", "abs_tol"})),
    "cmath.isclose": (_isclose, frozenset({"rel_tol", "abs_tol"})),
}


# Methods of the builtin types a test may call on the returned value (all bounded by the value's size); looked up
# on the value's exact builtin type, so nothing but the builtin runs.
METHODS = frozenset(
    {
        "lower", "upper", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith",
        "isdigit", "isalpha", "isalnum", "isspace", "isupper", "islower", "istitle", "isnumeric", "isdecimal",
        "title", "capitalize", "casefold", "swapcase", "count", "find", "rfind", "index", "rindex",
        "keys", "values", "items", "get", "issubset", "issuperset", "isdisjoint", "bit_length", "is_integer",
    }
)  # fmt: skip
_DATA_TYPES = (str, bytes, list, tuple, dict, set, frozenset, int, float)


def call_method(receiver: Any, name: str, args: list[Any]) -> Any:
    """``receiver.name(*args)`` for a method of ``METHODS`` on a builtin value; ``Refused`` for anything else."""
    kind = type(receiver)
    if kind not in _DATA_TYPES or name not in METHODS:
        raise Refused(f"no method {name} on {kind.__name__}")
    if name in ("split", "rsplit") and len(args) > 1 and not (isinstance(args[1], int) and args[1] < MAX_ITEMS):
        raise Refused("bad maxsplit")
    return getattr(kind, name)(receiver, *args)
