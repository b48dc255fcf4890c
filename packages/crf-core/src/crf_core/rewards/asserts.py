"""Split MBPP/HumanEval-style unit tests into what runs in the sandbox and what the trainer compares.

A test is a string of Python statements (usually one ``assert``). Each ``assert`` becomes a
``Check``: a *probe* expression the sandbox evaluates in the candidate's namespace (the value under
test), and a comparison the trainer makes against an *expected* value it alone holds, parsed here
from a constant expression (never executed). Supported shapes, with ``P`` the probe and ``E`` a
constant (literals, ``-x``, arithmetic on numbers, ``set(...)``/``tuple(...)``/``float('inf')``/
``math.pi`` and the like):

* ``assert P == E`` and ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in`` (either side may be ``E``);
* ``assert P is None`` / ``is True`` / ``is False`` (and ``is not``);
* ``assert P`` and ``assert not P`` (truthiness of the returned value);
* ``assert math.isclose(P, E, rel_tol=..., abs_tol=...)`` (also ``isclose``, ``cmath.isclose``);
* ``assert abs(P - E) < tol`` (or ``<=``, or ``abs(E - P)``);
* ``assert isinstance(P, T)`` for builtin types ``T`` (checked on the returned data);
* ``import`` statements, run in the sandbox before the probes (MBPP's ``test_setup_code``);
* any other assertion over one probe built from one comparison, arithmetic, ``and``/``or``/``not``,
  indexing and slicing, displays, builtin methods of the returned data (``.lower()``, ``.keys()``)
  and ``abs``, ``round``, ``len``, ``str``, ``sorted``, ``set``, ``sum``, ``min``, ``max``,
  ``math.fabs``, ``math.floor``, ``math.isclose`` and the like (``crf_core.rewards._verdict``), e.g.
  ``math.fabs(P - E) < tol``, ``abs((P - E) / E) < tol``, ``(P - E) ** 2 < tol``,
  ``round(P - E, 9) == 0``, ``str(P == E) == "True"``, ``sorted(P)[0] == E``.

The probe is only the call of the candidate's (``f(x)``, ``Cls(x).method()``); every operator the
test applies to its value runs on the trainer side, on the returned plain data, so an object with a
lying ``__sub__``, ``__eq__`` or ``__str__`` takes part in nothing.

``assert P, "message"`` is accepted (the message is ignored). A probe whose value would itself be
the verdict (``assert f(x) == g(y)``, ``assert all(...)``, a loop) cannot be split: the candidate
could make it true without knowing any answer. Such a test is refused with
``UnsplittableTestError`` naming it, unless the caller opts into ``unsplittable="verdict_in_sandbox"``,
which runs the whole statement in the sandbox and counts "no exception" as a pass; that verdict can
be forged by a candidate that patches the harness (documented as the weaker mode).
Parsing is ``ast.parse`` on text of bounded length (``MAX_TEST_CHARS``) plus one pass over the tree.
"""

from __future__ import annotations

import ast
import builtins
import cmath
import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, get_args

from crf_core.rewards._verdict import BINARY, CALLS, METHODS, UNARY, call_method
from crf_core.rewards.record import NotData, bounded_repr

__all__ = [
    "MAX_TEST_CHARS",
    "UNSPLITTABLE",
    "Check",
    "UnitTest",
    "Unsplittable",
    "UnsplittableTestError",
    "parse_test",
    "parse_tests",
]

MAX_TEST_CHARS = 100_000
Unsplittable = Literal["refuse", "verdict_in_sandbox"]
UNSPLITTABLE: tuple[Unsplittable, ...] = get_args(Unsplittable)
_MAX_OPERAND_BITS = 256
_MIRROR = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<=", "is": "is", "is not": "is not"}
_OPS: dict[type[ast.cmpop], str] = {
    ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
    ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in",
}  # fmt: skip
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "is": operator.is_, "is not": operator.is_not,
    "in": lambda got, exp: got in exp, "not in": lambda got, exp: got not in exp,
    "contains": lambda got, exp: exp in got, "not contains": lambda got, exp: exp not in got,
}  # fmt: skip
_BUILTIN_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "float": float, "complex": complex, "bool": bool, "str": str, "bytes": bytes,
    "list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "dict": dict,
}  # fmt: skip
_CONST_CALLS: dict[str, Callable[..., Any]] = {
    "set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict,
    "float": float, "complex": complex, "int": int, "bytes": bytes,
}  # fmt: skip
_MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}
_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}  # fmt: skip
_BUILTIN_NAMES = frozenset(dir(builtins)) | {"math", "cmath"}


