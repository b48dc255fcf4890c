"""The program ``UnitTestReward`` runs in the sandbox: it evaluates probes and reports data, never a verdict.

Standard library only, and only modules built into the interpreter until something fails (each
import is paid on every evaluation); run as ``__main__`` by ``run_python`` (its source is this
file's text). It reads a job from stdin, a ``marshal``-encoded dict ``{"code", "setup", "probes",
"entry_point"}`` written by the trainer (``marshal`` only ever reads trusted bytes here), where a
probe is ``(source, "eval" | "exec")``. It runs ``code`` (the candidate) in a fresh namespace, then the
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
``["?", type name]`` for anything that is not plain data (or is too big or too deep to report).

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
MAX_VALUE_CHARS = 200_000  # budget of one encoded value (characters of strings + nodes)
MAX_MESSAGE_CHARS = 500
MAX_TRACEBACK_CHARS = 1500
_SEQUENCES = ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F"))


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
    if depth > MAX_DEPTH:
        raise RecursionError
    _spend(budget, 1)
    if value is None:
        return ["N"]
    if isinstance(value, bool):
        return ["b", bool(value)]
    if isinstance(value, int):
        digits = format(int.__index__(value), "x")
        _spend(budget, len(digits))
        return ["i", digits]
    if isinstance(value, float):
        return ["f", float.__repr__(value)]
    if isinstance(value, complex):
        return ["c", float.__repr__(value.real), float.__repr__(value.imag)]
    if isinstance(value, str):
        text = str.__str__(value)
        _spend(budget, len(text))
        return ["s", text]
    if isinstance(value, (bytes, bytearray)):
        _spend(budget, 2 * len(value))
        return ["y", bytes(value).hex()]
    for kind, tag in _SEQUENCES:
        if isinstance(value, kind):
            return [tag, [_encode(item, depth + 1, budget) for item in value]]
    if isinstance(value, dict):
        return ["d", [[_encode(k, depth + 1, budget), _encode(v, depth + 1, budget)] for k, v in dict.items(value)]]
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fractions is not None and isinstance(value, fractions.Fraction):
        return ["q", format(value.numerator, "x"), format(value.denominator, "x")]
    if decimal is not None and isinstance(value, decimal.Decimal):
        text = str(value)
        _spend(budget, len(text))
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


def main() -> None:
    """Run the job on stdin and write the record (see the module docstring)."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="backslashreplace")
    os.dup2(2, 1)  # from here on the candidate's prints go to stderr
    emit_line, flush, encode_line, run, build, ns_exit = channel.write, channel.flush, dumps, exec, compile, os._exit
    evaluate = eval

    def emit(obj: object) -> None:
        emit_line(encode_line(obj) + "\n")
        flush()

    job = marshal.loads(sys.stdin.buffer.read())
    code = job["code"]
    _SOURCES["<candidate>"] = code
    namespace: dict[str, Any] = {"__name__": "__candidate__"}
    try:
        run(build(code, "<candidate>", "exec"), namespace)
        for statement in job["setup"]:
            run(build(statement, "<test>", "exec"), namespace)
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
        try:
            if mode == "exec":
                run(build(source, "<test>", "exec"), namespace)
                line: dict[str, Any] = {"value": ["N"]}
            else:
                line = {"value": encode(evaluate(build(source, "<test>", "eval"), namespace))}
        except BaseException as exc:
            line = {"raised": _raised(exc)}
        emit(line)
    emit({"end": len(probes)})
    ns_exit(0)


if __name__ == "__main__":
    main()
