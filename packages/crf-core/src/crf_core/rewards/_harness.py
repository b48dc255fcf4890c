"""The program ``UnitTestReward`` runs in the sandbox: it evaluates probes and reports data, never a verdict.

Standard library only, and only modules built into the interpreter until something fails (each
import is paid on every evaluation); run as ``__main__`` by ``run_python`` (its source is this
file's text). It reads a job from stdin, a ``marshal``-encoded dict ``{"code", "setup", "probes",
"entry_point", "budget"}`` written by the trainer (``marshal`` only ever reads trusted bytes here), where a
probe is ``(source, "eval" | "exec")``. It runs ``code`` (the candidate) as a fresh module registered as
``sys.modules["__main__"]`` (as ``python file.py`` would; no future flags inherited), then the
``setup`` imports, binds ``candidate`` to ``entry_point`` when given, and evaluates each probe
there. The expected values never enter the sandbox.

It writes its record, one JSON object per line (its own small writer; non-ASCII text as UTF-8, lone
surrogates as ``\\uXXXX`` escapes), to the stdout it was started with; before the
candidate runs, file descriptor 1 is pointed at stderr, so whatever the candidate prints goes to
stderr. Lines: ``{"load": null | RAISED}``, then (if the load succeeded) one ``{"value": VALUE}`` or
``{"raised": RAISED}`` per probe, then ``{"end": n}``; then it exits at once (``os._exit(0)``).
``RAISED`` is ``{"type", "message", "traceback"}`` (bounded). ``VALUE`` is a tagged encoding of plain
data: ``["N"]`` None, ``["b", bool]``, ``["i", hex]``, ``["f", repr]``, ``["c", repr, repr]``,
``["s", str]``, ``["y", hex]`` bytes, ``["l"|"t"|"S"|"F", [VALUE...]]`` list, tuple, set, frozenset,
``["d", [[VALUE, VALUE]...]]`` dict, ``["q", hex, hex]`` Fraction, ``["D", str]`` Decimal, and
``["?", type name]`` for anything else (or too big or too deep to report). Values are read with the
builtin types' own methods, never the object's: the trainer receives exact builtin data, and a
subclass with a lying ``__eq__``, ``__sub__`` or ``__str__`` is reported as the plain value it stores.
Sizes match what the trainer reads (``MAX_INT_BITS``, ``MAX_DECIMAL_CHARS``); the whole record
spends at most ``budget`` characters, then each further line is a short stand-in (at most
``LINE_RESERVE``), so a large value costs its own test, never the others.

The candidate shares this process and can rewrite any of it: the trainer treats every line as
untrusted data (``crf_core.rewards.record``). Whatever is forged here can claim values, not passes.
"""

from __future__ import annotations

import marshal
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 64
MAX_VALUE_CHARS = 2_000_000  # budget of one encoded value (an upper bound on its JSON characters)
MAX_INT_BITS = 262_144  # the trainer reads ints of up to 65,536 hex digits (crf_core.rewards.record)
MAX_DECIMAL_CHARS = 4_300  # and Decimal texts of up to 4,300 characters
MAX_MESSAGE_CHARS = 500
MAX_TRACEBACK_CHARS = 1500
_SEQUENCES: tuple[tuple[type, str, Any], ...] = (
    (list, "l", list.__iter__), (tuple, "t", tuple.__iter__), (set, "S", set.__iter__),
    (frozenset, "F", frozenset.__iter__),
)  # fmt: skip
_REAL, _IMAG = complex.real.__get__, complex.imag.__get__


class _TooBig(Exception):
    pass


def encode(value: Any, depth: int = 0, budget: list[int] | None = None) -> list[Any]:
    """The tagged encoding of ``value`` (see the module docstring); never raises."""
    budget = [MAX_VALUE_CHARS] if budget is None else budget
    try:
        return _encode(value, depth, budget)
    except _TooBig:
        return ["?", f"{_type_name(value)} too large to report"]
    except RecursionError:
        return ["?", f"{_type_name(value)} nested too deeply to report"]
    except Exception as exc:  # a hostile __iter__, __len__, ...
        return ["?", f"{_type_name(value)} (could not be read: {type(exc).__name__})"]


def _spend(budget: list[int], amount: int) -> None:
    budget[0] -= amount
    if budget[0] < 0:
        raise _TooBig


def _encode(value: Any, depth: int, budget: list[int]) -> list[Any]:
    """Reads go through the builtin types' own methods (``int.__index__``, ``list.__iter__``, ...), so a subclass
    (``Counter``, a namedtuple) is reported as the builtin value it stores and none of its own methods runs."""
    if depth > MAX_DEPTH:
        raise RecursionError
    _spend(budget, 8)
    if value is None:
        return ["N"]
    if type(value) is bool:
        return ["b", value is True]
    if isinstance(value, int):
        number = int.__index__(value)
        if number.bit_length() > MAX_INT_BITS:
            raise _TooBig
        digits = format(number, "x")
        _spend(budget, len(digits))
        return ["i", digits]
    if isinstance(value, float):
        return ["f", float.__repr__(value)]
    if isinstance(value, complex):
        return ["c", float.__repr__(_REAL(value)), float.__repr__(_IMAG(value))]
    if isinstance(value, str):
        text = str.__str__(value)
        _spend(budget, 6 * len(text))  # JSON escapes are at most 6 characters per character
        return ["s", text]
    if isinstance(value, (bytes, bytearray)):
        if isinstance(value, bytearray):
            data = bytes(bytearray.__iter__(value))
        elif hasattr(bytes, "__bytes__"):  # Python 3.11+: the builtin's own method, never a subclass's
            data = bytes.__bytes__(value)  # type: ignore[attr-defined]
        else:  # Python 3.10 has no bytes.__bytes__: read the builtin's own buffer
            data = bytes(memoryview(value))
        _spend(budget, 2 * len(data))
        return ["y", data.hex()]
    for kind, tag, items in _SEQUENCES:
        if isinstance(value, kind):
            return [tag, [_encode(item, depth + 1, budget) for item in items(value)]]
    if isinstance(value, dict):
        return ["d", [[_encode(k, depth + 1, budget), _encode(v, depth + 1, budget)] for k, v in dict.items(value)]]
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fractions is not None and type(value) is fractions.Fraction:  # classes written in Python: exact type only
        numerator, denominator = int.__index__(value._numerator), int.__index__(value._denominator)
        if max(numerator.bit_length(), denominator.bit_length()) > MAX_INT_BITS:
            raise _TooBig
        return ["q", format(numerator, "x"), format(denominator, "x")]
    if decimal is not None and type(value) is decimal.Decimal:
        text = str.__str__(decimal.Decimal.__str__(value))  # type: ignore[call-arg]
        if len(text) > MAX_DECIMAL_CHARS:
            raise _TooBig
        return ["D", text]
    return ["?", _type_name(value)]