class UnsplittableTestError(ValueError):
    """A unit test is not in a shape whose verdict can be kept out of the sandbox (the message names it)."""


Kind = Literal["compare", "truthy", "falsy", "isclose", "absdiff", "isinstance", "expression", "ran"]


@dataclass(frozen=True)
class Check:
    """One assertion: ``probe`` runs in the sandbox; the trainer compares its value with ``expected``.

    Attributes:
        assertion: the assert statement's source (for feedback).
        probe: expression evaluated in the sandbox (a whole statement when ``kind == "ran"``).
        kind: ``compare`` (``op``), ``truthy``, ``falsy``, ``isclose`` (``rel_tol``, ``abs_tol``),
            ``absdiff`` (``abs(got - expected) op tol``), ``isinstance`` (``expected`` is a type),
            ``expression`` (any other assertion over one probe: ``program`` applies the test's
            operators to the returned data on the trainer side, see ``crf_core.rewards._verdict``),
            ``ran`` (passes when the statement raised nothing: the weaker, opt-in mode).
    """

    assertion: str
    probe: str
    kind: Kind
    op: str = "=="
    expected: Any = None
    rel_tol: float = 1e-9
    abs_tol: float = 0.0
    tol: float = 0.0
    program: Callable[[Any], Any] | None = field(default=None, compare=False, repr=False)

    def passes(self, got: object) -> bool:
        """The verdict on the value the probe returned (decoded data). Never raises."""
        try:
            return bool(self._passes(got))
        except Exception:  # e.g. TypeError from "<" between a list and an int: the test fails
            return False

    def _passes(self, got: object) -> bool:
        if self.kind == "ran":
            return True
        if _contains_not_data(got):
            return False
        if self.kind == "compare":
            return bool(_COMPARE[self.op](got, self.expected))
        if self.kind == "truthy":
            return bool(got)
        if self.kind == "falsy":
            return not got
        if self.kind == "isinstance":
            return isinstance(got, self.expected)
        if self.kind == "expression":
            assert self.program is not None
            return bool(self.program(got))
        if not _is_number(got):
            return False
        if self.kind == "isclose":  # cmath's formula is math.isclose's, extended to complex numbers
            return cmath.isclose(got, self.expected, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        difference = abs(got - self.expected)
        return bool(difference < self.tol if self.op == "<" else difference <= self.tol)

    def expectation(self) -> str:
        """What the check wanted, in words (for feedback)."""
        if self.kind == "compare":
            words = {"contains": "containing", "not contains": "not containing"}.get(self.op, self.op)
            return bounded_repr(self.expected) if self.op == "==" else f"a value {words} {bounded_repr(self.expected)}"
        if self.kind == "truthy":
            return "a true value"
        if self.kind == "falsy":
            return "a false value"
        if self.kind == "isinstance":
            return f"an instance of {self.expected.__name__ if isinstance(self.expected, type) else self.expected}"
        if self.kind == "isclose":
            return f"a number close to {bounded_repr(self.expected)} (rel_tol={self.rel_tol}, abs_tol={self.abs_tol})"
        if self.kind == "absdiff":
            return f"a number within {self.tol} of {bounded_repr(self.expected)}"
        if self.kind == "expression":
            return "a value for which the assertion holds"
        return "no exception"


@dataclass(frozen=True)
class UnitTest:
    """One entry of a dataset row's test list: its source, the imports it needs, and its checks (all must pass).

    An entry of imports only (MBPP's ``test_setup_code`` put in the list) has no checks and is not counted.
    """

    source: str
    checks: tuple[Check, ...]
    setup: tuple[str, ...] = field(default=())


def parse_tests(tests: Sequence[str], unsplittable: Unsplittable = "refuse") -> tuple[UnitTest, ...]:
    """Parse a row's test list (a non-empty list of str). Raises ``ValueError``/``UnsplittableTestError``."""
    if isinstance(tests, str) or not isinstance(tests, Sequence) or not tests:
        raise ValueError(f"tests must be a non-empty list of Python statements (str), got {bounded_repr(tests)}")
    for test in tests:
        if not isinstance(test, str):
            raise ValueError(f"each test must be a str of Python statements, got {type(test).__name__}")
    parsed = tuple(parse_test(test, unsplittable) for test in tests)
    if not any(test.checks for test in parsed):
        raise UnsplittableTestError(f"the tests {bounded_repr(list(tests))} contain no assert statement")
    return parsed


@functools.lru_cache(maxsize=8192)
def parse_test(source: str, unsplittable: Unsplittable = "refuse") -> UnitTest:
    """Parse one test (see the module docstring). Cached: a dataset row is scored many times."""
    if unsplittable not in UNSPLITTABLE:
        raise ValueError(f"unsplittable must be 'refuse' or 'verdict_in_sandbox', got {unsplittable!r}")
    if len(source) > MAX_TEST_CHARS:
        raise UnsplittableTestError(f"the test {bounded_repr(source)} is longer than {MAX_TEST_CHARS} characters")
    try:
        tree = ast.parse(source, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise UnsplittableTestError(f"the test {bounded_repr(source)} is not valid Python: {exc}") from None
    checks: list[Check] = []
    setup: list[str] = []
    for statement in tree.body:
        text = ast.get_source_segment(source, statement) or ast.unparse(statement)
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            setup.append(text)
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # a docstring or a bare string
        check = _split(statement.test, text) if isinstance(statement, ast.Assert) else None
        if check is None:
            if unsplittable == "refuse":
                raise UnsplittableTestError(
                    f"cannot split the test {bounded_repr(text)} into a call and an expected value (supported: "
                    "assert P == E and other comparisons with a constant E, assert P, assert not P, math.isclose, "
                    "abs(P - E) < tol, isinstance(P, T)); rewrite it in one of these shapes, or pass "
                    "unsplittable='verdict_in_sandbox' to run it whole in the sandbox (a weaker check that a "
                    "hostile program can fake)"
                )
            check = Check(text, text, "ran")
        checks.append(check)
    if not checks and not setup:
        raise UnsplittableTestError(f"the test {bounded_repr(source)} contains no assert statement")
    return UnitTest(source, tuple(checks), tuple(setup))


def _split(test: ast.expr, text: str) -> Check | None:
    """The assertion's check: one of the fixed shapes, else a trainer-side expression over one probe, else None."""
    try:
        simple = _split_simple(test, text)
        if simple is not None:
            return simple
        leaves: list[ast.expr] = []
        program, _ = _compile(test, leaves)
    except (_NotSplittableError, RecursionError):
        return None
    probes = {ast.unparse(leaf) for leaf in leaves}
    if len(probes) != 1:
        return None  # none: nothing under test; several: the candidate would decide how they compare
    return Check(text, probes.pop(), "expression", program=program)


def _split_simple(test: ast.expr, text: str) -> Check | None:
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return _split_compare(test.left, _OPS[type(test.ops[0])], test.comparators[0], text)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return Check(text, ast.unparse(test.operand), "falsy") if _is_probe(test.operand) else None
    if isinstance(test, ast.Call):
        name = _call_name(test)
        if name in ("isclose", "math.isclose", "cmath.isclose"):
            return _split_isclose(test, text)
        if name == "isinstance" and len(test.args) == 2 and not test.keywords:
            kind = _type_arg(test.args[1])
            if kind is not None and _is_probe(test.args[0]):
                return Check(text, ast.unparse(test.args[0]), "isinstance", expected=kind)
            return None
    return Check(text, ast.unparse(test), "truthy") if _is_probe(test) else None


def _split_compare(left: ast.expr, op: str, right: ast.expr, text: str) -> Check | None:
    right_const, left_const = _constant(right), _constant(left)
    absdiff = _split_absdiff(left, op, right_const, text)
    if absdiff is not None:  # before the generic shape: a patched abs() must not be the probe
        return absdiff
    if right_const is not _NOT_CONST and left_const is _NOT_CONST and _is_probe(left):
        probe, expected = left, right_const
    elif left_const is not _NOT_CONST and right_const is _NOT_CONST and _is_probe(right):
        probe, expected = right, left_const
        op = {"in": "contains", "not in": "not contains"}.get(op) or _MIRROR[op]
    else:
        return None
    if op in ("is", "is not") and not (expected is None or isinstance(expected, bool)):
        return None  # identity with other objects cannot be checked across processes
    return Check(text, ast.unparse(probe), "compare", op=op, expected=expected)


def _split_absdiff(left: ast.expr, op: str, tol: Any, text: str) -> Check | None:
    """``abs(P - E) < tol`` / ``<= tol`` (or ``abs(E - P)``)."""
    if op not in ("<", "<=") or not _is_number(tol) or isinstance(tol, complex):
        return None
    if not (isinstance(left, ast.Call) and _call_name(left) == "abs" and len(left.args) == 1 and not left.keywords):
        return None
    inner = left.args[0]
    if not (isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub)):
        return None
    for probe, other in ((inner.left, inner.right), (inner.right, inner.left)):
        expected = _constant(other)
        if expected is not _NOT_CONST and _is_number(expected) and _is_probe(probe):
            return Check(text, ast.unparse(probe), "absdiff", op=op, expected=expected, tol=float(tol))
    return None


def _split_isclose(call: ast.Call, text: str) -> Check | None:
    if len(call.args) != 2:
        return None
    tolerances = {"rel_tol": 1e-9, "abs_tol": 0.0}
    for keyword in call.keywords:
        value = _constant(keyword.value)
        if keyword.arg not in tolerances or not _is_number(value) or isinstance(value, complex) or value < 0:
            return None
        tolerances[keyword.arg] = float(value)
    a, b = call.args
    for probe, other in ((a, b), (b, a)):
        expected = _constant(other)
        if expected is not _NOT_CONST and _is_number(expected) and _is_probe(probe):
            return Check(
                text,
                ast.unparse(probe),
                "isclose",
                expected=expected,
                rel_tol=tolerances["rel_tol"],
                abs_tol=tolerances["abs_tol"],
            )
    return None


def _is_probe(node: ast.expr) -> bool:
    """Whether ``node`` is a value under test: a name of the candidate's, or a call, attribute or item of one.

    Nothing the test applies to that value (a comparison, arithmetic, an index, ``abs``, ``str``, ``sorted``, a
    builtin method such as ``.lower()``) is part of the probe: it runs on the trainer side, on the returned data
    (``_compile``).
    """
    root = node
    while True:
        if isinstance(root, ast.Name):
            return root.id not in _BUILTIN_NAMES
        if isinstance(root, ast.Call):
            if isinstance(root.func, ast.Attribute) and root.func.attr in METHODS:
                return False  # f(x).lower(): a builtin method the trainer applies to the returned data
            root = root.func
        elif isinstance(root, ast.Attribute):
            root = root.value
        else:
            return False  # f(x)[0] included: the trainer indexes the returned data


_Program = Callable[[Any], Any]
_BINARY_OPS: dict[type[ast.operator], str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
}  # fmt: skip
_UNARY_OPS: dict[type[ast.unaryop], str] = {ast.USub: "-", ast.UAdd: "+", ast.Not: "not", ast.Invert: "~"}


class _NotSplittableError(Exception):
    pass


def _compile(node: ast.expr, leaves: list[ast.expr]) -> tuple[_Program, bool]:
    """``(function of the probe's value, whether node holds the probe)`` for the trainer-side part of an assertion.

    Allowed: constants (``_constant``), the probe (``_is_probe``; appended to ``leaves``), and over them one
    comparison, the arithmetic and unary operators, ``and``/``or``, displays, subscripts and slices, ``isinstance``
    with builtin types and the calls of ``_verdict.CALLS``. A part without the probe must be a constant.
    """
    constant = _constant(node)
    if constant is not _NOT_CONST:
        return (lambda value: constant), False
    if _is_probe(node):
        leaves.append(node)
        return (lambda value: value), True
    parts: list[_Program]
    held: bool
    if isinstance(node, ast.Compare):
        if len(node.ops) != 1:
            raise _NotSplittableError
        op = _OPS[type(node.ops[0])]
        if op in ("is", "is not") and not any(
            (c := _constant(side)) is None or isinstance(c, bool) for side in (node.left, node.comparators[0])
        ):
            raise _NotSplittableError  # identity with other objects cannot be checked across processes
        (left, a), (right, b) = _compile(node.left, leaves), _compile(node.comparators[0], leaves)
        compare = _COMPARE[op]
        program, held = (lambda value: compare(left(value), right(value))), a or b
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        (left, a), (right, b) = _compile(node.left, leaves), _compile(node.right, leaves)
        binary = BINARY[_BINARY_OPS[type(node.op)]]
        program, held = (lambda value: binary(left(value), right(value))), a or b
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        operand, held = _compile(node.operand, leaves)
        unary = UNARY[_UNARY_OPS[type(node.op)]]
        program = lambda value: unary(operand(value))  # noqa: E731
    elif isinstance(node, ast.BoolOp):
        compiled = [_compile(v, leaves) for v in node.values]
        parts, held = [p for p, _ in compiled], any(h for _, h in compiled)
        program = _all_of(parts) if isinstance(node.op, ast.And) else _any_of(parts)
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        if any(isinstance(e, ast.Starred) for e in node.elts):
            raise _NotSplittableError
        compiled = [_compile(e, leaves) for e in node.elts]
        parts, held = [p for p, _ in compiled], any(h for _, h in compiled)
        builders: dict[type, Callable[[list[Any]], Any]] = {ast.List: list, ast.Tuple: tuple, ast.Set: CALLS["set"][0]}
        build = builders[type(node)]
        program = lambda value: build([p(value) for p in parts])  # noqa: E731
    elif isinstance(node, ast.Subscript):
        (container, a), (index, b) = _compile(node.value, leaves), _compile_index(node.slice, leaves)
        program, held = (lambda value: container(value)[index(value)]), a or b
    elif isinstance(node, ast.Call):
        program, held = _compile_call(node, leaves)
    else:
        raise _NotSplittableError
    if not held:
        raise _NotSplittableError  # a part without the probe that is not a constant (e.g. 2 ** 10, sorted([3, 1]))
    return program, held


def _compile_index(node: ast.expr, leaves: list[ast.expr]) -> tuple[_Program, bool]:
    if not isinstance(node, ast.Slice):
        return _compile(node, leaves)
    bounds = [
        (lambda value: None, False) if b is None else _compile(b, leaves) for b in (node.lower, node.upper, node.step)
    ]
    (lower, _), (upper, _), (step, _) = bounds
    return (lambda value: slice(lower(value), upper(value), step(value))), any(h for _, h in bounds)


def _compile_call(node: ast.Call, leaves: list[ast.expr]) -> tuple[_Program, bool]:
    name = _call_name(node)
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise _NotSplittableError
    if isinstance(node.func, ast.Attribute) and node.func.attr in METHODS and not node.keywords:
        (receiver, held), method = _compile(node.func.value, leaves), node.func.attr
        compiled = [_compile(a, leaves) for a in node.args]
        arguments = [p for p, _ in compiled]
        return (lambda value: call_method(receiver(value), method, [a(value) for a in arguments])), held or any(
            h for _, h in compiled
        )
    if name == "isinstance" and len(node.args) == 2 and not node.keywords:
        kind = _type_arg(node.args[1])
        if kind is None:
            raise _NotSplittableError
        subject, held = _compile(node.args[0], leaves)
        return (lambda value: isinstance(subject(value), kind)), held
    if name not in CALLS:
        raise _NotSplittableError
    function, keywords = CALLS[name]
    if any(k.arg not in keywords for k in node.keywords):
        raise _NotSplittableError
    compiled = [_compile(a, leaves) for a in node.args]
    named = [(str(k.arg), *_compile(k.value, leaves)) for k in node.keywords]
    args = [p for p, _ in compiled]
    held = any(h for _, h in compiled) or any(h for _, _, h in named)

    def call(value: Any) -> Any:
        return function(*[a(value) for a in args], **{k: p(value) for k, p, _ in named})

    return call, held


def _all_of(parts: list[_Program]) -> _Program:
    def run(value: Any) -> Any:
        result: Any = True
        for part in parts:
            result = part(value)
            if not result:
                return result
        return result

    return run


def _any_of(parts: list[_Program]) -> _Program:
    def run(value: Any) -> Any:
        result: Any = False
        for part in parts:
            result = part(value)
            if result:
                return result
        return result

    return run


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def _type_arg(node: ast.expr) -> type | tuple[type, ...] | None:
    if isinstance(node, ast.Name):
        kind = _BUILTIN_TYPES.get(node.id)
        return kind if isinstance(kind, type) else None
    if isinstance(node, ast.Tuple) and node.elts:
        kinds = [_type_arg(e) for e in node.elts]
        if all(isinstance(k, type) for k in kinds):
            return tuple(k for k in kinds if isinstance(k, type))
    return None


class _NotConstant:
    def __repr__(self) -> str:
        return "<not constant>"


_NOT_CONST: Any = _NotConstant()


def _constant(node: ast.expr) -> Any:
    """The value of a constant expression, evaluated without running code; ``_NOT_CONST`` otherwise."""
    try:
        return _evaluate(node)
    except (_NotConstantError, ArithmeticError, TypeError, ValueError, RecursionError):
        return _NOT_CONST


class _NotConstantError(Exception):
    pass


def _evaluate(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and not isinstance(node.value, type(Ellipsis)):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_evaluate(e) for e in node.elts]
        return (
            tuple(items) if isinstance(node, ast.Tuple) else list(items) if isinstance(node, ast.List) else set(items)
        )
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _NotConstantError  # {**other}
        return {_evaluate(k): _evaluate(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        if not _is_number(value):
            raise _NotConstantError
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _evaluate(node.left), _evaluate(node.right)
        if not (_is_number(a) and _is_number(b)) or any(
            isinstance(x, int) and x.bit_length() > _MAX_OPERAND_BITS for x in (a, b)
        ):
            raise _NotConstantError
        return _BINOPS[type(node.op)](a, b)
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "math"
        and node.attr in _MATH_CONSTANTS
    ):
        return _MATH_CONSTANTS[node.attr]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONST_CALLS:
        if node.keywords or len(node.args) > 1:
            raise _NotConstantError
        args = [_evaluate(a) for a in node.args]
        if args and node.func.id in ("int", "bytes") and not _safe_conversion(node.func.id, args[0]):
            raise _NotConstantError
        return _CONST_CALLS[node.func.id](*args)
    raise _NotConstantError


def _safe_conversion(name: str, arg: object) -> bool:
    """``int(x)`` of a number or a short string (str->int is quadratic); ``bytes(x)`` of anything but an int size."""
    if name == "int":
        return _is_number(arg) or (isinstance(arg, str) and len(arg) <= 100)
    return not isinstance(arg, int)


def _is_number(value: object) -> TypeGuard[int | float | complex]:
    return isinstance(value, (int, float, complex)) and not isinstance(value, bool)


def _contains_not_data(value: object) -> bool:
    """Whether a decoded value holds a ``NotData`` anywhere (iterative; decoded values are bounded)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, NotData):
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return False
