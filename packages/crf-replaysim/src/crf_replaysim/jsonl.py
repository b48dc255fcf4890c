"""JSONL in and out without losing anything: a bad line costs only itself, a failed run costs nothing.

Reading (:func:`iter_json_lines`): one JSON value per line, read in binary with a cap per line, so a
single huge line, a non-UTF-8 byte, a lone surrogate escape (``"\\ud83d"``, valid JSON that no UTF-8
file can hold), ``NaN``/``Infinity``, nesting deeper than ``max_depth`` (which would otherwise raise
``RecursionError`` somewhere downstream) or plain bad JSON becomes a :class:`MalformedLine` with its
1-based line number, and the next line is read as usual. Memory per line is bounded by
``max_line_bytes``; an over-long line is skipped without being held.

Writing (:func:`atomic_output`): the output is written to a uniquely named temporary file beside it
and renamed over it only when the block finishes, so an error or Ctrl-C leaves the previous output
as it was; :func:`check_output` refuses, before anything is opened, an output that is the same file
as an input (``os.path.samefile``: any path, symlink or hard link to it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from crf_replaysim._checks import is_int

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_LINE_BYTES",
    "LONE_SURROGATE",
    "MalformedLine",
    "UnsafeOutputError",
    "atomic_output",
    "check_output",
    "iter_json_lines",
    "json_problem",
    "loads_bounded",
    "unique_temp_path",
]

DEFAULT_MAX_LINE_BYTES = 32 * 2**20
"""Longest line read (bytes, newline included); longer lines are reported and skipped."""
DEFAULT_MAX_DEPTH = 100
"""Deepest nesting of lists/objects accepted in one line (the records themselves need fewer than 10)."""

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""Matches a surrogate code point; in a decoded str any such match is lone (json joins valid pairs)."""


@dataclass(frozen=True)
class MalformedLine:
    """A line of a JSONL file that could not be used, with the reason (1-based ``line``)."""

    line: int
    reason: str


class UnsafeOutputError(ValueError):
    """An output path that would destroy an input (or is not a file path)."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def json_problem(value: Any, *, max_depth: int = DEFAULT_MAX_DEPTH) -> str | None:
    """Why ``value`` (decoded JSON) cannot be kept, or ``None``: nesting deeper than ``max_depth``,
    or a string (value or key) holding a lone surrogate. Iterative, so any depth is safe to check."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            found = LONE_SURROGATE.search(item)
            if found:
                return (
                    f"{where or 'value'} holds a lone surrogate U+{ord(found.group()):04X} (a \\u escape without "
                    "its pair); it cannot be written as UTF-8. Fix: repair or drop that text at the source"
                )
        elif isinstance(item, (dict, list)):
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels at {where or 'the top'}. Fix: flatten the data"
            if isinstance(item, dict):
                for key, child in item.items():
                    if isinstance(key, str) and LONE_SURROGATE.search(key):
                        return f"key {key!r} at {where or 'the top'} holds a lone surrogate. Fix: rename the key"
                    stack.append((child, depth + 1, f"{where}.{key}" if where else str(key)))
            else:
                stack.extend((child, depth + 1, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def loads_bounded(text: str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Decode untrusted JSON ``text``; raise ``ValueError`` with the reason (never ``RecursionError``).

    Refused: invalid JSON, ``NaN``/``Infinity``, nesting deeper than ``max_depth`` and lone surrogates.
    The one parser for every JSON value that arrives from outside (lines, tool-call arguments, tool specs).
    """
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise ValueError(f"nested too deeply to parse (limit {max_depth} levels). Fix: flatten the data") from None
    except ValueError as err:  # NaN / Infinity from _reject_constant
        raise ValueError(f"invalid JSON ({err}). Fix: store finite numbers or strings") from None
    # Only a text with enough brackets can be too deep, only a \\u escape can make a surrogate: skip the walk
    # for the usual text.
    if text.count("[") + text.count("{") > max_depth or "\\ud" in text or "\\uD" in text:
        problem = json_problem(value, max_depth=max_depth)
        if problem:
            raise ValueError(problem)
    return value


def iter_json_lines(
    path: str | os.PathLike[str],
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    blank_lines: str = "skip",
) -> Iterator[tuple[int, Any] | MalformedLine]:
    """Stream ``path``: ``(line_number, value)`` per good line, :class:`MalformedLine` per bad one.

    ``blank_lines``: ``"skip"`` (ignored) or ``"report"`` (a ``MalformedLine`` saying ``blank line``).
    A UTF-8 byte-order mark at the start of the file is ignored.
    """
    _check_limits(max_line_bytes, max_depth)
    if blank_lines not in ("skip", "report"):
        raise ValueError(f"blank_lines must be 'skip' or 'report', got {blank_lines!r}")
    with open(path, "rb") as fh:
        chunks = iter(partial(fh.readline, max_line_bytes + 1), b"")
        for number in itertools.count(1):
            raw = next(chunks, None)
            if raw is None:
                return
            if len(raw) > max_line_bytes:
                for rest in chunks:  # skip the remainder of the line without keeping it
                    if rest.endswith(b"\n"):
                        break
                yield MalformedLine(
                    number,
                    f"line is longer than max_line_bytes={max_line_bytes} bytes. "
                    "Fix: split the record, or raise the limit (--max-line-bytes)",
                )
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield MalformedLine(number, f"not UTF-8 ({err.reason} at byte {err.start}). Fix: re-encode as UTF-8")
                continue
            if number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            if not text.strip():
                if blank_lines == "report":
                    yield MalformedLine(number, "blank line")
                continue
            try:
                yield number, loads_bounded(text, max_depth=max_depth)
            except ValueError as err:
                yield MalformedLine(number, str(err))


def _check_limits(max_line_bytes: int, max_depth: int) -> None:
    for name, value in (("max_line_bytes", max_line_bytes), ("max_depth", max_depth)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_output(output: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]]) -> Path:
    """Refuse ``output`` if it is a directory or the same file as one of ``inputs``; return it as a Path.

    Sameness is ``os.path.samefile`` (device and inode), so a symlink or a hard link to an input is
    caught too. Nothing is opened or created.
    """
    out = Path(output)
    if out.is_dir():
        raise UnsafeOutputError(f"output {str(out)!r} is a directory. Fix: give a file path")
    if out.exists():
        for source in inputs:
            if Path(source).exists() and os.path.samefile(out, source):
                raise UnsafeOutputError(
                    f"output {str(out)!r} is the same file as the input {str(source)!r} (directly or through a "
                    "symlink or hard link); writing it would destroy the input. Fix: choose another output path"
                )
    return out


def unique_temp_path(target: Path, suffix: str = ".tmp") -> Path:
    """A fresh hidden name beside ``target`` that no other process picks (pid + 64 random bits)."""
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(8)}{suffix}")


def _create_exclusive(path: Path) -> int:
    """Create ``path`` (must not exist) for writing with the usual permissions (0o666 minus the umask)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)


@contextlib.contextmanager
def atomic_output(output: str | os.PathLike[str], *, inputs: Iterable[str | os.PathLike[str]] = ()) -> Iterator[TextIO]:
    """Write a text file all or nothing: yields a UTF-8 handle on a temporary file beside ``output``.

    When the block ends normally the file is flushed, fsynced and renamed over ``output``; on any
    exception (Ctrl-C included) it is removed and ``output`` is left as it was. ``inputs`` are
    checked with :func:`check_output` first.
    """
    out = check_output(output, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = unique_temp_path(out)
    fd = _create_exclusive(tmp)
    try:
        with open(fd, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