def _type_name(value: Any) -> str:
    try:
        return str(type(value).__name__)[:100]
    except Exception:
        return "object"


_ESCAPES = {i: f"\\u{i:04x}" for i in range(32)} | {ord('"'): '\\"', ord("\\"): "\\\\"}


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` (None, bool, int, str, list, dict with str keys), like ``json.dumps``."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, int):
        return str(int(obj))
    if isinstance(obj, str):
        return '"' + obj.translate(_ESCAPES) + '"'
    if isinstance(obj, list):
        return "[" + ",".join(dumps(item) for item in obj) + "]"
    return "{" + ",".join(dumps(str(key)) + ":" + dumps(value) for key, value in obj.items()) + "}"


_SOURCES: dict[str, str] = {}


def _raised(exc: BaseException) -> dict[str, str]:
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable message>"
    try:
        import linecache
        import traceback

        for name, text in _SOURCES.items():  # so the traceback shows the candidate's lines
            linecache.cache[name] = (len(text), None, text.splitlines(True), name)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in ("<candidate>", "<test>")]
        text = "".join(traceback.format_list(frames))
    except Exception:
        text = ""
    return {
        "type": _type_name(exc),
        "message": message[:MAX_MESSAGE_CHARS],
        "traceback": text[-MAX_TRACEBACK_CHARS:],
    }


def _dumps_large(obj: Any) -> str:
    """``dumps`` through the json module's C encoder (imported only for large values; the same text once read)."""
    import json

    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), check_circular=False)


LINE_RESERVE = 200  # the longest line written once the budget is spent (the trainer reads budget + this per line)


def _fallback(line: dict[str, Any]) -> dict[str, Any]:
    """A short stand-in for a result line that does not fit the record's budget."""
    if "raised" not in line:
        return {"value": ["?", "value not reported: the record's size budget is spent"]}
    kind = "".join(c for c in str(line["raised"]["type"])[:40] if c.isalnum() or c in "_.")
    return {"raised": {"type": kind or "Exception", "message": "(not reported: the record is full)", "traceback": ""}}


def main() -> None:
    """Run the job on stdin and write the record (see the module docstring)."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="backslashreplace")
    os.dup2(2, 1)  # from here on the candidate's prints go to stderr
    emit_line, flush, encode_line, run, build, ns_exit = channel.write, channel.flush, dumps, exec, compile, os._exit
    evaluate = eval
    job = marshal.loads(sys.stdin.buffer.read())
    budget = [int(job["budget"])]

    def emit(obj: dict[str, Any], large: bool = False) -> None:
        text = _dumps_large(obj) if large else encode_line(obj)
        if len(text) > budget[0]:
            text = encode_line(_fallback(obj))
        else:
            budget[0] -= len(text)
        emit_line(text + "\n")
        flush()

    code = job["code"]
    _SOURCES["<candidate>"] = code
    # The candidate's own module, registered as __main__ as when run by `python file.py` (dataclasses and pickle
    # look classes up there); compiled without this file's future flags (dont_inherit).
    module = type(sys)("__main__")
    sys.modules["__main__"] = module
    namespace: dict[str, Any] = module.__dict__
    try:
        run(build(code, "<candidate>", "exec", dont_inherit=True), namespace)
        for statement in job["setup"]:
            run(build(statement, "<test>", "exec", dont_inherit=True), namespace)
        if job["entry_point"]:
            if job["entry_point"] not in namespace:
                raise NameError(f"the code does not define {job['entry_point']!r}, the function under test")
            namespace["candidate"] = namespace[job["entry_point"]]
    except BaseException as exc:
        emit({"load": _raised(exc)})
        emit({"end": 0})
        ns_exit(0)
    emit({"load": None})
    probes = job["probes"]
    for source, mode in probes:
        spent = [MAX_VALUE_CHARS]
        try:
            if mode == "exec":
                run(build(source, "<test>", "exec", dont_inherit=True), namespace)
                line: dict[str, Any] = {"value": ["N"]}
            else:
                value = evaluate(build(source, "<test>", "eval", dont_inherit=True), namespace)
                line = {"value": encode(value, 0, spent)}
        except BaseException as exc:
            line = {"raised": _raised(exc)}
        emit(line, large=spent[0] < MAX_VALUE_CHARS - 20_000)
    emit({"end": len(probes)})
    ns_exit(0)


if __name__ == "__main__":
    main()
